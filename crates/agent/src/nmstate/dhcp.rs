//! DHCP clients of node interfaces (`ipv4: {dhcp: true}`): one busybox `udhcpc` per
//! interface, run in the node's network namespace, with an event script the agent writes.
//!
//! Why udhcpc and not a client in Rust over `dhcproto`: udhcpc is installed wherever the
//! agent runs (`busybox-static`, scripts/install-deps.sh) and already does what a client needs
//! and `dhcproto` does not: discovery over a raw packet socket on an interface without an
//! address, the renew/rebind timers, NAK handling and the release. Its process lives in the
//! node's namespace (`ip netns exec`), so the agent needs no per-thread `setns`.
//!
//! Files under `DATA_DIR/nmstate-dhcp/`: `IF.want` (the client the applied policies ask for,
//! with its [`DhcpOpts`]: written on start, removed on stop), `IF.pid` (the client's pid),
//! `IF.lease` (written by the script on `bound`/`renew`: `pid`, `addr IP/PREFIX`, `router`,
//! `dns`; removed on `deconfig`) and `IF.log`. The script applies the address (and the default
//! route with auto-gateway) itself, so renewals need nothing from the agent; on `deconfig`
//! (the client's start, a lost lease, a release) it removes what its lease file says it added.
//!
//! A client is running when its pid file names a live process whose command line is that
//! udhcpc; [`Dhcp::start`] adopts a running one (never two), [`Dhcp::ensure_all`] restarts
//! the wanted clients that died (an agent restart), [`Dhcp::stop`] releases the lease
//! (SIGUSR2, the script's `deconfig`), ends the client and removes what is left.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::plan::DhcpOpts;

/// A client's log is started afresh at its next start once it is larger than this.
const LOG_LIMIT: u64 = 1 << 20;

/// The event script (udhcpc runs it with the event as `$1` and the lease in the environment).
const SCRIPT: &str = r#"#!/bin/sh
# Written by ferrovirt-agent (nmstate DHCP): udhcpc events for one node interface.
f="$FERROVIRT_DHCP_DIR/$interface.lease"
old_addr=$(sed -n 's/^addr //p' "$f" 2>/dev/null)
old_router=$(sed -n 's/^router //p' "$f" 2>/dev/null)
case "$1" in
deconfig)
    [ -n "$old_router" ] && ip route del default via "$old_router" dev "$interface" 2>/dev/null
    [ -n "$old_addr" ] && ip addr del "$old_addr" dev "$interface" 2>/dev/null
    rm -f "$f"
    ip link set "$interface" up
    ;;
bound|renew)
    new="$ip/${mask:-32}"
    if [ -n "$old_addr" ] && [ "$old_addr" != "$new" ]; then
        ip addr del "$old_addr" dev "$interface" 2>/dev/null
    fi
    ip addr replace "$new" dev "$interface" || exit 1
    r=""
    for x in $router; do r="$x"; break; done
    if [ -n "$old_router" ] && [ "$old_router" != "$r" ]; then
        ip route del default via "$old_router" dev "$interface" 2>/dev/null
    fi
    if [ "$FERROVIRT_DHCP_GATEWAY" = 1 ] && [ -n "$r" ]; then
        ip route replace default via "$r" dev "$interface" || r=""
    else
        r=""
    fi
    d=""
    [ "$FERROVIRT_DHCP_DNS" = 1 ] && d="$dns"
    printf 'pid %s\naddr %s\nrouter %s\ndns %s\nlease %s\n' \
        "$PPID" "$new" "$r" "$d" "$lease" > "$f.tmp" && mv "$f.tmp" "$f"
    ;;
esac
exit 0
"#;

/// A lease as the script recorded it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lease {
    /// The client that wrote it.
    pub pid: u32,
    /// `IP/PREFIX`.
    pub addr: String,
    /// The default route installed (auto-gateway), if any.
    pub router: Option<String>,
    /// DNS servers (auto-dns).
    pub dns: Vec<String>,
    /// Lease time in seconds.
    pub lease_s: Option<u64>,
}

/// Parses a lease file (pure); `None` without an address.
pub fn parse_lease(text: &str) -> Option<Lease> {
    let mut l = Lease::default();
    for line in text.lines() {
        let (k, v) = line.split_once(' ').unwrap_or((line, ""));
        let v = v.trim();
        match k {
            "pid" => l.pid = v.parse().unwrap_or(0),
            "addr" => l.addr = v.to_string(),
            "router" if !v.is_empty() => l.router = Some(v.to_string()),
            "dns" => l.dns = v.split_whitespace().map(str::to_string).collect(),
            "lease" => l.lease_s = v.parse().ok(),
            _ => {}
        }
    }
    (!l.addr.is_empty()).then_some(l)
}

/// Marks the DHCP interfaces in a NodeNetworkState's `interfaces` (pure): `ipv4.dhcp`,
/// `auto-dns`, `auto-gateway` for each interface with a wanted client.
pub fn annotate(state: &mut Value, wanted: &BTreeMap<String, DhcpOpts>) {
    let Some(ifaces) = state["interfaces"].as_array_mut() else {
        return;
    };
    for i in ifaces {
        let Some(o) = i["name"].as_str().and_then(|n| wanted.get(n)).copied() else {
            continue;
        };
        i["ipv4"]["enabled"] = json!(true);
        i["ipv4"]["dhcp"] = json!(true);
        i["ipv4"]["auto-dns"] = json!(o.dns);
        i["ipv4"]["auto-gateway"] = json!(o.gateway);
    }
}

/// The clients of one node.
pub struct Dhcp {
    dir: PathBuf,
    netns: Option<String>,
}

impl Dhcp {
    /// The clients kept under `data_dir`, for the node namespace `netns` (`None`: the agent's).
    pub fn new(data_dir: &Path, netns: Option<String>) -> Dhcp {
        Dhcp {
            dir: data_dir.join("nmstate-dhcp"),
            netns,
        }
    }

    fn file(&self, iface: &str, ext: &str) -> PathBuf {
        self.dir.join(format!("{iface}.{ext}"))
    }

    /// The pid of the running client of `iface`.
    pub fn running(&self, iface: &str) -> Option<u32> {
        let pid: u32 = std::fs::read_to_string(self.file(iface, "pid"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        let is = args.iter().any(|a| a.ends_with(b"udhcpc"))
            && args
                .windows(2)
                .any(|w| w[0] == b"-i" && w[1] == iface.as_bytes());
        is.then_some(pid)
    }

    /// The clients the applied policies ask for.
    pub fn wanted(&self) -> BTreeMap<String, DhcpOpts> {
        let mut out = BTreeMap::new();
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "want")
                && let (Some(n), Ok(b)) = (p.file_stem(), std::fs::read(&p))
                && let Ok(o) = serde_json::from_slice::<DhcpOpts>(&b)
            {
                out.insert(n.to_string_lossy().into_owned(), o);
            }
        }
        out
    }

    /// The current lease of `iface` (its running client's).
    pub fn lease(&self, iface: &str) -> Option<Lease> {
        let pid = self.running(iface)?;
        let l = parse_lease(&std::fs::read_to_string(self.file(iface, "lease")).ok()?)?;
        (l.pid == pid).then_some(l)
    }

    /// Starts the client of `iface` unless one runs (then it is adopted, with `opts` kept for
    /// its next start). Returns whether a client was started.
    pub async fn start(&self, iface: &str, opts: DhcpOpts) -> Result<bool, String> {
        let io = |what: &str, e: std::io::Error| format!("{what}: {e}");
        std::fs::create_dir_all(&self.dir).map_err(|e| io("creating the DHCP dir", e))?;
        std::fs::write(
            self.file(iface, "want"),
            serde_json::to_vec(&opts).unwrap_or_default(),
        )
        .map_err(|e| io("recording the DHCP client", e))?;
        if self.running(iface).is_some() {
            return Ok(false);
        }
        let script = self.dir.join("udhcpc.script");
        std::fs::write(&script, SCRIPT).map_err(|e| io("writing the udhcpc script", e))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| io("the udhcpc script", e))?;
        }
        // The client's log, started afresh once it passed LOG_LIMIT (restarts append to it).
        let log_path = self.file(iface, "log");
        let full = std::fs::metadata(&log_path).is_ok_and(|m| m.len() > LOG_LIMIT);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(!full)
            .write(true)
            .truncate(full)
            .open(&log_path)
            .map_err(|e| io("the DHCP log", e))?;
        let pidfile = self.file(iface, "pid");
        let mut argv: Vec<String> = Vec::new();
        if let Some(n) = &self.netns {
            argv.extend(["ip", "netns", "exec", n].map(String::from));
        }
        argv.extend(["busybox", "udhcpc", "-f", "-i", iface, "-s"].map(String::from));
        argv.push(script.to_string_lossy().into_owned());
        argv.push("-p".into());
        argv.push(pidfile.to_string_lossy().into_owned());
        // Discover every second, three times, then pause 2 s and again (until stopped).
        argv.extend(["-t", "3", "-T", "1", "-A", "2"].map(String::from));
        let onoff = |b: bool| if b { "1" } else { "0" };
        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .env("FERROVIRT_DHCP_DIR", &self.dir)
            .env("FERROVIRT_DHCP_GATEWAY", onoff(opts.gateway))
            .env("FERROVIRT_DHCP_DNS", onoff(opts.dns))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| io("the DHCP log", e))?)
            .stderr(log)
            .kill_on_drop(false);
        let mut child = cmd.spawn().map_err(|e| io("starting busybox udhcpc", e))?;
        if let Some(pid) = child.id() {
            // udhcpc writes the same pid (ip netns exec execs); written here too so that the
            // client counts as running from now on.
            std::fs::write(&pidfile, format!("{pid}\n")).map_err(|e| io("the DHCP pid", e))?;
        }
        let name = iface.to_string();
        tokio::spawn(async move {
            let st = child.wait().await;
            tracing::info!(iface = %name, status = ?st, "nmstate: DHCP client ended");
        });
        tracing::info!(iface, ?opts, "nmstate: DHCP client started");
        Ok(true)
    }

    /// Waits for the running client's first lease of `iface` until `deadline`.
    pub async fn wait_lease(&self, iface: &str, deadline: Instant) -> Option<Lease> {
        loop {
            if let Some(l) = self.lease(iface) {
                return Some(l);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Stops the client of `iface`: releases its lease (the script removes the address and
    /// route), ends it, and removes what is left. Returns the options it ran with, when it
    /// was wanted.
    pub async fn stop(&self, iface: &str) -> Option<DhcpOpts> {
        let opts = self.wanted().remove(iface);
        let _ = std::fs::remove_file(self.file(iface, "want"));
        if let Some(pid) = self.running(iface) {
            let _ = signal("USR2", pid).await;
            let released = Instant::now() + Duration::from_secs(2);
            while Instant::now() < released && self.file(iface, "lease").exists() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = signal("TERM", pid).await;
            let gone = Instant::now() + Duration::from_secs(3);
            while Instant::now() < gone && self.running(iface).is_some() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if self.running(iface).is_some() {
                let _ = signal("KILL", pid).await;
            }
            tracing::info!(iface, pid, "nmstate: DHCP client stopped");
        }
        // What a client that died without its deconfig left.
        if let Some(l) = std::fs::read_to_string(self.file(iface, "lease"))
            .ok()
            .and_then(|t| parse_lease(&t))
        {
            if let Some(r) = &l.router {
                let _ = ferrovirt_network::apply::query(
                    "ip",
                    &self.netns,
                    &["route", "del", "default", "via", r, "dev", iface],
                )
                .await;
            }
            let _ = ferrovirt_network::apply::query(
                "ip",
                &self.netns,
                &["addr", "del", &l.addr, "dev", iface],
            )
            .await;
        }
        for ext in ["lease", "pid"] {
            let _ = std::fs::remove_file(self.file(iface, ext));
        }
        opts
    }

    /// Restarts the wanted clients that do not run (after an agent restart, or a client that
    /// died); a running one is left alone.
    /// An interface deleted outside any policy is skipped until it exists again (its client
    /// would only die again).
    pub async fn ensure_all(&self) {
        for (iface, opts) in self.wanted() {
            if self.running(&iface).is_some() || !self.exists(&iface).await {
                continue;
            }
            if let Err(e) = self.start(&iface, opts).await {
                tracing::warn!(iface, error = %e, "nmstate: restarting a DHCP client");
            }
        }
    }

    /// Whether `iface` exists in the node's namespace (`ip link show`).
    async fn exists(&self, iface: &str) -> bool {
        let mut cmd = tokio::process::Command::new("ip");
        if let Some(n) = &self.netns {
            cmd.args(["-n", n]);
        }
        cmd.args(["link", "show", "dev", iface])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .is_ok_and(|s| s.success())
    }
}

async fn signal(sig: &str, pid: u32) -> std::io::Result<std::process::ExitStatus> {
    tokio::process::Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
}
