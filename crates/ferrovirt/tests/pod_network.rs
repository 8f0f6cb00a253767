//! Pod networking through the whole system (server, scheduler, agent, launcher, QEMU): with
//! `--pod-network` the agent gives a VMI its own namespace on the node bridge; the guest leases
//! 10.0.2.2/24 via 10.0.2.1 from the agent's DHCP server (masquerade binding), the VMI reports
//! its pod address, the node reaches the guest's HTTP server through that address, and deleting
//! the VMI removes its namespace. The VMI has two vCPUs and `networkInterfaceMultiqueue: true`:
//! its virtio NIC (a multi-queue tap) shows two queue pairs in the guest. The "node" is a network namespace this test creates, so
//! nothing touches the host's own interfaces.

use std::time::Duration;

use ferrovirt_testkit::netns::{Netns, netns_list, token};
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};

const BOOT: Duration = Duration::from_secs(180);

#[test]
fn masquerade_vmi_gets_a_pod_address_reachable_from_its_node() -> anyhow::Result<()> {
    TestGuest::get()?;
    let node = Netns::new(&format!("fvn-{}", token()))?;
    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    // `auto` (the binary's default, spelled out because the test harness defaults to `user`)
    // picks the pod network: this test runs as root with ip and nft.
    opts.extra_args = vec![
        "--network-mode".into(),
        "auto".into(),
        "--pod-cidr".into(),
        "10.244.0.0/24".into(),
        "--node-netns".into(),
        node.name().to_string(),
    ];
    let c = Cluster::start(&opts)?;
    let n = c.wait_until(
        "the Node's network-mode label",
        Duration::from_secs(60),
        || {
            let n = c.get_json(&["node", "node1"])?;
            Ok(n["metadata"]["labels"]["ferrovirt.io/network-mode"]
                .as_str()
                .map(String::from))
        },
    )?;
    assert_eq!(n, "pod", "auto picks the pod network as root");
    assert!(
        c.server_log()
            .contains("--network-mode auto: root, ip, nft"),
        "the server logs the mode"
    );
    c.guest_disk_claim("net-root")?;
    c.apply(
        r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: web, namespace: default}
spec:
  domain:
    cpu: {cores: 2}
    memory: {guest: 128Mi}
    devices:
      networkInterfaceMultiqueue: true
      disks:
      - {name: root, disk: {bus: virtio}}
      interfaces:
      - name: default
        masquerade: {}
        ports: [{port: 80}]
  networks:
  - {name: default, pod: {}}
  volumes:
  - {name: root, persistentVolumeClaim: {claimName: net-root}}
  - {name: ci, cloudInitNoCloud: {userData: "#!/bin/sh\necho FERROVIRT-QUEUES $(ls /sys/class/net/eth0/queues)\n"}}
"##,
    )?;
    let v = c.wait_until("VMI Running with its pod address", BOOT, || {
        let v = c.get_json(&["vmi", "web"])?;
        let ok = v["status"]["phase"] == "Running"
            && v["status"]["interfaces"][0]["ipAddress"]
                .as_str()
                .is_some_and(|a| a.starts_with("10.244.0."));
        Ok(ok.then_some(v))
    })?;
    let addr = v["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let uid = v["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    // Whatever happens below, the VMI's namespace does not outlive the test.
    let _vmi_ns = Netns::guard(&format!("fv-{uid}"));
    let log = c.agent_dir().join("vmis").join(&uid).join("serial.log");
    let lease = c.wait_until("the guest's DHCP lease", BOOT, || {
        let text = String::from_utf8_lossy(&std::fs::read(&log).unwrap_or_default()).into_owned();
        Ok(complete_line(&text, "FERROVIRT-DHCP"))
    })?;
    assert!(
        lease.contains("ip=10.0.2.2/24") && lease.contains("router=10.0.2.1"),
        "{lease}"
    );
    // Two vCPUs, multi-queue: the guest's virtio NIC has two queue pairs.
    let queues = c.wait_until("the guest's NIC queues", BOOT, || {
        let text = String::from_utf8_lossy(&std::fs::read(&log).unwrap_or_default()).into_owned();
        Ok(complete_line(&text, "FERROVIRT-QUEUES"))
    })?;
    assert!(
        queues.contains("rx-0 rx-1 tx-0 tx-1"),
        "two queue pairs: {queues}"
    );
    // The node reaches the guest's port 80 through the VMI's pod address.
    let url = format!("http://{addr}/");
    let body = c.wait_until(
        "HTTP from the node to the VMI",
        Duration::from_secs(60),
        || {
            let out = node.exec(&["curl", "-s", "-m", "5", &url])?;
            let body = String::from_utf8_lossy(&out.stdout).into_owned();
            Ok(body.contains("hostname=").then_some(body))
        },
    )?;
    // The NoCloud data source names the guest after the VMI.
    assert!(body.contains("hostname=web"), "{body}");
    // Deleting the VMI tears its namespace down.
    c.kubectl_ok(&["delete", "vmi", "web", "--timeout=120s"])?;
    c.wait_until(
        "the VMI's namespace removed",
        Duration::from_secs(30),
        || Ok((!netns_list().iter().any(|n| n.contains(&uid))).then_some(())),
    )?;
    Ok(())
}

/// The first whole line (ended by a newline: the serial log may be read while the guest is
/// still writing it) that contains `marker`.
fn complete_line(text: &str, marker: &str) -> Option<String> {
    text.split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .find(|l| l.contains(marker))
        .map(|l| l.trim_end().to_string())
}
