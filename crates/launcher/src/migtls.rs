//! QEMU's own TLS for the live-migration stream (docs/migration.md "The stream"): this side's
//! ephemeral per-migration certificate (a fresh ECDSA P-256 key and self-signed leaf made
//! here, in the launcher: the key never leaves the launcher and its QEMU, and the agent's own
//! node key is never given to QEMU), the credentials directory QEMU reads at `object-add`
//! (`ca-cert.pem` is the peer's ephemeral certificate, the only thing trusted; our certificate
//! and key), written for QEMU's uid alone and removed as soon as QEMU has read it, and the QMP
//! arguments. The file layout and the arguments are pure and unit-tested.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::{Error, Result};

/// The id of the migration's `tls-creds-x509` object in QEMU.
pub const CREDS_ID: &str = "mig-tls";
/// The id of the same credentials for a block migration's NBD server or clients.
pub const NBD_CREDS_ID: &str = "nbd-tls";
/// The name in the target's ephemeral certificate; the source's QEMU checks it
/// (`tls-hostname`, mandatory with the `fd:` transport).
pub const TARGET_HOSTNAME: &str = "migration-target.ferrovirt.invalid";
/// The name in the source's ephemeral certificate.
pub const SOURCE_HOSTNAME: &str = "migration-source.ferrovirt.invalid";

/// Which end of the migration's TLS session this QEMU is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Endpoint {
    /// The source: it connects and sends.
    Client,
    /// The target: it receives and requires the source's certificate.
    Server,
}

impl Endpoint {
    fn name(self) -> &'static str {
        match self {
            Endpoint::Client => "client",
            Endpoint::Server => "server",
        }
    }

    /// The name written into this end's certificate.
    pub fn hostname(self) -> &'static str {
        match self {
            Endpoint::Client => SOURCE_HOSTNAME,
            Endpoint::Server => TARGET_HOSTNAME,
        }
    }
}

/// This side's ephemeral certificate and key for one migration.
#[derive(Clone)]
pub struct EphemeralCert {
    pub endpoint: Endpoint,
    /// PEM; what the peer trusts.
    pub cert_pem: String,
    key_pem: String,
}

impl std::fmt::Debug for EphemeralCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EphemeralCert")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

fn tls_err(e: impl std::fmt::Display) -> Error {
    Error::Migration(format!("ephemeral migration certificate: {e}"))
}

impl EphemeralCert {
    /// A fresh key pair and a self-signed leaf (CA:false) naming [`Endpoint::hostname`].
    /// QEMU (gnutls) trusts a peer whose certificate is exactly the one in its
    /// `ca-cert.pem`, so no CA is needed; the leaf cannot sign anything else.
    pub fn generate(endpoint: Endpoint) -> Result<EphemeralCert> {
        use rcgen::{
            CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
            KeyUsagePurpose,
        };
        let key = KeyPair::generate().map_err(tls_err)?;
        let mut params =
            CertificateParams::new(vec![endpoint.hostname().to_string()]).map_err(tls_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, endpoint.hostname());
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.self_signed(&key).map_err(tls_err)?;
        Ok(EphemeralCert {
            endpoint,
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// RFC 7919's `ffdhe2048` group (PKCS#3 PEM, as `openssl genpkey -genparam -algorithm DH
/// -pkeyopt group:ffdhe2048` writes it), public and standard. A server's `tls-creds-x509`
/// without a `dh-params.pem` makes QEMU generate 2048-bit DH parameters at `object-add`
/// (`gnutls_dh_params_generate2`): 0.6–1.5 s of CPU on every migration's critical path,
/// measured on QEMU 7.2. The group is only used by a finite-field DHE suite; TLS 1.3 and ECDHE
/// suites, which gnutls prefers, do not touch it.
pub const FFDHE2048_PEM: &str = "-----BEGIN DH PARAMETERS-----
MIIBCAKCAQEA//////////+t+FRYortKmq/cViAnPTzx2LnFg84tNpWp4TZBFGQz
+8yTnc4kmz75fS/jY2MMddj2gbICrsRhetPfHtXV/WVhJDP1H18GbtCFY2VVPe0a
87VXE15/V8k1mE8McODmi3fipona8+/och3xWKE2rec1MKzKT0g6eXq8CrGCsyT7
YdEIqUuyyOP7uWrat2DX9GgdT0Kj3jlN9K5W7edjcrsZCwenyO4KbXCeAvzhzffi
7MA0BM0oNC9hkXL+nOmFg/+OTxIy7vKBg8P+OxtMb61zO7X8vC7CIAXFjvGDfRaD
ssbzSibBsu/6iGtCOGEoXJf//////////wIBAg==
-----END DH PARAMETERS-----
";

/// The files of the credentials directory QEMU's `tls-creds-x509` reads: the peer's
/// certificate as the only trusted one (`ca-cert.pem`), ours as `client-…` or `server-…`,
/// and on a server the standard DH group ([`FFDHE2048_PEM`]: nothing generated at load).
pub fn creds_files(ours: &EphemeralCert, peer_cert_pem: &str) -> Vec<(String, String)> {
    let p = ours.endpoint.name();
    let mut files = vec![
        ("ca-cert.pem".to_string(), peer_cert_pem.to_string()),
        (format!("{p}-cert.pem"), ours.cert_pem.clone()),
        (format!("{p}-key.pem"), ours.key_pem.clone()),
    ];
    if ours.endpoint == Endpoint::Server {
        files.push(("dh-params.pem".to_string(), FFDHE2048_PEM.to_string()));
    }
    files
}

/// `object-add` of the credentials. `sanity-check` is off: QEMU's check would demand that
/// `ca-cert.pem` be a CA that signed our own certificate, which is not the scheme here (each
/// side trusts exactly the other's self-signed leaf); the handshake's verification of the
/// peer (`verify-peer`, gnutls against `ca-cert.pem`, and the hostname on the client) is
/// unaffected.
pub fn creds_object(id: &str, endpoint: Endpoint, dir: &Path) -> Value {
    json!({"qom-type": "tls-creds-x509", "id": id, "endpoint": endpoint.name(),
           "dir": dir.display().to_string(), "verify-peer": true, "sanity-check": false})
}

/// The TLS part of `migrate-set-parameters`: our credentials and, on the source, the name
/// the target's certificate must carry; plain (`tls-creds: ""`) without TLS.
pub fn tls_parameters(tls: bool, endpoint: Endpoint) -> Value {
    match (tls, endpoint) {
        (false, _) => json!({"tls-creds": "", "tls-hostname": ""}),
        (true, Endpoint::Client) => json!({"tls-creds": CREDS_ID, "tls-hostname": TARGET_HOSTNAME}),
        (true, Endpoint::Server) => json!({"tls-creds": CREDS_ID, "tls-hostname": ""}),
    }
}

/// The uid and gid QEMU runs as (`-runas`: `uid:gid` or a user name looked up in
/// `passwd`, the text of /etc/passwd); `None` without `-runas` (QEMU runs as we do).
pub fn runas_owner(run_as: Option<&str>, passwd: &str) -> Result<Option<(u32, u32)>> {
    let Some(r) = run_as else { return Ok(None) };
    if let Some((u, g)) = r.split_once(':')
        && let (Ok(u), Ok(g)) = (u.parse(), g.parse())
    {
        return Ok(Some((u, g)));
    }
    passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() >= 4 && f[0] == r)
        .and_then(|f| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
        .map(Some)
        .ok_or_else(|| Error::Migration(format!("-runas {r:?}: no such user")))
}

/// Where the credentials directories are made: `/run/ferrovirt-migtls` (memory, root's,
/// mode 0711: QEMU's uid may pass, not list), else (not root) the temporary directory.
pub fn creds_base() -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let run = PathBuf::from(CREDS_BASE);
    let made = std::fs::create_dir_all(&run)
        .and_then(|_| std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o711)));
    match made {
        Ok(()) => run,
        Err(_) => std::env::temp_dir(),
    }
}

/// The preferred parent of the credentials directories.
pub const CREDS_BASE: &str = "/run/ferrovirt-migtls";

/// A credentials directory; removed (with its files) when dropped.
#[derive(Debug)]
pub struct CredsDir {
    pub path: PathBuf,
}

impl Drop for CredsDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Writes `files` into a new directory under `base` (mode 0700, files 0400), owned by
/// `owner` when given: only QEMU's uid (and root) can read the key. The directory is made
/// fresh (never an existing path, so no planted link is followed).
pub fn write_creds_dir(
    base: &Path,
    files: &[(String, String)],
    owner: Option<(u32, u32)>,
) -> Result<CredsDir> {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let io = |p: &Path, e| Error::io(p.display().to_string(), e);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = base.join(format!(
        "ferrovirt-migtls-{}-{seq}-{nanos}",
        std::process::id()
    ));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&path)
        .map_err(|e| io(&path, e))?;
    let dir = CredsDir { path };
    for (name, contents) in files {
        let p = dir.path.join(name);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o400)
            .open(&p)
            .map_err(|e| io(&p, e))?;
        f.write_all(contents.as_bytes()).map_err(|e| io(&p, e))?;
        if let Some((u, g)) = owner {
            chown(&p, u, g)?;
        }
    }
    if let Some((u, g)) = owner {
        chown(&dir.path, u, g)?;
    }
    Ok(dir)
}

fn chown(p: &Path, uid: u32, gid: u32) -> Result<()> {
    let (u, g) = (
        rustix::fs::Uid::from_raw(uid),
        rustix::fs::Gid::from_raw(gid),
    );
    rustix::fs::chown(p, Some(u), Some(g))
        .map_err(|e| Error::io(format!("chown {}", p.display()), e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_holds_the_peer_as_ca_and_our_pair() {
        let ours = EphemeralCert::generate(Endpoint::Server).unwrap();
        let files = creds_files(&ours, "PEER");
        let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "ca-cert.pem",
                "server-cert.pem",
                "server-key.pem",
                "dh-params.pem"
            ]
        );
        assert_eq!(files[3].1, FFDHE2048_PEM);
        assert_eq!(files[0].1, "PEER");
        assert!(files[1].1.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(files[2].1.contains("PRIVATE KEY"));
        let client = EphemeralCert::generate(Endpoint::Client).unwrap();
        let client_files = creds_files(&client, "P");
        assert_eq!(client_files[1].0, "client-cert.pem");
        assert_eq!(client_files.len(), 3, "no DH group on a client");
        assert_ne!(client.cert_pem, ours.cert_pem, "a fresh pair each time");
        assert!(!format!("{ours:?}").contains("PRIVATE"));
    }

    #[test]
    fn qmp_arguments() {
        let o = creds_object(CREDS_ID, Endpoint::Server, Path::new("/tmp/x"));
        assert_eq!(o["id"], "mig-tls");
        assert_eq!(o["endpoint"], "server");
        assert_eq!(
            creds_object(NBD_CREDS_ID, Endpoint::Client, Path::new("/tmp/x"))["id"],
            "nbd-tls"
        );
        assert_eq!(o["dir"], "/tmp/x");
        assert_eq!(o["verify-peer"], true);
        assert_eq!(o["sanity-check"], false);
        assert_eq!(
            tls_parameters(true, Endpoint::Client),
            json!({"tls-creds": "mig-tls", "tls-hostname": TARGET_HOSTNAME})
        );
        assert_eq!(
            tls_parameters(true, Endpoint::Server)["tls-creds"],
            "mig-tls"
        );
        assert_eq!(tls_parameters(false, Endpoint::Client)["tls-creds"], "");
    }

    #[test]
    fn the_owner_comes_from_runas() {
        let passwd = "root:x:0:0::/root:/bin/sh\nferrovirt-qemu:x:990:985::/:/sbin/nologin\n";
        assert_eq!(runas_owner(None, passwd).unwrap(), None);
        assert_eq!(
            runas_owner(Some("3000000001:3000000001"), passwd).unwrap(),
            Some((3000000001, 3000000001))
        );
        assert_eq!(
            runas_owner(Some("ferrovirt-qemu"), passwd).unwrap(),
            Some((990, 985))
        );
        assert!(runas_owner(Some("nobody-here"), passwd).is_err());
    }

    #[test]
    fn the_directory_is_private_and_removed_on_drop() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().unwrap();
        let files = vec![("a.pem".to_string(), "A".to_string())];
        let dir = write_creds_dir(base.path(), &files, None).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.path), 0o700);
        assert_eq!(mode(&dir.path.join("a.pem")), 0o400);
        assert_eq!(
            std::fs::read_to_string(dir.path.join("a.pem")).unwrap(),
            "A"
        );
        let p = dir.path.clone();
        drop(dir);
        assert!(!p.exists());
    }
}
