//! Wrappers around `qemu-img`: `info --output=json` (parsed into [`ImageInfo`]), `check`,
//! `convert -p` with its progress parsed from the `(12.34/100%)` lines, and `resize`. The
//! parsing is pure and unit-tested; the commands run with `tokio::process`. `info` and
//! `check` inspect untrusted images, so they run under `prlimit` (address space
//! [`INSPECT_MEMORY_LIMIT`], CPU time [`INSPECT_CPU_SECONDS`]) and a wall-clock timeout
//! ([`INSPECT_TIMEOUT`]): a crafted header cannot make them eat the host.

use std::path::Path;
use std::process::Stdio;

use serde::Deserialize;
use tokio::io::AsyncReadExt;
use tokio::process::Command;

use crate::error::StorageError;

/// What `qemu-img info --output=json` says about an image.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ImageInfo {
    /// `raw`, `qcow2`, `vmdk`, `vhdx`, …
    pub format: String,
    /// Guest-visible size in bytes.
    pub virtual_size: u64,
    /// Bytes used on the host.
    #[serde(default)]
    pub actual_size: Option<u64>,
    #[serde(default)]
    pub backing_filename: Option<String>,
    #[serde(default)]
    pub full_backing_filename: Option<String>,
    #[serde(default)]
    pub encrypted: Option<bool>,
    /// Format-specific details (`{"type": "qcow2", "data": {"data-file": …}}`).
    #[serde(default)]
    pub format_specific: Option<serde_json::Value>,
}

impl ImageInfo {
    /// The external data file of a qcow2 image (`-o data_file=…`), if any.
    pub fn data_file(&self) -> Option<&str> {
        self.format_specific
            .as_ref()?
            .pointer("/data/data-file")?
            .as_str()
    }
}

/// Address-space limit for `qemu-img info`/`check` on untrusted images (bytes).
pub const INSPECT_MEMORY_LIMIT: u64 = 1 << 30;
/// CPU-time limit for `qemu-img info`/`check` (seconds).
pub const INSPECT_CPU_SECONDS: u64 = 30;
/// Wall-clock limit for `qemu-img info`/`check`.
pub const INSPECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Image formats the importer accepts as sources.
pub const ACCEPTED_FORMATS: &[&str] = &["raw", "qcow2", "vmdk", "vdi", "vhdx", "vpc", "qcow"];

/// Parse `qemu-img info --output=json`.
pub fn parse_info(json: &str) -> Result<ImageInfo, StorageError> {
    serde_json::from_str(json).map_err(|e| StorageError::Tool {
        tool: "qemu-img info".into(),
        message: format!("unexpected output ({e}): {json}"),
    })
}

/// Why an image may not be imported into a volume of `capacity` bytes: it has a backing file
/// (it could read any file of the host), is encrypted, has an unknown format, or its virtual
/// size exceeds the volume.
pub fn validate(info: &ImageInfo, capacity: u64) -> Result<(), StorageError> {
    if info.backing_filename.is_some() || info.full_backing_filename.is_some() {
        return Err(StorageError::Refused(format!(
            "the image has a backing file ({}); images with backing files are not accepted",
            info.backing_filename
                .as_deref()
                .or(info.full_backing_filename.as_deref())
                .unwrap_or("")
        )));
    }
    if let Some(f) = info.data_file() {
        return Err(StorageError::Refused(format!(
            "the image has an external data file ({f}); images with external data files are \
             not accepted"
        )));
    }
    if info.encrypted == Some(true) {
        return Err(StorageError::Refused("the image is encrypted".into()));
    }
    if !ACCEPTED_FORMATS.contains(&info.format.as_str()) {
        return Err(StorageError::Refused(format!(
            "unsupported image format {:?}",
            info.format
        )));
    }
    if info.virtual_size > capacity {
        return Err(StorageError::Refused(format!(
            "virtual image size {} is larger than the reported available storage {}; \
             a larger PVC is required",
            info.virtual_size, capacity
        )));
    }
    Ok(())
}

/// Why the image `info` describes (opened as `path`) is not self-contained: a VMDK with
/// more than one extent, or an extent that is not `path` itself (a FLAT extent naming a host
/// file), or any `json:`/protocol file name in its details.
pub fn validate_self_contained(info: &ImageInfo, path: &Path) -> Result<(), StorageError> {
    let refuse =
        |m: String| StorageError::Refused(format!("{m}; only self-contained images are accepted"));
    let own = path.to_string_lossy();
    if let Some(extents) = info
        .format_specific
        .as_ref()
        .and_then(|f| f.pointer("/data/extents"))
        .and_then(|e| e.as_array())
    {
        if extents.len() > 1 {
            return Err(refuse(format!(
                "the {} image has {} extents",
                info.format,
                extents.len()
            )));
        }
        for e in extents {
            let name = e.get("filename").and_then(|f| f.as_str()).unwrap_or("");
            if name != own {
                return Err(refuse(format!(
                    "the {} image names the extent file {name:?}",
                    info.format
                )));
            }
        }
    }
    let text = info
        .format_specific
        .as_ref()
        .map(|f| f.to_string())
        .unwrap_or_default();
    if text.contains("json:") {
        return Err(refuse(format!(
            "the {} image refers to a json: file name",
            info.format
        )));
    }
    Ok(())
}

/// Parse a `qemu-img convert -p` progress line such as `    (45.02/100%)` into 45.02.
pub fn parse_progress(line: &str) -> Option<f64> {
    let s = line.trim();
    let inner = s.strip_prefix('(')?.strip_suffix(")")?;
    let (num, rest) = inner.split_once('/')?;
    if rest != "100%" {
        return None;
    }
    let v: f64 = num.trim().parse().ok()?;
    (0.0..=100.0).contains(&v).then_some(v)
}

fn tool_err(tool: &str, message: impl Into<String>) -> StorageError {
    StorageError::Tool {
        tool: tool.into(),
        message: message.into(),
    }
}

async fn run(tool: &str, cmd: &mut Command) -> Result<String, StorageError> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| tool_err(tool, format!("cannot start qemu-img: {e}")))?;
    if !out.status.success() {
        return Err(tool_err(
            tool,
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The argv prefix that runs `qemu-img` under the inspection limits.
pub fn limited_qemu_img() -> Vec<String> {
    vec![
        "prlimit".into(),
        format!("--as={INSPECT_MEMORY_LIMIT}"),
        format!("--cpu={INSPECT_CPU_SECONDS}"),
        "--".into(),
        "qemu-img".into(),
    ]
}

fn limited(args: &[&str]) -> Command {
    let argv = limited_qemu_img();
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]).args(args).kill_on_drop(true);
    cmd
}

async fn run_limited(tool: &str, cmd: &mut Command) -> Result<std::process::Output, StorageError> {
    let out = tokio::time::timeout(INSPECT_TIMEOUT, cmd.stdin(Stdio::null()).output())
        .await
        .map_err(|_| {
            tool_err(
                tool,
                format!("timed out after {} s", INSPECT_TIMEOUT.as_secs()),
            )
        })?
        .map_err(|e| tool_err(tool, format!("cannot start prlimit/qemu-img: {e}")))?;
    Ok(out)
}

/// A path handed to `qemu-img`: absolute, so QEMU never reads it as a protocol
/// (`nbd:…`, `json:{…}`).
pub fn path_arg(path: &Path) -> Result<&Path, StorageError> {
    let s = path.to_string_lossy();
    if !path.is_absolute() || s.starts_with("json:") {
        return Err(StorageError::invalid(
            "image path",
            format!("{s:?} is not an absolute file path"),
        ));
    }
    Ok(path)
}

/// `qemu-img info --output=json -f format path` under the inspection limits. The format is
/// always given (never probed); backing files are not opened.
pub async fn info(path: &Path, format: &str) -> Result<ImageInfo, StorageError> {
    let mut cmd = limited(&["info", "--output=json", "-f", format]);
    cmd.arg(path_arg(path)?);
    let out = run_limited("qemu-img info", &mut cmd).await?;
    if !out.status.success() {
        return Err(tool_err(
            "qemu-img info",
            first_lines(&String::from_utf8_lossy(&out.stderr), 3),
        ));
    }
    parse_info(&String::from_utf8_lossy(&out.stdout))
}

/// The first `n` non-empty lines of `text`, joined with "; ".
pub fn first_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let mut s = lines.iter().take(n).copied().collect::<Vec<_>>().join("; ");
    if lines.len() > n {
        s.push_str(&format!(" (and {} more lines)", lines.len() - n));
    }
    s
}

/// `qemu-img check -f format path` under the inspection limits: `Err(Refused)` when the
/// image is corrupt (exit status 2) or cannot be checked (1); leaked clusters (3) are
/// harmless. Formats without a consistency check pass.
pub async fn check(path: &Path, format: &str) -> Result<(), StorageError> {
    if format != "qcow2" && format != "qcow" && format != "vdi" && format != "vhdx" {
        return Ok(());
    }
    let mut cmd = limited(&["check", "-f", format]);
    cmd.arg(path_arg(path)?);
    let out = run_limited("qemu-img check", &mut cmd).await?;
    match out.status.code() {
        Some(0) | Some(3) => Ok(()),
        Some(63) => Ok(()), // "check not supported for this format"
        _ => {
            let mut msg = String::from_utf8_lossy(&out.stderr).into_owned();
            msg.push('\n');
            msg.push_str(&String::from_utf8_lossy(&out.stdout));
            Err(StorageError::Refused(format!(
                "the {format} image is corrupt: {}",
                first_lines(&msg, 2)
            )))
        }
    }
}

/// What to convert.
#[derive(Debug, Clone)]
pub struct ConvertRequest<'a> {
    pub src: &'a Path,
    /// The source format as detected (never probed again, so a raw image cannot pose as qcow2).
    pub src_format: &'a str,
    pub dst: &'a Path,
    /// `raw` for ferrovirt volumes.
    pub dst_format: &'a str,
    /// Keep an existing destination file (`-n`): convert into a pre-created volume.
    pub existing_dst: bool,
}

/// `qemu-img convert -p` — copies `src` into `dst`, calling `progress` with the
/// percentage (0–100) as qemu-img reports it.
pub async fn convert(
    req: &ConvertRequest<'_>,
    mut progress: impl FnMut(f64),
) -> Result<(), StorageError> {
    let mut cmd = Command::new("qemu-img");
    cmd.args(["convert", "-p", "-f", req.src_format, "-O", req.dst_format]);
    if req.existing_dst {
        cmd.arg("-n");
    }
    cmd.arg(path_arg(req.src)?)
        .arg(path_arg(req.dst)?)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| tool_err("qemu-img convert", format!("cannot start qemu-img: {e}")))?;
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let err_task = tokio::spawn(async move {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s).await;
        s
    });
    let mut buf = [0u8; 512];
    let mut line = String::new();
    loop {
        let n = stdout
            .read(&mut buf)
            .await
            .map_err(|e| tool_err("qemu-img convert", e.to_string()))?;
        if n == 0 {
            break;
        }
        for ch in String::from_utf8_lossy(&buf[..n]).chars() {
            if ch == '\r' || ch == '\n' {
                if let Some(p) = parse_progress(&line) {
                    progress(p);
                }
                line.clear();
            } else {
                line.push(ch);
            }
        }
    }
    let status = child
        .wait()
        .await
        .map_err(|e| tool_err("qemu-img convert", e.to_string()))?;
    let stderr = err_task.await.unwrap_or_default();
    if !status.success() {
        return Err(tool_err("qemu-img convert", stderr.trim().to_string()));
    }
    progress(100.0);
    Ok(())
}

/// `qemu-img resize -f format path size` (grow only).
pub async fn resize(path: &Path, format: &str, size: u64) -> Result<(), StorageError> {
    let mut cmd = Command::new("qemu-img");
    cmd.args(["resize", "-f", format])
        .arg(path_arg(path)?)
        .arg(size.to_string());
    run("qemu-img resize", &mut cmd).await.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    const QCOW2: &str = r#"{
        "virtual-size": 67108864, "filename": "disk.qcow2", "cluster-size": 65536,
        "format": "qcow2", "actual-size": 1769472, "dirty-flag": false,
        "format-specific": {"type": "qcow2", "data": {"compat": "1.1"}}
    }"#;

    #[test]
    fn parses_info() {
        let i = parse_info(QCOW2).unwrap();
        assert_eq!(i.format, "qcow2");
        assert_eq!(i.virtual_size, 64 << 20);
        assert_eq!(i.actual_size, Some(1769472));
        assert_eq!(i.backing_filename, None);
        assert!(parse_info("not json").is_err());
    }

    #[test]
    fn validates_size_backing_and_format() {
        let i = parse_info(QCOW2).unwrap();
        validate(&i, 64 << 20).unwrap();
        let e = validate(&i, (64 << 20) - 1).unwrap_err().to_string();
        assert!(e.contains("larger"), "{e}");
        let mut b = i.clone();
        b.backing_filename = Some("/etc/shadow".into());
        assert!(
            validate(&b, 1 << 40)
                .unwrap_err()
                .to_string()
                .contains("backing")
        );
        let mut f = i;
        f.format = "luks".into();
        assert!(validate(&f, 1 << 40).is_err());
    }

    #[test]
    fn refuses_external_data_files() {
        let json = r#"{"virtual-size": 1048576, "format": "qcow2",
            "format-specific": {"type": "qcow2", "data": {"data-file": "/etc/passwd"}}}"#;
        let i = parse_info(json).unwrap();
        assert_eq!(i.data_file(), Some("/etc/passwd"));
        let e = validate(&i, 1 << 30).unwrap_err().to_string();
        assert!(e.contains("external data file (/etc/passwd)"), "{e}");
        assert_eq!(parse_info(QCOW2).unwrap().data_file(), None);
    }

    #[test]
    fn limits_and_line_trimming() {
        let argv = limited_qemu_img();
        assert_eq!(argv[0], "prlimit");
        assert!(argv.contains(&format!("--as={INSPECT_MEMORY_LIMIT}")));
        assert_eq!(argv.last().map(String::as_str), Some("qemu-img"));
        assert_eq!(first_lines("a\n\nb\nc\nd\n", 2), "a; b (and 2 more lines)");
        assert_eq!(first_lines("one\n", 3), "one");
    }

    #[tokio::test]
    async fn check_finds_truncated_qcow2() {
        let d = tempfile::tempdir().unwrap();
        let raw = d.path().join("a.raw");
        std::fs::write(&raw, vec![0x5au8; 4 << 20]).unwrap();
        let q = d.path().join("a.qcow2");
        convert(
            &ConvertRequest {
                src: &raw,
                src_format: "raw",
                dst: &q,
                dst_format: "qcow2",
                existing_dst: false,
            },
            |_| {},
        )
        .await
        .unwrap();
        check(&q, "qcow2").await.unwrap();
        let bytes = std::fs::read(&q).unwrap();
        let t = d.path().join("t.qcow2");
        std::fs::write(&t, &bytes[..bytes.len() / 3]).unwrap();
        let e = check(&t, "qcow2").await.unwrap_err().to_string();
        assert!(e.contains("corrupt"), "{e}");
        check(&raw, "raw").await.unwrap();
    }

    #[test]
    fn multi_file_vmdks_are_refused() {
        let json = r#"{"virtual-size": 4096, "format": "vmdk", "format-specific": {"type": "vmdk",
            "data": {"extents": [{"filename": "/etc/token", "format": "FLAT"}]}}}"#;
        let i = parse_info(json).unwrap();
        let e = validate_self_contained(&i, Path::new("/s/image")).unwrap_err();
        assert!(e.to_string().contains("/etc/token"), "{e}");
        let ok = json.replace("/etc/token", "/s/image");
        validate_self_contained(&parse_info(&ok).unwrap(), Path::new("/s/image")).unwrap();
        assert!(path_arg(Path::new("nbd:x")).is_err());
        assert!(path_arg(Path::new("/a/b")).is_ok());
    }

    #[test]
    fn parses_progress_lines() {
        assert_eq!(parse_progress("    (45.02/100%)"), Some(45.02));
        assert_eq!(parse_progress("(100.00/100%)"), Some(100.0));
        assert_eq!(parse_progress("(0.00/100%)"), Some(0.0));
        assert_eq!(parse_progress("garbage"), None);
        assert_eq!(parse_progress("(101.00/100%)"), None);
        assert_eq!(parse_progress("(5/50%)"), None);
    }

    #[tokio::test]
    async fn info_convert_resize_roundtrip() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("a.raw");
        std::fs::write(&src, vec![7u8; 1 << 20]).unwrap();
        let dst = d.path().join("b.qcow2");
        let mut seen = Vec::new();
        convert(
            &ConvertRequest {
                src: &src,
                src_format: "raw",
                dst: &dst,
                dst_format: "qcow2",
                existing_dst: false,
            },
            |p| seen.push(p),
        )
        .await
        .unwrap();
        assert_eq!(seen.last(), Some(&100.0));
        let i = info(&dst, "qcow2").await.unwrap();
        assert_eq!((i.format.as_str(), i.virtual_size), ("qcow2", 1 << 20));
        resize(&dst, "qcow2", 2 << 20).await.unwrap();
        assert_eq!(info(&dst, "qcow2").await.unwrap().virtual_size, 2 << 20);
    }
}
