//! Highly available servers, all real: a three-member etcd 3.4 cluster with TLS on client and
//! peer URLs and client certificates required, three `ferrovirt server`s on it (the second and
//! third joined with the first's token, loading the cluster's identity from the sealed
//! bootstrap data), and one `ferrovirt agent` joined with all three server URLs behind its
//! loopback balancer. A server with a wrong token refuses to start. A VM runs; the controllers'
//! leader is killed with SIGKILL: another server holds the Lease within 15 s, the running VM
//! keeps its launcher and QEMU and its guest keeps ticking, and a VM created through another
//! server starts and boots; the CLI given the dead server first in `FERROVIRT_SERVERS` uses a
//! live one. Then one etcd member is killed while ConfigMaps are written
//! through the servers: the API keeps answering and every acknowledged write is there.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ferrovirt_testkit::cluster::pids_matching;
use ferrovirt_testkit::{Cluster, ClusterOptions, EtcdCluster, SerialConsole, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);
const NODE: &str = "ha-node";

fn vm(name: &str, claim: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 10
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
      volumes:
      - name: root
        persistentVolumeClaim: {{claimName: {claim}}}
"#
    )
}

/// Waits until VMI `name` runs on the joined agent and its guest printed `marker` on its
/// serial console (`FERROVIRT-READY`: its shell takes commands); its uid.
fn wait_booted(c: &Cluster, agent_dir: &Path, name: &str, marker: &str) -> anyhow::Result<String> {
    let uid = c.wait_until(&format!("VMI {name} Running"), BOOT, || {
        let out = c.kubectl(&["get", "vmi", name, "-o", "json"])?;
        if !out.status.success() {
            return Ok(None);
        }
        let v: Value = serde_json::from_slice(&out.stdout)?;
        anyhow::ensure!(
            v["status"]["phase"] != "Failed",
            "VMI failed: {}",
            v["status"]
        );
        Ok((v["status"]["phase"] == "Running").then(|| {
            v["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        }))
    })?;
    let log = agent_dir.join("vmis").join(&uid).join("serial.log");
    c.wait_until(&format!("{marker} in {name}'s serial.log"), BOOT, || {
        let text = std::fs::read(&log).unwrap_or_default();
        Ok(String::from_utf8_lossy(&text)
            .contains(marker)
            .then_some(()))
    })?;
    Ok(uid)
}

/// The guest's uptime (seconds), read on its serial console (one connection for every read:
/// the console serves one client at a time).
fn guest_uptime(console: &SerialConsole) -> anyhow::Result<f64> {
    let (out, rc) = console.exec("cat /proc/uptime", Duration::from_secs(20))?;
    anyhow::ensure!(rc == 0, "cat /proc/uptime: {out}");
    out.lines()
        .filter_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .next_back()
        .ok_or_else(|| anyhow::anyhow!("no uptime in {out:?}"))
}

fn lease_holder(c: &Cluster) -> anyhow::Result<Option<String>> {
    let out = c.kubectl(&[
        "get",
        "lease",
        "-n",
        "kube-system",
        "ferrovirt-controllers",
        "-o",
        "json",
    ])?;
    if !out.status.success() {
        return Ok(None);
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(v["spec"]["holderIdentity"].as_str().map(String::from))
}

/// `ferrovirt server` joining with `token` (a file's contents) as `name`: it must refuse
/// (exit within 60 s, not serve); its output.
fn refused_join(
    etcd_args: &[String],
    dir: &Path,
    name: &str,
    token: &str,
) -> anyhow::Result<String> {
    let data = dir.join(name);
    let token_file = dir.join(format!("{name}.token"));
    let log = dir.join(format!("{name}.log"));
    std::fs::write(&token_file, token)?;
    let f = std::fs::File::create(&log)?;
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrovirt"))
        .arg("server")
        .arg("--data-dir")
        .arg(&data)
        .args(["--listen", "127.0.0.1:0", "--disable-agent"])
        .arg("--token-file")
        .arg(&token_file)
        .args(etcd_args)
        .stdin(std::process::Stdio::null())
        .stdout(f.try_clone()?)
        .stderr(f)
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!(
                "a server with a wrong token kept running:\n{}",
                std::fs::read_to_string(&log)?
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = std::fs::read_to_string(&log)?;
    anyhow::ensure!(!status.success(), "a wrong token was accepted:\n{text}");
    anyhow::ensure!(
        !data.join("tls/ca.key").exists(),
        "the refused server wrote the cluster's CA key"
    );
    Ok(text)
}

#[test]
fn three_servers_survive_the_leader_and_an_etcd_member_dying() -> anyhow::Result<()> {
    TestGuest::get()?;
    let started = Instant::now();
    let mut etcd = EtcdCluster::start_tls(3)?;
    let mut etcd_args = vec!["--datastore-endpoint".to_string(), etcd.endpoints()];
    etcd_args.extend(etcd.tls.server_args());
    let opts = |seed: Option<PathBuf>| {
        let mut o = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
        o.node_name = None;
        o.extra_args = etcd_args.clone();
        o.seed_from = seed;
        o
    };
    let mut servers = vec![Cluster::start(&opts(None))?];
    let first = servers[0].data_dir.clone();
    servers.push(Cluster::start(&opts(Some(first.clone())))?);
    servers.push(Cluster::start(&opts(Some(first.clone())))?);
    eprintln!(
        "etcd (TLS, 3 members) and 3 servers up in {:?}",
        started.elapsed()
    );

    // One identity: the same CA, client CA, admin token and join token; each server its own
    // serving certificate.
    let read = |c: &Cluster, f: &str| std::fs::read_to_string(c.data_dir.join(f));
    for s in &servers[1..] {
        for f in [
            "tls/ca.crt",
            "tls/client-ca.crt",
            "token",
            "node-token",
            "encryption-keys",
        ] {
            assert_eq!(read(s, f)?, read(&servers[0], f)?, "{f} differs");
        }
        assert_ne!(
            read(s, "tls/serving.crt")?,
            read(&servers[0], "tls/serving.crt")?
        );
    }

    // The attack: joining with a token of the right CA but a guessed secret, or with the
    // right secret and another CA hash, is refused before the server serves anything.
    let token = servers[0].join_token()?;
    let (head, secret) = token.split_once("::").expect("K10<hash>::<secret>");
    let wrong_secret = format!("{head}::{}", "0".repeat(secret.len()));
    let text = refused_join(&etcd_args, servers[0].dir(), "wrong-secret", &wrong_secret)?;
    assert!(text.contains("wrong token"), "{text}");
    let mut other_hash = head.to_string();
    let last = other_hash.pop().expect("hash");
    other_hash.push(if last == '0' { '1' } else { '0' });
    let text = refused_join(
        &etcd_args,
        servers[0].dir(),
        "wrong-ca",
        &format!("{other_hash}::{secret}"),
    )?;
    assert!(text.contains("CA hash does not match"), "{text}");

    // One agent joined with all three servers.
    let urls = servers
        .iter()
        .map(|c| format!("https://127.0.0.1:{}", c.port))
        .collect::<Vec<_>>()
        .join(",");
    let token_file = servers[0].dir().join("agent-token");
    std::fs::write(&token_file, &token)?;
    servers[0].start_joined_agent_servers(NODE, &token_file, &urls)?;
    let agent_dir = servers[0].extra_agent_dir(NODE);
    let agent_log = servers[0].dir().join(format!("agent-{NODE}.log"));
    servers[1].wait_until("the joined node Ready", Duration::from_secs(60), || {
        let v = servers[1].get_json(&["node", NODE])?;
        Ok(v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
            .then_some(()))
    })?;

    // A VM runs (created through the first server); both disks are made now.
    servers[0].guest_disk_claim("root-a")?;
    servers[0].guest_disk_claim("root-b")?;
    servers[0].apply(&vm("vm-a", "root-a"))?;
    let uid_a = wait_booted(&servers[0], &agent_dir, "vm-a", "FERROVIRT-READY")?;
    let vm_pids = || -> BTreeSet<u32> {
        pids_matching(&agent_dir.join("vmis").join(&uid_a).display().to_string())
            .into_iter()
            .collect()
    };
    let pids_before = vm_pids();
    assert!(pids_before.len() >= 2, "launcher and QEMU: {pids_before:?}");
    let console = SerialConsole::connect(
        &agent_dir.join("vmis").join(&uid_a).join("serial.sock"),
        Duration::from_secs(10),
    )?;
    let uptime_before = guest_uptime(&console)?;

    // Kill the controllers' leader.
    let holder = servers[1].wait_until("a lease holder", Duration::from_secs(30), || {
        lease_holder(&servers[1])
    })?;
    let leader = servers
        .iter()
        .position(|c| holder.ends_with(&format!("-{}", c.server_pid())))
        .ok_or_else(|| anyhow::anyhow!("lease holder {holder} is none of the servers"))?;
    let mut dead = servers.remove(leader);
    dead.kill_server()?;
    let killed_at = Instant::now();
    let alive = &servers[0];
    let new_holder = alive.wait_until("a new lease holder", Duration::from_secs(30), || {
        Ok(lease_holder(alive)?.filter(|h| *h != holder))
    })?;
    let takeover = killed_at.elapsed();
    eprintln!("leader server {leader} killed: {new_holder} holds the Lease after {takeover:?}");
    assert!(
        takeover < Duration::from_secs(15),
        "take-over took {takeover:?}"
    );

    // The CLI with the dead server's kubeconfig and FERROVIRT_SERVERS naming it first: it
    // picks a live server (same CA and credentials).
    let dead_url = format!("https://127.0.0.1:{}", dead.port);
    let list = std::iter::once(dead_url)
        .chain(
            servers
                .iter()
                .map(|c| format!("https://127.0.0.1:{}", c.port)),
        )
        .collect::<Vec<_>>()
        .join(",");
    let out = Command::new(env!("CARGO_BIN_EXE_ferrovirt"))
        .arg("--kubeconfig")
        .arg(&dead.kubeconfig)
        .args(["get", "vmi", "vm-a", "-o", "name"])
        .env("FERROVIRT_SERVERS", &list)
        .output()?;
    anyhow::ensure!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("vm-a"),
        "CLI through FERROVIRT_SERVERS: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let alone = Command::new(env!("CARGO_BIN_EXE_ferrovirt"))
        .arg("--kubeconfig")
        .arg(&dead.kubeconfig)
        .args(["get", "vmi", "vm-a", "-o", "name"])
        .env_remove("FERROVIRT_SERVERS")
        .output()?;
    assert!(!alone.status.success(), "the dead server answered");

    // The running VM is untouched: the same launcher and QEMU, the guest still ticking.
    assert_eq!(vm_pids(), pids_before, "the VM's processes changed");
    let uptime_after = guest_uptime(&console)?;
    assert!(
        uptime_after > uptime_before,
        "guest uptime {uptime_before} → {uptime_after}"
    );
    // A VM created through a surviving server starts on the agent (which lost its server if
    // it used the dead one) and boots.
    servers[1].apply(&vm("vm-b", "root-b"))?;
    let t = Instant::now();
    wait_booted(&servers[0], &agent_dir, "vm-b", "FERROVIRT-BOOT")?;
    eprintln!("vm-b booted {:?} after its create", t.elapsed());
    if leader == 0 {
        // The agent used the first server: it went through its balancer to another one.
        let log = std::fs::read_to_string(&agent_log)?;
        assert!(
            log.contains("API server failover"),
            "no failover in the agent log"
        );
        eprintln!("the agent failed over from the dead server");
    }

    // Writes through both surviving servers while one etcd member dies and after.
    const N: usize = 40;
    let mut acked = Vec::new();
    let mut failed = 0;
    for i in 0..N {
        if i == N / 3 {
            etcd.kill_member(0);
            eprintln!("etcd member m0 killed after {i} writes");
        }
        let via = &servers[i % 2];
        let name = format!("ha-{i}");
        let out = via.kubectl(&[
            "create",
            "configmap",
            &name,
            "--from-literal",
            &format!("i={i}"),
        ])?;
        if out.status.success() {
            acked.push(name);
        } else {
            failed += 1;
            eprintln!(
                "write {i} through server {} not acknowledged: {}",
                i % 2,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    for via in &servers {
        let v = via.get_json(&["configmaps"])?;
        let present: BTreeSet<String> = v["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["metadata"]["name"].as_str().map(String::from))
            .collect();
        let lost: Vec<&String> = acked.iter().filter(|n| !present.contains(*n)).collect();
        assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
    }
    eprintln!(
        "{} of {N} writes acknowledged ({failed} refused), all {} present on both servers",
        acked.len(),
        acked.len()
    );
    // The API keeps working: most writes (and every one after a short settling) went through.
    assert!(
        acked.len() >= N - 3,
        "only {} of {N} acknowledged",
        acked.len()
    );
    eprintln!("wall time {:?}", started.elapsed());
    drop(dead);
    Ok(())
}

/// The store alone on the TLS etcd cluster: a client without a certificate is refused by the
/// members, https without a CA is refused by the store; with one member killed in the middle of
/// a run of creates, every create the store acknowledged is delivered, in order and without a
/// gap, to each of several watches (some of which the dead member served: they resume on
/// another member).
#[test]
fn store_watches_resume_and_writes_go_on_when_an_etcd_member_dies() -> anyhow::Result<()> {
    use ferrovirt_store::DatastoreTls;
    use futures::StreamExt;
    let mut etcd = EtcdCluster::start_tls(3)?;
    let dir = tempfile::tempdir()?;
    let endpoints = etcd.endpoints();
    let full = DatastoreTls {
        ca_file: Some(etcd.tls.ca.clone()),
        cert_file: Some(etcd.tls.client_cert.clone()),
        key_file: Some(etcd.tls.client_key.clone()),
    };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let open = |tls: DatastoreTls| {
            let (e, d) = (endpoints.clone(), dir.path().to_path_buf());
            async move { ferrovirt_store::open_endpoint_tls(&e, &tls, &d).await }
        };
        let e = match open(DatastoreTls::default()).await {
            Ok(_) => anyhow::bail!("https without a CA was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("--datastore-cafile"), "{e}");
        let ca_only = DatastoreTls {
            ca_file: full.ca_file.clone(),
            ..Default::default()
        };
        assert!(
            open(ca_only).await.is_err(),
            "the members require a client certificate"
        );
        let store = open(full.clone()).await?;
        let start = store.current_revision().await?;
        let mut watches = Vec::new();
        for _ in 0..8 {
            watches.push(store.watch("/ha/", start).await?);
        }
        const N: usize = 30;
        let mut acked = Vec::new();
        for i in 0..N {
            if i == N / 3 {
                etcd.kill_member(0);
            }
            match store.create(&format!("/ha/k{i:02}"), vec![b'x']).await {
                Ok(kv) => acked.push((kv.key, kv.mod_revision)),
                Err(e) => eprintln!("create {i} not acknowledged: {e}"),
            }
        }
        eprintln!(
            "store: {} of {N} creates acknowledged with a member killed",
            acked.len()
        );
        assert!(acked.len() >= N - 2, "only {} acknowledged", acked.len());
        for (w, stream) in watches.iter_mut().enumerate() {
            let mut seen = Vec::new();
            while !seen.iter().any(|s| Some(s) == acked.last()) {
                let ev = tokio::time::timeout(Duration::from_secs(20), stream.next())
                    .await
                    .map_err(|_| anyhow::anyhow!("watch {w}: stalled after {seen:?}"))?
                    .ok_or_else(|| anyhow::anyhow!("watch {w} ended after {seen:?}"))??;
                seen.push((ev.kv.key, ev.revision));
            }
            // Every acknowledged create, in order; an unacknowledged one that was applied
            // after all would show up between them (none did here if the counts match).
            let acked_seen: Vec<_> = seen.iter().filter(|s| acked.contains(s)).cloned().collect();
            assert_eq!(acked_seen, acked, "watch {w}");
            assert!(
                seen.windows(2).all(|p| p[0].1 < p[1].1),
                "watch {w}: {seen:?}"
            );
        }
        anyhow::Ok(())
    })?;
    Ok(())
}
