//! Runs [`crate::render::Action`]s with iproute2 (`ip`) and nftables (`nft -f -`), skipping
//! creations whose object exists and removals whose object is gone, plus the preflight check
//! (root, `ip`, `nft`, /dev/net/tun).
//!
//! Process spawns are the cost of a VMI's network setup (issue #15's start path), so
//! [`apply_all`] runs consecutive `ip` steps in one namespace as one `ip [-n NS] -batch -`
//! ([`runs`], pure), checks whether a link exists in-process (`if_nametoindex` on a thread
//! inside the namespace) and starts `nft` from a thread inside the namespace instead of
//! through `ip netns exec` (which also builds a mount namespace and remounts /sys).
//! Why not netlink: the tap needs /dev/net/tun ioctls and the nft rulesets are text
//! anyway; batching keeps the same commands (and their logs and error messages) with a
//! handful of processes per VMI.

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

/// Runs `argv` (a program and its arguments) as a process inside the named namespace
/// `netns` (started from a thread that has entered it: the child inherits that thread's
/// namespace; only the network namespace changes), or in our own when `None`.
async fn run_in_netns(
    netns: &Option<String>,
    argv: Vec<String>,
    stdin: Option<String>,
) -> Result<Output> {
    let Some(n) = netns.clone() else {
        return run(&argv, stdin.as_deref()).await;
    };
    tokio::task::spawn_blocking(move || {
        crate::netns::run_in(Some(&n), move || run_blocking(&argv, stdin.as_deref()))?
    })
    .await
    .map_err(|e| Error::io("process task", std::io::Error::other(e)))?
}

/// [`run`] on the calling thread (which may have entered another network namespace).
fn run_blocking(argv: &[String], stdin: Option<&str>) -> Result<Output> {
    use std::io::Write as _;
    let (prog, args) = argv
        .split_first()
        .ok_or_else(|| Error::InvalidPlan("empty command".into()))?;
    let mut child = std::process::Command::new(prog)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("starting {prog}"), e))?;
    if let (Some(text), Some(mut w)) = (stdin, child.stdin.take()) {
        // Dropping `w` closes the pipe: the program sees the end of its input.
        let written = w.write_all(text.as_bytes());
        drop(w);
        if let Err(e) = written {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::io(format!("writing to {prog}"), e));
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Error::io(format!("waiting for {prog}"), e))?;
    Ok(Output {
        ok: out.status.success(),
        status: out.status.to_string(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

async fn run_ok_in_netns(
    netns: &Option<String>,
    argv: Vec<String>,
    stdin: Option<String>,
) -> Result<String> {
    let out = run_in_netns(netns, argv.clone(), stdin).await?;
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

/// Whether the link `name` exists in `netns` (`if_nametoindex` from a thread inside it: no
/// process).
pub async fn link_exists(netns: &Option<String>, name: &str) -> Result<bool> {
    if let Some(n) = netns
        && !crate::netns::exists(n)
    {
        return Ok(false);
    }
    let (ns, name) = (netns.clone(), name.to_string());
    tokio::task::spawn_blocking(move || {
        crate::netns::run_in(ns.as_deref(), move || {
            nix::net::if_::if_nametoindex(name.as_str()).is_ok()
        })
    })
    .await
    .map_err(|e| Error::io("link lookup task", std::io::Error::other(e)))?
}

async fn nft_table_exists(netns: &Option<String>, family: &str, table: &str) -> Result<bool> {
    if let Some(n) = netns
        && !crate::netns::exists(n)
    {
        return Ok(false);
    }
    let argv = vec![
        "nft".to_string(),
        "list".into(),
        "table".into(),
        family.into(),
        table.into(),
    ];
    Ok(run_in_netns(netns, argv, None).await?.ok)
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
            let argv = vec!["nft".to_string(), "-f".into(), "-".into()];
            run_ok_in_netns(netns, argv, Some(script.clone())).await?;
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
                let argv = vec![
                    "nft".to_string(),
                    "delete".into(),
                    "table".into(),
                    family.clone(),
                    table.clone(),
                ];
                run_ok_in_netns(netns, argv, None).await?;
            }
        }
    }
    Ok(())
}

/// How [`apply_all`] runs a stretch of actions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Run<'a> {
    /// One action on its own ([`apply_one`]).
    One(&'a Action),
    /// Consecutive `ip` steps ([`Action::Ip`], [`Action::AddLink`]) in one namespace: one
    /// `ip [-n NS] -batch -` (each `AddLink` dropped first when its link exists).
    IpBatch {
        netns: Option<String>,
        actions: Vec<&'a Action>,
    },
}

/// An `ip` step's namespace and arguments, when it can go into a batch: its arguments are
/// plain words (a batch line is split on blanks; quotes and comments would change it).
fn batchable(a: &Action) -> Option<(&Option<String>, &[String])> {
    let (netns, args) = match a {
        Action::Ip { netns, args } | Action::AddLink { netns, args, .. } => (netns, args),
        _ => return None,
    };
    let plain = |w: &String| {
        !w.is_empty()
            && !w
                .chars()
                .any(|c| c.is_whitespace() || matches!(c, '"' | '\'' | '\\' | '#'))
    };
    args.iter().all(plain).then_some((netns, args.as_slice()))
}

/// Groups `actions`, in order, into [`Run`]s (pure): each maximal stretch of batchable `ip`
/// steps in one namespace becomes one batch.
pub fn runs(actions: &[Action]) -> Vec<Run<'_>> {
    let mut out: Vec<Run<'_>> = Vec::new();
    for a in actions {
        let Some((netns, _)) = batchable(a) else {
            out.push(Run::One(a));
            continue;
        };
        match out.last_mut() {
            Some(Run::IpBatch { netns: n, actions }) if n == netns => actions.push(a),
            _ => out.push(Run::IpBatch {
                netns: netns.clone(),
                actions: vec![a],
            }),
        }
    }
    out
}

/// Runs one batch: drops the `AddLink`s whose link exists, then one `ip -batch -` (or a
/// single `ip` for one line). `ip` stops at the first failing line, as [`apply_all`] does.
async fn run_ip_batch(netns: &Option<String>, actions: &[&Action]) -> Result<()> {
    let mut lines: Vec<&[String]> = Vec::new();
    for a in actions {
        match a {
            Action::AddLink { name, .. } if link_exists(netns, name).await? => {}
            _ => lines.extend(batchable(a).map(|(_, args)| args)),
        }
    }
    match lines.as_slice() {
        [] => Ok(()),
        [one] => run_ok(ip_argv(netns, one), None).await.map(drop),
        many => {
            let script: String = many.iter().map(|l| l.join(" ") + "\n").collect();
            let argv = ip_argv(netns, &["-batch".into(), "-".into()]);
            let out = run(&argv, Some(&script)).await?;
            if out.ok {
                Ok(())
            } else {
                Err(Error::Command {
                    command: format!("{} <<< {:?}", argv.join(" "), script),
                    status: out.status,
                    stderr: out.stderr,
                })
            }
        }
    }
}

/// Runs actions in order, stopping at the first failure ([`runs`]: `ip` steps in batches).
pub async fn apply_all(actions: &[Action]) -> Result<()> {
    for r in runs(actions) {
        match r {
            Run::One(a) => apply_one(a).await?,
            Run::IpBatch { netns, actions } => run_ip_batch(&netns, &actions).await?,
        }
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
    use super::*;

    fn ip(netns: Option<&str>, args: &str) -> Action {
        Action::Ip {
            netns: netns.map(String::from),
            args: args.split(' ').map(String::from).collect(),
        }
    }

    #[test]
    fn consecutive_ip_steps_in_one_namespace_share_a_batch() {
        let add = Action::AddLink {
            netns: Some("ns".into()),
            name: "br".into(),
            args: vec!["link".into(), "add".into(), "br".into()],
        };
        let nft = Action::Nft {
            netns: Some("ns".into()),
            script: "table ip t\n".into(),
        };
        let actions = vec![
            Action::AddNetns("ns".into()),
            ip(None, "link set v master b"),
            ip(None, "link set v up"),
            ip(Some("ns"), "link set lo up"),
            add.clone(),
            nft.clone(),
            ip(Some("ns"), "link set br up"),
        ];
        let r = runs(&actions);
        assert_eq!(r.len(), 5);
        assert_eq!(r[0], Run::One(&actions[0]));
        assert_eq!(
            r[1],
            Run::IpBatch {
                netns: None,
                actions: vec![&actions[1], &actions[2]]
            }
        );
        assert_eq!(
            r[2],
            Run::IpBatch {
                netns: Some("ns".into()),
                actions: vec![&actions[3], &add]
            }
        );
        assert_eq!(r[3], Run::One(&nft));
        assert!(matches!(&r[4], Run::IpBatch { actions, .. } if actions.len() == 1));
    }

    #[test]
    fn words_a_batch_line_would_split_or_quote_run_alone() {
        let odd = ip(Some("ns"), "link set x alias");
        let Action::Ip { netns, mut args } = odd else {
            unreachable!()
        };
        args.push("two words".into());
        let odd = Action::Ip { netns, args };
        let actions = vec![ip(Some("ns"), "link set lo up"), odd.clone()];
        let r = runs(&actions);
        assert_eq!(r.len(), 2);
        assert_eq!(r[1], Run::One(&odd));
        for w in ["a\"b", "it's", "#c", "", "tab\t"] {
            let a = Action::Ip {
                netns: None,
                args: vec![w.into()],
            };
            assert!(batchable(&a).is_none(), "{w:?}");
        }
    }

    #[test]
    fn link_names_from_ip_o() {
        let t = "3: br-test: <BROADCAST,MULTICAST,UP> mtu 1500 qdisc noqueue\n\
                 7: fv0123456789@if2: <BROADCAST> mtu 1500\n";
        assert_eq!(super::parse_link_names(t), vec!["br-test", "fv0123456789"]);
    }
}
