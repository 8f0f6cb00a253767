//! core/v1 Pods: the launcher Pod views, computed from the VirtualMachineInstances by
//! [`ferrovirt_api::launcher_pod`] and never stored (list and get here; watch in
//! `crate::watch`), and their `eviction` subresource (policy/v1 and v1beta1 Eviction, what
//! `kubectl drain` posts), decided by [`ferrovirt_api::eviction::decide`]: an evacuation marks
//! the VMI's `status.evacuationNodeName` (the controller migrates it) and answers 429 until
//! the VMI has left the node (its Pod is then gone: 404, which ends kubectl's retries); an
//! eviction that stops the VMI deletes it. Creating, changing or deleting a Pod is refused:
//! deleting a launcher Pod is not an eviction (it would bypass the VMI's evictionStrategy).
//! The platform namespace also shows the components' Pod views
//! ([`ferrovirt_api::platform_pod`]: list and get; not in watches, not evictable).

use axum::body::Body;
use axum::response::Response;
use ferrovirt_api::eviction::{self, Answer, Subject};
use ferrovirt_api::hco::desired::PLATFORM_NAMESPACE;
use ferrovirt_api::launcher_pod;
use ferrovirt_api::platform_pod::{self, LEADER_LEASE};
use ferrovirt_api::registry::ResourceDef;
use ferrovirt_store::StoreError;
use http::{Method, StatusCode};
use serde_json::{Value, json};

use super::read::{list_all, list_body, render_one, selectors};
use super::{Ctx, DeleteOpts, delete_one, json_response, load, store_update};
use crate::body::{content_type, parse_object, read_body};
use crate::error::ApiError;
use crate::events::{EventRecord, record_event};
use crate::server::Shared;

/// The component named on the Events the eviction records (KubeVirt's webhook is virt-api).
const COMPONENT: &str = "virt-api";

/// Whether `def` is core/v1 Pod (served as launcher views).
pub(crate) fn is_pod(def: &ResourceDef) -> bool {
    def.group.is_empty() && def.plural == "pods"
}

/// The VirtualMachineInstance definition the views are computed from.
pub(crate) fn vmi_def(sh: &Shared) -> Result<ResourceDef, ApiError> {
    sh.resources
        .lookup("kubevirt.io", "v1", "virtualmachineinstances")
        .cloned()
        .ok_or_else(|| ApiError::internal("VirtualMachineInstances are not served"))
}

/// Serves a Pod request (`sub`: the subresource).
pub(super) async fn serve(
    ctx: Ctx,
    method: Method,
    name: Option<String>,
    sub: Option<&str>,
    body: Body,
    watching: bool,
) -> Result<Response, ApiError> {
    match (method.as_str(), name, sub) {
        ("POST", Some(name), Some("eviction")) => evict(&ctx, &name, body).await,
        ("GET", name, None) if watching => crate::watch::serve(ctx, name).await,
        ("GET", None, None) => list(&ctx).await,
        ("GET", Some(name), None | Some("status")) => get(&ctx, &name).await,
        ("DELETE", Some(name), None) => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            format!(
                "pods {name:?} is a launcher Pod, a view of a VirtualMachineInstance, and cannot be deleted: evict it (POST .../pods/{name}/eviction, as kubectl drain does), which honours the VMI's evictionStrategy, or delete the VirtualMachineInstance{}",
                launcher_pod::vmi_name_of(&name)
                    .map(|v| format!(" {v:?}"))
                    .unwrap_or_default()
            ),
        )),
        (_, _, Some(s)) if s != "status" && s != "eviction" => Err(ApiError::path_not_found()),
        (m, _, _) => Err(ApiError::method_not_allowed(m)),
    }
}

/// Every launcher Pod of the namespace (all when `None`), from the VMIs at one revision.
pub(crate) async fn views(ctx: &Ctx, ns: Option<&str>) -> Result<(Vec<Value>, i64), ApiError> {
    let def = vmi_def(&ctx.sh)?;
    let listed = list_all(ctx, &def, ns).await?;
    let mut pods: Vec<Value> = listed
        .items
        .iter()
        .flat_map(launcher_pod::pods_for)
        .collect();
    if ns.is_none_or(|n| n == PLATFORM_NAMESPACE) {
        pods.extend(platform_views(ctx).await?);
    }
    Ok((pods, listed.revision))
}

/// The platform's component Pods (`ferrovirt_api::platform_pod`), from the Nodes and the
/// controllers' leader Lease.
async fn platform_views(ctx: &Ctx) -> Result<Vec<Value>, ApiError> {
    let Some(node_def) = ctx.sh.resources.lookup("", "v1", "nodes").cloned() else {
        return Ok(Vec::new());
    };
    let nodes = list_all(ctx, &node_def, None).await?;
    let lease = match ctx
        .sh
        .resources
        .lookup("coordination.k8s.io", "v1", "leases")
        .cloned()
    {
        Some(def) => load(&ctx.sh, &def, Some(LEADER_LEASE.0), LEADER_LEASE.1)
            .await?
            .map(|(l, _)| l),
        None => None,
    };
    let since = match ctx.sh.resources.lookup("", "v1", "namespaces").cloned() {
        Some(def) => load(&ctx.sh, &def, None, PLATFORM_NAMESPACE)
            .await?
            .and_then(|(n, _)| n.pointer("/metadata/creationTimestamp").cloned()),
        None => None,
    };
    Ok(platform_pod::pods(
        &nodes.items,
        lease.as_ref(),
        &since.unwrap_or(Value::Null),
    ))
}

/// GET on the collection: every view matching the selectors (`limit` is not applied: the
/// whole list is one page, which the API allows).
async fn list(ctx: &Ctx) -> Result<Response, ApiError> {
    let (labels, fields) = selectors(ctx)?;
    let (pods, revision) = views(ctx, ctx.ns()).await?;
    let items: Vec<Value> = pods
        .into_iter()
        .filter(|p| labels.matches_object(p) && fields.matches(p))
        .collect();
    let meta = json!({"resourceVersion": revision.to_string()});
    Ok(json_response(StatusCode::OK, &list_body(ctx, items, meta)))
}

/// The view named `name` with its VMI and the VMI's revision.
async fn find(ctx: &Ctx, name: &str) -> Result<(Value, Value, i64), ApiError> {
    let not_found = || ApiError::not_found(&ctx.def, name);
    if ctx.ns() == Some(PLATFORM_NAMESPACE) && name.starts_with("virt-") {
        let pod = platform_views(ctx)
            .await?
            .into_iter()
            .find(|p| p.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
            .ok_or_else(not_found)?;
        return Ok((pod, Value::Null, 0));
    }
    let vmi_name = launcher_pod::vmi_name_of(name).ok_or_else(not_found)?;
    let def = vmi_def(&ctx.sh)?;
    let (vmi, rev) = load(&ctx.sh, &def, ctx.ns(), vmi_name)
        .await?
        .ok_or_else(not_found)?;
    let pod = launcher_pod::pods_for(&vmi)
        .into_iter()
        .find(|p| p.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
        .ok_or_else(not_found)?;
    Ok((pod, vmi, rev))
}

async fn get(ctx: &Ctx, name: &str) -> Result<Response, ApiError> {
    let (pod, _, _) = find(ctx, name).await?;
    Ok(json_response(StatusCode::OK, &render_one(ctx, pod)))
}

/// The first value at `ptr` among the objects of a cluster-wide kind (none when the kind is
/// not served or the list fails).
async fn first_value(ctx: &Ctx, gvp: (&str, &str, &str), ptr: &str) -> Option<String> {
    let def = ctx.sh.resources.lookup(gvp.0, gvp.1, gvp.2).cloned()?;
    let listed = list_all(ctx, &def, None).await.ok()?;
    listed
        .items
        .iter()
        .find_map(|o| o.pointer(ptr).and_then(Value::as_str).map(str::to_string))
}

/// The cluster's eviction strategies: (KubeVirt CR, HyperConverged). The HyperConverged's
/// `evictionStrategy` reaches the KubeVirt CR through its reconcile, so only that is read.
async fn cluster_strategies(ctx: &Ctx) -> (Option<String>, Option<String>) {
    (
        first_value(
            ctx,
            ("kubevirt.io", "v1", "kubevirts"),
            "/spec/configuration/evictionStrategy",
        )
        .await,
        None,
    )
}

/// A 429 TooManyRequests metav1.Status (kubectl drain retries these every 5 s).
fn too_many_requests(pod: &str, message: String) -> ApiError {
    ApiError {
        details: Some(json!({
            "name": pod, "kind": "pods",
            "causes": [{"reason": "EvictionBlocked", "message": message.clone()}],
        })),
        ..ApiError::new(429, "TooManyRequests", message)
    }
}

async fn event(sh: &Shared, vmi: &Value, warning: bool, reason: &str, message: &str) {
    let rec = EventRecord {
        involved: vmi.clone(),
        type_: if warning { "Warning" } else { "Normal" }.into(),
        reason: reason.into(),
        message: message.into(),
        component: COMPONENT.into(),
    };
    if let Err(e) = record_event(&*sh.store, &rec).await {
        tracing::debug!(error = %e, "recording an eviction event");
    }
}

/// POST `pods/{name}/eviction`.
async fn evict(ctx: &Ctx, name: &str, body: Body) -> Result<Response, ApiError> {
    let bytes = read_body(&ctx.headers, body, ctx.sh.max_body, ctx.sh.body_timeout).await?;
    let ev = parse_object(&bytes, &content_type(&ctx.headers))?;
    let api_version = ev.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    let kind = ev.get("kind").and_then(Value::as_str).unwrap_or("");
    // Clients may leave the type out (kube-rs does); the URL names it then.
    if !matches!(api_version, "policy/v1" | "policy/v1beta1" | "")
        || !matches!(kind, "Eviction" | "")
    {
        return Err(ApiError::bad_request(format!(
            "the body must be a policy/v1 (or policy/v1beta1) Eviction, not {api_version}, Kind={kind}"
        )));
    }
    if let Some(n) = ev.pointer("/metadata/name").and_then(Value::as_str)
        && n != name
    {
        return Err(ApiError::bad_request(format!(
            "name in URL does not match name in Eviction object: {name:?} != {n:?}"
        )));
    }
    let opts = ev.get("deleteOptions").cloned().unwrap_or(Value::Null);
    let dry_run = opts
        .get("dryRun")
        .and_then(Value::as_array)
        .is_some_and(|a| a.iter().any(|x| x == "All"))
        || ctx.q.get("dryRun") == Some("All");
    let vmi_def = vmi_def(&ctx.sh)?;
    let (kv_strategy, hco_strategy) = cluster_strategies(ctx).await;
    for _ in 0..8 {
        let (pod, vmi, rev) = find(ctx, name).await?;
        if vmi.is_null() {
            return Err(ApiError::new(
                405,
                "MethodNotAllowed",
                format!("pods {name:?} is a view of a platform component and cannot be evicted"),
            ));
        }
        for (field, ptr) in [
            ("UID", "/metadata/uid"),
            ("ResourceVersion", "/metadata/resourceVersion"),
        ] {
            let lower = if field == "UID" {
                "uid"
            } else {
                "resourceVersion"
            };
            if let Some(want) = opts
                .pointer(&format!("/preconditions/{lower}"))
                .and_then(Value::as_str)
            {
                let actual = pod.pointer(ptr).and_then(Value::as_str).unwrap_or_default();
                if want != actual {
                    return Err(ApiError::conflict(
                        &ctx.def,
                        name,
                        &format!(
                            "Precondition failed: {field} in precondition: {want}, {field} in object meta: {actual}"
                        ),
                    ));
                }
            }
        }
        let ok = || {
            json_response(
                StatusCode::CREATED,
                &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
            )
        };
        if vmi.pointer("/metadata/deletionTimestamp").is_some() {
            return Ok(ok()); // already going away
        }
        let ns = vmi
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or("default");
        let vmi_name = vmi
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let full = format!("{ns}/{vmi_name}");
        let node = pod
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if vmi.pointer("/status/nodeName").and_then(Value::as_str) != Some(node) {
            // The target of a running migration: it goes away or becomes the VMI's Pod
            // when the migration ends (the VMI's strategy is decided then).
            return Err(too_many_requests(
                name,
                format!(
                    "pod {name} is the target of a running migration of VMI {full}: evict it once the migration has ended"
                ),
            ));
        }
        let live = vmi
            .pointer("/status/conditions")
            .and_then(Value::as_array)
            .and_then(|cs| cs.iter().find(|c| c["type"] == "LiveMigratable"))
            .filter(|c| c["status"] == "False");
        let not_migratable = live.map(|c| {
            (
                c["reason"].as_str().unwrap_or_default(),
                c["message"].as_str().unwrap_or_default(),
            )
        });
        let subject = Subject {
            vmi: &full,
            node,
            strategy: eviction::effective(
                vmi.pointer("/spec/evictionStrategy")
                    .and_then(Value::as_str),
                kv_strategy.as_deref(),
                hco_strategy.as_deref(),
            ),
            running: vmi.pointer("/status/phase").and_then(Value::as_str) == Some("Running"),
            not_migratable,
            evacuation_node: vmi
                .pointer("/status/evacuationNodeName")
                .and_then(Value::as_str),
        };
        match eviction::decide(&subject) {
            Answer::Refuse {
                mark,
                message,
                event: note,
            } => {
                if mark && !dry_run {
                    let mut marked = vmi.clone();
                    if !marked.get("status").is_some_and(Value::is_object) {
                        marked["status"] = json!({});
                    }
                    marked["status"]["evacuationNodeName"] = json!(node);
                    match store_update(&ctx.sh, &vmi_def, marked, rev).await? {
                        Ok(_) => {}
                        Err(StoreError::Conflict { .. }) => continue,
                        Err(e) => return Err(ApiError::from_store(e)),
                    }
                }
                if let Some((reason, text, warning)) = note.filter(|_| !dry_run) {
                    event(&ctx.sh, &vmi, warning, reason, &text).await;
                }
                return Err(too_many_requests(name, message));
            }
            Answer::Stop { message } => {
                if !dry_run {
                    let del = DeleteOpts {
                        uid: vmi
                            .pointer("/metadata/uid")
                            .and_then(Value::as_str)
                            .map(str::to_string),
                        resource_version: None,
                        propagation: None,
                        grace_period: None,
                        dry_run: false,
                        orphan_dependents_false: false,
                    };
                    delete_one(&ctx.sh, &vmi_def, Some(ns), vmi_name, &del).await?;
                    event(&ctx.sh, &vmi, true, eviction::reasons::EVICTED, &message).await;
                }
                return Ok(ok());
            }
        }
    }
    Err(ApiError::stale(&ctx.def, name))
}
