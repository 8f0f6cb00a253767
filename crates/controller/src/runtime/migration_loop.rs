//! The live-migration loop: watches VirtualMachineInstanceMigrations and, on every change of
//! them, of VMIs or of Nodes (and every second, for the target-ready timeout), applies
//! [`crate::migration::decide`] to each unfinished one: the VMI's `status.migrationState`
//! first (guarded by the VMI's resourceVersion), then the migration's status, then Events.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::json;
use tokio::sync::Notify;

use ferrovirt_api::kubevirt::misc::MigrationPhase;
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;

use super::events::{EventRecorder, object_ref};
use super::resources::{Vmi, Vmim};
use super::stores::{Kind, Stores};
use crate::error::ControllerError;
use crate::migration::{self, Now, On, Step, TargetInputs};
use crate::scheduler::SchedulerOptions;
use crate::vm::template::KUBEVIRT_API_VERSION;

/// Component name on Events (KubeVirt's migration controller reports as virt-controller).
pub const COMPONENT: &str = "virtualmachine-controller";
/// Every pending decision is looked at again at least this often.
const RESYNC: Duration = Duration::from_secs(1);

/// Runs the migration loop until its watch ends.
pub async fn run(
    client: kube::Client,
    opts: SchedulerOptions,
    stores: Stores,
) -> Result<(), ControllerError> {
    let wake = Arc::new(Notify::new());
    let (vmims, writer) = reflector::store::<Vmim>();
    let stream = reflector(
        writer,
        watcher(Api::<Vmim>::all(client.clone()), watcher::Config::default()).default_backoff(),
    )
    .touched_objects();
    let w = wake.clone();
    let pump = async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            if let Err(e) = item {
                tracing::warn!(error = %e, "migration watch error");
            }
            w.notify_one();
        }
    };
    let w = wake.clone();
    let mut changes = stores.changes();
    let follow = async move {
        while changes.wait_for(&[Kind::Vmi, Kind::Node]).await.is_some() {
            w.notify_one();
        }
    };
    let recorder = EventRecorder::new(client.clone(), COMPONENT);
    let work = async {
        let _ = vmims.wait_until_ready().await;
        stores.ready().await;
        loop {
            for m in vmims.state() {
                if migration::is_final(migration::current_phase(&m.0)) {
                    continue;
                }
                if let Err(e) = reconcile(&client, &recorder, &stores, &opts, &m).await {
                    tracing::warn!(error = %e, migration = ?m.0.metadata.name, "migration step failed");
                }
            }
            let _ = tokio::time::timeout(RESYNC, wake.notified()).await;
        }
    };
    tokio::select! {
        _ = pump => Err(ControllerError::TaskStopped { name: "migration", reason: "watch stream ended".into() }),
        _ = follow => Err(ControllerError::TaskStopped { name: "migration", reason: "caches ended".into() }),
        _ = work => Ok(()),
    }
}

async fn reconcile(
    client: &kube::Client,
    recorder: &EventRecorder,
    stores: &Stores,
    opts: &SchedulerOptions,
    m: &Vmim,
) -> Result<(), kube::Error> {
    let vmim = &m.0;
    let ns = vmim
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let vmi_name = vmim
        .spec
        .as_ref()
        .and_then(|s| s.vmi_name.clone())
        .unwrap_or_default();
    let vmi = stores
        .vmis
        .get(&reflector::ObjectRef::<Vmi>::new(&vmi_name).within(&ns));
    let vmi: Option<&VirtualMachineInstance> = vmi.as_deref().map(|v| &v.0);
    // Target selection needs the VMI's volume constraints and every node and VMI.
    let picking = migration::current_phase(vmim) == MigrationPhase::Scheduling;
    let (affinity, shared) = match (picking, vmi) {
        (true, Some(v)) => super::scheduler_loop::volume_constraints(client, v).await,
        _ => (Vec::new(), Vec::new()),
    };
    let nodes = if picking {
        stores.node_list()
    } else {
        Vec::new()
    };
    let vmis: Vec<VirtualMachineInstance> = if picking {
        stores.vmis.state().iter().map(|v| v.0.clone()).collect()
    } else {
        Vec::new()
    };
    let inputs = TargetInputs {
        nodes: &nodes,
        vmis: &vmis,
        added_node_selector: vmim
            .spec
            .as_ref()
            .and_then(|s| s.added_node_selector.as_ref()),
        volume_affinity: &affinity,
        shared_mounts: &shared,
        opts,
    };
    let now = Timestamp::now();
    let rfc = now.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    let step: Step = migration::decide(
        vmim,
        vmi,
        |v| migration::pick_target(v, &inputs),
        Now {
            rfc3339: &rfc,
            epoch_secs: now.as_second(),
        },
    );
    if let (Some(status), Some(v)) = (&step.vmi_status, vmi) {
        let api: Api<Vmi> = Api::namespaced(client.clone(), &ns);
        let patch = json!({
            "metadata": {"resourceVersion": v.metadata.resource_version},
            "status": status,
        });
        api.patch(&vmi_name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    if let Some(status) = &step.migration_status {
        let api: Api<Vmim> = Api::namespaced(client.clone(), &ns);
        let name = vmim.metadata.name.clone().unwrap_or_default();
        let patch = json!({"status": status});
        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    for note in &step.events {
        let reference = match (note.on, vmi) {
            (On::Vmi, Some(v)) => {
                object_ref(KUBEVIRT_API_VERSION, "VirtualMachineInstance", &v.metadata)
            }
            (On::Vmi, None) => continue,
            (On::Migration, _) => object_ref(
                KUBEVIRT_API_VERSION,
                "VirtualMachineInstanceMigration",
                &vmim.metadata,
            ),
        };
        recorder
            .record(&reference, note.warning, note.reason, &note.message)
            .await;
    }
    Ok(())
}
