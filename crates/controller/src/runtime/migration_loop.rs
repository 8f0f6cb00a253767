//! The live-migration loop: watches VirtualMachineInstanceMigrations and, on every change of
//! them, of VMIs or of Nodes (and every second, for the target-ready timeout), applies
//! [`crate::migration::decide`] to each unfinished one: the VMI's `status.migrationState`
//! first (guarded by the VMI's resourceVersion), then the migration's status, then Events.
//! A VMI whose unfinished migration state names a migration that no longer exists (deleted:
//! `kubectl delete vmim`, `ferrovirt migrate-cancel`) gets its migration aborted
//! ([`migration::cancel_patch`]; every VMI is looked at for that only after a VMI or migration
//! changed, or while orphans were left, not on a Node change). The cluster migration
//! configuration comes from the shared stores' KubeVirt settings; MigrationPolicies are read
//! when a migration is scheduled.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector;
use serde_json::json;
use tokio::sync::Notify;

use ferrovirt_api::kubevirt::misc::{MigrationConfiguration, MigrationPhase, MigrationPolicy};
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_api::migration_policy as policy;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams};

use super::events::{EventRecorder, object_ref};
use super::resources::{Vmi, Vmim};
use super::stores::{Kind, Stores};
use crate::error::ControllerError;
use crate::migration::{self, Chosen, Limits, Now, On, Step, TargetInputs};
use crate::runtime::watched::watched_store;
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
    // Set when a VMI or a migration may have changed: only then can a VMI's migration have
    // become orphaned, so only then is every VMI looked at (a Node status patch is not).
    let orphans_may_change = Arc::new(AtomicBool::new(true));
    let w = wake.clone();
    let flag = orphans_may_change.clone();
    let (vmims, pump) = watched_store(Api::<Vmim>::all(client.clone()), "migration", move || {
        flag.store(true, Ordering::Release);
        w.notify_one();
    });
    let w = wake.clone();
    let flag = orphans_may_change.clone();
    let mut changes = stores.changes();
    let follow = async move {
        while let Some(c) = changes.next_batch(&[Kind::Vmi, Kind::Node]).await {
            if c.contains(Kind::Vmi) {
                flag.store(true, Ordering::Release);
            }
            w.notify_one();
        }
    };
    let recorder = EventRecorder::new(client.clone(), COMPONENT);
    let work = async {
        let _ = vmims.wait_until_ready().await;
        stores.ready().await;
        // Whether the last look found orphaned migrations (looked at again until none are
        // left: a failed cancel is retried on the resync).
        let mut orphans_left = false;
        loop {
            // Taken before the caches are read: a change after this sets it again.
            let look_for_orphans = orphans_may_change.swap(false, Ordering::AcqRel) || orphans_left;
            let all = vmims.state();
            let unfinished: Vec<_> = all
                .iter()
                .filter(|m| !migration::is_final(migration::current_phase(&m.0)))
                .collect();
            // The cluster settings only when a migration waits to be admitted.
            let cluster = if unfinished
                .iter()
                .any(|m| migration::current_phase(&m.0) == MigrationPhase::Pending)
            {
                stores.kubevirt().migrations.clone()
            } else {
                policy::defaults()
            };
            // The KubeVirt CR's overcommit settings as they are now (target fit).
            let opts = SchedulerOptions {
                overcommit: stores.overcommit(),
                obsolete_cpu_models: stores.obsolete_cpu_models(),
                workloads: stores.kubevirt().workloads.clone(),
                ..opts.clone()
            };
            for m in &unfinished {
                let limits = limits_for(&stores, &unfinished, &m.0, &cluster);
                if let Err(e) = reconcile(&client, &recorder, &stores, &opts, m, limits).await {
                    tracing::warn!(error = %e, migration = ?m.0.metadata.name, "migration step failed");
                }
            }
            let uids: std::collections::HashSet<String> = all
                .iter()
                .filter_map(|m| m.0.metadata.uid.clone())
                .collect();
            if look_for_orphans {
                orphans_left = cancel_orphaned(&client, &recorder, &stores, &uids).await;
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

/// The VMI's node of a migration (from the VMI cache).
fn source_of(
    stores: &Stores,
    m: &ferrovirt_api::kubevirt::misc::VirtualMachineInstanceMigration,
) -> Option<String> {
    let ns = m.metadata.namespace.as_deref().unwrap_or("default");
    let name = m.spec.as_ref()?.vmi_name.as_deref()?;
    let v = stores
        .vmis
        .get(&reflector::ObjectRef::<Vmi>::new(name).within(ns))?;
    v.0.status.as_ref()?.node_name.clone()
}

/// The parallel limits as they stand for `m`.
fn limits_for(
    stores: &Stores,
    unfinished: &[&Arc<Vmim>],
    m: &ferrovirt_api::kubevirt::misc::VirtualMachineInstanceMigration,
    cluster: &MigrationConfiguration,
) -> Limits {
    let source = source_of(stores, m);
    let active: Vec<_> = unfinished
        .iter()
        .filter(|o| migration::is_active(migration::current_phase(&o.0)))
        .collect();
    Limits {
        active_in_cluster: active.len(),
        active_from_node: active
            .iter()
            .filter(|o| source.is_some() && source_of(stores, &o.0) == source)
            .count(),
        per_cluster: cluster
            .parallel_migrations_per_cluster
            .unwrap_or(policy::DEFAULT_PARALLEL_PER_CLUSTER),
        per_node: cluster
            .parallel_outbound_migrations_per_node
            .unwrap_or(policy::DEFAULT_PARALLEL_OUTBOUND_PER_NODE),
    }
}

fn dynamic(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

/// Every object of a kind, typed (errors and undecodable objects: none).
async fn list_all<T: serde::de::DeserializeOwned>(
    client: &kube::Client,
    ar: &ApiResource,
) -> Vec<T> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), ar);
    match api.list(&ListParams::default()).await {
        Ok(l) => l
            .items
            .into_iter()
            .filter_map(|o| {
                serde_json::to_value(o)
                    .ok()
                    .and_then(|v| serde_json::from_value(v).ok())
            })
            .collect(),
        Err(e) => {
            tracing::debug!(error = %e, kind = %ar.kind, "listing for the migration settings");
            Vec::new()
        }
    }
}

/// The settings a migration of `vmi` runs with, and the policy's name.
async fn settings(
    client: &kube::Client,
    stores: &Stores,
    vmi: &VirtualMachineInstance,
) -> (serde_json::Value, Option<String>) {
    let cluster = stores.kubevirt().migrations.clone();
    let policies: Vec<MigrationPolicy> = list_all(
        client,
        &dynamic(
            "migrations.kubevirt.io",
            "v1alpha1",
            "MigrationPolicy",
            "migrationpolicies",
        ),
    )
    .await;
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let ns_labels = match Api::<Namespace>::all(client.clone()).get_opt(ns).await {
        Ok(Some(n)) => n.metadata.labels.unwrap_or_default(),
        _ => Default::default(),
    };
    let vmi_labels = vmi.metadata.labels.clone().unwrap_or_default();
    let chosen = policy::select_policy(&policies, &vmi_labels, &ns_labels);
    let (c, name) = policy::effective(&cluster, chosen);
    (serde_json::to_value(c).unwrap_or_default(), name)
}

/// Aborts the migrations of VMIs whose VMIM was deleted.
async fn cancel_orphaned(
    client: &kube::Client,
    recorder: &EventRecorder,
    stores: &Stores,
    migrations: &std::collections::HashSet<String>,
) -> bool {
    let now = Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    let mut found = false;
    // Filtered in place: only the orphaned VMIs' handles are copied out of the cache.
    let orphaned = stores.vmis.state_filter(|v| {
        migration::cancel_patch(&v.0, |u| migrations.contains(u), &now).is_some()
    });
    for v in orphaned {
        let vmi = &v.0;
        let Some(patch) = migration::cancel_patch(vmi, |u| migrations.contains(u), &now) else {
            continue;
        };
        found = true;
        let ns = vmi
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let name = vmi.metadata.name.clone().unwrap_or_default();
        let body = json!({
            "metadata": {"resourceVersion": vmi.metadata.resource_version},
            "status": patch,
        });
        let api: Api<Vmi> = Api::namespaced(client.clone(), &ns);
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(_) => {
                let reference = object_ref(
                    KUBEVIRT_API_VERSION,
                    "VirtualMachineInstance",
                    &vmi.metadata,
                );
                recorder
                    .record(&reference, false, "MigrationAborting", "The migration was cancelled (its VirtualMachineInstanceMigration was deleted); the VM stays where it is")
                    .await;
            }
            Err(e) => tracing::debug!(error = %e, "cancelling a migration"),
        }
    }
    found
}

async fn reconcile(
    client: &kube::Client,
    recorder: &EventRecorder,
    stores: &Stores,
    opts: &SchedulerOptions,
    m: &Vmim,
    limits: Limits,
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
    // The node affinity of the VMI's node-local volumes does not bind the target: a
    // migratable VMI's node-local claims are copied there (block migration) and their PVs
    // follow the VM. Shared filesystems must be mounted on the target.
    let (affinity, shared) = match (picking, vmi) {
        (true, Some(v)) => {
            let (_, shared, _) = super::scheduler_loop::volume_constraints(client, stores, v).await;
            (Vec::new(), shared)
        }
        _ => (Vec::new(), Vec::new()),
    };
    let (configuration, policy_name) = match (picking, vmi) {
        (true, Some(v)) => settings(client, stores, v).await,
        _ => (serde_json::Value::Null, None),
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
        |v| {
            migration::pick_target(v, &inputs).map(|node| Chosen {
                node,
                configuration,
                policy: policy_name,
            })
        },
        limits,
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
        match api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            // The namespace's quota cannot hold the target (a second launcher Pod): the
            // migration stays Pending with KubeVirt's condition and is tried again each pass.
            Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("exceeded quota") => {
                if let Some(st) = migration::quota_rejected(vmim, &s.message, &rfc) {
                    let patch = json!({"status": st});
                    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await?;
                    let reference = object_ref(
                        KUBEVIRT_API_VERSION,
                        "VirtualMachineInstanceMigration",
                        &vmim.metadata,
                    );
                    recorder
                        .record(&reference, true, migration::QUOTA_REASON, &s.message)
                        .await;
                }
                return Ok(());
            }
            Err(e) => return Err(e),
        }
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
