//! k8s.ovn.org user-defined networks through the public API (docs/networking.md "User-defined
//! networks"), one server with its embedded agent (no guest is booted): a Primary Layer2
//! UserDefinedNetwork gets its NetworkAttachmentDefinition (OVN-K's label, finalizer, owner reference, ovn-k8s-cni-overlay
//! config) and `NetworkCreated=True`; OVN-K's validation rules refuse bad networks with 422
//! naming the field, and the network is immutable; a ClusterUserDefinedNetwork follows its
//! namespace selector as labels change; deleting a UDN waits while a VMI in its namespace
//! uses it, saying so in the condition; `kubectl get udn,cudn` prints the columns; the
//! network's VNI, the addresses its VMIs get (`k8s.ovn.org/pod-networks`) and a VM's IPAMClaim
//! that keeps its address across a restart, gone with the VM. This node runs QEMU user
//! networking, which has no Primary UDN data plane: its agent refuses a pod-network VMI in a
//! namespace labelled `k8s.ovn.org/primary-user-defined-network`, naming the field (the data
//! plane itself: `udn_dataplane.rs`).

use std::time::{Duration, Instant};

use ferrovirt_testkit::{Cluster, ClusterOptions};
use serde_json::Value;

const T: Duration = Duration::from_secs(30);

fn condition(obj: &Value) -> Option<(String, String, String)> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "NetworkCreated")
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
            (s("status"), s("reason"), s("message"))
        })
}

fn refused(c: &Cluster, yaml: &str, field: &str, message: &str) -> anyhow::Result<()> {
    let err = c.apply(yaml).expect_err("an invalid network was accepted");
    let err = format!("{err:#}");
    anyhow::ensure!(
        err.contains(field) && err.contains(message),
        "expected a refusal naming {field} ({message}), got: {err}"
    );
    Ok(())
}

fn nad(c: &Cluster, ns: &str, name: &str) -> anyhow::Result<Option<Value>> {
    let out = c.kubectl(&["get", "net-attach-def", name, "-n", ns, "-o", "json"])?;
    Ok(out
        .status
        .success()
        .then(|| serde_json::from_slice(&out.stdout))
        .transpose()?)
}

const UDN_A: &str = r#"
apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {name: tenant, namespace: udn-a}
spec:
  topology: Layer2
  layer2:
    role: Primary
    subnets: ["10.100.0.0/24"]
    ipam: {lifecycle: Persistent}
"#;

#[test]
fn user_defined_networks_through_the_api() -> anyhow::Result<()> {
    let started = Instant::now();
    // One node (QEMU user networking): the VMI below is refused before any guest starts.
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    c.apply(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: udn-a\n  labels: {k8s.ovn.org/primary-user-defined-network: \"\"}\n---\n\
         apiVersion: v1\nkind: Namespace\nmetadata:\n  name: udn-b\n  labels: {tenant: blue}\n---\n\
         apiVersion: v1\nkind: Namespace\nmetadata:\n  name: udn-c\n",
    )?;

    // A Primary Layer2 UDN: its NAD and condition.
    c.apply(UDN_A)?;
    let n = c.wait_until("the UDN's NAD", T, || nad(&c, "udn-a", "tenant"))?;
    assert!(n["metadata"]["labels"]["k8s.ovn.org/user-defined-network"].is_string());
    assert_eq!(
        n["metadata"]["finalizers"][0],
        "k8s.ovn.org/user-defined-network-protection"
    );
    assert_eq!(
        n["metadata"]["ownerReferences"][0]["kind"],
        "UserDefinedNetwork"
    );
    let cfg: Value = serde_json::from_str(n["spec"]["config"].as_str().unwrap_or("{}"))?;
    assert_eq!(cfg["type"], "ovn-k8s-cni-overlay");
    assert_eq!(cfg["role"], "primary");
    assert_eq!(cfg["topology"], "layer2");
    assert_eq!(cfg["subnets"], "10.100.0.0/24");
    assert_eq!(cfg["netAttachDefName"], "udn-a/tenant");
    let (status, reason, _) = c.wait_until("NetworkCreated", T, || {
        Ok(condition(&c.get_json(&["udn", "tenant", "-n", "udn-a"])?))
    })?;
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "NetworkAttachmentDefinitionCreated")
    );
    let udn = c.get_json(&["udn", "tenant", "-n", "udn-a"])?;
    assert_eq!(
        udn["metadata"]["finalizers"][0],
        "k8s.ovn.org/user-defined-network-protection"
    );

    // Validation as OVN-K publishes it, 422 naming the field.
    refused(
        &c,
        "apiVersion: k8s.ovn.org/v1\nkind: UserDefinedNetwork\nmetadata: {name: ln, namespace: udn-a}\nspec: {topology: Localnet}\n",
        "spec.topology",
        "Localnet is only supported on a ClusterUserDefinedNetwork",
    )?;
    refused(
        &c,
        "apiVersion: k8s.ovn.org/v1\nkind: UserDefinedNetwork\nmetadata: {name: bad, namespace: udn-a}\nspec:\n  topology: Layer2\n  layer2: {role: Primary, ipam: {mode: Disabled}}\n",
        "spec.layer2.ipam.mode",
        "only supported for Secondary network",
    )?;
    refused(
        &c,
        "apiVersion: k8s.ovn.org/v1\nkind: UserDefinedNetwork\nmetadata: {name: bad, namespace: udn-a}\nspec:\n  topology: Layer3\n  layer2: {role: Primary, subnets: [10.0.0.0/24]}\n",
        "spec.layer3",
        "required when topology is Layer3",
    )?;
    refused(
        &c,
        "apiVersion: k8s.ovn.org/v1\nkind: ClusterUserDefinedNetwork\nmetadata: {name: badln}\nspec:\n  namespaceSelector: {}\n  network:\n    topology: Localnet\n    localnet: {role: Primary, physicalNetworkName: physnet}\n",
        "spec.network.localnet.role",
        "Secondary only",
    )?;
    refused(
        &c,
        &UDN_A.replace("10.100.0.0/24", "10.101.0.0/24"),
        "spec",
        "Spec is immutable",
    )?;

    // A CUDN follows its namespace selector.
    c.apply(
        "apiVersion: k8s.ovn.org/v1\nkind: ClusterUserDefinedNetwork\nmetadata: {name: shared}\nspec:\n  namespaceSelector: {matchLabels: {tenant: blue}}\n  network:\n    topology: Layer2\n    layer2: {role: Secondary, subnets: [10.200.0.0/24]}\n",
    )?;
    c.wait_until("the CUDN's NAD in udn-b", T, || nad(&c, "udn-b", "shared"))?;
    c.kubectl_ok(&["label", "namespace", "udn-c", "tenant=blue"])?;
    c.wait_until("the CUDN's NAD in udn-c", T, || nad(&c, "udn-c", "shared"))?;
    c.kubectl_ok(&["label", "namespace", "udn-b", "tenant-"])?;
    c.wait_until("the CUDN's NAD gone from udn-b", T, || {
        Ok(nad(&c, "udn-b", "shared")?.is_none().then_some(()))
    })?;
    c.wait_until("the CUDN's condition listing udn-c", T, || {
        let cond = condition(&c.get_json(&["cudn", "shared"])?);
        Ok(cond.filter(|(s, _, m)| s == "True" && m.ends_with("[udn-c]")))
    })?;

    let table = c.kubectl_ok(&["get", "udn,cudn", "-A"])?;
    for want in [
        "TOPOLOGY",
        "CREATED",
        "REASON",
        "tenant",
        "shared",
        "Layer2",
        "NetworkAttachmentDefinitionCreated",
    ] {
        assert!(table.contains(want), "no {want} in:\n{table}");
    }

    // Addresses (IPAMClaim, the VMI's k8s.ovn.org/pod-networks) and the network's VNI. The VMs
    // cannot be scheduled (no node has the label), so only the controller acts on their VMIs.
    let vni = udn["metadata"]["annotations"]["ferrovirt.io/udn-vni"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(vni.parse::<u32>().is_ok_and(|v| v >= 10_000), "VNI {vni:?}");
    assert_eq!(
        nad(&c, "udn-a", "tenant")?.unwrap_or_default()["metadata"]["annotations"]["ferrovirt.io/udn-vni"],
        vni.as_str()
    );
    for vm in ["vm1", "vm2"] {
        c.apply(&format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata: {{name: {vm}, namespace: udn-a}}\nspec:\n  runStrategy: Always\n  template:\n    spec:\n      nodeSelector: {{nowhere: \"true\"}}\n      domain:\n        devices: {{}}\n        resources: {{requests: {{memory: 64Mi}}}}\n"
        ))?;
    }
    let address = |vmi: &str| -> anyhow::Result<Option<(String, String)>> {
        let v = c.get_json(&["vmi", vmi, "-n", "udn-a"])?;
        let text = v["metadata"]["annotations"]["k8s.ovn.org/pod-networks"]
            .as_str()
            .unwrap_or("{}")
            .to_string();
        let pn: Value = serde_json::from_str(&text)?;
        let ip = pn["udn-a/tenant"]["ip_addresses"][0]
            .as_str()
            .map(String::from);
        Ok(ip.map(|ip| (ip, v["metadata"]["uid"].as_str().unwrap_or("").to_string())))
    };
    let (ip1, uid1) = c.wait_until("vm1's address", T, || address("vm1"))?;
    let (ip2, _) = c.wait_until("vm2's address", T, || address("vm2"))?;
    assert!(
        ip1.starts_with("10.100.0.") && ip1.ends_with("/24"),
        "{ip1}"
    );
    assert_ne!(ip1, ip2);
    assert_ne!(ip1, "10.100.0.1/24", "the gateway was handed out");
    let pn: Value = serde_json::from_str(
        c.get_json(&["vmi", "vm1", "-n", "udn-a"])?["metadata"]["annotations"]
            ["k8s.ovn.org/pod-networks"]
            .as_str()
            .unwrap_or("{}"),
    )?;
    assert_eq!(pn["udn-a/tenant"]["role"], "primary");
    assert_eq!(pn["udn-a/tenant"]["gateway_ips"][0], "10.100.0.1");
    let claim = c.wait_until("vm1's IPAMClaim", T, || {
        let cl = c.get_json(&["ipamclaims", "vm1.default", "-n", "udn-a"])?;
        Ok((cl["status"]["ips"][0] == ip1.as_str()).then_some(cl))
    })?;
    assert_eq!(claim["spec"]["network"], "udn-a_tenant");
    assert_eq!(
        claim["metadata"]["ownerReferences"][0]["kind"],
        "VirtualMachine"
    );
    let table = c.kubectl_ok(&["get", "ipamclaims", "-n", "udn-a"])?;
    assert!(
        table.contains("NETWORK") && table.contains("udn-a_tenant") && table.contains(&ip1),
        "{table}"
    );
    // A restarted VM (a new VMI) keeps its address.
    c.kubectl_ok(&[
        "patch",
        "vm",
        "vm1",
        "-n",
        "udn-a",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"runStrategy":"Halted"}}"#,
    ])?;
    c.wait_gone_in("udn-a", "vmi", "vm1", T)?;
    c.kubectl_ok(&[
        "patch",
        "vm",
        "vm1",
        "-n",
        "udn-a",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"runStrategy":"Always"}}"#,
    ])?;
    let (again, uid) = c.wait_until("vm1's new VMI's address", T, || {
        Ok(address("vm1")?.filter(|(_, u)| *u != uid1))
    })?;
    assert_ne!(uid, uid1);
    assert_eq!(again, ip1, "the restarted VM lost its address");
    // A claim that names a bad address is refused, naming the field.
    refused(
        &c,
        "apiVersion: k8s.cni.cncf.io/v1alpha1\nkind: IPAMClaim\nmetadata: {name: x, namespace: udn-a}\nspec: {network: net1}\n",
        "spec.interface",
        "Required value",
    )?;
    // Deleting the VMs deletes their claims (owner references).
    c.kubectl_ok(&["delete", "vm", "vm1", "vm2", "-n", "udn-a"])?;
    c.wait_gone_in("udn-a", "ipamclaims", "vm1.default", T)?;

    // A Layer3 network: every node gets a host subnet of it (k8s.ovn.org/node-subnets),
    // dropped when the network is gone.
    c.apply(
        "apiVersion: k8s.ovn.org/v1\nkind: UserDefinedNetwork\nmetadata: {name: l3, namespace: udn-c}\nspec:\n  topology: Layer3\n  layer3:\n    role: Secondary\n    subnets: [{cidr: 10.150.0.0/16, hostSubnet: 24}]\n",
    )?;
    let node_subnets = || -> anyhow::Result<Value> {
        let nodes = c.get_json(&["nodes"])?;
        let text = nodes["items"][0]["metadata"]["annotations"]["k8s.ovn.org/node-subnets"]
            .as_str()
            .unwrap_or("{}")
            .to_string();
        Ok(serde_json::from_str(&text)?)
    };
    let host = c.wait_until("the node's Layer3 host subnet", T, || {
        Ok(node_subnets()?["udn-c_l3"][0].as_str().map(String::from))
    })?;
    assert!(
        host.starts_with("10.150.") && host.ends_with(".0/24"),
        "{host}"
    );
    c.kubectl_ok(&["delete", "udn", "l3", "-n", "udn-c"])?;
    c.wait_until("the host subnet dropped", T, || {
        Ok(node_subnets()?.get("udn-c_l3").is_none().then_some(()))
    })?;

    // Deleting a UDN waits while a VMI of its namespace is on the network.
    c.apply(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: user, namespace: udn-a}\nspec:\n  domain:\n    devices: {}\n    resources: {requests: {memory: 64Mi}}\n",
    )?;
    // A user-networking node has no Primary UDN data plane: the agent refuses the VMI naming it.
    let msg = c.wait_until("the VMI refused", Duration::from_secs(90), || {
        let v = c.get_json(&["vmi", "user", "-n", "udn-a"])?;
        let failed = v["status"]["phase"] == "Failed";
        let text = v["status"]["conditions"].to_string();
        Ok((failed && text.contains("primary-user-defined-network")).then_some(text))
    })?;
    assert!(
        msg.contains("spec.networks") && msg.contains("Primary UserDefinedNetwork"),
        "{msg}"
    );
    c.kubectl_ok(&["delete", "udn", "tenant", "-n", "udn-a", "--wait=false"])?;
    let (status, _, message) = c.wait_until("the in-use condition", T, || {
        let cond = condition(&c.get_json(&["udn", "tenant", "-n", "udn-a"])?);
        Ok(cond.filter(|(s, _, _)| s == "False"))
    })?;
    assert!(
        message.contains("in use") && message.contains("udn-a/user"),
        "{status}: {message}"
    );
    assert!(
        nad(&c, "udn-a", "tenant")?.is_some(),
        "the NAD went while in use"
    );
    c.kubectl_ok(&["delete", "vmi", "user", "-n", "udn-a"])?;
    c.wait_gone_in("udn-a", "udn", "tenant", T)?;
    c.wait_until("the UDN's NAD gone", T, || {
        Ok(nad(&c, "udn-a", "tenant")?.is_none().then_some(()))
    })?;
    eprintln!(
        "user-defined networks API test took {:?}",
        started.elapsed()
    );
    Ok(())
}
