//! virtctl's `image-upload dv NAME --size SIZE --image-path FILE`: creates the DataVolume
//! (source `upload: {}`) when absent, waits for `UploadReady`, asks for an upload token
//! (`UploadTokenRequest`, `upload.cdi.kubevirt.io/v1beta1`), streams the file to the server's
//! `/v1beta1/upload` with a progress bar ([`crate::progress`]: redrawn on a terminal, plain
//! lines every 10 % otherwise) and waits for `Succeeded`.
//!
//! ferrovirt's API server authenticates every request with the kubeconfig's token, so that
//! token goes in `Authorization` and the upload token in `X-Upload-Token`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::CliError;
use crate::target::Target;

/// The upload path (CDI's upload proxy).
pub const UPLOAD_PATH: &str = "/v1beta1/upload";
/// The header carrying the upload token.
pub const TOKEN_HEADER: &str = "X-Upload-Token";

/// What to upload where.
#[derive(Debug, Clone)]
pub struct UploadOptions {
    /// DataVolume (and PVC) name.
    pub name: String,
    /// Size of a DataVolume to create (`1Gi`).
    pub size: Option<String>,
    pub image_path: PathBuf,
    pub storage_class: Option<String>,
    pub access_mode: Option<String>,
    /// Do not verify the server's certificate.
    pub insecure: bool,
    /// How long to wait for UploadReady and for the processing.
    pub wait: Duration,
}

fn dv_resource() -> ApiResource {
    ApiResource {
        group: "cdi.kubevirt.io".into(),
        version: "v1beta1".into(),
        api_version: "cdi.kubevirt.io/v1beta1".into(),
        kind: "DataVolume".into(),
        plural: "datavolumes".into(),
    }
}

/// The DataVolume `image-upload` creates (pure).
pub fn dv_manifest(o: &UploadOptions, namespace: &str) -> Result<Value, CliError> {
    let size = o
        .size
        .as_deref()
        .ok_or_else(|| CliError::Usage("--size is required to create a DataVolume".into()))?;
    let mut storage = json!({"resources": {"requests": {"storage": size}}});
    if let Some(c) = &o.storage_class {
        storage["storageClassName"] = json!(c);
    }
    if let Some(m) = &o.access_mode {
        storage["accessModes"] = json!([m]);
    }
    Ok(json!({
        "apiVersion": "cdi.kubevirt.io/v1beta1",
        "kind": "DataVolume",
        "metadata": {"name": o.name, "namespace": namespace},
        "spec": {"source": {"upload": {}}, "storage": storage},
    }))
}

/// The status code and body of a raw HTTP/1.1 answer (chunked bodies decoded).
pub fn parse_response(raw: &[u8]) -> Option<(u16, String)> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    if !chunked {
        return Some((code, body.to_string()));
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).ok()?;
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].strip_prefix("\r\n").unwrap_or(&after[n..]);
    }
    Some((code, out))
}

async fn phase(api: &Api<DynamicObject>, name: &str) -> Result<(String, Value), CliError> {
    let dv = api.get(name).await.map_err(CliError::from_kube)?;
    let status = dv.data.get("status").cloned().unwrap_or(Value::Null);
    let phase = status["phase"].as_str().unwrap_or_default().to_string();
    Ok((phase, status))
}

fn failure_message(status: &Value) -> String {
    status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Running")
        .and_then(|c| c["message"].as_str())
        .unwrap_or("")
        .to_string()
}

async fn wait_phase(
    api: &Api<DynamicObject>,
    name: &str,
    want: &str,
    timeout: Duration,
) -> Result<(), CliError> {
    let deadline = Instant::now() + timeout;
    loop {
        let (p, status) = phase(api, name).await?;
        if p == want || (want == "UploadReady" && p == "Succeeded") {
            return Ok(());
        }
        if p == "Failed" {
            return Err(CliError::Usage(format!(
                "DataVolume {name} failed: {}",
                failure_message(&status)
            )));
        }
        if Instant::now() > deadline {
            return Err(CliError::Usage(format!(
                "timed out waiting for DataVolume {name} to be {want} (phase {p:?})"
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Runs `image-upload dv`.
pub async fn run(target: &Target, o: &UploadOptions) -> Result<(), CliError> {
    let ns = target.namespace.clone();
    let meta = std::fs::metadata(&o.image_path).map_err(|e| CliError::Io {
        context: format!("reading {}", o.image_path.display()),
        source: e,
    })?;
    let client = target.client().await?;
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &dv_resource());
    match api.get_opt(&o.name).await.map_err(CliError::from_kube)? {
        Some(dv) => {
            if dv.data.pointer("/spec/source/upload").is_none() {
                return Err(CliError::Usage(format!(
                    "DataVolume {ns}/{} exists and has no upload source",
                    o.name
                )));
            }
            eprintln!("Using existing DataVolume {ns}/{}", o.name);
        }
        None => {
            let obj: DynamicObject = serde_json::from_value(dv_manifest(o, &ns)?)
                .map_err(|e| CliError::Usage(e.to_string()))?;
            api.create(&PostParams::default(), &obj)
                .await
                .map_err(CliError::from_kube)?;
            eprintln!("DataVolume {ns}/{} created", o.name);
        }
    }
    eprintln!("Waiting for PVC {} upload to be ready...", o.name);
    wait_phase(&api, &o.name, "UploadReady", o.wait).await?;
    if phase(&api, &o.name).await?.0 == "Succeeded" {
        eprintln!("DataVolume {ns}/{} already succeeded", o.name);
        return Ok(());
    }
    eprintln!("Upload ready");
    let token = request_token(&client, &ns, &o.name).await?;
    eprintln!(
        "Uploading data to {}://{}{UPLOAD_PATH}",
        target.server.scheme_str().unwrap_or("https"),
        target
            .server
            .authority()
            .map(|a| a.as_str())
            .unwrap_or_default()
    );
    send(target, o, &token, meta.len()).await?;
    eprintln!("Uploading data completed successfully, waiting for processing to complete");
    wait_phase(&api, &o.name, "Succeeded", o.wait).await?;
    eprintln!("Processing completed successfully");
    println!(
        "Uploading {} completed successfully",
        o.image_path.display()
    );
    Ok(())
}

/// `POST .../uploadtokenrequests` for `pvc`; returns `status.token`.
pub async fn request_token(
    client: &kube::Client,
    namespace: &str,
    pvc: &str,
) -> Result<String, CliError> {
    let body = json!({
        "apiVersion": "upload.cdi.kubevirt.io/v1beta1",
        "kind": "UploadTokenRequest",
        "metadata": {"name": pvc, "namespace": namespace},
        "spec": {"pvcName": pvc},
    });
    let req = http::Request::builder()
        .method("POST")
        .uri(format!(
            "/apis/upload.cdi.kubevirt.io/v1beta1/namespaces/{namespace}/uploadtokenrequests"
        ))
        .header("Content-Type", "application/json")
        .body(body.to_string().into_bytes())
        .map_err(|e| CliError::Transport(e.to_string()))?;
    let text = client
        .request_text(req)
        .await
        .map_err(CliError::from_kube)?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| CliError::Transport(format!("decoding the UploadTokenRequest: {e}")))?;
    v["status"]["token"]
        .as_str()
        .map(String::from)
        .ok_or_else(|| CliError::Transport("the UploadTokenRequest has no status.token".into()))
}

/// Streams the image to the upload path.
async fn send(target: &Target, o: &UploadOptions, token: &str, total: u64) -> Result<(), CliError> {
    let (mut tls, host, port) = target.connect_tls(o.insecure).await?;
    let head = format!(
        "POST {UPLOAD_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {}\r\n\
         {TOKEN_HEADER}: {token}\r\nContent-Type: application/octet-stream\r\n\
         Content-Length: {total}\r\nConnection: close\r\n\r\n",
        target.token()
    );
    let io = |e: std::io::Error| CliError::Transport(format!("uploading: {e}"));
    let mut file = tokio::fs::File::open(&o.image_path)
        .await
        .map_err(|e| CliError::Io {
            context: format!("reading {}", o.image_path.display()),
            source: e,
        })?;
    let mut progress = crate::progress::ByteProgress::new(total);
    let mut sent = 0u64;
    let written: Result<(), std::io::Error> = async {
        tls.write_all(head.as_bytes()).await?;
        let mut buf = vec![0u8; 256 << 10];
        loop {
            let n = file.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            tls.write_all(&buf[..n]).await?;
            sent += n as u64;
            progress.update(sent);
        }
        tls.flush().await
    }
    .await;
    progress.finish();
    // The server may answer (401, 409) before reading everything: read its answer anyway.
    let mut raw = Vec::new();
    let read = (&mut tls).take(1 << 20).read_to_end(&mut raw).await;
    let Some((code, body)) = parse_response(&raw) else {
        return Err(match (written, read) {
            (Err(e), _) | (_, Err(e)) => io(e),
            _ => CliError::Transport("the server closed the connection without an answer".into()),
        });
    };
    if !(200..300).contains(&code) {
        return Err(CliError::from_response(code, &body));
    }
    written.map_err(io)
}

/// A TLS connector that accepts any server certificate (`--insecure`).
pub(crate) fn insecure_connector() -> tokio_rustls::TlsConnector {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAny(provider)))
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
}

#[derive(Debug)]
struct AcceptAny(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> UploadOptions {
        UploadOptions {
            name: "d".into(),
            size: Some("1Gi".into()),
            image_path: "/x.qcow2".into(),
            storage_class: Some("shared".into()),
            access_mode: Some("ReadWriteMany".into()),
            insecure: false,
            wait: Duration::from_secs(1),
        }
    }

    #[test]
    fn manifest() {
        let v = dv_manifest(&opts(), "ns").unwrap();
        assert_eq!(v["spec"]["source"], json!({"upload": {}}));
        assert_eq!(
            v["spec"]["storage"]["resources"]["requests"]["storage"],
            "1Gi"
        );
        assert_eq!(v["spec"]["storage"]["storageClassName"], "shared");
        assert_eq!(
            v["spec"]["storage"]["accessModes"],
            json!(["ReadWriteMany"])
        );
        assert_eq!(v["metadata"]["namespace"], "ns");
        let mut o = opts();
        o.size = None;
        assert!(dv_manifest(&o, "ns").is_err());
    }

    #[test]
    fn responses() {
        let r = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_response(r), Some((401, "{}".into())));
        let c = b"HTTP/1.1 400 Bad Request\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(c), Some((400, "abcde".into())));
        assert_eq!(parse_response(b"garbage"), None);
    }
}
