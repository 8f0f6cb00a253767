//! ResourceQuota (core/v1) enforcement: every create in a namespace is charged against the
//! namespace's quotas before it is stored ([`charge`]): each quota that limits something the
//! object uses has its `status.used` raised with a compare-and-swap on the quota object
//! (retried on conflict), as kube-apiserver's quota admission does, so two racing creates
//! never both take the last slot; a refused create is 403 with Kubernetes' `exceeded quota:`
//! message, a create that then fails gives its charge back ([`refund`]). [`run`] recounts
//! `status.used` from the stored objects every few seconds (and so follows deletes) and fills
//! `status.hard`, as Kubernetes' quota controller; it reads nothing while no quota exists.
//! The decisions are pure ([`usage`]).

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
    let mut done: Vec<Charge> = Vec::new();
    for key in keys {
        match charge_one(sh, &key, &requested).await {
            Ok(true) => done.push(Charge {
                key,
                requested: requested.clone(),
            }),
            Ok(false) => {}
            Err(msg) => {
                refund(sh, done).await;
                let qualified = if def.group.is_empty() {
                    def.plural.to_string()
                } else {
                    format!("{}.{}", def.plural, def.group)
                };
                let name = name_of(obj);
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

/// Charges one quota with compare-and-swap: Ok(true) charged, Ok(false) nothing it limits,
/// Err(message) exceeded (or the quota could not be written).
async fn charge_one(sh: &Shared, key: &str, requested: &Usage) -> Result<bool, String> {
    for _ in 0..32 {
        let kv = match sh.store.get(key).await {
            Ok(Some(kv)) => kv,
            Ok(None) => return Ok(false),
            Err(e) => return Err(format!("reading quota {key}: {e}")),
        };
        let Ok(mut q) = decode(&kv) else {
            return Ok(false);
        };
        let hard = usage::usage_of(&q["spec"]["hard"]);
        if !hard
            .keys()
            .any(|k| requested.get(k).is_some_and(|v| *v > 0))
        {
            return Ok(false);
        }
        if q["status"]["used"].is_null() {
            // Never counted yet (just created): count what exists first.
            recount(sh, key).await.map_err(|e| e.message)?;
            continue;
        }
        let used = usage::usage_of(&q["status"]["used"]);
        let new_used = usage::admit(name_of(&q), &hard, &used, requested)?;
        q["status"] = json!({"hard": q["spec"]["hard"].clone(), "used": usage::to_json(&new_used)});
        match sh.store.update(key, encode(&q), kv.mod_revision).await {
            Ok(_) => return Ok(true),
            Err(StoreError::Conflict { .. }) => continue,
            Err(StoreError::NotFound(_)) => return Ok(false),
            Err(e) => return Err(format!("writing quota {key}: {e}")),
        }
    }
    Err(format!("quota {key} is changing too often; try again"))
}

/// Gives charges back (a create that failed after being charged).
pub(crate) async fn refund(sh: &Shared, charges: Vec<Charge>) {
    for c in charges {
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
        let mut total = Usage::new();
        for def in kinds_for(sh, &hard) {
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
                for (k, v) in usage::charged(def.group, def.plural, &obj, &overcommit) {
                    *total.entry(k).or_default() += v;
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
