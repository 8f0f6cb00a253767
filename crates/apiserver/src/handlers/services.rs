//! Service ClusterIP and NodePort allocation. Each address or port in use is one store key
//! (`/ferrovirt/allocations/serviceips/<ip>`, `/ferrovirt/allocations/nodeports/<port>`)
//! created with create-if-absent, so two concurrent creates (on one server or on several
//! sharing an etcd) never get the same value. A key names its Service by namespace, name and
//! uid; it is released when the Service is deleted or stops using it, and a key whose Service
//! is gone (a namespace torn down, a create that failed half-way) is taken over once it is older
//! than [`STALE_AFTER_SECS`].

use std::net::Ipv4Addr;
use std::time::{SystemTime, UNIX_EPOCH};

use ferrovirt_api::registry::ResourceDef;
use ferrovirt_api::service::{self, NODE_PORT_MAX, NODE_PORT_MIN, ServiceCidr};
use ferrovirt_store::StoreError;
use serde_json::{Value, json};

use super::load;
use crate::error::ApiError;
use crate::objects::{meta_str, name_of, namespace_of};
use crate::server::Shared;

const IP_PREFIX: &str = "/ferrovirt/allocations/serviceips/";
const PORT_PREFIX: &str = "/ferrovirt/allocations/nodeports/";
/// A reservation whose Service does not exist is taken over after this long (a create in
/// flight stores its Service well within it).
const STALE_AFTER_SECS: u64 = 60;

/// Whether `def` is core/v1 Service.
pub(crate) fn applies_to(def: &ResourceDef) -> bool {
    def.group.is_empty() && def.kind == "Service"
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn ip_key(ip: Ipv4Addr) -> String {
    format!("{IP_PREFIX}{ip}")
}

fn port_key(port: u16) -> String {
    format!("{PORT_PREFIX}{port}")
}

/// The owner record of a reservation.
fn record(obj: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "namespace": namespace_of(obj).unwrap_or_default(),
        "name": name_of(obj),
        "uid": meta_str(obj, "uid").unwrap_or_default(),
        "at": now(),
    }))
    .unwrap_or_default()
}

/// Creates `key` for `obj`'s Service; true when it is (now) held by that Service.
async fn reserve(sh: &Shared, def: &ResourceDef, key: &str, obj: &Value) -> Result<bool, ApiError> {
    let uid = meta_str(obj, "uid").unwrap_or_default();
    for _ in 0..3 {
        match sh.store.create(key, record(obj)).await {
            Ok(_) => return Ok(true),
            Err(StoreError::AlreadyExists(_)) => {}
            Err(e) => return Err(ApiError::from_store(e)),
        }
        let Some(kv) = sh.store.get(key).await.map_err(ApiError::from_store)? else {
            continue;
        };
        let held: Value = serde_json::from_slice(&kv.value).unwrap_or_default();
        if held["uid"] == uid {
            return Ok(true);
        }
        let age = now().saturating_sub(held["at"].as_u64().unwrap_or(0));
        let (ns, name) = (
            held["namespace"].as_str().unwrap_or_default(),
            held["name"].as_str().unwrap_or_default(),
        );
        let alive = match load(sh, def, Some(ns), name).await? {
            Some((svc, _)) => meta_str(&svc, "uid") == held["uid"].as_str(),
            None => false,
        };
        if alive || age < STALE_AFTER_SECS {
            return Ok(false);
        }
        match sh.store.update(key, record(obj), kv.mod_revision).await {
            Ok(_) => return Ok(true),
            Err(StoreError::Conflict { .. } | StoreError::NotFound(_)) => continue,
            Err(e) => return Err(ApiError::from_store(e)),
        }
    }
    Ok(false)
}

/// Deletes `key` when `uid` holds it.
async fn release_key(sh: &Shared, key: &str, uid: &str) {
    let Ok(Some(kv)) = sh.store.get(key).await else {
        return;
    };
    let held: Value = serde_json::from_slice(&kv.value).unwrap_or_default();
    if held["uid"] == uid {
        let _ = sh.store.delete(key, Some(kv.mod_revision)).await;
    }
}

/// The reservation keys a Service holds.
fn keys_of(obj: &Value) -> Vec<String> {
    let mut keys = Vec::new();
    if let Some(ip) = obj
        .pointer("/spec/clusterIP")
        .and_then(Value::as_str)
        .and_then(|s| s.parse::<Ipv4Addr>().ok())
    {
        keys.push(ip_key(ip));
    }
    keys.extend(
        service::node_ports(obj)
            .into_iter()
            .map(|(_, p)| port_key(p)),
    );
    keys
}

/// Allocates what `obj` (admitted; `old` on update) needs and does not hold yet: its ClusterIP
/// and NodePorts, writing the allocated values into it. Returns the keys reserved now (to be
/// [`release_keys`]d if the write fails).
pub(crate) async fn allocate(
    sh: &Shared,
    def: &ResourceDef,
    obj: &mut Value,
    old: Option<&Value>,
) -> Result<Vec<String>, ApiError> {
    let held: Vec<String> = old.map(keys_of).unwrap_or_default();
    let mut taken = Vec::new();
    let res = allocate_into(sh, def, obj, &held, &mut taken).await;
    if res.is_err() {
        release_keys(sh, obj, &taken).await;
    }
    res.map(|()| taken)
}

async fn allocate_into(
    sh: &Shared,
    def: &ResourceDef,
    obj: &mut Value,
    held: &[String],
    taken: &mut Vec<String>,
) -> Result<(), ApiError> {
    let name = name_of(obj).to_string();
    let cidr: ServiceCidr = sh.service_cidr;
    let ty = obj
        .pointer("/spec/type")
        .and_then(Value::as_str)
        .unwrap_or("ClusterIP")
        .to_string();
    if !service::is_headless(obj) {
        match obj.pointer("/spec/clusterIP").and_then(Value::as_str) {
            Some(ip_s) => {
                let ip: Ipv4Addr = ip_s.parse().map_err(|_| {
                    ApiError::invalid_field(
                        def,
                        &name,
                        "spec.clusterIPs",
                        format!("Invalid value: {ip_s:?}: not an IPv4 address"),
                    )
                })?;
                let key = ip_key(ip);
                if !held.contains(&key) {
                    if !cidr.assignable(ip) {
                        return Err(ApiError::invalid_field(
                            def,
                            &name,
                            "spec.clusterIPs",
                            format!(
                                "Invalid value: []string{{{ip_s:?}}}: {}",
                                service::ip_out_of_range(ip_s, &cidr)
                            ),
                        ));
                    }
                    if !reserve(sh, def, &key, obj).await? {
                        return Err(ApiError::invalid_field(
                            def,
                            &name,
                            "spec.clusterIPs",
                            format!(
                                "Invalid value: []string{{{ip_s:?}}}: {}",
                                service::ip_taken(ip_s)
                            ),
                        ));
                    }
                    taken.push(key);
                }
            }
            None => {
                let start = uuid::Uuid::new_v4().as_u128() as u32;
                let mut found = None;
                for i in 0..cidr.usable() {
                    let ip = cidr.nth(start.wrapping_add(i));
                    let key = ip_key(ip);
                    if reserve(sh, def, &key, obj).await? {
                        taken.push(key);
                        found = Some(ip);
                        break;
                    }
                }
                let ip = found.ok_or_else(|| {
                    ApiError::internal(format!(
                        "failed to allocate a serviceIP: range {cidr} is full"
                    ))
                })?;
                obj["spec"]["clusterIP"] = json!(ip.to_string());
                obj["spec"]["clusterIPs"] = json!([ip.to_string()]);
            }
        }
    }
    if ty != "NodePort" {
        return Ok(());
    }
    let count = obj
        .pointer("/spec/ports")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    let span = u32::from(NODE_PORT_MAX - NODE_PORT_MIN) + 1;
    for i in 0..count {
        let given = obj["spec"]["ports"][i]["nodePort"]
            .as_u64()
            .and_then(|n| u16::try_from(n).ok());
        match given {
            Some(p) => {
                let key = port_key(p);
                if held.contains(&key) || taken.contains(&key) {
                    continue;
                }
                if !reserve(sh, def, &key, obj).await? {
                    return Err(ApiError::invalid_field(
                        def,
                        &name,
                        &format!("spec.ports[{i}].nodePort"),
                        format!("Invalid value: {p}: {}", service::PORT_TAKEN),
                    ));
                }
                taken.push(key);
            }
            None => {
                let start = uuid::Uuid::new_v4().as_u128() as u32;
                let mut found = None;
                for j in 0..span {
                    let p = NODE_PORT_MIN + ((start.wrapping_add(j)) % span) as u16;
                    let key = port_key(p);
                    if held.contains(&key) || taken.contains(&key) {
                        continue;
                    }
                    if reserve(sh, def, &key, obj).await? {
                        taken.push(key);
                        found = Some(p);
                        break;
                    }
                }
                let p = found.ok_or_else(|| {
                    ApiError::internal("failed to allocate a nodePort: range is full")
                })?;
                obj["spec"]["ports"][i]["nodePort"] = json!(p);
            }
        }
    }
    Ok(())
}

/// Releases `keys` held by `obj`'s Service.
pub(crate) async fn release_keys(sh: &Shared, obj: &Value, keys: &[String]) {
    let uid = meta_str(obj, "uid").unwrap_or_default();
    for k in keys {
        release_key(sh, k, uid).await;
    }
}

/// After a write: releases what `old` held and `new` (None: deleted) no longer does.
pub(crate) async fn release_dropped(sh: &Shared, old: &Value, new: Option<&Value>) {
    let keep = new.map(keys_of).unwrap_or_default();
    let dropped: Vec<String> = keys_of(old)
        .into_iter()
        .filter(|k| !keep.contains(k))
        .collect();
    release_keys(sh, old, &dropped).await;
}
