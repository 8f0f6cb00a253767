//! ClusterUserDefinedNetwork Localnet onto an NNCP-made host bridge (issue #22). A node agent
//! `ln-a` joins with its own credential (the node authorizer: it writes its own
//! NodeNetworkState, enactment and the policy's status) and runs `--nmstate` and the pod
//! network on a node namespace; with that credential, creating another node's
//! NodeNetworkState, patching or deleting the policy and labelling its own enactment are 403. A NodeNetworkConfigurationPolicy makes `br-ext` there with the
//! veth `eth1` as port (its peer in a namespace acting as the physical network,
//! 192.168.77.1/24) and the bridge mapping `physnet → br-ext`. A Localnet CUDN on `physnet`
//! selects namespace `ln`; a VM there with the CUDN as a bridge secondary interface (static
//! 192.168.77.10 from its user-data) pings the peer (the guest writes the result on its
//! console) and the peer pings it. A second CUDN with `vlan.access.id: 100`: where the kernel
//! has bridge VLAN filtering, a second VM on it is reached from the peer's VLAN 100 interface
//! (tagged on the wire); where it has not, the VMI fails naming the VLAN and the test says it
//! skips that part. A third CUDN has `subnets` (IPAM): the controller allots the VMI an
//! address (`k8s.ovn.org/pod-networks`), the agent's DHCP server on the VMI-side bridge offers
//! it, the guest's DHCP client takes it (the guest agent reports it), the guest pings the peer
//! and the peer pings the allotted address, but not the VMI namespace's own DHCP address. A CUDN naming an unmapped physicalNetworkName fails
//! the VMI naming the field and the reason (Secondary Layer2 UDNs: udn_secondary.rs).

use std::time::{Duration, Instant};

use ferrovirt_testkit::netns::{Netns, token, veth};
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);
const BOOT: Duration = Duration::from_secs(240);
const NODE: &str = "ln-a";

fn ready_message(v: &Value) -> String {
    v["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// Waits until VMI `ln/name` is Failed and returns the message of its Ready condition.
fn failure_of(c: &Cluster, name: &str) -> anyhow::Result<String> {
    c.wait_until(&format!("VMI {name} Failed"), T, || {
        let v = c.get_json(&["-n", "ln", "vmi", name])?;
        Ok((v["status"]["phase"] == "Failed").then(|| ready_message(&v)))
    })
}

/// A CUDN over namespace `ln` on physical network `phys`; `vlan` 0: untagged.
fn cudn(name: &str, phys: &str, vlan: u16) -> String {
    let vlan = if vlan == 0 {
        String::new()
    } else {
        format!(", vlan: {{mode: Access, access: {{id: {vlan}}}}}")
    };
    format!(
        "apiVersion: k8s.ovn.org/v1\nkind: ClusterUserDefinedNetwork\nmetadata: {{name: {name}}}\nspec:\n  \
         namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: ln}}}}\n  network:\n    \
         topology: Localnet\n    localnet: {{role: Secondary, physicalNetworkName: {phys}, ipam: {{mode: Disabled}}{vlan}}}\n"
    )
}

/// A Localnet CUDN over `ln` on `physnet` with IPAM (the controller allots, DHCP offers).
const CUDN_IPAM: &str = "apiVersion: k8s.ovn.org/v1\nkind: ClusterUserDefinedNetwork\nmetadata: {name: physnet-ipam}\n\
spec:\n  namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: ln}}\n  network:\n    topology: Localnet\n    \
localnet: {role: Secondary, physicalNetworkName: physnet, subnets: [192.168.79.0/24], excludeSubnets: [192.168.79.0/28]}\n";

/// How a test guest gets its address.
#[derive(Clone, Copy)]
enum Addr<'a> {
    /// No guest booted (the VMI is to fail before QEMU starts).
    NoGuest,
    /// User-data sets this /24 address (and stops the guest's DHCP client).
    Static(&'a str),
    /// The guest's DHCP client (the agent's server offers the allotted address).
    Dhcp,
}

/// A VMI in `ln` on node ln-a whose only NIC is on network `nad`; a booted guest pings `peer`
/// until answered and says `LN-PING-OK` on its console.
fn vmi(name: &str, nad: &str, addr: Addr, peer: &str) -> String {
    let (disks, volumes) = match addr {
        Addr::NoGuest => ("", String::new()),
        Addr::Static(_) | Addr::Dhcp => {
            let set = match addr {
                Addr::Static(ip) => {
                    format!(
                        "killall udhcpc\\nip addr add {ip}/24 dev eth0\\nip link set eth0 up\\n"
                    )
                }
                _ => String::new(),
            };
            let script = format!(
                "#!/bin/sh\\n{set}(i=0; while [ $i -lt 90 ]; do if ping -c 1 -W 1 {peer} >/dev/null 2>&1; then \
                 echo LN-PING-OK {peer}; break; fi; i=$((i+1)); sleep 1; done) >/dev/console 2>&1 </dev/null &\\n"
            );
            (
                "      disks:\n      - {name: root, disk: {bus: virtio}}\n      - {name: ci, disk: {bus: virtio}}\n",
                format!(
                    "  volumes:\n  - {{name: root, persistentVolumeClaim: {{claimName: {name}-root}}}}\n  - {{name: ci, cloudInitNoCloud: {{userData: \"{script}\"}}}}\n"
                ),
            )
        }
    };
    format!(
        "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: ln}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {NODE}}}
  domain:
    memory: {{guest: 128Mi}}
    devices:
{disks}      interfaces:
      - {{name: phys, bridge: {{}}}}
  networks:
  - {{name: phys, multus: {{networkName: {nad}}}}}
{volumes}"
    )
}

/// The test guest's disk as claim `ln/<claim>`.
fn disk_claim(c: &Cluster, claim: &str) -> anyhow::Result<()> {
    let g = TestGuest::get()?;
    let dir = c.dir().join("pvs").join(claim);
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(&g.disk_raw, dir.join("disk.img"))?;
    c.apply(&format!(
        "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: pv-{claim}}}\nspec:\n  \
         capacity: {{storage: 1Gi}}\n  accessModes: [ReadWriteOnce]\n  persistentVolumeReclaimPolicy: Retain\n  \
         hostPath: {{path: {}}}\n---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {claim}, namespace: ln}}\n\
         spec:\n  accessModes: [ReadWriteOnce]\n  resources: {{requests: {{storage: 1Gi}}}}\n  volumeName: pv-{claim}\n",
        dir.display()
    ))?;
    Ok(())
}

/// Boots VMI `name` and waits for its console to say it pinged the peer; its uid.
fn running_guest(c: &Cluster, name: &str) -> anyhow::Result<String> {
    let v = c.wait_until(&format!("VMI {name} Running"), BOOT, || {
        let v = c.get_json(&["-n", "ln", "vmi", name])?;
        anyhow::ensure!(
            v["status"]["phase"] != "Failed",
            "VMI {name} failed: {}",
            ready_message(&v)
        );
        Ok((v["status"]["phase"] == "Running").then_some(v))
    })?;
    let uid = v["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let log = c
        .extra_agent_dir(NODE)
        .join("vmis")
        .join(&uid)
        .join("serial.log");
    c.wait_until(&format!("{name}'s guest pinged the peer"), BOOT, || {
        let text = String::from_utf8_lossy(&std::fs::read(&log).unwrap_or_default()).into_owned();
        Ok(text.contains("LN-PING-OK").then_some(()))
    })?;
    Ok(uid)
}

fn ping(from: &Netns, to: &str) -> anyhow::Result<String> {
    let out = from.exec(&["busybox", "ping", "-c", "3", "-i", "0.2", "-W", "2", to])?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    anyhow::ensure!(out.status.success(), "ping {to}: {text}");
    Ok(text.lines().last().unwrap_or_default().to_string())
}

/// Whether this kernel lets a bridge filter VLANs (CONFIG_BRIDGE_VLAN_FILTERING).
fn vlan_filtering() -> anyhow::Result<bool> {
    let probe = Netns::new(&format!("fvlp-{}", token()))?;
    probe.ip(&["link", "add", "br-probe", "type", "bridge"])?;
    Ok(probe
        .ip(&[
            "link",
            "set",
            "br-probe",
            "type",
            "bridge",
            "vlan_filtering",
            "1",
        ])
        .is_ok())
}

#[test]
fn localnet_onto_an_nncp_bridge() -> anyhow::Result<()> {
    let started = Instant::now();
    TestGuest::get()?;
    let vlans = vlan_filtering()?;
    let t = token();
    let node = Netns::new(&format!("fvln-{t}"))?;
    let phys = Netns::new(&format!("fvlp-{t}"))?;
    veth(
        (&node, "eth1", None),
        (&phys, "phy0", Some("192.168.77.1/24")),
    )?;
    if vlans {
        phys.ip(&[
            "link", "add", "link", "phy0", "name", "phy0.100", "type", "vlan", "id", "100",
        ])?;
        phys.ip(&["addr", "add", "192.168.78.1/24", "dev", "phy0.100"])?;
        phys.ip(&["link", "set", "phy0.100", "up"])?;
    }

    let mut c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let token_file = c.dir().join("join-token");
    std::fs::write(&token_file, c.join_token()?)?;
    c.start_joined_agent_with(
        NODE,
        &token_file,
        &[
            "--pod-network",
            "--pod-cidr",
            "10.244.9.0/24",
            "--node-netns",
            node.name(),
            "--nmstate",
        ],
    )?;
    c.wait_until(
        "ln-a's NodeNetworkState (written with its own credential)",
        T,
        || {
            let out = c.kubectl(&["get", "nns", NODE, "-o", "json"])?;
            Ok(out.status.success().then_some(()))
        },
    )?;
    c.kubectl_ok(&["label", "node", NODE, "localnet-test=yes"])?;
    let joined = started.elapsed();

    // The bridge and mapping, by policy (VLAN 100 trunked on the uplink where possible).
    let port = if vlans {
        "{name: eth1, vlan: {mode: trunk, trunk-tags: [{id: 100}]}}"
    } else {
        "{name: eth1}"
    };
    c.apply(&format!(
        "apiVersion: nmstate.io/v1\nkind: NodeNetworkConfigurationPolicy\nmetadata: {{name: br-ext}}\nspec:\n  \
         nodeSelector: {{localnet-test: \"yes\"}}\n  desiredState:\n    interfaces:\n    - name: br-ext\n      \
         type: linux-bridge\n      state: up\n      bridge:\n        options: {{stp: {{enabled: false}}}}\n        \
         port: [{port}]\n    ovn:\n      bridge-mappings: [{{localnet: physnet, bridge: br-ext}}]\n"
    ))?;
    let enact = c.wait_until("enactment ln-a.br-ext finished", T, || {
        let out = c.kubectl(&["get", "nnce", "ln-a.br-ext", "-o", "json"])?;
        if !out.status.success() {
            return Ok(None);
        }
        let e: Value = serde_json::from_slice(&out.stdout)?;
        Ok(e["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["status"] == "True" && (c["type"] == "Available" || c["type"] == "Failing"))
            .cloned())
    })?;
    assert_eq!(enact["type"], "Available", "{enact}");
    c.wait_until(
        "the policy Available (status written by the node)",
        T,
        || {
            let p = c.get_json(&["nncp", "br-ext"])?;
            Ok(p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Available" && c["status"] == "True")
                .then_some(()))
        },
    )?;
    c.wait_until("the mapping in ln-a's NodeNetworkState", T, || {
        let s = c.get_json(&["nns", NODE])?;
        Ok(
            (s["status"]["currentState"]["ovn"]["bridge-mappings"][0]["bridge"] == "br-ext")
                .then_some(()),
        )
    })?;
    let bridged = started.elapsed();

    // The node's own credential reaches only its own nmstate.io objects.
    let kc = c.node_credential_kubeconfig(NODE)?;
    let as_node = |args: &[&str]| -> anyhow::Result<std::process::Output> {
        Ok(std::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&kc)
            .arg("--cache-dir")
            .arg(c.dir().join("kubectl-cache-node"))
            .args(args)
            .output()?)
    };
    assert!(as_node(&["get", "nncp", "br-ext"])?.status.success());
    let other_nns = c.dir().join("other-nns.yaml");
    std::fs::write(
        &other_nns,
        "apiVersion: nmstate.io/v1beta1\nkind: NodeNetworkState\nmetadata: {name: other-node}\n",
    )?;
    let other_nns = other_nns.to_string_lossy().into_owned();
    for args in [
        vec!["create", "-f", other_nns.as_str()],
        vec![
            "patch",
            "nncp",
            "br-ext",
            "--type",
            "merge",
            "-p",
            r#"{"spec":{"maxUnavailable":3}}"#,
        ],
        vec!["delete", "nncp", "br-ext"],
        vec!["label", "nnce", "ln-a.br-ext", "evil=yes"],
    ] {
        let out = as_node(&args)?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("forbidden") && err.contains("system:node:ln-a"),
            "as node ln-a, kubectl {args:?}: {err}"
        );
    }

    // The networks and their NADs in `ln`.
    c.kubectl_ok(&["create", "namespace", "ln"])?;
    c.apply(&cudn("physnet-ln", "physnet", 0))?;
    c.apply(&cudn("physnet-vlan", "physnet", 100))?;
    c.apply(&cudn("nowhere-ln", "nowhere", 0))?;
    c.apply(CUDN_IPAM)?;
    for nad in ["physnet-ln", "physnet-vlan", "nowhere-ln", "physnet-ipam"] {
        c.wait_until(&format!("NAD ln/{nad}"), T, || {
            let out = c.kubectl(&["-n", "ln", "get", "net-attach-def", nad])?;
            Ok(out.status.success().then_some(()))
        })?;
    }

    // Refusals, without a guest.
    c.apply(&vmi("unmapped", "nowhere-ln", Addr::NoGuest, ""))?;
    let msg = failure_of(&c, "unmapped")?;
    assert!(
        msg.contains("spec.networks[0].multus.networkName")
            && msg.contains("network \"phys\"")
            && msg.contains("physicalNetworkName \"nowhere\" has no bridge mapping on node ln-a"),
        "{msg}"
    );
    if !vlans {
        c.apply(&vmi("vlan", "physnet-vlan", Addr::NoGuest, ""))?;
        let msg = failure_of(&c, "vlan")?;
        assert!(
            msg.contains("VLAN 100 needs VLAN filtering on bridge \"br-ext\""),
            "{msg}"
        );
        eprintln!(
            "SKIP (VLAN part only): this kernel has no bridge VLAN filtering (802.1Q); \
             the VMI on the vlanID 100 network failed as it should: {msg}"
        );
    }

    // The guest on the untagged Localnet and the physical network reach each other.
    disk_claim(&c, "vm-root")?;
    let t0 = Instant::now();
    c.apply(&vmi(
        "vm",
        "physnet-ln",
        Addr::Static("192.168.77.10"),
        "192.168.77.1",
    ))?;
    running_guest(&c, "vm")?;
    let guest_pinged = t0.elapsed();
    let peer_ping = ping(&phys, "192.168.77.10")?;
    eprintln!("peer -> guest over br-ext: {peer_ping}");
    let ports = node.ip(&["-o", "link", "show", "master", "br-ext"])?;
    let ports = ferrovirt_testkit::netns::link_names(&ports);
    assert!(
        ports.contains(&"eth1".to_string()) && ports.iter().any(|p| p.starts_with("fv")),
        "{ports:?}"
    );

    // IPAM: the controller allots an address (the VMI's k8s.ovn.org/pod-networks), the agent's
    // DHCP server on the VMI-side bridge offers it, the guest's DHCP client takes it.
    phys.ip(&["addr", "add", "192.168.79.1/24", "dev", "phy0"])?;
    disk_claim(&c, "vmd-root")?;
    let t1 = Instant::now();
    c.apply(&vmi("vmd", "physnet-ipam", Addr::Dhcp, "192.168.79.1"))?;
    let allotted = c.wait_until("the address allotted to vmd", T, || {
        let v = c.get_json(&["-n", "ln", "vmi", "vmd"])?;
        let Some(a) = v["metadata"]["annotations"]["k8s.ovn.org/pod-networks"].as_str() else {
            return Ok(None);
        };
        let a: Value = serde_json::from_str(a)?;
        Ok(a["ln/physnet-ipam"]["ip_addresses"][0]
            .as_str()
            .map(|s| s.split('/').next().unwrap_or_default().to_string()))
    })?;
    running_guest(&c, "vmd")?;
    let dhcp_pinged = t1.elapsed();
    eprintln!("peer -> DHCP guest {allotted}: {}", ping(&phys, &allotted)?);
    let iface = c.wait_until("the guest agent's address of vmd", T, || {
        let v = c.get_json(&["-n", "ln", "vmi", "vmd"])?;
        let i = v["status"]["interfaces"][0].clone();
        Ok((i["ipAddress"] == allotted.as_str()).then_some(i))
    })?;
    assert_eq!(iface["name"], "phys");
    // The VMI namespace itself (the DHCP server's 169.254.75.10 on its bridge) does not even
    // answer ARP from the physical network: its secondary filter drops what the host bridge
    // side delivers to it (without the filter the namespace answers).
    let probe = phys.exec(&[
        "busybox",
        "arping",
        "-I",
        "phy0",
        "-c",
        "2",
        "-w",
        "3",
        "169.254.75.10",
    ])?;
    assert!(
        !probe.status.success(),
        "the physical network reached the VMI namespace's own address: {}",
        String::from_utf8_lossy(&probe.stdout)
    );

    if vlans {
        // Tagged on the wire: only the peer's VLAN 100 interface reaches this guest.
        disk_claim(&c, "vmv-root")?;
        c.apply(&vmi(
            "vmv",
            "physnet-vlan",
            Addr::Static("192.168.78.10"),
            "192.168.78.1",
        ))?;
        running_guest(&c, "vmv")?;
        eprintln!(
            "peer (VLAN 100) -> guest: {}",
            ping(&phys, "192.168.78.10")?
        );
    }

    eprintln!(
        "joined {joined:?}, bridge by policy {bridged:?}, guest pinged the peer {guest_pinged:?} after create (DHCP guest {dhcp_pinged:?}), whole test {:?}",
        started.elapsed()
    );
    c.kubectl_ok(&["delete", "vmi", "-n", "ln", "--all", "--timeout=120s"])?;
    Ok(())
}
