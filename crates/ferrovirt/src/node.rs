//! `ferrovirt agent`: argument parsing and the kube-rs client setup for a node agent.

use std::path::{Path, PathBuf};

use anyhow::Context;
use base64::Engine;

#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    /// Kubeconfig for the server (e.g. the server's DATA_DIR/kubeconfig.yaml).
    #[arg(long, env = "KUBECONFIG", conflicts_with = "server")]
    kubeconfig: Option<PathBuf>,
    /// Server URL (with --token and --certificate-authority instead of a kubeconfig).
    #[arg(long, requires_all = ["token", "certificate_authority"])]
    server: Option<String>,
    /// Bearer token.
    #[arg(long)]
    token: Option<String>,
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
}

/// The machine's host name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// A kube-rs client from a kubeconfig file.
pub async fn client_from_kubeconfig(path: &Path) -> anyhow::Result<kube::Client> {
    let kc = kube::config::Kubeconfig::read_from(path)
        .with_context(|| format!("reading {}", path.display()))?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    Ok(kube::Client::try_from(cfg)?)
}

async fn client_from_flags(server: &str, token: &str, ca: &Path) -> anyhow::Result<kube::Client> {
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
    Ok(kube::Client::try_from(cfg)?)
}

/// Runs `ferrovirt agent`.
pub async fn run_agent(args: AgentArgs) -> anyhow::Result<()> {
    let client = match (&args.server, &args.kubeconfig) {
        (Some(server), _) => {
            client_from_flags(
                server,
                args.token.as_deref().unwrap_or_default(),
                args.certificate_authority
                    .as_deref()
                    .unwrap_or(Path::new("")),
            )
            .await?
        }
        (None, Some(kc)) => client_from_kubeconfig(kc).await?,
        (None, None) => {
            anyhow::bail!("give --kubeconfig, or --server with --token and --certificate-authority")
        }
    };
    let name = args.node_name.clone().unwrap_or_else(hostname);
    let mut opts = ferrovirt_agent::runtime::AgentOptions::new(name, args.data_dir.clone());
    opts.address = args.address.clone();
    ferrovirt_agent::runtime::run(client, opts).await?;
    Ok(())
}
