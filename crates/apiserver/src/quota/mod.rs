//! ResourceQuota (core/v1) enforcement: every create in a namespace is charged against the
//! namespace's quotas before it is stored ([`charge`]): each quota that limits something the
//! object uses has its `status.used` raised with a compare-and-swap on the quota object
//! (retried on conflict), as kube-apiserver's quota admission does, so two racing creates
//! never both take the last slot; a refused create is 403 with Kubernetes' `exceeded quota:`
//! message, a create that then fails gives its charge back ([`refund`]). [`run`] recounts
//! `status.used` from the stored objects every few seconds (and so follows deletes) and fills
//! `status.hard`, as Kubernetes' quota controller; it reads nothing while no quota exists.
//! A live migration's target is charged when its VirtualMachineInstanceMigration enters
//! Scheduling ([`charge_migration`], the launcher Pod's resources a second time; refused: 403
//! with the `exceeded quota:` message, the controller keeps it Pending) and counted by the
//! recount while it holds the target; it is recounted away when the migration ends.
//! A charge is [`InFlight`] from before its quota write until its object is stored, and the
//! recount adds what is in flight, so a recount between the two never drops a charge (which
//! would let another create over-admit). The decisions are pure ([`usage`]).

pub mod usage;

use std::sync::Arc;
use std::time::Duration;

use ferrovirt_api::registry::ResourceDef;
use ferrovirt_store::{ListOptions, StoreError};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::objects::{decode, encode, name_of};
use crate::resources;
use crate::server::Shared;
use usage::Usage;

/// How often [`run`] recounts.
const RECOUNT_EVERY: Duration = Duration::from_secs(5);

/// Refuses what quota enforcement does not carry out: `spec.scopes` and `spec.scopeSelector`
/// (a scoped quota would otherwise be enforced as an unscoped one); 422 naming the field.
pub(crate) fn validate(def: &ResourceDef, obj: &Value) -> Result<(), ApiError> {
    if !(def.group.is_empty() && def.plural == "resourcequotas") {
        return Ok(());
    }
    for field in ["scopes", "scopeSelector"] {
        let v = &obj["spec"][field];
        let set = match v {
            Value::Null => false,
            Value::Array(a) => !a.is_empty(),
            Value::Object(m) => !m.is_empty(),
            _ => true,
        };
        if set {
            return Err(ApiError::invalid_field(
                def,
                name_of(obj),
                &format!("spec.{field}"),
                "Unsupported value: quota scopes are not supported by ferrovirt; the quota would apply to every object".into(),
            ));
        }
    }
    Ok(())
}

/// One quota's charge for one create.
pub(crate) struct Charge {
    key: String,
    requested: Usage,
    id: u64,
}

/// Charges written to a quota whose object is not stored yet, by id: (quota key, usage).
#[derive(Default)]
pub(crate) struct InFlight {
    next: std::sync::atomic::AtomicU64,
    charges: std::sync::Mutex<std::collections::BTreeMap<u64, (String, Usage)>>,
}

impl InFlight {
    fn add(&self, key: &str, u: &Usage) -> u64 {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut m) = self.charges.lock() {
            m.insert(id, (key.to_string(), u.clone()));
        }
        id
    }
    fn remove(&self, id: u64) {
        if let Ok(mut m) = self.charges.lock() {
            m.remove(&id);
        }
    }
    /// What is in flight for quota `key`.
    fn of(&self, key: &str) -> Usage {
        let mut total = Usage::new();
        if let Ok(m) = self.charges.lock() {
            for (k, u) in m.values() {
                if k == key {
                    for (r, v) in u {
                        *total.entry(r.clone()).or_default() += v;
                    }
                }
            }
        }
        total
    }
}

/// The charged object is stored: its charges are no longer in flight (the recount finds it).
pub(crate) fn settle(sh: &Shared, charges: &[Charge]) {
    for c in charges {
        sh.quota_inflight.remove(c.id);
    }
}

fn quota_def(sh: &Shared) -> Option<&ResourceDef> {
    sh.resources.lookup("", "v1", "resourcequotas")
}

async fn quotas_in(sh: &Shared, ns: &str) -> Result<Vec<String>, ApiError> {
    let Some(def) = quota_def(sh) else {
        return Ok(Vec::new());
    };
    let list = sh
        .store
        .list(
            &resources::list_prefix(def, Some(ns)),
            ListOptions::default(),
        )
        .await
        .map_err(ApiError::from_store)?;
    Ok(list.items.into_iter().map(|kv| kv.key).collect())
}

/// Charges `obj` (about to be created as `def` in `ns`) against the namespace's quotas; on
/// refusal, the charges already made are given back.
pub(crate) async fn charge(
    sh: &Shared,
    def: &ResourceDef,
    ns: &str,
    obj: &Value,
) -> Result<Vec<Charge>, ApiError> {
    let keys = quotas_in(sh, ns).await?;
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let overcommit = crate::cluster_config::overcommit(sh).await;
    let requested = usage::charged(def.group, def.plural, obj, &overcommit);
    let qualified = if def.group.is_empty() {
        def.plural.to_string()
    } else {
        format!("{}.{}", def.plural, def.group)
    };
    charge_usage(sh, keys, &requested, def, &qualified, name_of(obj)).await
}

/// Charges `requested` against the quotas `keys` for the object `name` of `def`.
async fn charge_usage(
    sh: &Shared,
    keys: Vec<String>,
    requested: &Usage,
    def: &ResourceDef,
    qualified: &str,
    name: &str,
) -> Result<Vec<Charge>, ApiError> {
    let mut done: Vec<Charge> = Vec::new();
    for key in keys {
        match charge_one(sh, &key, requested).await {
            Ok(Some(id)) => done.push(Charge {
                key,
                requested: requested.clone(),
                id,
            }),
            Ok(None) => {}
            Err(msg) => {
                refund(sh, done).await;
                let message = if name.is_empty() {
                    format!("{qualified} is forbidden: {msg}")
                } else {
                    format!("{qualified} {name:?} is forbidden: {msg}")
                };
                return Err(ApiError {
                    details: Some(json!({"name": name, "group": def.group, "kind": def.plural})),
                    ..ApiError::forbidden(message)
                });
            }
        }
    }
    Ok(done)
}

/// The quota step of an update of a VirtualMachineInstanceMigration (`def`) from `old` to
/// `new`: entering Scheduling charges its target (the VMI's launcher-Pod resources; refused:
/// 403 `exceeded quota: …`), settled or refunded by the caller after its write
/// ([`after_migration_update`]).
pub(crate) async fn charge_migration(
    sh: &Shared,
    def: &ResourceDef,
    old: &Value,
    new: &Value,
) -> Result<Vec<Charge>, ApiError> {
    if !is_migration(def) || usage::migration_transition(old, new) != usage::MigrationQuota::Charge
    {
        return Ok(Vec::new());
    }
    let ns = new["metadata"]["namespace"].as_str().unwrap_or_default();
    let keys = quotas_in(sh, ns).await?;
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let vmi_name = new["spec"]["vmiName"].as_str().unwrap_or_default();
    let Some(vmi) = stored_vmi(sh, ns, vmi_name).await? else {
        // The controller fails a migration of a missing VMI; nothing to hold.
        return Ok(Vec::new());
    };
    let overcommit = crate::cluster_config::overcommit(sh).await;
    let requested = usage::migration_target(&vmi, &overcommit);
    charge_usage(
        sh,
        keys,
        &requested,
        def,
        "virtualmachineinstancemigrations.kubevirt.io",
        name_of(new),
    )
    .await
}

/// After a migration's update was written (`ok`) or not: its charges settled or refunded;
/// a migration that stopped holding its target is recounted away at once.
pub(crate) async fn after_migration_update(
    sh: &Shared,
    def: &ResourceDef,
    old: &Value,
    new: &Value,
    charges: Vec<Charge>,
    ok: bool,
) {
    if ok {
        settle(sh, &charges);
    } else {
        refund(sh, charges).await;
    }
    if ok
        && is_migration(def)
        && usage::migration_transition(old, new) == usage::MigrationQuota::Release
    {
        recount_namespace(
            sh,
            new["metadata"]["namespace"].as_str().unwrap_or_default(),
        )
        .await;
    }
}

/// After `obj` of `def` was deleted: a migration that held its target (a cancel) is
/// recounted away at once (the recount would within [`RECOUNT_EVERY`]).
pub(crate) async fn after_delete(sh: &Shared, def: &ResourceDef, obj: &Value) {
    if is_migration(def)
        && usage::migration_holds_target(obj["status"]["phase"].as_str().unwrap_or(""))
    {
        recount_namespace(
            sh,
            obj["metadata"]["namespace"].as_str().unwrap_or_default(),
        )
        .await;
    }
}

async fn recount_namespace(sh: &Shared, ns: &str) {
    for key in quotas_in(sh, ns).await.unwrap_or_default() {
        if let Err(e) = recount(sh, &key).await {
            tracing::warn!("quota: recounting {key}: {}", e.message);
        }
    }
}

fn is_migration(def: &ResourceDef) -> bool {
    def.group == "kubevirt.io" && def.plural == "virtualmachineinstancemigrations"
}

async fn stored_vmi(sh: &Shared, ns: &str, name: &str) -> Result<Option<Value>, ApiError> {
    let Some(def) = sh
        .resources
        .lookup("kubevirt.io", "v1", "virtualmachineinstances")
    else {
        return Ok(None);
    };
    let key = resources::object_key(def, Some(ns), name);
    match sh.store.get(&key).await.map_err(ApiError::from_store)? {
        Some(kv) => Ok(decode(&kv).ok()),
        None => Ok(None),
    }
}

/// Charges one quota with compare-and-swap: Ok(Some(in-flight id)) charged, Ok(None) nothing
/// it limits, Err(message) exceeded (or the quota could not be written). The charge is in
/// flight ([`InFlight`]) from before its write.
async fn charge_one(sh: &Shared, key: &str, requested: &Usage) -> Result<Option<u64>, String> {
    for _ in 0..32 {
        let kv = match sh.store.get(key).await {
            Ok(Some(kv)) => kv,
            Ok(None) => return Ok(None),
            Err(e) => return Err(format!("reading quota {key}: {e}")),
        };
        let Ok(mut q) = decode(&kv) else {
            return Ok(None);
        };
        let hard = usage::usage_of(&q["spec"]["hard"]);
        if !hard
            .keys()
            .any(|k| requested.get(k).is_some_and(|v| *v > 0))
        {
            return Ok(None);
        }
        if q["status"]["used"].is_null() {
            // Never counted yet (just created): count what exists first.
            recount(sh, key).await.map_err(|e| e.message)?;
            continue;
        }
        let used = usage::usage_of(&q["status"]["used"]);
        let new_used = usage::admit(name_of(&q), &hard, &used, requested)?;
        q["status"] = json!({"hard": q["spec"]["hard"].clone(), "used": usage::to_json(&new_used)});
        let id = sh.quota_inflight.add(key, requested);
        match sh.store.update(key, encode(&q), kv.mod_revision).await {
            Ok(_) => return Ok(Some(id)),
            Err(StoreError::Conflict { .. }) => {}
            Err(StoreError::NotFound(_)) => {
                sh.quota_inflight.remove(id);
                return Ok(None);
            }
            Err(e) => {
                sh.quota_inflight.remove(id);
                return Err(format!("writing quota {key}: {e}"));
            }
        }
        sh.quota_inflight.remove(id);
    }
    Err(format!("quota {key} is changing too often; try again"))
}

/// Gives charges back (a create that failed after being charged).
pub(crate) async fn refund(sh: &Shared, charges: Vec<Charge>) {
    for c in charges {
        sh.quota_inflight.remove(c.id);
        for _ in 0..32 {
            let Ok(Some(kv)) = sh.store.get(&c.key).await else {
                break;
            };
            let Ok(mut q) = decode(&kv) else { break };
            let hard = usage::usage_of(&q["spec"]["hard"]);
            let used = usage::usage_of(&q["status"]["used"]);
            q["status"]["used"] = usage::to_json(&usage::release(&hard, &used, &c.requested));
            match sh.store.update(&c.key, encode(&q), kv.mod_revision).await {
                Err(StoreError::Conflict { .. }) => continue,
                _ => break,
            }
        }
    }
}

/// The kinds whose objects a quota's `hard` names: `count/<plural>[.<group>]`, the legacy
/// count names, VMIs for cpu/memory/pods, claims for storage.
fn kinds_for<'a>(sh: &'a Shared, hard: &Usage) -> Vec<&'a ResourceDef> {
    let mut out: Vec<&ResourceDef> = Vec::new();
    let mut push = |d: Option<&'a ResourceDef>| {
        if let Some(d) = d
            && !out
                .iter()
                .any(|o| o.group == d.group && o.plural == d.plural)
        {
            out.push(d);
        }
    };
    let vmis = sh
        .resources
        .lookup("kubevirt.io", "v1", "virtualmachineinstances");
    let pvcs = sh.resources.lookup("", "v1", "persistentvolumeclaims");
    for k in hard.keys() {
        let k = k.as_str();
        match k {
            "pods" | "count/pods" | "cpu" | "memory" | "requests.cpu" | "requests.memory" => {
                push(vmis)
            }
            "requests.storage" | "persistentvolumeclaims" => push(pvcs),
            _ => {
                let name = k.strip_prefix("count/").unwrap_or(k);
                let (plural, group) = name.split_once('.').unwrap_or((name, ""));
                push(
                    sh.resources
                        .storage_defs()
                        .into_iter()
                        .find(|d| d.group == group && d.plural == plural && d.namespaced),
                );
            }
        }
    }
    out
}

/// Recounts one quota from the stored objects; writes `status` when it changed.
async fn recount(sh: &Shared, key: &str) -> Result<(), ApiError> {
    let overcommit = crate::cluster_config::overcommit(sh).await;
    for _ in 0..8 {
        let Some(kv) = sh.store.get(key).await.map_err(ApiError::from_store)? else {
            return Ok(());
        };
        let mut q = decode(&kv)?;
        let ns = q["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let hard = usage::usage_of(&q["spec"]["hard"]);
        // Read after the quota (whose revision the write below is guarded by) and before the
        // objects: a charge in that revision is either still in flight or already stored.
        let mut total = sh.quota_inflight.of(key);
        let mut vmis: std::collections::HashMap<String, Value> = Default::default();
        let kinds = kinds_for(sh, &hard);
        for def in &kinds {
            let list = sh
                .store
                .list(
                    &resources::list_prefix(def, Some(&ns)),
                    ListOptions::default(),
                )
                .await
                .map_err(ApiError::from_store)?;
            for item in &list.items {
                let Ok(obj) = decode(item) else { continue };
                // A VMI that has finished no longer has a running launcher Pod.
                let finished = matches!(
                    obj["status"]["phase"].as_str(),
                    Some("Succeeded" | "Failed")
                );
                if def.plural == "virtualmachineinstances" && finished {
                    continue;
                }
                if def.plural == "virtualmachineinstances" {
                    vmis.insert(name_of(&obj).to_string(), obj.clone());
                }
                for (k, v) in usage::charged(def.group, def.plural, &obj, &overcommit) {
                    *total.entry(k).or_default() += v;
                }
            }
        }
        // Migrations holding a target charge the VMI's launcher Pod a second time.
        if kinds.iter().any(|d| d.plural == "virtualmachineinstances")
            && let Some(mdef) =
                sh.resources
                    .lookup("kubevirt.io", "v1", "virtualmachineinstancemigrations")
        {
            let list = sh
                .store
                .list(
                    &resources::list_prefix(mdef, Some(&ns)),
                    ListOptions::default(),
                )
                .await
                .map_err(ApiError::from_store)?;
            for item in &list.items {
                let Ok(m) = decode(item) else { continue };
                if !usage::migration_holds_target(m["status"]["phase"].as_str().unwrap_or("")) {
                    continue;
                }
                if let Some(vmi) = m["spec"]["vmiName"].as_str().and_then(|n| vmis.get(n)) {
                    for (k, v) in usage::migration_target(vmi, &overcommit) {
                        *total.entry(k).or_default() += v;
                    }
                }
            }
        }
        let used: Usage = hard
            .keys()
            .map(|k| (k.clone(), total.get(k).copied().unwrap_or(0)))
            .collect();
        let status = json!({"hard": q["spec"]["hard"].clone(), "used": usage::to_json(&used)});
        if q["status"] == status {
            return Ok(());
        }
        q["status"] = status;
        match sh.store.update(key, encode(&q), kv.mod_revision).await {
            Err(StoreError::Conflict { .. }) => continue,
            Err(StoreError::NotFound(_)) => return Ok(()),
            other => return other.map(|_| ()).map_err(ApiError::from_store),
        }
    }
    Ok(())
}

/// Keeps every quota's `status` recounted until shutdown.
pub(crate) async fn run(sh: Arc<Shared>) {
    let mut shutdown = sh.shutdown.clone();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(RECOUNT_EVERY) => {}
            _ = shutdown.changed() => return,
        }
        let Some(def) = quota_def(&sh) else { return };
        let keys = match sh
            .store
            .list(&resources::list_prefix(def, None), ListOptions::default())
            .await
        {
            Ok(l) => l.items.into_iter().map(|kv| kv.key).collect::<Vec<_>>(),
            Err(e) => {
                tracing::warn!("quota: cannot list quotas: {e}");
                continue;
            }
        };
        for key in keys {
            if let Err(e) = recount(&sh, &key).await {
                tracing::warn!("quota: recounting {key}: {}", e.message);
            }
        }
    }
}
