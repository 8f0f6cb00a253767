//! virtctl's `vmexport`: `create NAME --pvc=|--vm=|--snapshot= [--ttl=]`, `download NAME
//! --output FILE [--volume] [--format gzip|raw] [--manifest [--include-secret]
//! [--manifest-output-format yaml|json]] [--keep-vme] [--insecure]` (with a source flag it
//! creates the export first) and `delete NAME`.
//!
//! A download waits for the export to be `Ready`, reads its token from the token Secret,
//! takes the volume's URL from `status.links.external` and fetches it through the
//! kubeconfig's server and CA (the export routes authenticate the `x-kubevirt-export-token`
//! header), writing the file with a progress bar and printing its SHA-256. Unless
//! `--keep-vme`, the export is deleted afterwards, as virtctl does.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
use serde_json::{Value, json};

use crate::error::CliError;
use crate::target::Target;

/// The header carrying the export token.
pub const TOKEN_HEADER: &str = "x-kubevirt-export-token";

/// What to export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Pvc(String),
    Vm(String),
    Snapshot(String),
}

/// `vmexport create`.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    pub name: String,
    pub source: Source,
    /// `ttlDuration` (`30m`, `2h`).
    pub ttl: Option<String>,
}

/// `vmexport download`.
#[derive(Debug, Clone)]
pub struct DownloadOptions {
    pub name: String,
    /// Create the export from this source first.
    pub source: Option<Source>,
    pub ttl: Option<String>,
    pub volume: Option<String>,
    /// `gzip` (default) or `raw`.
    pub format: String,
    pub output: Option<PathBuf>,
    /// Download the manifests instead of a volume.
    pub manifest: bool,
    pub include_secret: bool,
    /// `yaml` (default) or `json`.
    pub manifest_format: String,
    pub keep_vme: bool,
    pub insecure: bool,
    /// How long to wait for the export to be ready.
    pub wait: Duration,
}

fn resource() -> ApiResource {
    ApiResource {
        group: "export.kubevirt.io".into(),
        version: "v1beta1".into(),
        api_version: "export.kubevirt.io/v1beta1".into(),
        kind: "VirtualMachineExport".into(),
        plural: "virtualmachineexports".into(),
    }
}

/// The VirtualMachineExport `create` makes (pure).
pub fn manifest(o: &CreateOptions, namespace: &str) -> Value {
    let (group, kind, name) = match &o.source {
        Source::Pvc(n) => ("", "PersistentVolumeClaim", n),
        Source::Vm(n) => ("kubevirt.io", "VirtualMachine", n),
        Source::Snapshot(n) => ("snapshot.kubevirt.io", "VirtualMachineSnapshot", n),
    };
    let mut spec = json!({"source": {"apiGroup": group, "kind": kind, "name": name}});
    if let Some(t) = &o.ttl {
        spec["ttlDuration"] = json!(t);
    }
    json!({
        "apiVersion": "export.kubevirt.io/v1beta1",
        "kind": "VirtualMachineExport",
        "metadata": {"name": o.name, "namespace": namespace},
        "spec": spec,
    })
}

/// Runs `vmexport create`.
pub async fn create(target: &Target, o: &CreateOptions) -> Result<(), CliError> {
    let client = target.client().await?;
    let ns = &target.namespace;
    let api: Api<DynamicObject> = Api::namespaced_with(client, ns, &resource());
    let obj: DynamicObject =
        serde_json::from_value(manifest(o, ns)).map_err(|e| CliError::Usage(e.to_string()))?;
    api.create(&PostParams::default(), &obj)
        .await
        .map_err(CliError::from_kube)?;
    println!("VirtualMachineExport '{ns}/{}' created succesfully", o.name);
    Ok(())
}

/// Runs `vmexport delete`.
pub async fn delete(target: &Target, name: &str) -> Result<(), CliError> {
    let client = target.client().await?;
    let ns = &target.namespace;
    let api: Api<DynamicObject> = Api::namespaced_with(client, ns, &resource());
    api.delete(name, &DeleteParams::default())
        .await
        .map_err(CliError::from_kube)?;
    println!("VirtualMachineExport '{ns}/{name}' deleted succesfully");
    Ok(())
}

/// The URL of `volume` (or the only volume) in `format` from an export's status (pure).
pub fn volume_url(status: &Value, volume: Option<&str>, format: &str) -> Result<String, CliError> {
    let vols = status
        .pointer("/links/external/volumes")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let v = match volume {
        Some(want) => vols
            .iter()
            .find(|v| v["name"] == want)
            .ok_or_else(|| CliError::Usage(format!("the export has no volume {want}")))?,
        None if vols.len() == 1 => &vols[0],
        None if vols.is_empty() => {
            return Err(CliError::Usage("the export has no volumes".into()));
        }
        None => {
            let names: Vec<_> = vols.iter().filter_map(|v| v["name"].as_str()).collect();
            return Err(CliError::Usage(format!(
                "the export has several volumes ({}): choose one with --volume",
                names.join(", ")
            )));
        }
    };
    v["formats"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|f| f["format"] == format)
        .and_then(|f| f["url"].as_str())
        .map(String::from)
        .ok_or_else(|| CliError::Usage(format!("the volume has no {format} format")))
}

/// The path and query of a link (sent to the kubeconfig's server).
pub fn path_of(url: &str) -> Result<String, CliError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| CliError::Transport(format!("bad link {url:?}: {e}")))?;
    Ok(uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into()))
}

async fn wait_ready(
    api: &Api<DynamicObject>,
    name: &str,
    wait: Duration,
) -> Result<Value, CliError> {
    let deadline = Instant::now() + wait;
    let mut said = String::new();
    loop {
        let e = api.get(name).await.map_err(CliError::from_kube)?;
        let status = e.data.get("status").cloned().unwrap_or(Value::Null);
        let phase = status["phase"].as_str().unwrap_or("");
        if phase == "Ready" {
            return Ok(status);
        }
        let ready = status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "Ready")
            .cloned()
            .unwrap_or(Value::Null);
        let why = ready["message"].as_str().unwrap_or("").to_string();
        // A running VM's export whose online snapshot failed never becomes ready.
        if matches!(phase, "Terminated" | "Skipped") || ready["reason"] == "SnapshotFailed" {
            return Err(CliError::Usage(format!(
                "VirtualMachineExport {name} is {phase}: {why}"
            )));
        }
        if why != said && !why.is_empty() {
            eprintln!("waiting for VM Export {name} status to be ready: {why}");
            said = why;
        }
        if Instant::now() > deadline {
            return Err(CliError::Usage(format!(
                "timed out waiting for VirtualMachineExport {name} to be ready (phase {phase:?})"
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn token(client: &kube::Client, ns: &str, status: &Value) -> Result<String, CliError> {
    let name = status["tokenSecretRef"]
        .as_str()
        .ok_or_else(|| CliError::Usage("the export names no token Secret yet".into()))?;
    let api: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), ns);
    let s = api.get(name).await.map_err(CliError::from_kube)?;
    s.data
        .and_then(|mut d| d.remove("token"))
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        .ok_or_else(|| CliError::Usage(format!("Secret {name} has no token")))
}

/// Runs `vmexport download`.
pub async fn download(target: &Target, o: &DownloadOptions) -> Result<(), CliError> {
    if !matches!(o.format.as_str(), "gzip" | "raw") {
        return Err(CliError::Usage(format!(
            "--format {:?}: the formats are gzip and raw",
            o.format
        )));
    }
    let client = target.client().await?;
    let ns = target.namespace.clone();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &resource());
    if let Some(src) = &o.source
        && api
            .get_opt(&o.name)
            .await
            .map_err(CliError::from_kube)?
            .is_none()
    {
        let c = CreateOptions {
            name: o.name.clone(),
            source: src.clone(),
            ttl: o.ttl.clone(),
        };
        create(target, &c).await?;
    }
    let status = wait_ready(&api, &o.name, o.wait).await?;
    let token = token(&client, &ns, &status).await?;
    let transport = target.transport(o.insecure).await?;
    let result = if o.manifest {
        manifests(&transport, o, &status, &token).await
    } else {
        let url = volume_url(&status, o.volume.as_deref(), &o.format)?;
        let output = o
            .output
            .clone()
            .ok_or_else(|| CliError::Usage("--output is required".into()))?;
        eprintln!("Downloading file: {url}");
        fetch(&transport, &path_of(&url)?, &token, &output).await
    };
    if !o.keep_vme {
        api.delete(&o.name, &DeleteParams::default())
            .await
            .map_err(CliError::from_kube)?;
        eprintln!("VirtualMachineExport '{ns}/{}' deleted succesfully", o.name);
    }
    result
}

async fn get(
    transport: &crate::transport::Transport,
    path: &str,
    token: &str,
    accept: &str,
) -> Result<http::Response<hyper::body::Incoming>, CliError> {
    let req = http::Request::get(path)
        .header(TOKEN_HEADER, token)
        .header(http::header::ACCEPT, accept)
        .body(crate::transport::empty_body())
        .map_err(|e| CliError::Transport(e.to_string()))?;
    let resp = transport.send(req).await?;
    if !resp.status().is_success() {
        return Err(crate::transport::error_response(resp).await);
    }
    Ok(resp)
}

async fn manifests(
    transport: &crate::transport::Transport,
    o: &DownloadOptions,
    status: &Value,
    token: &str,
) -> Result<(), CliError> {
    let yaml = o.manifest_format != "json";
    let accept = if yaml {
        "application/yaml"
    } else {
        "application/json"
    };
    let link = |t: &str| {
        status
            .pointer("/links/external/manifests")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|m| m["type"] == t)
            .and_then(|m| m["url"].as_str())
            .map(String::from)
            .ok_or_else(|| CliError::Usage(format!("the export has no {t} manifest")))
    };
    let mut out = Vec::new();
    let mut urls = vec![link("all")?];
    if o.include_secret {
        urls.push(link("auth-header-secret")?);
    }
    for u in urls {
        let resp = get(transport, &path_of(&u)?, token, accept).await?;
        out.extend_from_slice(&crate::transport::read_body(resp, 16 << 20).await?);
    }
    match &o.output {
        Some(p) => std::fs::write(p, &out).map_err(|e| CliError::Io {
            context: format!("writing {}", p.display()),
            source: e,
        }),
        None => {
            use std::io::Write;
            std::io::stdout().write_all(&out).map_err(|e| CliError::Io {
                context: "writing the manifests".into(),
                source: e,
            })
        }
    }
}

/// Streams `path` into `output` with progress; prints the file's SHA-256.
async fn fetch(
    transport: &crate::transport::Transport,
    path: &str,
    token: &str,
    output: &std::path::Path,
) -> Result<(), CliError> {
    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;
    let resp = get(transport, path, token, "*/*").await?;
    let total = resp
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let io = |e| CliError::Io {
        context: format!("writing {}", output.display()),
        source: e,
    };
    let mut file = tokio::fs::File::create(output).await.map_err(io)?;
    let mut progress = total.map(crate::progress::ByteProgress::new);
    let mut sha = ring::digest::Context::new(&ring::digest::SHA256);
    let mut body = resp.into_body();
    let (mut done, mut last_line) = (0u64, Instant::now());
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| CliError::Transport(format!("download broke: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        sha.update(&data);
        file.write_all(&data).await.map_err(io)?;
        done += data.len() as u64;
        match &mut progress {
            Some(p) => p.update(done),
            None if last_line.elapsed() >= Duration::from_secs(2) => {
                eprintln!("{} downloaded", crate::progress::human(done));
                last_line = Instant::now();
            }
            None => {}
        }
    }
    if let Some(p) = &mut progress {
        p.finish();
    }
    if total.is_some_and(|t| t != done) {
        return Err(CliError::Transport(format!(
            "download ended after {done} of {} bytes",
            total.unwrap_or_default()
        )));
    }
    file.flush().await.map_err(io)?;
    file.sync_all().await.map_err(io)?;
    let hex: String = sha
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    eprintln!("Download finished succesfully");
    println!("{hex}  {}", output.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_names_the_source_with_its_group() {
        let o = CreateOptions {
            name: "ex".into(),
            source: Source::Snapshot("s".into()),
            ttl: Some("10m".into()),
        };
        let m = manifest(&o, "ns");
        assert_eq!(m["spec"]["source"]["apiGroup"], "snapshot.kubevirt.io");
        assert_eq!(m["spec"]["source"]["kind"], "VirtualMachineSnapshot");
        assert_eq!(m["spec"]["ttlDuration"], "10m");
        let o = CreateOptions {
            name: "ex".into(),
            source: Source::Pvc("p".into()),
            ttl: None,
        };
        assert_eq!(manifest(&o, "ns")["spec"]["source"]["apiGroup"], "");
    }

    #[test]
    fn urls_from_the_status() {
        let s = json!({"links": {"external": {"volumes": [
            {"name": "a", "formats": [{"format": "raw", "url": "https://h:1/x/a/disk.img"},
                                      {"format": "gzip", "url": "https://h:1/x/a/disk.img.gz"}]},
            {"name": "b", "formats": [{"format": "raw", "url": "https://h:1/x/b/disk.img"}]}]}}});
        assert_eq!(
            volume_url(&s, Some("a"), "gzip").unwrap(),
            "https://h:1/x/a/disk.img.gz"
        );
        assert!(volume_url(&s, None, "raw").is_err());
        assert!(volume_url(&s, Some("c"), "raw").is_err());
        assert!(volume_url(&s, Some("b"), "gzip").is_err());
        assert_eq!(
            path_of("https://h:1/x/a/disk.img?q=1").unwrap(),
            "/x/a/disk.img?q=1"
        );
    }
}
