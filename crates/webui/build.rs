//! Produces the web console bundle and embeds it: runs `ui/build.sh` (npm ci + esbuild) when
//! `ui/dist` is missing or older than the UI sources, the lockfile or the script, copies the
//! bundle into OUT_DIR and writes `assets.rs`, a table of `include_bytes!` entries. Fails with
//! a message naming the missing tool when node or npm is absent.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

fn main() {
    let manifest =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let ui = manifest.join("../../ui");
    let ui = ui.canonicalize().unwrap_or(ui);
    let sources = ["src", "package.json", "package-lock.json", "build.sh"];
    for s in sources {
        println!("cargo:rerun-if-changed={}", ui.join(s).display());
    }
    let dist = ui.join("dist");
    let newest_source = sources
        .iter()
        .filter_map(|s| newest(&ui.join(s)))
        .max()
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let built = std::fs::metadata(dist.join("index.html"))
        .and_then(|m| m.modified())
        .ok();
    if built.is_none_or(|b| b < newest_source) {
        build(&ui);
    }

    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let copy = out.join("ui");
    let _ = std::fs::remove_dir_all(&copy);
    std::fs::create_dir_all(&copy).expect("creating OUT_DIR/ui");
    let mut files = Vec::new();
    collect(&dist, &dist, &mut files);
    files.sort();
    let mut table = String::from(
        "/// The files of `ui/dist`, embedded at build time.\npub static ASSETS: &[Asset] = &[\n",
    );
    for rel in &files {
        let to = copy.join(rel);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).expect("creating an asset folder");
        }
        std::fs::copy(dist.join(rel), &to).expect("copying an asset");
        let name = rel.to_string_lossy().replace('\\', "/");
        writeln!(
            table,
            "    Asset {{ path: {name:?}, content_type: {:?}, body: include_bytes!({:?}) }},",
            content_type(&name),
            to.display().to_string()
        )
        .expect("writing to a string");
    }
    table.push_str("];\n");
    std::fs::write(out.join("assets.rs"), table).expect("writing assets.rs");
    if !files.iter().any(|f| f == Path::new("index.html")) {
        panic!(
            "{} has no index.html: ui/build.sh did not produce the bundle",
            dist.display()
        );
    }
}

fn build(ui: &Path) {
    for tool in ["node", "npm", "bash"] {
        if Command::new(tool).arg("--version").output().is_err() {
            panic!(
                "building the web console (ui/) needs `{tool}`, which is not on PATH: install Node.js \
                 and npm (scripts/install-deps.sh installs Debian's nodejs and npm), or build ui/dist \
                 elsewhere with ui/build.sh"
            );
        }
    }
    let status = Command::new("bash")
        .arg(ui.join("build.sh"))
        .status()
        .expect("running ui/build.sh");
    if !status.success() {
        panic!(
            "ui/build.sh failed ({status}): the web console could not be bundled; its output above \
             says why (npm needs the registry for `npm ci` the first time)"
        );
    }
}

/// The newest modification time of a file or of any file under a folder.
fn newest(p: &Path) -> Option<SystemTime> {
    let meta = std::fs::metadata(p).ok()?;
    if !meta.is_dir() {
        return meta.modified().ok();
    }
    std::fs::read_dir(p)
        .ok()?
        .flatten()
        .filter_map(|e| newest(&e.path()))
        .max()
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect(root, &p, out);
        } else if let Ok(rel) = p.strip_prefix(root) {
            out.push(rel.to_path_buf());
        }
    }
}

fn content_type(name: &str) -> &'static str {
    match name.rsplit_once('.').map(|(_, e)| e) {
        Some("html") => "text/html; charset=utf-8",
        Some("js") | Some("mjs") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("txt") => "text/plain; charset=utf-8",
        Some("json") | Some("map") => "application/json",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("ico") => "image/x-icon",
        Some("woff2") => "font/woff2",
        _ => "application/octet-stream",
    }
}
