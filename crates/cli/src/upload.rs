//! virtctl's `image-upload dv NAME --size SIZE --image-path FILE`: creates the DataVolume
//! (source `upload: {}`) when absent, waits for `UploadReady`, asks for an upload token
//! (`UploadTokenRequest`, `upload.cdi.kubevirt.io/v1beta1`), streams the file to the server's
//! `/v1beta1/upload` with a progress bar ([`crate::progress`]: redrawn on a terminal, plain
//! lines every 10 % otherwise) and waits for `Succeeded`.
//!
//! ferrovirt's API server authenticates every request with the kubeconfig's credentials, so
//! those go in `Authorization` (through [`crate::transport`], as for every verb) and the upload
//! token in `X-Upload-Token`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::{Value, json};

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
    let meta = std::fs::metadata(&o.image_path).map_err(|e| CliError::Io {
        context: format!("reading {}", o.image_path.display()),
        source: e,
    })?;
    let file = tokio::fs::File::open(&o.image_path)
        .await
        .map_err(|e| CliError::Io {
            context: format!("reading {}", o.image_path.display()),
            source: e,
        })?;
    run_stream(target, o, file, meta.len()).await?;
    println!(
        "Uploading {} completed successfully",
        o.image_path.display()
    );
    Ok(())
}

/// `image-upload` of `total` bytes read from `reader` (`o.image_path` unused): the backup
/// restore's path into a new DataVolume.
pub async fn run_stream<R>(
    target: &Target,
    o: &UploadOptions,
    reader: R,
    total: u64,
) -> Result<(), CliError>
where
    R: tokio::io::AsyncRead + Send + Unpin + 'static,
{
    let ns = target.namespace.clone();
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
    send(target, o, &token, reader, total).await?;
    eprintln!("Uploading data completed successfully, waiting for processing to complete");
    wait_phase(&api, &o.name, "Succeeded", o.wait).await?;
    eprintln!("Processing completed successfully");
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

/// Streams the image to the upload path (the kubeconfig's credentials in `Authorization`, the
/// upload token in `X-Upload-Token`; `--insecure` skips the server certificate check).
async fn send<R>(
    target: &Target,
    o: &UploadOptions,
    token: &str,
    file: R,
    total: u64,
) -> Result<(), CliError>
where
    R: tokio::io::AsyncRead + Send + Unpin + 'static,
{
    use futures::StreamExt;
    use http_body_util::BodyExt;

    let transport = target.transport(o.insecure).await?;
    let mut progress = crate::progress::ByteProgress::new(total);
    let mut sent = 0u64;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
    let chunks = tokio_util::io::ReaderStream::with_capacity(file, 256 << 10).map(move |c| {
        if let Ok(b) = &c {
            let _ = tx.send(b.len() as u64);
        }
        c.map(hyper::body::Frame::data)
    });
    let body = http_body_util::StreamBody::new(chunks).boxed_unsync();
    let req = http::Request::post(UPLOAD_PATH)
        .header(TOKEN_HEADER, token)
        .header(http::header::CONTENT_TYPE, "application/octet-stream")
        .header(http::header::CONTENT_LENGTH, total)
        .body(body)
        .map_err(|e| CliError::Transport(e.to_string()))?;
    let answer = transport.send(req);
    tokio::pin!(answer);
    let resp = loop {
        tokio::select! {
            r = &mut answer => break r,
            Some(n) = rx.recv() => {
                sent += n;
                progress.update(sent);
            }
        }
    };
    while let Ok(n) = rx.try_recv() {
        sent += n;
        progress.update(sent);
    }
    progress.finish();
    let resp = resp?;
    if !resp.status().is_success() {
        return Err(crate::transport::error_response(resp).await);
    }
    crate::transport::read_body(resp, 1 << 20).await?;
    Ok(())
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
}
