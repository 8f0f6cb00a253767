//! The node's resolver (`dns-resolver.config`): where it lives ([`path`], pure: a node played
//! by a network namespace `X` has `/etc/netns/X/resolv.conf`, iproute2's per-namespace file
//! that `ip netns exec` bind-mounts over `/etc/resolv.conf`; else `--nmstate-resolv-conf`),
//! its text ([`render`], [`parse`], pure), and the write with its checkpoint ([`write`],
//! [`Checkpoint::restore`]): the previous content, or its absence, comes back on rollback.
//! The file is rewritten in place (never renamed over), so a bind mount of it stays valid.

use std::path::{Path, PathBuf};

use ferrovirt_api::nmstate::state::DnsConfig;
use serde_json::{Value, json};

/// The resolver file of the node (pure).
pub fn path(netns: &Option<String>, flag: &Path) -> PathBuf {
    match netns {
        Some(n) => Path::new("/etc/netns").join(n).join("resolv.conf"),
        None => flag.to_path_buf(),
    }
}

/// The file's text for a configuration (pure).
pub fn render(cfg: &DnsConfig) -> String {
    let mut s = String::from("# Written by ferrovirt-agent (nmstate dns-resolver).\n");
    for srv in &cfg.server {
        s.push_str(&format!("nameserver {srv}\n"));
    }
    if !cfg.search.is_empty() {
        s.push_str(&format!("search {}\n", cfg.search.join(" ")));
    }
    s
}

/// The servers and search domains of a resolv.conf text (pure).
pub fn parse(text: &str) -> DnsConfig {
    let mut c = DnsConfig::default();
    for line in text.lines() {
        let mut w = line.split_whitespace();
        match w.next() {
            Some("nameserver") => c.server.extend(w.next().map(str::to_string)),
            Some("search") | Some("domain") => c.search = w.map(str::to_string).collect(),
            _ => {}
        }
    }
    c
}

/// The NodeNetworkState's `dns-resolver` (pure): `config` as the file holds it, `running`
/// with the DHCP leases' servers (auto-dns) added.
pub fn report(file: &DnsConfig, dhcp_servers: &[String]) -> Value {
    let mut running = file.server.clone();
    for s in dhcp_servers {
        if !running.contains(s) {
            running.push(s.clone());
        }
    }
    json!({
        "config": {"server": file.server, "search": file.search},
        "running": {"server": running, "search": file.search},
    })
}

/// What was there before a write.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    before: Option<Vec<u8>>,
    /// The directory the write created (removed again on restore when empty).
    made_dir: Option<PathBuf>,
}

/// Writes `cfg` to `path`, returning what restores the previous state.
pub fn write(path: &Path, cfg: &DnsConfig) -> Result<Checkpoint, String> {
    let before = std::fs::read(path).ok();
    let mut made_dir = None;
    if let Some(dir) = path.parent()
        && !dir.exists()
    {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        made_dir = Some(dir.to_path_buf());
    }
    std::fs::write(path, render(cfg)).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Checkpoint {
        path: path.to_path_buf(),
        before,
        made_dir,
    })
}

impl Checkpoint {
    /// Puts back the previous content (or removes the file and the directory the write made).
    pub fn restore(&self) -> Result<(), String> {
        let r = match &self.before {
            Some(b) => std::fs::write(&self.path, b),
            None => std::fs::remove_file(&self.path),
        };
        r.map_err(|e| format!("{}: {e}", self.path.display()))?;
        if let Some(d) = &self.made_dir {
            let _ = std::fs::remove_dir(d);
        }
        Ok(())
    }
}
