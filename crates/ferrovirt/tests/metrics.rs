//! VMI metrics scraped by a real Prometheus (issue #20): one cluster on the pod network
//! (its own node namespace) with a running VM that boots the test guest from its disk and
//! takes a DHCP lease on its masquerade interface `default`. Debian's `prometheus`, started
//! on loopback in the test's directory, scrapes every second the embedded agent's `/metrics`
//! over HTTPS (the agent's self-signed endpoint certificate as its CA) and the API server's
//! `/metrics` (its CA), both with the token of a ServiceAccount bound to
//! `ferrovirt:metrics-reader` (the agent reviews it with the API server). Before that, the
//! attacks: another ServiceAccount's token gets 403 from both, a forged one 401 from the
//! agent, and the reader's token opens no other agent route. Its query
//! API must return `kubevirt_vmi_info` for the VM (`os` and `workload` from the template's
//! annotations), a non-zero `rate()` of `kubevirt_vmi_cpu_usage_seconds_total`, storage read
//! bytes above zero (the guest booted from that disk) of its drive `root`, the resident
//! memory, the guest memory size, the guest's own memory view from its balloon driver (usable
//! and total memory, minor page faults), one vCPU's time, traffic both ways on interface `default`
//! (the guest's DHCP) and the API server's `apiserver_request_total`, and from the API
//! server the VMI in `kubevirt_vmi_phase_count`, the VM in `kubevirt_number_of_vms`, timed
//! LISTs in `apiserver_request_duration_seconds`, the `local` class's StorageProfile in
//! `kubevirt_cdi_storageprofile_info`, and the controllers' `kubevirt_workqueue_*` series
//! (the VM controller's reconciles timed and counted, the scheduler's queue empty).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use ferrovirt_testkit::netns::{Netns, token};
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest, free_port, http_get};

const BOOT: Duration = Duration::from_secs(120);
const SCRAPED: Duration = Duration::from_secs(60);

const VM: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: metered, namespace: default}
spec:
  runStrategy: Always
  template:
    metadata:
      annotations: {vm.kubevirt.io/os: fedora, vm.kubevirt.io/workload: server}
    spec:
      terminationGracePeriodSeconds: 5
      domain:
        memory: {guest: 128Mi}
        devices:
          disks:
          - {name: root, disk: {bus: virtio}}
          interfaces:
          - {name: default, masquerade: {}}
      networks:
      - {name: default, pod: {}}
      volumes:
      - {name: root, persistentVolumeClaim: {claimName: metered-root}}
"#;

/// A Prometheus server, killed when dropped.
struct Prometheus {
    child: Child,
    port: u16,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts `prometheus` in `dir` scraping the agent at `target` (`host:port`, its
    /// certificate `ca`) and the API server at `server` (its CA `server_ca`) over HTTPS, both
    /// with the bearer token in `token`.
    fn start(
        dir: &Path,
        target: &str,
        ca: &Path,
        server: &str,
        server_ca: &Path,
        token: &Path,
    ) -> anyhow::Result<Prometheus> {
        let port = free_port()?;
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                r#"global: {{scrape_interval: 1s, scrape_timeout: 1s}}
scrape_configs:
- job_name: ferrovirt-agents
  scheme: https
  authorization: {{credentials_file: "{}"}}
  tls_config: {{ca_file: "{}"}}
  static_configs: [{{targets: ["{target}"]}}]
- job_name: ferrovirt-server
  scheme: https
  authorization: {{credentials_file: "{}"}}
  tls_config: {{ca_file: "{}"}}
  static_configs: [{{targets: ["{server}"]}}]
"#,
                token.display(),
                ca.display(),
                token.display(),
                server_ca.display()
            ),
        )?;
        let log = std::fs::File::create(dir.join("prometheus.log"))?;
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting prometheus (Debian package `prometheus`)")?;
        let p = Prometheus { child, port };
        http_get(port, "/-/ready", Duration::from_secs(30)).context("prometheus ready")?;
        Ok(p)
    }

    /// The samples of an instant query: (labels, value).
    fn query(&self, q: &str) -> anyhow::Result<Vec<(serde_json::Value, f64)>> {
        let body = http_get(
            self.port,
            &format!("/api/v1/query?query={}", encode(q)),
            Duration::from_secs(10),
        )?;
        let v: serde_json::Value = serde_json::from_str(&body)?;
        anyhow::ensure!(v["status"] == "success", "query {q}: {body}");
        Ok(v["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .map(|s| {
                let value = s["value"][1].as_str().and_then(|x| x.parse().ok());
                (s["metric"].clone(), value.unwrap_or(f64::NAN))
            })
            .collect())
    }
}

/// A token of ServiceAccount `name` (made here, in `default`), written to a file in the
/// test's directory; `reader`: bound to `ferrovirt:metrics-reader`.
fn scrape_token(c: &Cluster, name: &str, reader: bool) -> anyhow::Result<std::path::PathBuf> {
    c.kubectl_ok(&["-n", "default", "create", "serviceaccount", name])?;
    if reader {
        c.kubectl_ok(&[
            "create",
            "clusterrolebinding",
            name,
            "--clusterrole=ferrovirt:metrics-reader",
            &format!("--serviceaccount=default:{name}"),
        ])?;
    }
    let token = c.kubectl_ok(&["-n", "default", "create", "token", name])?;
    let path = c.dir().join(format!("{name}.token"));
    std::fs::write(&path, token.trim())?;
    Ok(path)
}

/// The HTTP status of `GET https://{target}{path}` (CA `ca`) with `token`, by curl.
fn status_of(target: &str, path: &str, ca: &Path, token: &str) -> anyhow::Result<String> {
    let out = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "10",
        ])
        .arg("--cacert")
        .arg(ca)
        .arg("-H")
        .arg(format!("Authorization: Bearer {token}"))
        .arg(format!("https://{target}{path}"))
        .output()
        .context("curl")?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The attacks on the scrape endpoints: a ServiceAccount without the metrics reader role is
/// refused (403) by the agent and the API server, a forged token is unauthenticated (401), and
/// even the reader's token opens none of the agent's other routes (only the API server's
/// token does).
fn refuses_other_scrapers(c: &Cluster, target: &str, ca: &Path) -> anyhow::Result<()> {
    let nobody = std::fs::read_to_string(scrape_token(c, "nobody", false)?)?;
    let reader = std::fs::read_to_string(c.dir().join("prom.token"))?;
    let server = format!("127.0.0.1:{}", c.port);
    let server_ca = c.data_dir.join("tls").join("ca.crt");
    assert_eq!(status_of(target, "/metrics", ca, &nobody)?, "403");
    assert_eq!(status_of(&server, "/metrics", &server_ca, &nobody)?, "403");
    assert_eq!(
        status_of(target, "/metrics", ca, &format!("{reader}x"))?,
        "401"
    );
    assert_eq!(status_of(target, "/healthz", ca, &reader)?, "403");
    assert_eq!(
        status_of(
            target,
            "/vmis/00000000-0000-0000-0000-000000000000/guestinfo",
            ca,
            &reader
        )?,
        "401"
    );
    assert_eq!(status_of(target, "/metrics", ca, &reader)?, "200");
    assert_eq!(status_of(&server, "/metrics", &server_ca, &reader)?, "200");
    Ok(())
}

/// Percent-encodes a query parameter value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[test]
fn prometheus_scrapes_vmi_metrics_from_the_agent() -> anyhow::Result<()> {
    TestGuest::get()?;
    let node_ns = Netns::new(&format!("fvm-{}", token()))?;
    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    opts.extra_args = vec![
        "--network-mode".into(),
        "pod".into(),
        "--pod-cidr".into(),
        "10.244.0.0/24".into(),
        "--node-netns".into(),
        node_ns.name().to_string(),
    ];
    let c = Cluster::start(&opts)?;
    c.guest_disk_claim("metered-root")?;
    c.apply(VM)?;
    let vmi = c.wait_until("VMI metered Running", BOOT, || {
        let v = c.get_json(&["vmi", "metered"])?;
        Ok((v["status"]["phase"] == "Running").then_some(v))
    })?;
    // Whatever happens below, the VMI's namespace does not outlive the test.
    let _vmi_ns = Netns::guard(&format!(
        "fv-{}",
        vmi["metadata"]["uid"].as_str().unwrap_or("")
    ));
    let node = vmi["status"]["nodeName"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let n = c.get_json(&["node", &node])?;
    let url = n["metadata"]["annotations"]["ferrovirt.io/agent-endpoint"]
        .as_str()
        .context("the Node has no agent endpoint")?;
    let target = url.strip_prefix("https://").context("endpoint not https")?;
    let ca = c.agent_dir().join("endpoint-tls").join("tls.crt");
    // Prometheus scrapes with a ServiceAccount of its own bound to the metrics reader role,
    // not the admin token; the agent has the API server vouch for it.
    let token = scrape_token(&c, "prom", true)?;
    refuses_other_scrapers(&c, target, &ca)?;

    let t0 = Instant::now();
    let server = format!("127.0.0.1:{}", c.port);
    let server_ca = c.data_dir.join("tls").join("ca.crt");
    let prom = Prometheus::start(c.dir(), target, &ca, &server, &server_ca, &token)?;
    let started = t0.elapsed();
    let name = r#"name="metered",namespace="default""#;
    let first =
        |q: &str| -> anyhow::Result<Option<f64>> { Ok(prom.query(q)?.first().map(|(_, v)| *v)) };
    let result = c.wait_until("Prometheus has the VM's series", SCRAPED, || {
        let info = prom.query(&format!("kubevirt_vmi_info{{{name}}}"))?;
        let rate = first(&format!(
            "rate(kubevirt_vmi_cpu_usage_seconds_total{{{name}}}[10s])"
        ))?;
        let read = first(&format!(
            "sum(kubevirt_vmi_storage_read_traffic_bytes_total{{{name}}})"
        ))?;
        let net = |dir: &str| {
            first(&format!(
                r#"kubevirt_vmi_network_{dir}_bytes_total{{{name},interface="default"}}"#
            ))
        };
        let (rx, tx) = (net("receive")?, net("transmit")?);
        let api = first(r#"sum(apiserver_request_total{job="ferrovirt-server"})"#)?;
        Ok(match (info.first(), rate, read, rx, tx, api) {
            (Some(i), Some(r), Some(b), Some(rx), Some(tx), Some(api))
                if r > 0.0 && b > 0.0 && rx > 0.0 && tx > 0.0 && api > 0.0 =>
            {
                Some((i.0.clone(), r, b))
            }
            _ => None,
        })
    });
    let (info, rate, read) = match result {
        Ok(x) => x,
        Err(e) => {
            let targets =
                http_get(prom.port, "/api/v1/targets", Duration::from_secs(5)).unwrap_or_default();
            anyhow::bail!("{e:#}\ntargets: {targets}");
        }
    };
    eprintln!(
        "prometheus ready after {:.1} s; series complete {:.1} s after start; cpu rate {rate:.3}, read bytes {read}",
        started.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(info["phase"], "running", "{info}");
    assert_eq!(info["os"], "fedora", "{info}");
    assert_eq!(info["workload"], "server", "{info}");
    assert_eq!(info["flavor"], "<none>", "{info}");
    assert_eq!(info["node"], node.as_str(), "{info}");
    assert_eq!(info["job"], "ferrovirt-agents", "{info}");
    let drives = prom.query(&format!(
        "kubevirt_vmi_storage_read_traffic_bytes_total{{{name}}}"
    ))?;
    assert!(
        drives.iter().any(|(l, _)| l["drive"] == "root"),
        "{drives:?}"
    );
    let rss = first(&format!("kubevirt_vmi_memory_resident_bytes{{{name}}}"))?;
    assert!(rss.is_some_and(|b| b > 16.0 * 1024.0 * 1024.0), "{rss:?}");
    let domain = first(&format!("kubevirt_vmi_memory_domain_bytes{{{name}}}"))?;
    assert_eq!(domain, Some(128.0 * 1024.0 * 1024.0));
    // The guest's own view of its memory, from its virtio balloon driver (QEMU polls it every
    // 5 s from the first scrape on).
    let (usable, total) = c.wait_until("the guest memory series", SCRAPED, || {
        let usable = first(&format!("kubevirt_vmi_memory_usable_bytes{{{name}}}"))?;
        let total = first(&format!("kubevirt_vmi_memory_available_bytes{{{name}}}"))?;
        Ok(usable.zip(total))
    })?;
    assert!(
        usable > 0.0 && usable <= total && total <= 128.0 * 1024.0 * 1024.0,
        "usable {usable}, total {total}"
    );
    let faults = first(&format!("kubevirt_vmi_memory_pgminfault_total{{{name}}}"))?;
    assert!(faults.is_some_and(|f| f > 0.0), "{faults:?}");
    let vcpus = prom.query(&format!("kubevirt_vmi_vcpu_seconds_total{{{name}}}"))?;
    // QEMU names its vCPU threads (`CPU 0/TCG`): one vCPU, one series.
    assert_eq!(vcpus.len(), 1, "{vcpus:?}");
    assert_eq!(vcpus[0].0["id"], "0", "{vcpus:?}");
    assert!(vcpus[0].1 > 0.0, "{vcpus:?}");
    // The API server's cluster series (computed from the store at each scrape).
    let phases = prom.query(r#"kubevirt_vmi_phase_count{job="ferrovirt-server"}"#)?;
    assert!(
        phases
            .iter()
            .any(|(l, v)| l["phase"] == "running" && l["node"] == node.as_str() && *v == 1.0),
        "{phases:?}"
    );
    let vms = first(r#"kubevirt_number_of_vms{job="ferrovirt-server",namespace="default"}"#)?;
    assert_eq!(vms, Some(1.0));
    let lists = first(
        r#"sum(apiserver_request_duration_seconds_count{job="ferrovirt-server",verb="LIST"})"#,
    )?;
    assert!(lists.is_some_and(|n| n > 0.0), "{lists:?}");
    // The controllers' workqueue series (they run in the server's process).
    let reconciles = first(
        r#"kubevirt_workqueue_work_duration_seconds_count{job="ferrovirt-server",name="VM"}"#,
    )?;
    assert!(reconciles.is_some_and(|n| n > 0.0), "{reconciles:?}");
    let adds = first(r#"kubevirt_workqueue_adds_total{job="ferrovirt-server",name="VM"}"#)?;
    assert!(adds.is_some_and(|n| n > 0.0), "{adds:?}");
    let depth = first(r#"kubevirt_workqueue_depth{job="ferrovirt-server",name="scheduler"}"#)?;
    assert_eq!(depth, Some(0.0));
    let profiles = prom.query(r#"kubevirt_cdi_storageprofile_info{job="ferrovirt-server"}"#)?;
    assert!(
        profiles.iter().any(|(l, _)| l["storageclass"] == "local"),
        "{profiles:?}"
    );
    Ok(())
}
