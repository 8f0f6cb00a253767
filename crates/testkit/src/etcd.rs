//! A real etcd for tests (Debian `etcd-server`, or `$FERROVIRT_ETCD_BIN`): one member on free
//! loopback ports in a temporary directory, killed on drop. Fails (never skips) when etcd is
//! missing.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// A running single-member etcd.
pub struct Etcd {
    pub dir: tempfile::TempDir,
    pub client_port: u16,
    child: Child,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("client_port", &self.client_port)
            .finish_non_exhaustive()
    }
}

impl Etcd {
    /// Starts etcd and waits until `/health` answers (again on new ports when a port picked
    /// as free was taken before etcd bound it: [`retry_taken_ports`]).
    pub fn start() -> anyhow::Result<Etcd> {
        retry_taken_ports(Self::try_start)
    }

    fn try_start() -> anyhow::Result<Etcd> {
        let bin = std::env::var_os("FERROVIRT_ETCD_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/bin/etcd"));
        if !bin.is_file() {
            bail!(
                "etcd not found at {} (install Debian's etcd-server or set FERROVIRT_ETCD_BIN)",
                bin.display()
            );
        }
        let dir = tempfile::Builder::new().prefix("fv-etcd-").tempdir()?;
        let client_port = crate::free_port()?;
        let peer_port = crate::free_port()?;
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log = std::fs::File::create(dir.path().join("etcd.log"))?;
        let child = Command::new(&bin)
            .args(["--name", "fv-test"])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("fv-test={peer}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut e = Etcd {
            dir,
            client_port,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(s) = e.child.try_wait()? {
                bail!("etcd exited ({s}): {}", e.log());
            }
            if let Ok(body) = crate::http_get(client_port, "/health", Duration::from_millis(300))
                && body.contains("true")
            {
                return Ok(e);
            }
            if Instant::now() > deadline {
                bail!("etcd not healthy after 30 s: {}", e.log());
            }
        }
    }

    /// The client URL (`http://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// What etcd logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Certificates for a TLS etcd cluster and its clients, made with rcgen: one CA, a serving
/// and peer certificate for 127.0.0.1 (each member uses it for both) and a client certificate.
#[derive(Debug, Clone)]
pub struct EtcdTlsFiles {
    pub ca: PathBuf,
    pub member_cert: PathBuf,
    pub member_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl EtcdTlsFiles {
    fn make(dir: &std::path::Path) -> anyhow::Result<EtcdTlsFiles> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair,
        };
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.distinguished_name
            .push(DnType::CommonName, "fv-test-etcd-ca");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca, ca_key);
        let leaf = |cn: &str, sans: Vec<String>, usages: Vec<ExtendedKeyUsagePurpose>| {
            let key = KeyPair::generate()?;
            let mut p = CertificateParams::new(sans)?;
            p.distinguished_name.push(DnType::CommonName, cn);
            p.extended_key_usages = usages;
            let cert = p.signed_by(&key, &issuer)?;
            anyhow::Ok((cert.pem(), key.serialize_pem()))
        };
        let (member, member_key) = leaf(
            "etcd-member",
            vec!["127.0.0.1".into(), "localhost".into()],
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )?;
        let (client, client_key) = leaf(
            "ferrovirt-server",
            Vec::new(),
            vec![ExtendedKeyUsagePurpose::ClientAuth],
        )?;
        let files = EtcdTlsFiles {
            ca: dir.join("ca.crt"),
            member_cert: dir.join("member.crt"),
            member_key: dir.join("member.key"),
            client_cert: dir.join("client.crt"),
            client_key: dir.join("client.key"),
        };
        std::fs::write(&files.ca, ca_cert.pem())?;
        std::fs::write(&files.member_cert, member)?;
        std::fs::write(&files.member_key, member_key)?;
        std::fs::write(&files.client_cert, client)?;
        std::fs::write(&files.client_key, client_key)?;
        Ok(files)
    }

    /// `ferrovirt server` flags for these files (k3s' names).
    pub fn server_args(&self) -> Vec<String> {
        let s = |p: &PathBuf| p.display().to_string();
        vec![
            "--datastore-cafile".into(),
            s(&self.ca),
            "--datastore-certfile".into(),
            s(&self.client_cert),
            "--datastore-keyfile".into(),
            s(&self.client_key),
        ]
    }
}

/// A running etcd cluster of several members on loopback, TLS on client and peer URLs with
/// client certificates required on both (`--client-cert-auth`, `--peer-client-cert-auth`).
pub struct EtcdCluster {
    pub dir: tempfile::TempDir,
    pub tls: EtcdTlsFiles,
    pub client_ports: Vec<u16>,
    members: Vec<Option<Child>>,
}

impl std::fmt::Debug for EtcdCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCluster")
            .field("client_ports", &self.client_ports)
            .finish_non_exhaustive()
    }
}

impl EtcdCluster {
    /// Starts `n` members and waits until each is ready to serve clients (again on new ports
    /// when a port picked as free was taken before a member bound it: [`retry_taken_ports`]).
    pub fn start_tls(n: usize) -> anyhow::Result<EtcdCluster> {
        retry_taken_ports(|| Self::try_start_tls(n))
    }

    fn try_start_tls(n: usize) -> anyhow::Result<EtcdCluster> {
        let bin = std::env::var_os("FERROVIRT_ETCD_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/bin/etcd"));
        if !bin.is_file() {
            bail!(
                "etcd not found at {} (install Debian's etcd-server or set FERROVIRT_ETCD_BIN)",
                bin.display()
            );
        }
        let dir = tempfile::Builder::new().prefix("fv-etcd3-").tempdir()?;
        let tls = EtcdTlsFiles::make(dir.path())?;
        let client_ports = (0..n)
            .map(|_| crate::free_port())
            .collect::<anyhow::Result<Vec<_>>>()?;
        let peer_ports = (0..n)
            .map(|_| crate::free_port())
            .collect::<anyhow::Result<Vec<_>>>()?;
        let initial = (0..n)
            .map(|i| format!("m{i}=https://127.0.0.1:{}", peer_ports[i]))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::new();
        for i in 0..n {
            let client = format!("https://127.0.0.1:{}", client_ports[i]);
            let peer = format!("https://127.0.0.1:{}", peer_ports[i]);
            let log = std::fs::File::create(dir.path().join(format!("m{i}.log")))?;
            let s = |p: &PathBuf| p.display().to_string();
            let child = Command::new(&bin)
                .args(["--name", &format!("m{i}")])
                .arg("--data-dir")
                .arg(dir.path().join(format!("m{i}")))
                .args(["--listen-client-urls", &client])
                .args(["--advertise-client-urls", &client])
                .args(["--listen-peer-urls", &peer])
                .args(["--initial-advertise-peer-urls", &peer])
                .args(["--initial-cluster", &initial])
                .args(["--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", "fv-test"])
                .args(["--cert-file", &s(&tls.member_cert)])
                .args(["--key-file", &s(&tls.member_key)])
                .args(["--trusted-ca-file", &s(&tls.ca)])
                .arg("--client-cert-auth")
                .args(["--peer-cert-file", &s(&tls.member_cert)])
                .args(["--peer-key-file", &s(&tls.member_key)])
                .args(["--peer-trusted-ca-file", &s(&tls.ca)])
                .arg("--peer-client-cert-auth")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting {}", bin.display()))?;
            members.push(Some(child));
        }
        let mut c = EtcdCluster {
            dir,
            tls,
            client_ports,
            members,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(0..n).all(|i| c.log(i).contains("ready to serve client requests")) {
            for (i, m) in c.members.iter_mut().enumerate() {
                if let Some(child) = m
                    && let Some(s) = child.try_wait()?
                {
                    bail!("etcd member m{i} exited ({s}): {}", c.log(i));
                }
            }
            if Instant::now() > deadline {
                bail!("etcd cluster not ready after 30 s: {}", c.log(0));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(c)
    }

    /// `https://127.0.0.1:P1,https://127.0.0.1:P2,…`
    pub fn endpoints(&self) -> String {
        self.client_ports
            .iter()
            .map(|p| format!("https://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// What member `i` logged.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("m{i}.log"))).unwrap_or_default()
    }

    /// kill -9 of member `i`.
    pub fn kill_member(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill_member(i);
        }
    }
}

/// Runs `start` up to three times while it fails because a port was already in use: a port
/// [`crate::free_port`] found free may be taken (by another test's listener, or as the source
/// port of an outgoing connection) before etcd binds it. Any other failure is returned at once.
fn retry_taken_ports<T>(mut start: impl FnMut() -> anyhow::Result<T>) -> anyhow::Result<T> {
    let mut attempt = 1;
    loop {
        match start() {
            Err(e) if attempt < 3 && format!("{e:#}").contains("address already in use") => {
                eprintln!("etcd start attempt {attempt}: a port was taken; again on new ports");
                attempt += 1;
            }
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::retry_taken_ports;

    #[test]
    fn a_taken_port_is_tried_again_up_to_three_times_and_nothing_else_is() {
        let mut calls = 0;
        let r = retry_taken_ports(|| {
            calls += 1;
            if calls < 3 {
                anyhow::bail!("etcd exited: bind: address already in use")
            }
            Ok(calls)
        });
        assert_eq!(r.unwrap(), 3);

        let mut calls = 0;
        let r: anyhow::Result<()> = retry_taken_ports(|| {
            calls += 1;
            anyhow::bail!("etcd exited: bind: address already in use")
        });
        assert!(r.is_err());
        assert_eq!(calls, 3);

        let mut calls = 0;
        let r: anyhow::Result<()> = retry_taken_ports(|| {
            calls += 1;
            anyhow::bail!("etcd not healthy after 30 s")
        });
        assert!(r.is_err());
        assert_eq!(calls, 1);
    }
}
