//! What the controllers read from the cluster's KubeVirt CRs, kept by one watch of `kubevirts`
//! in the shared stores ([`super::stores::Stores::kubevirt`]): the overcommit settings (the
//! scheduler and the migration target fit), the drain taint key and the cluster eviction
//! strategy (evacuation), and the cluster migration configuration (admission of migrations and
//! their settings), whether the common instancetypes are deployed, the obsolete CPU models
//! (the scheduler), the workloads placement and the permitted host devices (the scheduler). A change rings [`Kind::KubeVirt`]; no reconcile lists `kubevirts`.
//!
//! Which CR counts: the HyperConverged's own (`kubevirt-kubevirt-hyperconverged`) first, then
//! the others oldest first ([`KubeVirtConfig::from_crs`], pure); each setting is taken from the
//! first CR in that order that sets it.

use std::sync::Arc;

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::{self, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::Value;

use ferrovirt_api::kubevirt::host_devices::PermittedHostDevices;
use ferrovirt_api::kubevirt::misc::MigrationConfiguration;
use ferrovirt_api::kubevirt::overcommit::Overcommit;
use ferrovirt_api::migration_policy;

use super::stores::Kind;

/// The cluster settings the controllers take from the KubeVirt CRs.
#[derive(Debug, Clone, PartialEq)]
pub struct KubeVirtConfig {
    pub overcommit: Overcommit,
    /// `configuration.migrations.nodeDrainTaintKey` (default `kubevirt.io/drain`).
    pub drain_key: String,
    /// `configuration.evictionStrategy`, as written (checked where it is used).
    pub eviction_strategy: Option<String>,
    /// The cluster migration configuration: defaults ← `configuration.migrations`.
    pub migrations: MigrationConfiguration,
    /// `configuration.commonInstancetypesDeployment.enabled` (default true): the common
    /// instancetypes and preferences are deployed (`crate::hco::common`).
    pub common_instancetypes: bool,
    /// `configuration.obsoleteCPUModels` (KubeVirt's default list without one): a VMI naming
    /// one is unschedulable.
    pub obsolete_cpu_models: std::collections::BTreeSet<String>,
    /// `workloads.nodePlacement`: the nodes VMs may run on (the scheduler).
    pub workloads: Option<crate::scheduler::placement::WorkloadsPlacement>,
    /// `configuration.permittedHostDevices` (None: not set, every device name allowed): a
    /// VMI asking for a device it does not list is not placed (the scheduler).
    pub permitted_host_devices: Option<PermittedHostDevices>,
}

impl Default for KubeVirtConfig {
    fn default() -> Self {
        Self::from_crs(&[])
    }
}

impl KubeVirtConfig {
    /// The settings of `crs` (whole objects as JSON): the HyperConverged's own CR first, then
    /// the oldest; each setting from the first CR that sets it, the defaults without any.
    pub fn from_crs(crs: &[&Value]) -> Self {
        let mut ordered: Vec<&Value> = crs.to_vec();
        ferrovirt_api::hco::desired::order_kubevirts(&mut ordered);
        let specs: Vec<Option<&Value>> = ordered.iter().map(|o| o.get("spec")).collect();
        let overcommit = specs
            .first()
            .map(|s| Overcommit::from_kubevirt_spec(*s))
            .unwrap_or_default();
        let drain_key = specs
            .iter()
            .map(|s| ferrovirt_api::eviction::drain_taint_key(*s))
            .find(|k| k != ferrovirt_api::eviction::DRAIN_TAINT)
            .unwrap_or_else(|| ferrovirt_api::eviction::DRAIN_TAINT.to_string());
        let eviction_strategy = specs.iter().find_map(|s| {
            (*s)?
                .pointer("/configuration/evictionStrategy")
                .and_then(Value::as_str)
                .map(str::to_string)
        });
        let migrations = specs.iter().find_map(|s| {
            let m = (*s)?.pointer("/configuration/migrations")?;
            serde_json::from_value::<MigrationConfiguration>(m.clone()).ok()
        });
        KubeVirtConfig {
            overcommit,
            drain_key,
            eviction_strategy,
            migrations: migration_policy::cluster_configuration(None, migrations.as_ref()),
            common_instancetypes: ferrovirt_api::hco::common::enabled(
                specs.first().copied().flatten(),
            ),
            obsolete_cpu_models: ferrovirt_api::kubevirt::cpu_model::obsolete_models(
                ordered.iter().copied(),
            ),
            workloads: specs.iter().find_map(|s| {
                crate::scheduler::placement::WorkloadsPlacement::from_kubevirt_spec(*s)
            }),
            permitted_host_devices: PermittedHostDevices::from_kubevirts(ordered.iter().copied()),
        }
    }
}

/// Keeps `tx` at the settings of the cluster's KubeVirt CRs (a watch of `kubevirts` with its
/// own small cache), ringing [`Kind::KubeVirt`] when they change.
pub(super) async fn follow(
    client: kube::Client,
    tx: tokio::sync::watch::Sender<Arc<KubeVirtConfig>>,
    changed: super::changes::Announcer,
) {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "KubeVirt"),
        "kubevirts",
    );
    let api: Api<DynamicObject> = Api::all_with(client, &ar);
    let writer = reflector::store::Writer::<DynamicObject>::new(ar);
    let store = writer.as_reader();
    let mut events = std::pin::pin!(
        reflector(writer, watcher(api, watcher::Config::default()))
            .default_backoff()
            .touched_objects()
    );
    while let Some(ev) = events.next().await {
        if let Err(e) = ev {
            tracing::debug!("watching kubevirts: {e}");
            continue;
        }
        let crs: Vec<Value> = store
            .state()
            .iter()
            .filter_map(|o| serde_json::to_value(&**o).ok())
            .collect();
        let now = KubeVirtConfig::from_crs(&crs.iter().collect::<Vec<_>>());
        if tx.send_if_modified(|cur| {
            let differs = **cur != now;
            if differs {
                *cur = Arc::new(now.clone());
            }
            differs
        }) {
            tracing::info!(overcommit = ?now.overcommit, drain_key = %now.drain_key,
                eviction_strategy = ?now.eviction_strategy, "KubeVirt CR settings");
            changed.send(Kind::KubeVirt);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cr(name: &str, created: &str, configuration: Value) -> Value {
        json!({"metadata": {"name": name, "creationTimestamp": created},
               "spec": {"configuration": configuration}})
    }

    #[test]
    fn the_hyperconvergeds_own_cr_wins_then_the_oldest() {
        let user = cr(
            "mine",
            "2026-01-01T00:00:00Z",
            json!({"evictionStrategy": "None",
                   "developerConfiguration": {"cpuAllocationRatio": 4},
                   "migrations": {"parallelMigrationsPerCluster": 9,
                                  "nodeDrainTaintKey": "example.com/drain"}}),
        );
        let owned = cr(
            "kubevirt-kubevirt-hyperconverged",
            "2026-06-01T00:00:00Z",
            json!({"evictionStrategy": "LiveMigrate",
                   "obsoleteCPUModels": {"Nehalem": true},
                   "developerConfiguration": {"cpuAllocationRatio": 20},
                   "migrations": {"parallelMigrationsPerCluster": 3}}),
        );
        let c = KubeVirtConfig::from_crs(&[&user, &owned]);
        assert_eq!(c.overcommit.cpu_allocation_ratio, 20);
        assert_eq!(c.eviction_strategy.as_deref(), Some("LiveMigrate"));
        assert_eq!(c.migrations.parallel_migrations_per_cluster, Some(3));
        assert_eq!(
            c.obsolete_cpu_models.iter().collect::<Vec<_>>(),
            ["Nehalem"]
        );
        // The owned CR keeps the default key: the first CR that names another one gives it.
        assert_eq!(c.drain_key, "example.com/drain");
        // Without the owned one, the oldest.
        let later = cr(
            "later",
            "2026-09-01T00:00:00Z",
            json!({"evictionStrategy": "External"}),
        );
        let c = KubeVirtConfig::from_crs(&[&later, &user]);
        assert_eq!(c.eviction_strategy.as_deref(), Some("None"));
        assert_eq!(c.overcommit.cpu_allocation_ratio, 4);
    }

    #[test]
    fn no_cr_gives_the_defaults() {
        let c = KubeVirtConfig::default();
        assert_eq!(c.overcommit, Overcommit::default());
        assert_eq!(c.drain_key, ferrovirt_api::eviction::DRAIN_TAINT);
        assert_eq!(c.eviction_strategy, None);
        assert!(c.common_instancetypes);
        assert!(c.obsolete_cpu_models.contains("qemu64"));
        assert_eq!(c.permitted_host_devices, None);
        assert_eq!(
            c.migrations,
            migration_policy::cluster_configuration(None, None)
        );
    }
}
