//! The `ferrovirt` binary: argument parsing and wiring only. Each subcommand hands over to the
//! crate that owns it.

mod demo;
mod node;
mod renew;
mod verbs;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

/// mimalloc instead of glibc's malloc for every subcommand: the idle API server spent about a
/// quarter of its CPU in glibc's allocator (fastbin consolidation on hyper's per-read buffer
/// growth), see docs/scale.md.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// ferrovirt: virtual machines as declarative, KubeVirt-compatible API objects.
#[derive(Debug, Parser)]
#[command(name = "ferrovirt", version, about)]
struct Cli {
    #[command(flatten)]
    conn: verbs::Conn,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the API server (and, unless disabled, a node agent for this machine).
    Server(ServerArgs),
    /// Run a node agent against a server.
    Agent(node::AgentArgs),
    /// Internal: run one VMI's launcher (started by the agent).
    #[command(hide = true)]
    Launcher {
        /// The VMI's directory (spec.json, meta.json, sockets).
        #[arg(long)]
        dir: PathBuf,
        /// Started early by the agent: join these cgroups, then wait on stdin for the word
        /// to run (`ferrovirt_launcher::early`).
        #[arg(long)]
        early_cgroup: Option<String>,
    },
    /// Server maintenance of Secrets at rest.
    Secrets {
        #[command(subcommand)]
        cmd: SecretsCommand,
    },
    /// Credentials for other identities.
    Kubeconfig {
        #[command(subcommand)]
        cmd: KubeconfigCommand,
    },
    /// Print the node join token (`K10<CA hash>::<secret>`, kept in `DATA_DIR/node-token`,
    /// 0600): give it to `ferrovirt agent --server URL --token-file FILE` on a new node.
    Token {
        /// The server's data directory.
        #[arg(long, default_value = "/var/lib/ferrovirt")]
        data_dir: PathBuf,
    },
    /// Boot the test guest as a demo VM straight through QEMU, without the server.
    Demo {
        #[command(subcommand)]
        cmd: demo::DemoCommand,
    },
    #[command(flatten)]
    Verb(verbs::VerbCommand),
}

#[derive(Debug, clap::Args)]
struct ServerArgs {
    /// Data directory (TLS material, token, kubeconfig.yaml, SQLite store, agent state).
    #[arg(long, default_value = "/var/lib/ferrovirt")]
    data_dir: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:6443")]
    listen: SocketAddr,
    /// Store: `sqlite://PATH` (default: DATA_DIR/state.db) or etcd `http://host:2379,...`
    /// (`https://...` with --datastore-cafile; several servers may share one etcd:
    /// docs/nodes.md "Highly available servers").
    #[arg(long)]
    datastore_endpoint: Option<String>,
    #[command(flatten)]
    datastore_tls: DatastoreTlsArgs,
    /// Join the cluster of the servers already on this (etcd) datastore: the file holds the
    /// first server's `ferrovirt token`; this server loads the cluster's CA, keys and tokens
    /// from the datastore (sealed under the token's secret) instead of making new ones.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Do not run a node agent in this process.
    #[arg(long)]
    disable_agent: bool,
    /// Do not run the controllers (VM lifecycle, scheduler, node lifecycle) in this process.
    #[arg(long)]
    disable_controllers: bool,
    /// Node name of the embedded agent (default: the host name).
    #[arg(long)]
    node_name: Option<String>,
    /// Address ranges (comma list, e.g. `10.0.0.0/8,fd00::/8`) that DataVolume imports may
    /// reach although they are loopback, link-local, multicast or this machine's own
    /// addresses (refused by default); HyperConverged `spec.storageImport.allowedImportCIDRs`
    /// adds more.
    #[arg(long, value_parser = parse_cidrs, default_value = "")]
    import_allowed_cidrs: Cidrs,
    /// The range Service ClusterIPs are allocated from; must not overlap `--cluster-cidr`.
    #[arg(long, default_value = ferrovirt_api::service::DEFAULT_SERVICE_CIDR)]
    service_cidr: ferrovirt_api::service::ServiceCidr,
    /// Append an audit log (Kubernetes' audit.k8s.io/v1 Events, one JSON line per request) to
    /// this file (created 0600).
    #[arg(long)]
    audit_log_path: Option<PathBuf>,
    /// How long a node certificate (joining, renewal) is valid, in seconds (at least 10);
    /// agents renew theirs when less than a third is left (docs/nodes.md).
    #[arg(long, default_value_t = 365 * 86_400, value_parser = clap::value_parser!(u64).range(10..))]
    node_cert_lifetime_seconds: u64,
    /// What the audit log records: `Metadata` (who, what, when, the code) or `Request` (also
    /// JSON request bodies; never a Secret's).
    #[arg(long, default_value = "Metadata")]
    audit_level: ferrovirt_apiserver::audit::Level,
    #[command(flatten)]
    pod: node::PodNetArgs,
    #[command(flatten)]
    isolation: node::IsolationArgs,
}

/// The etcd TLS flags (k3s' names).
#[derive(Debug, Clone, clap::Args)]
struct DatastoreTlsArgs {
    /// PEM file of the CA that signed the etcd members' certificates (needed for https://).
    #[arg(long)]
    datastore_cafile: Option<PathBuf>,
    /// PEM client certificate presented to etcd (members run with --client-cert-auth).
    #[arg(long)]
    datastore_certfile: Option<PathBuf>,
    /// PEM key of --datastore-certfile.
    #[arg(long)]
    datastore_keyfile: Option<PathBuf>,
}

impl DatastoreTlsArgs {
    fn tls(&self) -> ferrovirt_store::DatastoreTls {
        ferrovirt_store::DatastoreTls {
            ca_file: self.datastore_cafile.clone(),
            cert_file: self.datastore_certfile.clone(),
            key_file: self.datastore_keyfile.clone(),
        }
    }
}

/// The ranges of `--import-allowed-cidrs`.
#[derive(Debug, Clone)]
struct Cidrs(Vec<ferrovirt_storage::netpolicy::Cidr>);

fn parse_cidrs(s: &str) -> Result<Cidrs, String> {
    ferrovirt_storage::netpolicy::parse_list(s).map(Cidrs)
}

#[derive(Debug, Subcommand)]
enum SecretsCommand {
    /// Add a new encryption key, re-encrypt every Secret with it and retire the old keys.
    /// With SQLite, stop the server first; with etcd it runs beside the servers, which must
    /// share this data dir's `encryption-keys` file.
    RotateKey {
        /// The server's data directory (holds `encryption-keys`).
        #[arg(long, default_value = "/var/lib/ferrovirt")]
        data_dir: PathBuf,
        /// The server's store (default: DATA_DIR/state.db).
        #[arg(long)]
        datastore_endpoint: Option<String>,
        #[command(flatten)]
        datastore_tls: DatastoreTlsArgs,
        /// How long to wait after adding the key before re-encrypting, so that running
        /// servers (etcd) have picked it up.
        #[arg(long, default_value = "2s", value_parser = parse_secs)]
        settle: std::time::Duration,
    },
}

#[derive(Debug, Subcommand)]
enum KubeconfigCommand {
    /// Print a kubeconfig for a client-certificate identity: a new key made here and a
    /// certificate signed by the server's client CA (CN = user, O = groups, as Kubernetes
    /// reads them). Runs on the server machine: it reads `DATA_DIR/tls/client-ca.key` (root
    /// only, 0600), `tls/ca.crt` and the server URL from `kubeconfig.yaml`; grant rights with
    /// RoleBindings to the user or its groups.
    Create {
        /// The server's data directory.
        #[arg(long, default_value = "/var/lib/ferrovirt")]
        data_dir: PathBuf,
        /// The user name (certificate CN).
        #[arg(long)]
        user: String,
        /// A group (certificate O); repeat for a second one.
        #[arg(long = "group")]
        groups: Vec<String>,
        /// How long the certificate is valid, in days.
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
}

fn parse_secs(s: &str) -> Result<std::time::Duration, String> {
    let n = s.strip_suffix('s').unwrap_or(s);
    n.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(std::time::Duration::from_secs_f64)
        .ok_or_else(|| format!("invalid duration {s:?} (e.g. 2s)"))
}

async fn secrets(cmd: SecretsCommand) -> anyhow::Result<()> {
    let SecretsCommand::RotateKey {
        data_dir,
        datastore_endpoint,
        datastore_tls,
        settle,
    } = cmd;
    let endpoint = datastore_endpoint.unwrap_or_default();
    let store = ferrovirt_store::open_endpoint_tls(&endpoint, &datastore_tls.tls(), &data_dir)
        .await
        .map_err(|e| {
            if e.to_string().contains("in use by another store") {
                anyhow::anyhow!(
                    "{e}: stop the server first (an SQLite store is opened by one process at a time)"
                )
            } else {
                anyhow::anyhow!("opening the store: {e}")
            }
        })?;
    let key_file = ferrovirt_apiserver::encryption_key_file(&data_dir);
    let done = ferrovirt_store::encrypt::rotate(
        store,
        &key_file,
        ferrovirt_apiserver::ENCRYPTED_PREFIXES,
        settle,
    )
    .await
    .with_context(|| format!("rotating the keys in {}", key_file.display()))?;
    println!(
        "new key {}; {} Secret(s) re-encrypted; retired {}",
        done.new_key,
        done.rewritten,
        if done.retired.is_empty() {
            "nothing".to_string()
        } else {
            done.retired.join(", ")
        }
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    // One rustls crypto provider for every TLS user in the process.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    match cli.command {
        Command::Demo { cmd } => demo::run(cmd),
        Command::Launcher { dir, early_cgroup } => {
            // Before the runtime exists: the process has one thread, so entering the VMI's
            // network namespace moves all of it.
            if let Some(name) = early_cgroup
                && !ferrovirt_launcher::early::prepare(&name, std::io::stdin().lock())?
            {
                return Ok(());
            }
            runtime()?.block_on(async {
                let report = ferrovirt_launcher::daemon::run(&dir).await?;
                tracing::info!(reason = ?report.reason, "launcher done: {}", report.message);
                Ok(())
            })
        }
        Command::Agent(args) => runtime()?.block_on(node::run_agent(args)),
        Command::Server(args) => runtime()?.block_on(server(args)),
        Command::Secrets { cmd } => runtime()?.block_on(secrets(cmd)),
        Command::Kubeconfig {
            cmd:
                KubeconfigCommand::Create {
                    data_dir,
                    user,
                    groups,
                    days,
                },
        } => {
            let text = ferrovirt_apiserver::client_kubeconfig(&data_dir, &user, &groups, days)
                .with_context(|| format!("making a kubeconfig from {}", data_dir.display()))?;
            print!("{text}");
            Ok(())
        }
        Command::Token { data_dir } => {
            let path = data_dir.join(ferrovirt_apiserver::auth::join::TOKEN_FILE);
            let text = std::fs::read_to_string(&path).with_context(|| {
                format!(
                    "reading {} (the server creates it on its first start)",
                    path.display()
                )
            })?;
            println!("{}", text.trim());
            Ok(())
        }
        Command::Verb(cmd) => {
            let code = runtime()?.block_on(verbs::run(&cli.conn, cmd));
            std::process::exit(code);
        }
    }
}

/// On a shared (etcd) datastore: the cluster's shared credentials loaded into the data dir
/// (`--token-file`, or a restart), or None and the store to publish them in after the start.
async fn bootstrap(
    args: &ServerArgs,
) -> anyhow::Result<
    Option<(
        std::sync::Arc<dyn ferrovirt_store::Store>,
        ferrovirt_apiserver::bootstrap::Prepared,
    )>,
> {
    let endpoint = args.datastore_endpoint.clone().unwrap_or_default();
    let tls = args.datastore_tls.tls();
    let shared = ferrovirt_store::Datastore::parse(&endpoint, &tls, &args.data_dir)
        .map_err(|e| anyhow::anyhow!("--datastore-endpoint: {e}"))?
        .is_shared();
    let token = match &args.token_file {
        None => None,
        Some(_) if !shared => anyhow::bail!(
            "--token-file joins the servers of a shared etcd datastore: give \
             --datastore-endpoint http(s)://…"
        ),
        Some(f) => {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            Some(
                ferrovirt_api::jointoken::JoinToken::parse(&text)
                    .map_err(|e| anyhow::anyhow!("the token in {}: {e}", f.display()))?,
            )
        }
    };
    if !shared {
        return Ok(None);
    }
    let store = ferrovirt_store::open_endpoint_tls(&endpoint, &tls, &args.data_dir)
        .await
        .map_err(|e| anyhow::anyhow!("opening the datastore: {e}"))?;
    let prepared = ferrovirt_apiserver::bootstrap::prepare(
        store.as_ref(),
        &args.data_dir,
        token.as_ref(),
        std::time::Duration::from_secs(60),
    )
    .await?;
    Ok(Some((store, prepared)))
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

async fn server(args: ServerArgs) -> anyhow::Result<()> {
    ferrovirt_apiserver::private_dir(&args.data_dir)
        .with_context(|| format!("creating {}", args.data_dir.display()))?;
    // Servers sharing an etcd share one identity: a joining server loads it before anything
    // reads the data dir (the upload key below included).
    let bootstrap = bootstrap(&args).await?;
    // KubeVirt's subresource API (console, VNC, pause, start/stop, ...) needs a client of this
    // very server, which exists only once the server has started and written its kubeconfig:
    // the routes go in now and answer 503 until they get their client right after the start.
    let (subresources, subresources_handle) = ferrovirt_agent::proxy::deferred();
    // CDI's upload token requests and upload proxy path, also deferred until the client exists.
    let (upload, upload_handle) = ferrovirt_controller::storage::upload_api::deferred(
        ferrovirt_controller::storage::upload_api::UploadOptions::new(&args.data_dir),
    )
    .context("loading the upload token key")?;
    // VirtualMachineExport downloads: authenticated by the export token, not the API token.
    let (exports, exports_handle) = ferrovirt_controller::export::serve::deferred();
    let pods: ferrovirt_network::Ipv4Cidr = args
        .pod
        .cluster_cidr
        .parse()
        .with_context(|| format!("--cluster-cidr {}", args.pod.cluster_cidr))?;
    if args.service_cidr.overlaps(pods.network(), pods.prefix()) {
        anyhow::bail!(
            "--service-cidr {} overlaps --cluster-cidr {}: Service addresses must lie outside the pod network",
            args.service_cidr,
            args.pod.cluster_cidr
        );
    }
    let opts = ferrovirt_apiserver::ServerOptions {
        // The web console's static files at /ui/ need no token (they hold no secrets); every
        // API call the page makes carries the user's own.
        public_routes: Some(exports.merge(ferrovirt_webui::router())),
        service_cidr: args.service_cidr,
        audit_log: args.audit_log_path.clone().map(|p| (p, args.audit_level)),
        node_cert_lifetime: std::time::Duration::from_secs(args.node_cert_lifetime_seconds),
        // The controllers run in this process: their workqueue series join the server's.
        extra_metrics: (!args.disable_controllers)
            .then_some(ferrovirt_controller::runtime::metrics::render as fn() -> String),
        data_dir: args.data_dir.clone(),
        listen: args.listen,
        datastore_endpoint: args.datastore_endpoint.clone(),
        datastore_tls: args.datastore_tls.tls(),
        extra_routes: Some(subresources.merge(upload)),
        // upload.cdi.kubevirt.io is in the resource table (UploadTokenRequest, create-only).
        extra_groups: vec![format!("{}/v1", ferrovirt_agent::proxy::GROUP)],
        endpoint_token: Some(ferrovirt_agent::tls::endpoint_token),
        ..Default::default()
    };
    let server = ferrovirt_apiserver::Server::start(opts).await?;
    if let Some((store, ferrovirt_apiserver::bootstrap::Prepared::First)) = &bootstrap {
        ferrovirt_apiserver::bootstrap::publish(store.as_ref(), &args.data_dir)
            .await
            .context("storing the bootstrap data for further servers")?;
    }
    // The server's own client certificate for joined agents' endpoints (mutual TLS beside the
    // derived token), signed by the client CA at every start (docs/nodes.md).
    {
        use ferrovirt_api::jointoken::{SERVER_GROUP, SERVER_USER};
        let ca = ferrovirt_apiserver::auth::certs::load(&args.data_dir)?;
        let (cert, key) = ca.issue(SERVER_USER, &[SERVER_GROUP.to_string()], 365)?;
        ferrovirt_agent::tls::set_server_identity(&cert, &key)?;
    }
    subresources_handle.set(
        node::client_from_kubeconfig(&server.kubeconfig_path, "ferrovirt-subresources").await?,
        server.token.clone(),
    );
    upload_handle.set(
        node::client_from_kubeconfig(&server.kubeconfig_path, "ferrovirt-upload").await?,
        Some(server.token.clone()),
    );
    // Export links name the server as clients reach it (a wildcard listen: by host name).
    let export_endpoint = ferrovirt_controller::export::plan::Endpoint {
        base_url: if server.addr.ip().is_unspecified() {
            format!("https://{}:{}", node::hostname(), server.addr.port())
        } else {
            server.url()
        },
        ca_pem: server.ca_pem.clone(),
    };
    exports_handle.set(ferrovirt_controller::export::serve::ServeOptions {
        client: node::client_from_kubeconfig(&server.kubeconfig_path, "ferrovirt-export").await?,
        agent_token: Some(server.token.clone()),
        endpoint: export_endpoint.clone(),
        // The embedded agent's volumes are read in this process (one TLS hop less).
        local_node: (!args.disable_agent).then(|| ferrovirt_controller::export::serve::LocalNode {
            name: args.node_name.clone().unwrap_or_else(node::hostname),
            agent_data_dir: args.data_dir.join("agent"),
        }),
    });
    tracing::info!(
        "API server listening on https://{}; kubeconfig: {}",
        server.addr,
        server.kubeconfig_path.display()
    );
    let mut tasks = tokio::task::JoinSet::new();
    if !args.disable_controllers {
        // In this process: the server's routes are called directly (node::in_process_client).
        let client =
            node::in_process_client(server.router(), &server.token, node::CONTROLLER_USER_AGENT)?;
        let mut opts = ferrovirt_controller::ControllerOptions::default();
        opts.leader_election.identity = format!("{}-{}", node::hostname(), std::process::id());
        // Servers sharing an etcd: a dead leader's Lease runs out in 10 s and the others retry
        // every 2 s, so a new leader holds it at most ~12 s after the old one died (the
        // Kubernetes default of 15 s with 5 s renewals could take 20 s).
        opts.leader_election.lease_duration = std::time::Duration::from_secs(10);
        opts.leader_election.renew_period = std::time::Duration::from_secs(2);
        opts.storage.data_dir = Some(args.data_dir.clone());
        opts.storage.import_allowed_cidrs = args.import_allowed_cidrs.0.clone();
        opts.storage.agent_token = Some(server.token.clone());
        opts.export = Some(export_endpoint.clone());
        opts.node_ipam.cluster_cidr = args.pod.cluster_cidr.clone();
        tasks.spawn(async move {
            ferrovirt_controller::run(client, opts)
                .await
                .context("controllers")
        });
    }
    if !args.disable_agent {
        let name = args.node_name.clone().unwrap_or_else(node::hostname);
        let client =
            node::client_from_kubeconfig(&server.kubeconfig_path, &node::agent_user_agent(&name))
                .await?;
        let mut opts =
            ferrovirt_agent::runtime::AgentOptions::new(name, args.data_dir.join("agent"));
        opts.api_token = Some(server.token.clone());
        opts.api_ca_pem = Some(server.ca_pem.clone());
        opts.pod_network = args.pod.node_network()?;
        opts.isolation = args.isolation.options(vec![args.data_dir.clone()])?;
        tasks.spawn(async move {
            ferrovirt_agent::runtime::run(client, opts)
                .await
                .context("embedded agent")
        });
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupted; stopping"),
        _ = term.recv() => tracing::info!("terminated; stopping"),
        Some(r) = tasks.join_next() => {
            r??;
        }
    }
    server.shutdown().await;
    Ok(())
}
