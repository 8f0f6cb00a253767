//! `ferrovirt agent`: argument parsing and the kube-rs client setup for a node agent.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use base64::Engine;

#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// Kubeconfig for the server (e.g. the server's DATA_DIR/kubeconfig.yaml).
    #[arg(long, env = "KUBECONFIG", conflicts_with = "server")]
    kubeconfig: Option<PathBuf>,
    /// Server URL, or a comma list of the URLs of a cluster's servers (`https://a:6443,
    /// https://b:6443`): the agent then talks to them through a loopback balancer that fails
    /// over when its server dies (docs/nodes.md "Highly available servers"). With --token-file
    /// (or the environment variable FERROVIRT_TOKEN) the node joins with the server's join
    /// token and gets a credential of its own; with --token and --certificate-authority it
    /// uses that bearer token.
    #[arg(long)]
    server: Option<String>,
    /// Bearer token (an admin-token agent; joined nodes use --token-file).
    #[arg(long, conflicts_with = "token_file")]
    token: Option<String>,
    /// File holding the join token (`ferrovirt token` on the server: `K10<CA hash>::<secret>`).
    /// The token is never taken from the command line; FERROVIRT_TOKEN may hold it instead.
    #[arg(long, requires = "server", conflicts_with = "certificate_authority")]
    token_file: Option<PathBuf>,
    /// PEM file of the server's CA.
    #[arg(long)]
    certificate_authority: Option<PathBuf>,
    /// Node name (default: the host name).
    #[arg(long)]
    node_name: Option<String>,
    /// Agent state directory (VMI directories, sockets).
    #[arg(long, default_value = "/var/lib/ferrovirt/agent")]
    data_dir: PathBuf,
    /// Address reported as the node's InternalIP.
    #[arg(long, default_value = "127.0.0.1")]
    address: String,
    /// Where the agent's HTTPS endpoint (console, VNC, port-forward, lifecycle calls from the
    /// API server) listens; port 0 picks a free port. An unspecified address (0.0.0.0) is
    /// published with `--address` as its host.
    #[arg(long, default_value = "127.0.0.1:0")]
    endpoint_listen: std::net::SocketAddr,
    #[command(flatten)]
    pub pod: PodNetArgs,
    #[command(flatten)]
    pub isolation: IsolationArgs,
    #[command(flatten)]
    pub nmstate: NmstateArgs,
}

/// Host network configuration from NodeNetworkConfigurationPolicies (docs/networking.md
/// "Host network configuration").
#[derive(Debug, Clone, clap::Args)]
pub struct NmstateArgs {
    /// Apply the NodeNetworkConfigurationPolicies that select this node to its network (the
    /// `--node-netns` namespace, else the agent's own) and report its NodeNetworkState. Off by
    /// default: the agent then never changes the node's network.
    #[arg(long)]
    pub nmstate: bool,
    /// Seconds the node may take to reach the API server after applying a policy before the
    /// change is rolled back.
    #[arg(long, default_value_t = 30, env = "FERROVIRT_NMSTATE_PROBE_TIMEOUT")]
    pub nmstate_probe_timeout: u64,
    /// The resolver file a policy's `dns-resolver` writes when the node is not a network
    /// namespace (with `--node-netns X` it is `/etc/netns/X/resolv.conf`).
    #[arg(long, default_value = "/etc/resolv.conf")]
    pub nmstate_resolv_conf: std::path::PathBuf,
}

impl NmstateArgs {
    /// The agent's options (`None` without `--nmstate`).
    pub fn options(
        &self,
        netns: Option<String>,
    ) -> Option<ferrovirt_agent::nmstate::NmstateOptions> {
        self.nmstate
            .then(|| ferrovirt_agent::nmstate::NmstateOptions {
                netns,
                probe_timeout: std::time::Duration::from_secs(self.nmstate_probe_timeout.max(1)),
                resolv_conf: self.nmstate_resolv_conf.clone(),
                ..Default::default()
            })
    }
}

/// How a node keeps its VMs apart from the host and each other (docs/security.md).
#[derive(Debug, Clone, clap::Args)]
pub struct IsolationArgs {
    /// A directory hostDisk volumes (with the HyperConverged feature gate HostDisk) and the
    /// host paths of hand-made PersistentVolumes may lie under; repeat for several. None by
    /// default: such paths are refused.
    #[arg(long = "host-disk-root", value_name = "DIR")]
    pub host_disk_roots: Vec<PathBuf>,
    /// The uids (and equal gids) VMs' QEMU processes run as, one per VM, FIRST-LAST.
    #[arg(long, default_value = "3000000000-3000065535")]
    pub qemu_uid_range: String,
    /// Bound of each VM's serial.log; it is rotated to serial.log.1 before passing it.
    #[arg(long, default_value_t = 4 << 20)]
    pub serial_log_max_bytes: u64,
    /// pids.max of each VM's cgroup (launcher and QEMU threads together).
    #[arg(long, default_value_t = 4096)]
    pub vm_pids_max: u64,
}

impl IsolationArgs {
    /// The agent's isolation options; `protected` are ferrovirt's data dirs besides the
    /// agent's own.
    pub fn options(
        &self,
        protected: Vec<PathBuf>,
    ) -> anyhow::Result<ferrovirt_agent::isolation::IsolationOptions> {
        let qemu_uids = ferrovirt_agent::isolation::UidRange::parse(&self.qemu_uid_range)
            .map_err(|e| anyhow::anyhow!("--qemu-uid-range: {e}"))?;
        for r in &self.host_disk_roots {
            anyhow::ensure!(
                r.is_absolute(),
                "--host-disk-root {}: must be absolute",
                r.display()
            );
        }
        Ok(ferrovirt_agent::isolation::IsolationOptions {
            host_disk_roots: self.host_disk_roots.clone(),
            protected_dirs: protected,
            qemu_uids,
            serial_log_max_bytes: self.serial_log_max_bytes,
            pids_max: self.vm_pids_max,
        })
    }
}

/// Networking for a node's VMIs: the pod network by default wherever the node can build it.
#[derive(Debug, Clone, clap::Args)]
pub struct PodNetArgs {
    /// `pod`: real pod networking, a namespace per VMI on a node bridge, a tap, DHCP and
    /// nftables (needs root, `ip`, `nft`, `nsenter`, /dev/net/tun; the agent refuses to start
    /// without them). `user`: QEMU user networking, restricted (the guest reaches no host
    /// address; bridge bindings and multus networks are refused). `auto`: `pod` when the node
    /// can build it, else `user` with a warning. The agent logs the mode and labels its Node
    /// `ferrovirt.io/network-mode`.
    #[arg(long, default_value = "auto", value_parser = parse_mode)]
    pub network_mode: ferrovirt_network::RequestedMode,
    /// Same as `--network-mode pod` (kept for older command lines).
    #[arg(long, conflicts_with = "network_mode")]
    pub pod_network: bool,
    /// The cluster's pod address range.
    #[arg(long, default_value = "10.244.0.0/16")]
    pub cluster_cidr: String,
    /// This node's subnet of the cluster range, recorded as the Node's spec.podCIDR (default:
    /// the one the node IPAM controller assigns).
    #[arg(long)]
    pub pod_cidr: Option<String>,
    /// The node's underlay address: published as its InternalIP and used as the VXLAN
    /// endpoint of the overlay between the nodes' pod networks (default: no overlay).
    #[arg(long)]
    pub node_ip: Option<std::net::Ipv4Addr>,
    /// Put the node bridge in this named network namespace (default: the agent's own).
    #[arg(long)]
    pub node_netns: Option<String>,
    /// Masquerade traffic leaving the cluster range out of this interface.
    #[arg(long)]
    pub uplink: Option<String>,
}

fn parse_mode(s: &str) -> Result<ferrovirt_network::RequestedMode, String> {
    s.parse()
}

impl PodNetArgs {
    /// The mode asked for (`--pod-network` = `pod`).
    pub fn requested_mode(&self) -> ferrovirt_network::RequestedMode {
        if self.pod_network {
            ferrovirt_network::RequestedMode::Pod
        } else {
            self.network_mode
        }
    }

    /// The node network these flags describe, unless user networking was asked for (`auto`
    /// is settled by the agent, which checks what the node offers).
    pub fn node_network(
        &self,
    ) -> anyhow::Result<Option<ferrovirt_agent::network::PodNetworkOptions>> {
        let requested = self.requested_mode();
        if requested == ferrovirt_network::RequestedMode::User {
            return Ok(None);
        }
        let cluster: ferrovirt_network::Ipv4Cidr = self
            .cluster_cidr
            .parse()
            .with_context(|| format!("--cluster-cidr {}", self.cluster_cidr))?;
        let ipam = ferrovirt_network::Ipam::new(cluster, 24)?;
        let pod_cidr: Option<ferrovirt_network::Ipv4Cidr> = match &self.pod_cidr {
            Some(s) => Some(s.parse().with_context(|| format!("--pod-cidr {s}"))?),
            None => None,
        };
        // Until the Node's podCIDR is known, the first subnet stands in (for validation).
        let subnet = match pod_cidr {
            Some(c) => c,
            None => ipam.node_subnet(0)?,
        };
        let mut node = ferrovirt_network::NodeNetwork::new(ipam, subnet);
        node.netns = self.node_netns.clone();
        node.uplink = self.uplink.clone();
        node.validate().with_context(|| match &self.pod_cidr {
            Some(c) => format!("--pod-cidr {c} with --cluster-cidr {}", self.cluster_cidr),
            None => format!("--cluster-cidr {}", self.cluster_cidr),
        })?;
        Ok(Some(ferrovirt_agent::network::PodNetworkOptions {
            requested,
            node,
            pod_cidr,
            node_ip: self.node_ip,
        }))
    }
}

/// The machine's host name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// A kube-rs client from a kubeconfig file that names itself `user_agent` (the API server
/// counts requests per user agent: `/metrics`).
pub async fn client_from_kubeconfig(path: &Path, user_agent: &str) -> anyhow::Result<kube::Client> {
    let kc = kube::config::Kubeconfig::read_from(path)
        .with_context(|| format!("reading {}", path.display()))?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    client_with_agent(cfg, user_agent)
}

fn client_with_agent(mut cfg: kube::Config, user_agent: &str) -> anyhow::Result<kube::Client> {
    let value = http::HeaderValue::from_str(user_agent)
        .with_context(|| format!("user agent {user_agent:?}"))?;
    cfg.headers.push((http::header::USER_AGENT, value));
    Ok(kube::Client::try_from(cfg)?)
}

/// A client of the API server running in this process that calls its routes directly
/// (`router`, from `Server::router`) with bearer `token` and `user_agent`: no TLS, no loopback
/// connection, no HTTP framing. The controllers' watches carry every Lease renewal and Node
/// change of the cluster; over loopback TLS each event was also encrypted, framed and
/// decrypted by this same process (measured alone, the idle server's CPU changed by less than
/// the run-to-run spread: 6.95 → 6.85 %, docs/scale.md eleventh pass). Requests go through the
/// same authentication, authorization, audit and admission as any other; only upgrades
/// (WebSocket subresources) need a real connection.
pub fn in_process_client(
    router: axum::Router,
    token: &str,
    user_agent: &str,
) -> anyhow::Result<kube::Client> {
    let auth = http::HeaderValue::from_str(&format!("Bearer {token}")).context("the token")?;
    let agent = http::HeaderValue::from_str(user_agent)
        .with_context(|| format!("user agent {user_agent:?}"))?;
    let service = tower::ServiceBuilder::new()
        .map_request(move |mut req: http::Request<kube::client::Body>| {
            let headers = req.headers_mut();
            headers.insert(http::header::AUTHORIZATION, auth.clone());
            headers.insert(http::header::USER_AGENT, agent.clone());
            req
        })
        .service(router);
    Ok(kube::Client::new(service, "default"))
}

/// The user agent of a node agent's API client.
pub fn agent_user_agent(node: &str) -> String {
    format!("ferrovirt-agent/{node}")
}

/// The user agent of the controllers' API client.
pub const CONTROLLER_USER_AGENT: &str = "ferrovirt-controller";

/// The bearer token of the kubeconfig's current user (the agent's endpoint requires it).
fn kubeconfig_token(path: &Path) -> Option<String> {
    let kc = kube::config::Kubeconfig::read_from(path).ok()?;
    let user = kc
        .current_context
        .as_deref()
        .and_then(|c| kc.contexts.iter().find(|n| n.name == c))
        .and_then(|c| c.context.as_ref())
        .map(|c| c.user.clone());
    // The token is a secret string: its serialized form is the plain value.
    let users = serde_json::to_value(&kc.auth_infos).ok()?;
    users.as_array()?.iter().find_map(|u| {
        let name_ok = user
            .as_ref()
            .is_none_or(|n| u["name"].as_str() == n.as_deref());
        name_ok.then(|| u["user"]["token"].as_str().map(String::from))?
    })
}

/// The PEM of the current cluster's `certificate-authority-data` (or `certificate-authority`
/// file) in a kubeconfig.
fn kubeconfig_ca(path: &Path) -> Option<String> {
    let kc = kube::config::Kubeconfig::read_from(path).ok()?;
    let cluster_name = kc
        .current_context
        .as_deref()
        .and_then(|c| kc.contexts.iter().find(|n| n.name == c))
        .and_then(|c| c.context.as_ref())
        .map(|c| c.cluster.clone());
    let cluster = kc
        .clusters
        .iter()
        .find(|c| cluster_name.as_ref().is_none_or(|n| c.name == *n))?
        .cluster
        .as_ref()?;
    if let Some(data) = &cluster.certificate_authority_data {
        let pem = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .ok()?;
        return String::from_utf8(pem).ok();
    }
    std::fs::read_to_string(cluster.certificate_authority.as_ref()?).ok()
}

async fn client_from_flags(
    server: &str,
    token: &str,
    ca: &Path,
    user_agent: &str,
) -> anyhow::Result<kube::Client> {
    let pem = std::fs::read_to_string(ca).with_context(|| format!("reading {}", ca.display()))?;
    let kc = serde_json::json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "ferrovirt",
        "clusters": [{"name": "ferrovirt", "cluster": {
            "server": server,
            "certificate-authority-data": base64::engine::general_purpose::STANDARD.encode(pem.as_bytes()),
        }}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "ferrovirt", "context": {"cluster": "ferrovirt", "user": "agent"}}],
    });
    let kc: kube::config::Kubeconfig = serde_json::from_value(kc)?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    client_with_agent(cfg, user_agent)
}

/// The environment variable that may hold the join token.
pub const TOKEN_ENV: &str = "FERROVIRT_TOKEN";

/// The join token of a `--server` agent without `--token`: from `--token-file`, else from
/// FERROVIRT_TOKEN; None when neither is given.
fn join_token(args: &AgentArgs) -> anyhow::Result<Option<ferrovirt_api::jointoken::JoinToken>> {
    let (text, from) = match (&args.token_file, std::env::var(TOKEN_ENV)) {
        (Some(f), _) => (
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?,
            f.display().to_string(),
        ),
        (None, Ok(t)) => (t, TOKEN_ENV.to_string()),
        (None, Err(_)) => return Ok(None),
    };
    let token = ferrovirt_api::jointoken::JoinToken::parse(&text)
        .map_err(|e| anyhow::anyhow!("the join token in {from}: {e}"))?;
    Ok(Some(token))
}

/// A kube-rs client with the node's own client certificate, trusting only the CA the join
/// token vouched for.
async fn client_from_credential(
    server: &str,
    cred: &ferrovirt_agent::join::NodeCredential,
    user_agent: &str,
) -> anyhow::Result<kube::Client> {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    let kc = serde_json::json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "ferrovirt",
        "clusters": [{"name": "ferrovirt", "cluster": {
            "server": server,
            "certificate-authority-data": b64(&cred.server_ca_pem),
        }}],
        "users": [{"name": "node", "user": {
            "client-certificate-data": b64(&cred.cert_pem),
            "client-key-data": b64(&cred.key_pem),
        }}],
        "contexts": [{"name": "ferrovirt", "context": {"cluster": "ferrovirt", "user": "node"}}],
    });
    let kc: kube::config::Kubeconfig = serde_json::from_value(kc)?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    client_with_agent(cfg, user_agent)
}

/// Runs `ferrovirt agent`.
pub async fn run_agent(mut args: AgentArgs) -> anyhow::Result<()> {
    let name = args.node_name.clone().unwrap_or_else(hostname);
    // Several servers: every client of this agent talks to the loopback balancer.
    let _balancer = match &args.server {
        Some(list) if list.contains(',') => {
            let upstreams = ferrovirt_agent::serverlb::parse_servers(list)?;
            let lb = ferrovirt_agent::serverlb::ServerBalancer::start(upstreams).await?;
            tracing::info!(servers = %list, via = %lb.url(), "API servers behind a loopback balancer");
            args.server = Some(lb.url());
            Some(lb)
        }
        _ => None,
    };
    let user_agent = agent_user_agent(&name);
    let joining = match (&args.server, &args.token) {
        (Some(_), None) => join_token(&args)?,
        _ => None,
    };
    if let (Some(server), Some(token)) = (&args.server, joining) {
        let cred = ferrovirt_agent::join::join(&ferrovirt_agent::join::JoinOptions {
            server: server.clone(),
            token,
            node_name: name.clone(),
            data_dir: args.data_dir.clone(),
            user_agent: user_agent.clone(),
        })
        .await?;
        let cred = crate::renew::renew_if_due(server, cred, &user_agent).await;
        let slot: crate::renew::Slot = Arc::new(std::sync::RwLock::new(
            client_from_credential(server, &cred, &user_agent).await?,
        ));
        let client = kube::Client::new(crate::renew::Swappable(slot.clone()), "default");
        {
            let (server, ua) = (server.clone(), user_agent.clone());
            let cred = cred.clone();
            tokio::spawn(async move {
                let build_ua = ua.clone();
                let build_server = server.clone();
                crate::renew::keep_renewed(server, cred, slot, ua, move |c| {
                    let (s, u) = (build_server.clone(), build_ua.clone());
                    async move { client_from_credential(&s, &c, &u).await }
                })
                .await;
            });
        }
        let mut opts = ferrovirt_agent::runtime::AgentOptions::new(name, args.data_dir.clone());
        opts.address = args.address.clone();
        opts.endpoint_listen = args.endpoint_listen;
        opts.endpoint_token = cred.endpoint_token.clone();
        opts.endpoint_client_ca = Some(cred.client_ca_pem.clone());
        opts.api_ca_pem = Some(cred.server_ca_pem.clone());
        opts.pod_network = args.pod.node_network()?;
        opts.isolation = args.isolation.options(Vec::new())?;
        opts.nmstate = args.nmstate.options(args.pod.node_netns.clone());
        ferrovirt_agent::runtime::run(client, opts).await?;
        return Ok(());
    }
    let token = match (&args.token, &args.kubeconfig) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(kc)) => kubeconfig_token(kc),
        (None, None) => None,
    };
    let client = match (&args.server, &args.kubeconfig) {
        (Some(_), _) if args.token.is_none() || args.certificate_authority.is_none() => {
            anyhow::bail!(
                "--server needs --token-file (or {TOKEN_ENV}) to join, or --token with \
                 --certificate-authority"
            )
        }
        (Some(server), _) => {
            client_from_flags(
                server,
                args.token.as_deref().unwrap_or_default(),
                args.certificate_authority
                    .as_deref()
                    .unwrap_or(Path::new("")),
                &user_agent,
            )
            .await?
        }
        (None, Some(kc)) => client_from_kubeconfig(kc, &user_agent).await?,
        (None, None) => {
            anyhow::bail!(
                "give --kubeconfig, or --server with --token-file (joining), or --server with \
                 --token and --certificate-authority"
            )
        }
    };
    let mut opts = ferrovirt_agent::runtime::AgentOptions::new(name, args.data_dir.clone());
    opts.address = args.address.clone();
    opts.endpoint_listen = args.endpoint_listen;
    opts.api_token = token;
    opts.api_ca_pem = match (&args.server, &args.kubeconfig) {
        (Some(_), _) => args
            .certificate_authority
            .as_deref()
            .and_then(|p| std::fs::read_to_string(p).ok()),
        (None, Some(kc)) => kubeconfig_ca(kc),
        (None, None) => None,
    };
    opts.pod_network = args.pod.node_network()?;
    opts.isolation = args.isolation.options(Vec::new())?;
    opts.nmstate = args.nmstate.options(args.pod.node_netns.clone());
    ferrovirt_agent::runtime::run(client, opts).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use ferrovirt_network::RequestedMode;

    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        pod: PodNetArgs,
    }

    #[test]
    fn network_mode_flags() {
        let mode = |argv: &[&str]| {
            Flags::try_parse_from([&["t"], argv].concat()).map(|f| f.pod.requested_mode())
        };
        assert_eq!(mode(&[]).unwrap(), RequestedMode::Auto);
        assert_eq!(mode(&["--pod-network"]).unwrap(), RequestedMode::Pod);
        assert_eq!(
            mode(&["--network-mode", "user"]).unwrap(),
            RequestedMode::User
        );
        assert!(mode(&["--network-mode", "slirp"]).is_err());
        assert!(mode(&["--pod-network", "--network-mode", "user"]).is_err());
        let f = Flags::try_parse_from(["t", "--network-mode", "user"]).unwrap();
        assert!(f.pod.node_network().unwrap().is_none());
        let f = Flags::try_parse_from(["t"]).unwrap();
        assert_eq!(
            f.pod.node_network().unwrap().unwrap().requested,
            RequestedMode::Auto
        );
    }

    #[derive(clap::Parser)]
    struct Agent {
        #[command(flatten)]
        agent: AgentArgs,
    }

    #[test]
    fn join_flags_take_the_token_from_a_file_only() {
        if std::env::var_os("KUBECONFIG").is_some() || std::env::var_os(TOKEN_ENV).is_some() {
            // --kubeconfig reads KUBECONFIG and conflicts with --server.
            eprintln!("skipped: KUBECONFIG or {TOKEN_ENV} is set");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        let token = format!("K10{}::{}", "ab".repeat(32), "s".repeat(20));
        std::fs::write(&file, format!("{token}\n")).unwrap();
        let parse = |argv: &[&str]| Agent::try_parse_from([&["agent"], argv].concat());
        let f = file.to_str().unwrap();
        let a = parse(&["--server", "https://127.0.0.1:1", "--token-file", f]).unwrap();
        assert_eq!(join_token(&a.agent).unwrap().unwrap().format(), token);
        // A join token is never a command-line value; --token is a bearer token and does
        // not mix with --token-file, nor --token-file with --certificate-authority.
        assert!(parse(&["--server", "https://x", "--join-token", &token]).is_err());
        assert!(parse(&["--server", "https://x", "--token-file", f, "--token", "t"]).is_err());
        assert!(
            parse(&[
                "--server",
                "https://x",
                "--token-file",
                f,
                "--certificate-authority",
                f
            ])
            .is_err()
        );
        assert!(
            parse(&["--token-file", f]).is_err(),
            "--token-file needs --server"
        );
        std::fs::write(&file, "K10nothex::x").unwrap();
        let e = join_token(&a.agent).unwrap_err().to_string();
        assert!(e.contains("CA hash") && e.contains(f), "{e}");
    }

    #[test]
    fn token_of_the_current_user() {
        let path = std::env::temp_dir().join(format!("fv-kubeconfig-{}.yaml", std::process::id()));
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\ncurrent-context: b\n\
             clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n\
             users: [{name: ua, user: {token: ta}}, {name: ub, user: {token: tb}}]\n\
             contexts: [{name: a, context: {cluster: c, user: ua}}, {name: b, context: {cluster: c, user: ub}}]\n",
        )
        .unwrap();
        assert_eq!(kubeconfig_token(&path).as_deref(), Some("tb"));
        let _ = std::fs::remove_file(&path);
        assert_eq!(kubeconfig_token(Path::new("/nonexistent")), None);
    }

    #[test]
    fn ca_of_the_current_cluster() {
        let path =
            std::env::temp_dir().join(format!("fv-kubeconfig-ca-{}.yaml", std::process::id()));
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: b\n\
                 clusters: [{{name: c1, cluster: {{server: 'https://a', certificate-authority-data: {}}}}}, \
                 {{name: c2, cluster: {{server: 'https://b', certificate-authority-data: {}}}}}]\n\
                 users: [{{name: u, user: {{token: t}}}}]\n\
                 contexts: [{{name: a, context: {{cluster: c1, user: u}}}}, {{name: b, context: {{cluster: c2, user: u}}}}]\n",
                b64("PEM-ONE"),
                b64("PEM-TWO")
            ),
        )
        .unwrap();
        assert_eq!(kubeconfig_ca(&path).as_deref(), Some("PEM-TWO"));
        let _ = std::fs::remove_file(&path);
        assert_eq!(kubeconfig_ca(Path::new("/nonexistent")), None);
    }
}
