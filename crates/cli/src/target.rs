//! Which server the CLI talks to and with which credentials, as kubectl decides it:
//! `--kubeconfig`, else every file of `$KUBECONFIG` merged (the first to set a value wins), else
//! the local server's (`./.ferrovirt/server/kubeconfig.yaml` from the quick start, then
//! `/var/lib/ferrovirt/kubeconfig.yaml`), else `~/.kube/config`. Credentials are kube-rs's
//! (`kube::Config`: tokens, token files, exec plugins, client certificates, CAs), for the
//! kube-rs client and for the websocket/upload [`Transport`] alike.
//!
//! Several servers (docs/nodes.md "Highly available servers"): `FERROVIRT_SERVERS` lists
//! their URLs (`https://a:6443,https://b:6443`); the CLI then talks to the first that accepts
//! a connection ([`pick_server`]) with the kubeconfig's credentials and CA (the servers share
//! both), instead of the kubeconfig's one server. One command is short: picking a live server
//! when it starts is the failover; a command that runs on (`get -w`, a console) ends when its
//! server dies and is run again.

use std::path::{Path, PathBuf};

use http::Uri;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::error::CliError;
use crate::transport::{ApiWebSocket, Transport};

pub use crate::transport::WS_PROTOCOL;

/// The environment variable listing several servers' URLs.
pub const SERVERS_ENV: &str = "FERROVIRT_SERVERS";

/// The first of the comma list `servers` that `reachable` accepts; an error names the list
/// when none does (or when it holds no https URL).
pub fn pick_server(servers: &str, reachable: impl Fn(&Uri) -> bool) -> Result<Uri, CliError> {
    let mut urls = Vec::new();
    for s in servers.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let u: Uri = s
            .parse()
            .map_err(|e| CliError::Config(format!("{SERVERS_ENV}: {s:?}: {e}")))?;
        if u.scheme_str() != Some("https") || u.authority().is_none() {
            return Err(CliError::Config(format!(
                "{SERVERS_ENV}: {s:?} is not an https://HOST:PORT URL"
            )));
        }
        urls.push(u);
    }
    if urls.is_empty() {
        return Err(CliError::Config(format!("{SERVERS_ENV} names no server")));
    }
    urls.iter().find(|u| reachable(u)).cloned().ok_or_else(|| {
        CliError::Config(format!("no server of {SERVERS_ENV}={servers} is reachable"))
    })
}

/// Whether a TCP connection to `u`'s host and port opens within 2 s.
fn tcp_reachable(u: &Uri) -> bool {
    use std::net::ToSocketAddrs;
    let host = u.host().unwrap_or_default().trim_matches(['[', ']']);
    let port = u.port_u16().unwrap_or(443);
    (host, port).to_socket_addrs().is_ok_and(|mut addrs| {
        addrs.any(|a| {
            std::net::TcpStream::connect_timeout(&a, std::time::Duration::from_secs(2)).is_ok()
        })
    })
}

/// Candidate kubeconfig paths, in order.
pub fn kubeconfig_candidates(
    explicit: Option<&Path>,
    env: Option<&str>,
    home: Option<&str>,
) -> Vec<PathBuf> {
    if let Some(p) = explicit {
        return vec![p.to_path_buf()];
    }
    if let Some(e) = env.filter(|e| !e.is_empty()) {
        return e
            .split(':')
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .collect();
    }
    let mut v = vec![
        PathBuf::from(".ferrovirt/server/kubeconfig.yaml"),
        PathBuf::from("/var/lib/ferrovirt/kubeconfig.yaml"),
    ];
    if let Some(h) = home {
        v.push(Path::new(h).join(".kube/config"));
    }
    v
}

/// A resolved server: the (merged) kubeconfig, its current server and namespace.
#[derive(Clone)]
pub struct Target {
    /// The first kubeconfig file read.
    pub kubeconfig: PathBuf,
    pub server: Uri,
    pub namespace: String,
    kc: Kubeconfig,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("kubeconfig", &self.kubeconfig)
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Kubeconfig, CliError> {
    Kubeconfig::read_from(path).map_err(|e| CliError::Config(format!("{}: {e}", path.display())))
}

/// Reads the kubeconfig the candidates name: an explicit file must exist; `$KUBECONFIG`'s
/// existing files are merged in order; otherwise the first existing default.
fn load_merged(
    explicit: Option<&Path>,
    env: Option<&str>,
    home: Option<&str>,
) -> Result<(Kubeconfig, PathBuf), CliError> {
    let candidates = kubeconfig_candidates(explicit, env, home);
    let tried = || {
        candidates
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let merge = explicit.is_none() && env.is_some_and(|e| !e.is_empty());
    let mut found = candidates.iter().filter(|p| p.is_file());
    let Some(first) = found.next() else {
        return Err(CliError::Config(format!(
            "no kubeconfig found (tried {}); pass --kubeconfig",
            tried()
        )));
    };
    let mut kc = read(first)?;
    if merge {
        for p in found {
            kc = kc
                .merge(read(p)?)
                .map_err(|e| CliError::Config(format!("merging {}: {e}", p.display())))?;
        }
    }
    Ok((kc, first.clone()))
}

impl Target {
    /// Loads the kubeconfig of [`kubeconfig_candidates`] (merging `$KUBECONFIG`'s list).
    pub fn load(explicit: Option<&Path>, namespace: Option<&str>) -> Result<Target, CliError> {
        let env = std::env::var("KUBECONFIG").ok();
        let home = std::env::var("HOME").ok();
        let (kc, path) = load_merged(explicit, env.as_deref(), home.as_deref())?;
        let ctx_name = kc.current_context.clone().unwrap_or_default();
        let ctx = kc
            .contexts
            .iter()
            .find(|c| c.name == ctx_name)
            .or_else(|| kc.contexts.first())
            .and_then(|c| c.context.clone());
        let cluster_name = ctx.as_ref().map(|c| c.cluster.clone()).unwrap_or_default();
        let cluster = kc
            .clusters
            .iter()
            .find(|c| c.name == cluster_name)
            .or_else(|| kc.clusters.first())
            .and_then(|c| c.cluster.clone())
            .ok_or_else(|| CliError::Config(format!("{}: no cluster", path.display())))?;
        let server: Uri = match std::env::var(SERVERS_ENV) {
            Ok(list) if !list.trim().is_empty() => pick_server(&list, tcp_reachable)?,
            _ => cluster
                .server
                .clone()
                .unwrap_or_default()
                .parse()
                .map_err(|e| {
                    CliError::Config(format!("{}: bad server URL: {e}", path.display()))
                })?,
        };
        let namespace = namespace
            .map(String::from)
            .or_else(|| ctx.and_then(|c| c.namespace))
            .unwrap_or_else(|| "default".into());
        Ok(Target {
            kubeconfig: path,
            server,
            namespace,
            kc,
        })
    }

    /// kube-rs's configuration of this target; `insecure` skips server certificate checks.
    pub async fn config(&self, insecure: bool) -> Result<kube::Config, CliError> {
        let opts = KubeConfigOptions {
            context: self.kc.current_context.clone(),
            ..Default::default()
        };
        let mut cfg = kube::Config::from_custom_kubeconfig(self.kc.clone(), &opts)
            .await
            .map_err(|e| CliError::Config(e.to_string()))?;
        if insecure {
            cfg.accept_invalid_certs = true;
        }
        // FERROVIRT_SERVERS may have picked another server than the kubeconfig's.
        cfg.cluster_url = self.server.clone();
        Ok(cfg)
    }

    /// A kube-rs client for this target.
    pub async fn client(&self) -> Result<kube::Client, CliError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        kube::Client::try_from(self.config(false).await?)
            .map_err(|e| CliError::Config(e.to_string()))
    }

    /// The websocket/streaming transport for this target.
    pub async fn transport(&self, insecure: bool) -> Result<Transport, CliError> {
        Transport::new(&self.config(insecure).await?)
    }

    /// Opens a websocket to `path` (KubeVirt's `plain.kubevirt.io` subprotocol).
    pub async fn websocket(&self, path: &str) -> Result<ApiWebSocket, CliError> {
        self.transport(false).await?.websocket(path).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubeconfig_search_order() {
        assert_eq!(
            kubeconfig_candidates(Some(Path::new("/x")), Some("/y"), None),
            vec![PathBuf::from("/x")]
        );
        assert_eq!(
            kubeconfig_candidates(None, Some("/a:/b"), None),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert_eq!(
            kubeconfig_candidates(None, Some("/a::/b:"), None),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        let v = kubeconfig_candidates(None, None, Some("/home/u"));
        assert_eq!(v[0], PathBuf::from(".ferrovirt/server/kubeconfig.yaml"));
        assert_eq!(v.last(), Some(&PathBuf::from("/home/u/.kube/config")));
    }

    #[test]
    fn several_servers_pick_the_first_reachable() {
        let up = |u: &Uri| u.port_u16() != Some(1);
        let got = pick_server("https://127.0.0.1:1, https://127.0.0.1:2,https://h:3", up).unwrap();
        assert_eq!(got.to_string(), "https://127.0.0.1:2/");
        let e = pick_server("https://a:1", up).unwrap_err().to_string();
        assert!(e.contains("no server") && e.contains("https://a:1"), "{e}");
        let e = pick_server("http://a:2", up).unwrap_err().to_string();
        assert!(e.contains("not an https"), "{e}");
        assert!(pick_server(" , ", up).is_err());
    }
}
