//! End to end against a real ferrovirt API server in a temp dir: the controllers create a
//! VMI for a VM with runStrategy Always and the scheduler binds it; halting the VM deletes
//! the VMI; a VM whose nodeSelector matches no node gets an Unschedulable condition and a
//! FailedScheduling Event with Kubernetes' message.

use std::time::Duration;

use ferrovirt_apiserver::{Server, ServerOptions};
use ferrovirt_controller::runtime::resources::{Vm, Vmi};
use ferrovirt_controller::{ControllerOptions, run};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(30);

async fn client(server: &Server) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(&server.kubeconfig_path).expect("kubeconfig");
    let cfg = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .expect("config");
    kube::Client::try_from(cfg).expect("client")
}

/// Poll `f` until it returns Some, or panic with `what` after [`TIMEOUT`].
async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = std::time::Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(start.elapsed() < TIMEOUT, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn add_node(client: &kube::Client, name: &str, lease_seconds: i32) {
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": {}
    }))
    .unwrap();
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create node");
    let now = Timestamp::now().to_string();
    let status = json!({"status": {
        "allocatable": {"cpu": "4", "memory": "8Gi"},
        "capacity": {"cpu": "4", "memory": "8Gi"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}]
    }});
    nodes
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("node status");
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let lease: Lease = serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": name, "namespace": "kube-node-lease"},
        "spec": {"holderIdentity": name, "leaseDurationSeconds": lease_seconds,
                 "renewTime": Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S.%6fZ").to_string()}
    }))
    .unwrap();
    leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("create lease");
}

fn vm(name: &str, placement: Option<(&str, serde_json::Value)>) -> Vm {
    let mut spec = json!({
        "domain": {"memory": {"guest": "128Mi"}, "devices": {}},
    });
    if let Some((field, value)) = placement {
        spec[field] = value;
    }
    serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"runStrategy": "Always", "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}
    }))
    .unwrap()
}

/// A server in a temp dir and a client for it.
async fn start_server() -> (tempfile::TempDir, Server, kube::Client) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(ServerOptions {
        data_dir: dir.path().to_path_buf(),
        listen: "127.0.0.1:0".parse().unwrap(),
        gc_interval: Duration::from_secs(1),
        ..Default::default()
    })
    .await
    .expect("server starts");
    let client = client(&server).await;
    (dir, server, client)
}

fn fast_options(identity: &str) -> ControllerOptions {
    let mut opts = ControllerOptions::default();
    opts.leader_election.identity = identity.into();
    opts.leader_election.renew_period = Duration::from_secs(1);
    opts.leader_election.lease_duration = Duration::from_secs(3);
    opts.scheduler.resync = Duration::from_secs(1);
    opts.node_lifecycle.fence_margin = Duration::from_secs(1);
    opts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_lifecycle_against_a_real_server() {
    let (_dir, server, client) = start_server().await;
    add_node(&client, "node-a", 3600).await;
    add_node(&client, "node-b", 3600).await;
    let controllers = tokio::spawn(run(client.clone(), fast_options("c1")));

    let vms: Api<Vm> = Api::namespaced(client.clone(), "default");
    let vmis: Api<Vmi> = Api::namespaced(client.clone(), "default");
    vms.create(&PostParams::default(), &vm("vm1", None))
        .await
        .expect("create vm");

    // The VM controller creates the VMI and the scheduler binds it.
    let vmi = eventually("vm1's VMI to be bound", || async {
        let v = vmis.get_opt("vm1").await.ok()??;
        v.status.as_ref()?.node_name.as_ref()?;
        Some(v)
    })
    .await;
    let status = vmi.status.clone().unwrap();
    assert!(status.node_name.as_deref().unwrap().starts_with("node-"));
    assert_eq!(
        status.phase,
        Some(ferrovirt_api::kubevirt::vmi::VmiPhase::Scheduled)
    );
    let owner = &vmi.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.controller),
        ("VirtualMachine", Some(true))
    );
    eventually("the kubevirt.io/nodeName label", || async {
        let v = vmis.get_opt("vm1").await.ok()??;
        v.metadata
            .labels
            .as_ref()?
            .get("kubevirt.io/nodeName")
            .cloned()
    })
    .await;
    eventually("vm1 to report created", || async {
        let v = vms.get_opt("vm1").await.ok()??;
        (v.status.as_ref()?.created == Some(true)).then_some(())
    })
    .await;

    // Halting the VM deletes the VMI.
    let halt = json!({"spec": {"runStrategy": "Halted"}});
    vms.patch("vm1", &PatchParams::default(), &Patch::Merge(&halt))
        .await
        .expect("halt");
    eventually("vm1's VMI to be deleted", || async {
        match vmis.get_opt("vm1").await.ok()? {
            None => Some(()),
            Some(v) => v.0.metadata.deletion_timestamp.map(|_| ()),
        }
    })
    .await;

    // A nodeSelector no node matches: Unschedulable, with Kubernetes' message and an Event.
    let selector = json!({"zone": "nowhere"});
    vms.create(
        &PostParams::default(),
        &vm("vm2", Some(("nodeSelector", selector))),
    )
    .await
    .expect("create vm2");
    let want = "0/2 nodes are available: 2 node(s) didn't match node selector.";
    let cond = eventually("vm2's VMI to be Unschedulable", || async {
        let v = vmis.get_opt("vm2").await.ok()??;
        let conds = v.0.status?.conditions?;
        conds
            .into_iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
    })
    .await;
    assert_eq!(cond.reason.as_deref(), Some("Unschedulable"));
    assert_eq!(cond.message.as_deref(), Some(want));
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    eventually("a FailedScheduling event", || async {
        let list = events.list(&ListParams::default()).await.ok()?;
        list.items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("FailedScheduling")
                    && e.message.as_deref() == Some(want)
            })
            .map(|_| ())
    })
    .await;
    eventually("vm2 to show ErrorUnschedulable", || async {
        let v = vms.get_opt("vm2").await.ok()??;
        let s = v.status.as_ref()?.printable_status?;
        (s == ferrovirt_api::kubevirt::vm::PrintableStatus::ErrorUnschedulable).then_some(())
    })
    .await;

    controllers.abort();
    server.shutdown().await;
}

async fn vmi_on(vmis: &Api<Vmi>, name: &str, node: &str, not_uid: Option<&str>) -> String {
    eventually(&format!("{name} bound to {node}"), || async {
        let v = vmis.get_opt(name).await.ok()??;
        let uid = v.metadata.uid.clone()?;
        let on = v.status.as_ref()?.node_name.as_deref() == Some(node);
        (on && Some(uid.as_str()) != not_uid && v.metadata.deletion_timestamp.is_none())
            .then_some(uid)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_recovers_from_node_failure() {
    let (_dir, server, client) = start_server().await;
    // node-a's lease is never renewed: it expires after 2 s.
    add_node(&client, "node-a", 2).await;
    add_node(&client, "node-b", 3600).await;
    let vms: Api<Vm> = Api::namespaced(client.clone(), "default");
    let vmis: Api<Vmi> = Api::namespaced(client.clone(), "default");
    let prefer_a = json!({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "preference": {"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-a"]}]}}]}});
    vms.create(
        &PostParams::default(),
        &vm("vm1", Some(("affinity", prefer_a))),
    )
    .await
    .expect("create vm");
    let controllers = tokio::spawn(run(client.clone(), fast_options("c1")));
    let first = vmi_on(&vmis, "vm1", "node-a", None).await;
    // node-a dies: its VMI is failed (NodeUnresponsive) and the VM gets a new one on node-b.
    let second = vmi_on(&vmis, "vm1", "node-b", Some(&first)).await;
    assert_ne!(first, second);
    let nodes: Api<Node> = Api::all(client.clone());
    let a = nodes.get("node-a").await.unwrap();
    let ready = a
        .status
        .unwrap()
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.status, "Unknown");
    let taints = a.spec.unwrap().taints.unwrap_or_default();
    assert!(
        taints
            .iter()
            .any(|t| t.key == "node.kubernetes.io/unreachable" && t.effect == "NoExecute")
    );
    controllers.abort();
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_request_replaces_the_vmi() {
    let (_dir, server, client) = start_server().await;
    add_node(&client, "node-a", 3600).await;
    let vms: Api<Vm> = Api::namespaced(client.clone(), "default");
    let vmis: Api<Vmi> = Api::namespaced(client.clone(), "default");
    let mut manual = vm("vm1", None);
    manual.0.spec.as_mut().unwrap().run_strategy =
        Some(ferrovirt_api::kubevirt::vm::RunStrategy::Manual);
    vms.create(&PostParams::default(), &manual)
        .await
        .expect("create vm");
    let controllers = tokio::spawn(run(client.clone(), fast_options("c1")));
    let request =
        |action: &str, uid: Option<&str>| ferrovirt_api::kubevirt::vm::StateChangeRequest {
            action: action.into(),
            data: None,
            uid: uid.map(Into::into),
        };
    // What the start subresource does: append a Start request to the status.
    let append = |reqs: Vec<ferrovirt_api::kubevirt::vm::StateChangeRequest>| {
        let vms = vms.clone();
        async move {
            eventually("the state change request to be written", || {
                let (vms, reqs) = (vms.clone(), reqs.clone());
                async move {
                    let mut v = vms.get("vm1").await.ok()?;
                    v.0.status
                        .get_or_insert_default()
                        .state_change_requests
                        .get_or_insert_default()
                        .extend(reqs);
                    vms.replace_status("vm1", &PostParams::default(), &v)
                        .await
                        .ok()
                        .map(|_| ())
                }
            })
            .await
        }
    };
    append(vec![request("Start", None)]).await;
    let first = vmi_on(&vmis, "vm1", "node-a", None).await;
    append(vec![request("Stop", Some(&first)), request("Start", None)]).await;
    let second = vmi_on(&vmis, "vm1", "node-a", Some(&first)).await;
    assert_ne!(first, second);
    eventually("the requests to be consumed", || async {
        let v = vms.get("vm1").await.ok()?;
        v.0.status?.state_change_requests.is_none().then_some(())
    })
    .await;
    controllers.abort();
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_takes_over_the_lease() {
    let (_dir, server, client) = start_server().await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-system");
    let holder = || async {
        let l = leases.get_opt("ferrovirt-controllers").await.ok()??;
        l.spec?.holder_identity
    };
    let one = tokio::spawn(run(client.clone(), fast_options("one")));
    let first = eventually("a leader", holder).await;
    assert_eq!(first, "one");
    let two = tokio::spawn(run(client.clone(), fast_options("two")));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        holder().await.as_deref(),
        Some("one"),
        "the holder keeps its lease"
    );
    one.abort();
    let start = std::time::Instant::now();
    eventually("the other instance to lead", || async {
        (holder().await? == "two").then_some(())
    })
    .await;
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "takeover within the lease duration"
    );
    two.abort();
    server.shutdown().await;
}
