//! The etcd backend under the conformance suite: each test starts its own real etcd process
//! (`/usr/bin/etcd`, or `$FERROVIRT_ETCD_BIN`) with a temp data dir on free loopback ports, and
//! kills it when the test ends. A missing etcd binary fails the test; it is never skipped.

use std::fs::File;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use async_trait::async_trait;
use ferrovirt_store::{EtcdStore, Store};

use crate::Backend;

const DEFAULT_ETCD: &str = "/usr/bin/etcd";
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Keys of the tests live under this prefix, to exercise the prefix handling.
const KEY_PREFIX: &str = "/ferrovirt-test";

/// A running etcd process; killed on drop.
pub(crate) struct EtcdProcess {
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn etcd_binary() -> Result<PathBuf> {
    let path = std::env::var_os("FERROVIRT_ETCD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_ETCD));
    etcd_binary_at(path)
}

fn etcd_binary_at(path: impl Into<PathBuf>) -> Result<PathBuf> {
    let path = path.into();
    if !path.is_file() {
        bail!(
            "etcd binary not found at {}: the etcd conformance tests need a real etcd \
             (Debian package `etcd-server`, or set FERROVIRT_ETCD_BIN)",
            path.display()
        );
    }
    Ok(path)
}

impl EtcdProcess {
    pub(crate) fn new() -> Result<Self> {
        Ok(EtcdProcess {
            dir: tempfile::tempdir()?,
            client_port: free_port()?,
            peer_port: free_port()?,
            child: None,
        })
    }

    pub(crate) fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// Starts etcd on this data dir and these ports and waits until a store can connect.
    pub(crate) async fn start(&mut self) -> Result<EtcdStore> {
        let client_url = self.endpoint();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let child = Command::new(etcd_binary()?)
            .arg("--name=conformance")
            .arg(format!(
                "--data-dir={}",
                self.dir.path().join("data").display()
            ))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=conformance={peer_url}"))
            .arg("--initial-cluster-state=new")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting etcd")?;
        self.child = Some(child);

        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().transpose()) {
                let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
                bail!("etcd exited early ({}):\n{log}", status?);
            }
            let attempt = tokio::time::timeout(
                Duration::from_secs(3),
                EtcdStore::connect(std::slice::from_ref(&client_url), KEY_PREFIX),
            )
            .await;
            match attempt {
                Ok(Ok(store)) => return Ok(store),
                _ if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok(Err(e)) => bail!("etcd at {client_url} did not answer: {e}"),
                Err(_) => bail!("etcd at {client_url} did not answer in time"),
            }
        }
    }

    /// SIGKILL, like a crash or power cut of the etcd host.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

pub struct Etcd {
    process: EtcdProcess,
    store: Arc<dyn Store>,
}

#[async_trait]
impl Backend for Etcd {
    async fn start() -> Result<Self> {
        // A port picked as free can be taken by someone else before etcd binds it: retry with
        // new ports a few times.
        let mut attempt = 1;
        loop {
            let mut process = EtcdProcess::new()?;
            match process.start().await {
                Ok(store) => {
                    return Ok(Etcd {
                        process,
                        store: Arc::new(store),
                    });
                }
                Err(e) if attempt < 3 && e.to_string().contains("exited early") => {
                    eprintln!("etcd start attempt {attempt} failed, retrying: {e}");
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn store(&self) -> Arc<dyn Store> {
        Arc::clone(&self.store)
    }

    async fn restart(&mut self, old: Arc<dyn Store>) -> Result<Arc<dyn Store>> {
        drop(old);
        self.process.kill();
        self.store = Arc::new(self.process.start().await?);
        Ok(self.store())
    }
}

mod tests {
    use futures::StreamExt;

    crate::all_conformance_tests!(super::Etcd);

    /// `open_endpoint` with an etcd URL list, and an empty key prefix (the whole keyspace).
    #[tokio::test]
    async fn open_endpoint_connects_with_an_empty_prefix() -> anyhow::Result<()> {
        let mut process = super::EtcdProcess::new()?;
        process.start().await?;
        let endpoints = format!("{},{}", process.endpoint(), process.endpoint());
        let store =
            ferrovirt_store::open_endpoint(&endpoints, std::path::Path::new("/nonexistent"))
                .await?;
        let start = store.current_revision().await?;
        let mut w = store.watch("", start).await?;
        let kv = store.create("/registry/x", b"1".to_vec()).await?;
        let all = store
            .list("", ferrovirt_store::ListOptions::default())
            .await?;
        assert_eq!(all.items, vec![kv.clone()]);
        let ev = w.next().await.expect("event")?;
        assert_eq!(ev.kv, kv);
        let https =
            ferrovirt_store::open_endpoint("https://127.0.0.1:1", std::path::Path::new("/"));
        assert!(https.await.is_err());
        Ok(())
    }

    /// The compacted revision a store remembers is checked before use: another server on the
    /// same etcd may have compacted further.
    #[tokio::test]
    async fn compacted_revision_follows_another_servers_compaction() -> anyhow::Result<()> {
        use ferrovirt_store::Store;
        let mut process = super::EtcdProcess::new()?;
        let a = process.start().await?;
        let b = super::EtcdStore::connect(&[process.endpoint()], super::KEY_PREFIX).await?;
        let mut kv = a.create("/k", b"0".to_vec()).await?;
        for i in 1..20 {
            kv = a
                .update("/k", i.to_string().into_bytes(), kv.mod_revision)
                .await?;
        }
        let first = kv.mod_revision - 10;
        a.compact(first).await?;
        assert_eq!(a.compacted_revision().await?, first);
        assert_eq!(b.compacted_revision().await?, first);
        b.compact(kv.mod_revision - 3).await?;
        assert_eq!(a.compacted_revision().await?, kv.mod_revision - 3);
        assert_eq!(a.compacted_revision().await?, kv.mod_revision - 3);
        Ok(())
    }

    /// A missing etcd binary is a failure with a clear message, never a silent skip.
    #[test]
    fn missing_binary_is_reported() {
        let err = super::etcd_binary_at("/nonexistent/etcd").unwrap_err();
        assert!(err.to_string().contains("etcd binary not found"), "{err}");
    }
}
