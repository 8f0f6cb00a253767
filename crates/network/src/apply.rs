//! Runs [`crate::render::Action`]s with iproute2 (`ip`) and nftables (`nft -f -`), skipping
//! creations whose object exists and removals whose object is gone, plus the preflight check
//! (root, `ip`, `nft`, /dev/net/tun).

use std::process::Stdio;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use crate::error::{Error, Result};
use crate::render::Action;

/// Output of one command.
struct Output {
    ok: bool,
    status: String,
    stdout: String,
    stderr: String,
}

async fn run(argv: &[String], stdin: Option<&str>) -> Result<Output> {
    let (prog, args) = argv
        .split_first()
        .ok_or_else(|| Error::InvalidPlan("empty command".into()))?;
    let mut child = Command::new(prog)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| Error::io(format!("starting {prog}"), e))?;
    if let (Some(text), Some(mut w)) = (stdin, child.stdin.take()) {
        w.write_all(text.as_bytes())
            .await
            .map_err(|e| Error::io(format!("writing to {prog}"), e))?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| Error::io(format!("waiting for {prog}"), e))?;
    Ok(Output {
        ok: out.status.success(),
        status: out.status.to_string(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

async fn run_ok(argv: Vec<String>, stdin: Option<&str>) -> Result<String> {
    let out = run(&argv, stdin).await?;
    if out.ok {
        Ok(out.stdout)
    } else {
        Err(Error::Command {
            command: argv.join(" "),
            status: out.status,
            stderr: out.stderr,
        })
    }
}

fn ip_argv(netns: &Option<String>, args: &[String]) -> Vec<String> {
    let mut v = vec!["ip".to_string()];
    if let Some(n) = netns {
        v.extend(["-n".to_string(), n.clone()]);
    }
    v.extend(args.iter().cloned());
    v
}

fn in_netns(netns: &Option<String>, argv: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = match netns {
        Some(n) => vec!["ip".into(), "netns".into(), "exec".into(), n.clone()],
        None => Vec::new(),
    };
    v.extend(argv.iter().map(|s| s.to_string()));
    v
}

/// Whether the link `name` exists in `netns`.
pub async fn link_exists(netns: &Option<String>, name: &str) -> Result<bool> {
    if let Some(n) = netns
        && !crate::netns::exists(n)
    {
        return Ok(false);
    }
    let argv = ip_argv(
        netns,
        &["link".into(), "show".into(), "dev".into(), name.into()],
    );
    Ok(run(&argv, None).await?.ok)
}

async fn nft_table_exists(netns: &Option<String>, family: &str, table: &str) -> Result<bool> {
    if let Some(n) = netns
        && !crate::netns::exists(n)
    {
        return Ok(false);
    }
    Ok(run(
        &in_netns(netns, &["nft", "list", "table", family, table]),
        None,
    )
    .await?
    .ok)
}

async fn sysctl(netns: &Option<String>, key: &str, value: &str) -> Result<()> {
    let path = format!("/proc/sys/{key}");
    let v = value.to_string();
    let p = path.clone();
    crate::netns::run_in(netns.as_deref(), move || std::fs::write(&p, v))?
        .map_err(|e| Error::io(format!("writing {path} in netns {netns:?}"), e))
}

/// Runs one action.
pub async fn apply_one(a: &Action) -> Result<()> {
    match a {
        Action::AddNetns(n) => {
            if !crate::netns::exists(n) {
                run_ok(
                    vec!["ip".into(), "netns".into(), "add".into(), n.clone()],
                    None,
                )
                .await?;
            }
        }
        Action::AddLink { netns, name, args } => {
            if !link_exists(netns, name).await? {
                run_ok(ip_argv(netns, args), None).await?;
            }
        }
        Action::Ip { netns, args } => {
            run_ok(ip_argv(netns, args), None).await?;
        }
        Action::Sysctl { netns, key, value } => sysctl(netns, key, value).await?,
        Action::Nft { netns, script } => {
            run_ok(in_netns(netns, &["nft", "-f", "-"]), Some(script)).await?;
        }
        Action::DelLink { netns, name } => {
            if link_exists(netns, name).await? {
                run_ok(
                    ip_argv(netns, &["link".into(), "del".into(), name.clone()]),
                    None,
                )
                .await?;
            }
        }
        Action::Bridge {
            netns,
            args,
            tolerate_failure,
        } => {
            let mut argv = vec!["bridge".to_string()];
            if let Some(n) = netns {
                argv.extend(["-n".to_string(), n.clone()]);
            }
            argv.extend(args.iter().cloned());
            if *tolerate_failure {
                let out = run(&argv, None).await?;
                if !out.ok {
                    tracing::debug!("`{}` failed (ignored): {}", argv.join(" "), out.stderr);
                }
            } else {
                run_ok(argv, None).await?;
            }
        }
        Action::DelNetns(n) => {
            if crate::netns::exists(n) {
                run_ok(
                    vec!["ip".into(), "netns".into(), "del".into(), n.clone()],
                    None,
                )
                .await?;
            }
        }
        Action::DelNftTable {
            netns,
            family,
            table,
        } => {
            if nft_table_exists(netns, family, table).await? {
                run_ok(
                    in_netns(netns, &["nft", "delete", "table", family, table]),
                    None,
                )
                .await?;
            }
        }
    }
    Ok(())
}

/// Runs actions in order, stopping at the first failure.
pub async fn apply_all(actions: &[Action]) -> Result<()> {
    for a in actions {
        apply_one(a).await?;
    }
    Ok(())
}

/// Runs every action, even after failures; returns the first error.
pub async fn apply_all_best_effort(actions: &[Action]) -> Result<()> {
    let mut first = None;
    for a in actions {
        if let Err(e) = apply_one(a).await {
            tracing::warn!("network cleanup step failed: {e}");
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// The effective uid from /proc (no unsafe, no extra dependency).
fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// Fails with a clear message unless this process can apply plans: root, `ip` and `nft` on
/// PATH, `nsenter` (to start launchers in a VMI namespace), /dev/net/tun present.
pub async fn preflight() -> Result<()> {
    let mut missing = Vec::new();
    if effective_uid() != Some(0) {
        missing.push("root privileges (run as root)".to_string());
    }
    for (tool, flag, pkg) in [
        ("ip", "-V", "iproute2"),
        ("nft", "--version", "nftables"),
        ("nsenter", "--version", "util-linux"),
    ] {
        if run(&[tool.to_string(), flag.to_string()], None)
            .await
            .map(|o| !o.ok)
            .unwrap_or(true)
        {
            missing.push(format!("`{tool}` (Debian package {pkg})"));
        }
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        missing.push("/dev/net/tun".into());
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::Preflight(format!("missing {}", missing.join(", "))))
    }
}

/// Runs `TOOL [-n NETNS] ARGS…` (`ip` or `bridge`) and returns its stdout (for `-j` queries).
pub async fn query(tool: &str, netns: &Option<String>, args: &[&str]) -> Result<String> {
    let mut argv = vec![tool.to_string()];
    if let Some(n) = netns {
        argv.extend(["-n".to_string(), n.clone()]);
    }
    argv.extend(args.iter().map(|s| s.to_string()));
    run_ok(argv, None).await
}

/// Names of the bridges in `netns` (`ip -o link show type bridge`).
pub async fn bridges(netns: &Option<String>) -> Result<Vec<String>> {
    if let Some(n) = netns
        && !crate::netns::exists(n)
    {
        return Err(Error::Preflight(format!(
            "node namespace {n} does not exist"
        )));
    }
    let out = query("ip", netns, &["-o", "link", "show", "type", "bridge"]).await?;
    Ok(parse_link_names(&out))
}

/// Link names from `ip -o link show` lines (`3: br0: <…> …`, `4: veth0@if3: …`).
pub fn parse_link_names(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).trim().to_string())
        .filter(|n| !n.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn link_names_from_ip_o() {
        let t = "3: br-test: <BROADCAST,MULTICAST,UP> mtu 1500 qdisc noqueue\n\
                 7: fv0123456789@if2: <BROADCAST> mtu 1500\n";
        assert_eq!(super::parse_link_names(t), vec!["br-test", "fv0123456789"]);
    }
}
