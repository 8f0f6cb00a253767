//! Secondary networks (issue #8, acceptance d and e): a NetworkAttachmentDefinition with a
//! bridge CNI config (`br-<token>`) and a VMI whose only NIC is on it (no pod network, as after
//! a VMware migration). The test makes the bridge in its node namespace and a peer on it that
//! pings and fetches the guest's HTTP page on the address the guest's user-data script set.
//! Where the kernel has bridge VLAN filtering the NAD asks for VLAN 100, the peer is an access
//! port of VLAN 100 and a second peer on VLAN 200 must not reach the guest; where it has not
//! (CONFIG_BRIDGE_VLAN_FILTERING off, as on the development VMs) the network is untagged and
//! a VMI on a VLAN NAD must fail with a clear reason instead. The VMI reports the interface's
//! MAC and (guest agent) IP. VMIs naming a missing NAD, a NAD with a missing bridge, or
//! another VMI's MAC fail with a reason naming the network / MAC, and deleting the VMI
//! removes its veth from the bridge and its namespace.

use std::time::{Duration, Instant};

use ferrovirt_testkit::netns::{Netns, netns_list, token, veth};
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);
const GUEST_IP: &str = "192.168.100.10";
const MAC: &str = "02:fe:00:00:00:01";

fn vmi_yaml(name: &str, nad: &str, mac: Option<&str>, disks: bool) -> String {
    let mac = mac
        .map(|m| format!(", macAddress: \"{m}\""))
        .unwrap_or_default();
    let (disks, volumes) = if disks {
        (
            "      disks:\n      - {name: root, disk: {bus: virtio}}\n      - {name: ci, disk: {bus: virtio}}\n",
            format!(
                "  volumes:\n  - {{name: root, persistentVolumeClaim: {{claimName: {name}-root}}}}\n  - {{name: ci, cloudInitNoCloud: {{userData: \"#!/bin/sh\\nkillall udhcpc\\nip addr add {GUEST_IP}/24 dev eth0\\nip link set eth0 up\\n\"}}}}\n"
            ),
        )
    } else {
        ("", String::new())
    };
    format!(
        "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: default}}
spec:
  domain:
    memory: {{guest: 128Mi}}
    devices:
{disks}      interfaces:
      - {{name: sec, bridge: {{}}{mac}}}
  networks:
  - {{name: sec, multus: {{networkName: {nad}}}}}
{volumes}"
    )
}

/// A bridge NAD; `vlan` 0: untagged.
fn nad_yaml(name: &str, bridge: &str, vlan: u16) -> String {
    let vlan = if vlan == 0 {
        String::new()
    } else {
        format!(",\"vlan\":{vlan}")
    };
    format!(
        r#"apiVersion: k8s.cni.cncf.io/v1
kind: NetworkAttachmentDefinition
metadata: {{name: {name}, namespace: default}}
spec:
  config: '{{"cniVersion":"0.3.1","type":"bridge","bridge":"{bridge}"{vlan}}}'
"#
    )
}

/// Waits until `name` is Failed and returns the message of its Ready condition.
fn failure_of(c: &Cluster, name: &str) -> anyhow::Result<(Value, String)> {
    c.wait_until(
        &format!("VMI {name} Failed"),
        Duration::from_secs(60),
        || {
            let v = c.get_json(&["vmi", name])?;
            if v["status"]["phase"] != "Failed" {
                return Ok(None);
            }
            let msg = v["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "Ready")
                .and_then(|c| c["message"].as_str())
                .unwrap_or_default()
                .to_string();
            Ok(Some((v, msg)))
        },
    )
}

#[test]
fn vmi_on_a_vlan_bridge_network_only() -> anyhow::Result<()> {
    let started = Instant::now();
    TestGuest::get()?;
    let t = token();
    let node = Netns::new(&format!("fvsn-{t}"))?;
    let peer = Netns::new(&format!("fvsp-{t}"))?;
    let other = Netns::new(&format!("fvso-{t}"))?;
    let bridge = format!("br-{t}");
    node.ip(&["link", "add", &bridge, "type", "bridge"])?;
    node.ip(&["link", "set", &bridge, "up"])?;
    // Peers: VLAN 100 (the VMI's) and VLAN 200, same subnet.
    veth(
        (&peer, "eth0", Some("192.168.100.1/24")),
        (&node, "peer100", None),
    )?;
    veth(
        (&other, "eth0", Some("192.168.100.2/24")),
        (&node, "peer200", None),
    )?;
    let vlans = node
        .ip(&[
            "link",
            "set",
            &bridge,
            "type",
            "bridge",
            "vlan_filtering",
            "1",
        ])
        .is_ok();
    eprintln!("bridge VLAN filtering available: {vlans}");
    for (port, vid) in [("peer100", "100"), ("peer200", "200")] {
        node.ip(&["link", "set", port, "master", &bridge])?;
        if vlans {
            node.bridge(&["vlan", "add", "vid", vid, "pvid", "untagged", "dev", port])?;
            node.bridge(&["vlan", "del", "vid", "1", "dev", port])?;
        }
    }

    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    opts.extra_args = [
        "--pod-network",
        "--pod-cidr",
        "10.244.0.0/24",
        "--node-netns",
        node.name(),
    ]
    .map(String::from)
    .to_vec();
    let c = Cluster::start(&opts)?;
    c.apply(&nad_yaml("vlan100", &bridge, 100))?;
    c.apply(&nad_yaml("untagged", &bridge, 0))?;
    c.apply(&nad_yaml("nobridge", "br-absent", 100))?;
    let nad = if vlans { "vlan100" } else { "untagged" };
    c.guest_disk_claim("sec-root")?;
    c.apply(&vmi_yaml("sec", nad, Some(MAC), true))?;
    let v = c.wait_until("VMI sec Running", BOOT, || {
        let v = c.get_json(&["vmi", "sec"])?;
        Ok((v["status"]["phase"] == "Running").then_some(v))
    })?;
    let uid = v["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let _vmi_ns = Netns::guard(&format!("fv-{uid}"));

    // Refusals (no guest is booted for these).
    c.apply(&vmi_yaml("nonad", "absent", None, false))?;
    c.apply(&vmi_yaml("nobr", "default/nobridge", None, false))?;
    c.apply(&vmi_yaml("dupmac", nad, Some(MAC), false))?;
    if !vlans {
        c.apply(&vmi_yaml("novlan", "vlan100", None, false))?;
        let (_, msg) = failure_of(&c, "novlan")?;
        assert!(
            msg.contains(&format!(
                "network \"sec\": VLAN 100 needs VLAN filtering on bridge \"{bridge}\""
            )),
            "{msg}"
        );
        c.kubectl_ok(&["delete", "vmi", "novlan", "--timeout=60s"])?;
    }
    let (_, msg) = failure_of(&c, "nonad")?;
    assert!(
        msg.contains("spec.networks[0].multus.networkName")
            && msg
                .contains("network \"sec\": NetworkAttachmentDefinition default/absent not found"),
        "{msg}"
    );
    let (nobr, msg) = failure_of(&c, "nobr")?;
    assert!(
        msg.contains("network \"sec\": bridge \"br-absent\" does not exist on this node"),
        "{msg}"
    );
    let (_, msg) = failure_of(&c, "dupmac")?;
    assert!(
        msg.contains("interfaces[0].macAddress")
            && msg.contains(&format!(
                "MAC address {MAC} is already in use by VirtualMachineInstance default/sec"
            )),
        "{msg}"
    );
    let nobr_uid = nobr["metadata"]["uid"].as_str().unwrap_or_default();
    assert!(
        !netns_list().iter().any(|n| n.contains(nobr_uid)),
        "a failed attachment leaves no namespace"
    );
    let events = c.kubectl_ok(&[
        "get",
        "events",
        "--field-selector",
        "involvedObject.name=nonad",
    ])?;
    assert!(
        events.contains("NetworkAttachmentDefinition default/absent not found"),
        "{events}"
    );

    // The guest's NIC is a port of the bridge, on VLAN 100 only.
    let host_veth = c.wait_until(
        "the VMI's port on the bridge",
        Duration::from_secs(10),
        || {
            let ports = node.ip(&["-o", "link", "show", "master", &bridge])?;
            Ok(ferrovirt_testkit::netns::link_names(&ports)
                .into_iter()
                .find(|p| p.starts_with("fv")))
        },
    )?;
    if vlans {
        let v = node.bridge(&["vlan", "show", "dev", &host_veth])?;
        assert!(v.contains("100 PVID") && !v.contains(" 1 "), "{v}");
    }

    // d) The peer on VLAN 100 reaches the guest's user-data address; VLAN 200 does not.
    let log = c.agent_dir().join("vmis").join(&uid).join("serial.log");
    c.wait_until("the guest ready", BOOT, || {
        let text = String::from_utf8_lossy(&std::fs::read(&log).unwrap_or_default()).into_owned();
        Ok(text.contains("FERROVIRT-READY").then_some(()))
    })?;
    let body = c.wait_until(
        "HTTP from the VLAN 100 peer",
        Duration::from_secs(60),
        || {
            let out = peer.exec(&["curl", "-s", "-m", "5", &format!("http://{GUEST_IP}/")])?;
            let body = String::from_utf8_lossy(&out.stdout).into_owned();
            Ok(body.contains("hostname=").then_some(body))
        },
    )?;
    assert!(body.contains("hostname=sec"), "{body}");
    let ping = peer.exec(&[
        "busybox", "ping", "-c", "5", "-i", "0.2", "-W", "2", GUEST_IP,
    ])?;
    let ping_out = String::from_utf8_lossy(&ping.stdout).into_owned();
    assert!(ping.status.success(), "{ping_out}");
    eprintln!(
        "peer -> guest on the VLAN bridge: {}",
        ping_out.lines().last().unwrap_or_default()
    );
    if vlans {
        let other_ping = other.exec(&["busybox", "ping", "-c", "2", "-W", "1", GUEST_IP])?;
        assert!(
            !other_ping.status.success(),
            "VLAN 200 must not reach the guest"
        );
    }

    // status.interfaces: the name and MAC, and the guest agent's view of the address.
    let iface = c.wait_until(
        "the interface's IP in status",
        Duration::from_secs(60),
        || {
            let v = c.get_json(&["vmi", "sec"])?;
            let i = v["status"]["interfaces"][0].clone();
            Ok((i["ipAddress"] == GUEST_IP).then_some(i))
        },
    )?;
    assert_eq!(iface["name"], "sec");
    assert_eq!(iface["mac"], MAC);

    // e) Deleting the VMI removes its veth from the bridge and its namespace.
    c.kubectl_ok(&[
        "delete",
        "vmi",
        "sec",
        "nonad",
        "nobr",
        "dupmac",
        "--timeout=120s",
    ])?;
    c.wait_until(
        "the VMI's namespace and veth removed",
        Duration::from_secs(60),
        || {
            let gone_ns = !netns_list().iter().any(|n| n.contains(uid.as_str()));
            let links = node.links()?;
            let gone_veth = !links.iter().any(|l| l == &host_veth);
            Ok((gone_ns && gone_veth).then_some(()))
        },
    )?;
    let ports = node.ip(&["-o", "link", "show", "master", &bridge])?;
    let ports = ferrovirt_testkit::netns::link_names(&ports);
    assert_eq!(ports, vec!["peer100".to_string(), "peer200".to_string()]);
    eprintln!("whole test {:?}", started.elapsed());
    Ok(())
}
