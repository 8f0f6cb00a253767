//! A real OCI registry for tests: Debian's `docker-registry` (distribution 2.8) on a free
//! loopback port with its storage in a temporary directory, optionally behind htpasswd basic
//! auth (bcrypt hashes from `htpasswd -B`), killed on drop. [`Registry::push_disk`] builds and
//! uploads a containerDisk image (one gzip tar layer holding `disk/<file>`, an OCI config and
//! manifest, optionally wrapped in an image index) with the distribution API's monolithic
//! upload: `POST /v2/<name>/blobs/uploads/`, `PUT <location>&digest=…`, `PUT manifests/<tag>`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use base64::Engine;

/// The registry binary of Debian's `docker-registry` package.
pub const REGISTRY_BINARY: &str = "/usr/bin/docker-registry";

/// A running registry.
pub struct Registry {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    pub port: u16,
    dir: tempfile::TempDir,
    /// Where its config and log are.
    work: std::path::PathBuf,
    child: Child,
    auth: Option<(String, String)>,
    /// Serves HTTPS ([`Registry::serve_tls`]): push to the plain registry instead.
    tls: bool,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// `sha256:<hex>` of `data`.
pub fn sha256_digest(data: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, data);
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// A tar layer holding `disk/` and `disk/<file_name>` with `data` (gzip-compressed when
/// `gzip`), as containerDisk images are built.
pub fn disk_layer(file_name: &str, data: &[u8], gzip: bool) -> anyhow::Result<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    let mut dir = tar::Header::new_ustar();
    dir.set_path("disk/")?;
    dir.set_entry_type(tar::EntryType::Directory);
    dir.set_mode(0o555);
    dir.set_size(0);
    dir.set_cksum();
    b.append(&dir, &[][..])?;
    let mut h = tar::Header::new_gnu();
    h.set_path(format!("disk/{file_name}"))?;
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o444);
    h.set_uid(107);
    h.set_gid(107);
    h.set_size(data.len() as u64);
    h.set_cksum();
    b.append(&h, data)?;
    let tar = b.into_inner()?;
    if !gzip {
        return Ok(tar);
    }
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(&tar)?;
    Ok(e.finish()?)
}

impl Registry {
    /// Starts an anonymous registry.
    pub fn start() -> anyhow::Result<Registry> {
        Self::start_inner(None)
    }

    /// Starts a registry that requires `user`/`password` (htpasswd basic auth).
    pub fn start_with_auth(user: &str, password: &str) -> anyhow::Result<Registry> {
        Self::start_inner(Some((user.to_string(), password.to_string())))
    }

    /// A second registry serving this one's storage over HTTPS, with a certificate for
    /// 127.0.0.1 from a fresh CA; returns it and the CA's PEM (push to `self`, pull from it;
    /// drop it before `self`).
    pub fn serve_tls(&self) -> anyhow::Result<(Registry, String)> {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate()?;
        let cert =
            CertificateParams::new(vec!["127.0.0.1".to_string()])?.signed_by(&key, &issuer)?;
        let dir = self.dir.path().join(format!("tls-{}", crate::free_port()?));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("tls.crt"), cert.pem())?;
        std::fs::write(dir.join("tls.key"), key.serialize_pem())?;
        let tls = format!(
            "  tls:\n    certificate: {}\n    key: {}\n",
            dir.join("tls.crt").display(),
            dir.join("tls.key").display()
        );
        let r = Self::launch(self.dir.path(), &dir, &tls, self.auth.clone())?;
        Ok((r, ca_cert.pem()))
    }

    fn start_inner(auth: Option<(String, String)>) -> anyhow::Result<Registry> {
        let dir = tempfile::Builder::new().prefix("fv-registry-").tempdir()?;
        let root = dir.path().to_path_buf();
        let mut r = Self::launch(&root, &root, "", auth)?;
        r.dir = dir;
        Ok(r)
    }

    /// Starts docker-registry on a free port with its storage under `storage_root/data` and
    /// its config, log and htpasswd in `work`; `tls` is extra YAML for the `http:` section.
    fn launch(
        storage_root: &Path,
        work: &Path,
        tls: &str,
        auth: Option<(String, String)>,
    ) -> anyhow::Result<Registry> {
        anyhow::ensure!(
            Path::new(REGISTRY_BINARY).exists(),
            "{REGISTRY_BINARY} is missing: run scripts/install-deps.sh (package docker-registry)"
        );
        // A directory the registry owns (removed on drop; `start` puts its storage there).
        let dir = tempfile::Builder::new().prefix("fv-registry-").tempdir()?;
        let port = crate::free_port()?;
        let mut auth_yaml = String::new();
        if let Some((u, p)) = &auth {
            let out = Command::new("htpasswd")
                .args(["-Bbn", u, p])
                .output()
                .context("running htpasswd (package apache2-utils)")?;
            anyhow::ensure!(out.status.success(), "htpasswd failed");
            std::fs::write(work.join("htpasswd"), &out.stdout)?;
            auth_yaml = format!(
                "auth:\n  htpasswd:\n    realm: ferrovirt-test\n    path: {}\n",
                work.join("htpasswd").display()
            );
        }
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n  \
             delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n{tls}{auth_yaml}",
            storage_root.join("data").display()
        );
        let cfg = work.join("config.yml");
        std::fs::write(&cfg, config)?;
        let log = std::fs::File::create(work.join("registry.log"))?;
        let child = Command::new(REGISTRY_BINARY)
            .arg("serve")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting docker-registry")?;
        let mut r = Registry {
            addr: format!("127.0.0.1:{port}"),
            port,
            dir,
            work: work.to_path_buf(),
            child,
            auth,
            tls: !tls.is_empty(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = r.child.try_wait()? {
                bail!("docker-registry exited ({s}):\n{}", r.log());
            }
            // A TLS registry answers plain HTTP with 400: it is up.
            if let Ok(resp) = r.request("GET", "/v2/", &[], &[])
                && (resp.status == 200 || resp.status == 401 || (r.tls && resp.status == 400))
            {
                return Ok(r);
            }
            if Instant::now() > deadline {
                bail!("docker-registry not answering after 20 s:\n{}", r.log());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// What the registry logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.work.join("registry.log")).unwrap_or_default()
    }

    /// One HTTP/1.1 request (`Connection: close`), with the registry's credentials when it
    /// has some. `path` may be absolute (`http://…`) as in a Location header.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> anyhow::Result<HttpResponse> {
        let path = match path.split_once("://") {
            Some((_, rest)) => rest.find('/').map_or("/", |i| &rest[i..]),
            None => path,
        };
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        if let Some((u, p)) = &self.auth {
            let t = base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"));
            head.push_str(&format!("Authorization: Basic {t}\r\n"));
        }
        for (n, v) in headers {
            head.push_str(&format!("{n}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes())?;
        s.write_all(body)?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .context("no HTTP response header")?;
        let head = String::from_utf8_lossy(&raw[..split]).into_owned();
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|c| c.parse().ok())
            .context("no HTTP status")?;
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
            .collect();
        Ok(HttpResponse {
            status,
            headers,
            body: raw[split + 4..].to_vec(),
        })
    }

    /// Uploads a blob (monolithic upload); returns its digest.
    pub fn push_blob(&self, repo: &str, data: &[u8]) -> anyhow::Result<String> {
        let digest = sha256_digest(data);
        let r = self.request("POST", &format!("/v2/{repo}/blobs/uploads/"), &[], &[])?;
        if r.status != 202 {
            bail!(
                "starting an upload: {} {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            );
        }
        let loc = r.header("Location").context("upload without Location")?;
        let sep = if loc.contains('?') { '&' } else { '?' };
        let url = format!("{loc}{sep}digest={digest}");
        let r = self.request(
            "PUT",
            &url,
            &[("Content-Type", "application/octet-stream")],
            data,
        )?;
        if r.status != 201 {
            bail!(
                "uploading blob: {} {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            );
        }
        Ok(digest)
    }

    /// Uploads a manifest under `reference`; returns its digest.
    pub fn push_manifest(
        &self,
        repo: &str,
        reference: &str,
        media_type: &str,
        body: &[u8],
    ) -> anyhow::Result<String> {
        let r = self.request(
            "PUT",
            &format!("/v2/{repo}/manifests/{reference}"),
            &[("Content-Type", media_type)],
            body,
        )?;
        if r.status != 201 {
            bail!(
                "uploading manifest: {} {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            );
        }
        Ok(sha256_digest(body))
    }

    /// Pushes a containerDisk image `repo:tag` whose layers are `layers` (tar or tar+gzip
    /// bytes, by their magic); with `index` the tag names an OCI image index whose
    /// linux/amd64 entry is the image. Returns the tag's manifest digest.
    pub fn push_image(
        &self,
        repo: &str,
        tag: &str,
        layers: &[Vec<u8>],
        index: bool,
    ) -> anyhow::Result<String> {
        let mut layer_json = Vec::new();
        let mut diff_ids = Vec::new();
        for l in layers {
            let gz = l.starts_with(&[0x1f, 0x8b]);
            let plain = if gz {
                let mut d = flate2::read::GzDecoder::new(&l[..]);
                let mut v = Vec::new();
                d.read_to_end(&mut v)?;
                v
            } else {
                l.clone()
            };
            diff_ids.push(sha256_digest(&plain));
            let digest = self.push_blob(repo, l)?;
            let mt = if gz {
                "application/vnd.oci.image.layer.v1.tar+gzip"
            } else {
                "application/vnd.oci.image.layer.v1.tar"
            };
            layer_json
                .push(serde_json::json!({"mediaType": mt, "digest": digest, "size": l.len()}));
        }
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64", "os": "linux", "config": {},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }))?;
        let config_digest = self.push_blob(repo, &config)?;
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config_digest, "size": config.len()},
            "layers": layer_json,
        }))?;
        let mt = "application/vnd.oci.image.manifest.v1+json";
        if !index {
            return self.push_manifest(repo, tag, mt, &manifest);
        }
        let digest = self.push_manifest(repo, &sha256_digest(&manifest), mt, &manifest)?;
        let idx = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{"mediaType": mt, "digest": digest, "size": manifest.len(),
                           "platform": {"architecture": "amd64", "os": "linux"}}],
        }))?;
        self.push_manifest(repo, tag, "application/vnd.oci.image.index.v1+json", &idx)
    }

    /// Pushes `disk` (a qcow2 or raw file) as the containerDisk image `repo:tag`, stored in
    /// the image as `disk/<file_name>`.
    pub fn push_disk(
        &self,
        repo: &str,
        tag: &str,
        disk: &Path,
        file_name: &str,
        index: bool,
    ) -> anyhow::Result<String> {
        let data = std::fs::read(disk).with_context(|| format!("reading {}", disk.display()))?;
        let layer = disk_layer(file_name, &data, true)?;
        self.push_image(repo, tag, &[layer], index)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
