//! delete and deletecollection: preconditions, finalizers and `deletionTimestamp`, propagation
//! policies (the garbage collector finishes Foreground/Orphan), and namespace termination.

use axum::body::Body;
use axum::response::Response;
use ferrovirt_api::registry::ResourceDef;
use ferrovirt_store::StoreError;
use http::StatusCode;
use serde_json::{Value, json};

use super::read::{ListParams, list_objects, selectors};
use super::{Ctx, json_response, load, store_update};
use crate::body::{parse_document, read_body};
use crate::error::ApiError;
use crate::objects::{finalizers, is_deleting, meta_mut, meta_str};
use crate::server::Shared;
use crate::{resources, timefmt};

/// metav1.DeleteOptions, from the body and the query.
#[derive(Debug, Clone, Default)]
pub struct DeleteOpts {
    pub uid: Option<String>,
    pub resource_version: Option<String>,
    /// Background (default), Foreground or Orphan.
    pub propagation: Option<String>,
    pub grace_period: Option<i64>,
    pub dry_run: bool,
    /// The deprecated `orphanDependents: false`: the one case where kube-apiserver answers 202
    /// (rather than 200) to a delete that has not finished.
    pub orphan_dependents_false: bool,
}

impl DeleteOpts {
    async fn from_request(ctx: &Ctx, body: Body) -> Result<Self, ApiError> {
        let bytes = read_body(&ctx.headers, body, ctx.sh.max_body, ctx.sh.body_timeout).await?;
        let b = if bytes.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            parse_document(&bytes, "application/json")?
        };
        let s = |v: &Value| v.as_str().map(str::to_string);
        let mut o = DeleteOpts {
            uid: b.pointer("/preconditions/uid").and_then(s),
            resource_version: b.pointer("/preconditions/resourceVersion").and_then(s),
            propagation: b.get("propagationPolicy").and_then(s),
            grace_period: b.get("gracePeriodSeconds").and_then(Value::as_i64),
            dry_run: b
                .get("dryRun")
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().any(|x| x == "All")),
            orphan_dependents_false: b.get("orphanDependents") == Some(&Value::Bool(false))
                || ctx.q.get("orphanDependents") == Some("false"),
        };
        if let Some(p) = ctx.q.get("propagationPolicy") {
            o.propagation = Some(p.to_string());
        }
        if b.get("orphanDependents") == Some(&Value::Bool(true))
            || ctx.q.get("orphanDependents") == Some("true")
        {
            o.propagation.get_or_insert_with(|| "Orphan".into());
        }
        if o.orphan_dependents_false {
            o.propagation.get_or_insert_with(|| "Foreground".into());
        }
        if let Some(g) = ctx.q.int("gracePeriodSeconds")? {
            o.grace_period = Some(g);
        }
        o.dry_run |= ctx.q.get("dryRun") == Some("All");
        match o.propagation.as_deref() {
            None | Some("Background" | "Foreground" | "Orphan") => Ok(o),
            Some(p) => Err(ApiError::bad_request(format!(
                "propagationPolicy: Unsupported value: {p:?}: supported values: \"Foreground\", \"Background\", \"Orphan\""
            ))),
        }
    }
}

/// Deletes (or starts deleting) one object. Returns the object and whether it is gone now.
pub(crate) async fn delete_one(
    sh: &Shared,
    def: &ResourceDef,
    ns: Option<&str>,
    name: &str,
    opts: &DeleteOpts,
) -> Result<(Value, bool), ApiError> {
    let key = resources::object_key(def, ns, name);
    for _ in 0..8 {
        let (obj, rev) = load(sh, def, ns, name)
            .await?
            .ok_or_else(|| ApiError::not_found(def, name))?;
        if let Some(uid) = &opts.uid {
            let actual = meta_str(&obj, "uid").unwrap_or_default();
            if actual != uid {
                return Err(ApiError::conflict(
                    def,
                    name,
                    &format!(
                        "Precondition failed: UID in precondition: {uid}, UID in object meta: {actual}"
                    ),
                ));
            }
        }
        if let Some(want) = &opts.resource_version
            && *want != rev.to_string()
        {
            return Err(ApiError::conflict(
                def,
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {want}, ResourceVersion in object meta: {rev}"
                ),
            ));
        }
        let is_namespace = def.kind == "Namespace" && def.group.is_empty();
        let mut fins = finalizers(&obj);
        match opts.propagation.as_deref() {
            Some("Foreground") if !fins.iter().any(|f| f == "foregroundDeletion") => {
                fins.push("foregroundDeletion".into())
            }
            Some("Orphan") if !fins.iter().any(|f| f == "orphan") => fins.push("orphan".into()),
            _ => {}
        }
        let old_fins = finalizers(&obj);
        if is_deleting(&obj) && fins == old_fins {
            return Ok((obj, false));
        }
        if opts.dry_run {
            return Ok((obj, false));
        }
        if fins.is_empty() && !is_namespace {
            match sh.store.delete(&key, Some(rev)).await {
                Ok(kv) => {
                    if super::services::applies_to(def) {
                        super::services::release_dropped(sh, &obj, None).await;
                    }
                    // A cancelled migration's target is given back at once.
                    crate::quota::after_delete(sh, def, &obj).await;
                    let mut o = obj;
                    meta_mut(&mut o).insert(
                        "resourceVersion".into(),
                        Value::String(kv.mod_revision.to_string()),
                    );
                    sh.gc_kick.notify_one();
                    return Ok((o, true));
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(StoreError::NotFound(_)) => return Err(ApiError::not_found(def, name)),
                Err(e) => return Err(ApiError::from_store(e)),
            }
        }
        let mut o = obj;
        {
            let m = meta_mut(&mut o);
            m.entry("deletionTimestamp")
                .or_insert_with(|| Value::String(timefmt::now_rfc3339()));
            m.entry("deletionGracePeriodSeconds")
                .or_insert_with(|| json!(opts.grace_period.unwrap_or(0).max(0)));
            if fins.is_empty() {
                m.remove("finalizers");
            } else {
                m.insert("finalizers".into(), json!(fins));
            }
        }
        if is_namespace {
            if !o.get("status").is_some_and(Value::is_object) {
                o["status"] = json!({});
            }
            o["status"]["phase"] = json!("Terminating");
        }
        match store_update(sh, def, o, rev).await? {
            Ok(updated) => {
                sh.gc_kick.notify_one();
                return Ok((updated, false));
            }
            Err(StoreError::Conflict { .. }) => continue,
            Err(StoreError::NotFound(_)) => return Err(ApiError::not_found(def, name)),
            Err(e) => return Err(ApiError::from_store(e)),
        }
    }
    Err(ApiError::stale(def, name))
}

pub(super) async fn delete_handler(
    ctx: &Ctx,
    name: &str,
    body: Body,
) -> Result<Response, ApiError> {
    let opts = DeleteOpts::from_request(ctx, body).await?;
    let (obj, gone) = delete_one(&ctx.sh, &ctx.def, ctx.ns(), name, &opts).await?;
    Ok(json_response(delete_status(gone, &opts), &obj))
}

/// kube-apiserver's status for a delete: 200 with the object whether it is gone or only marked
/// (finalizers, Foreground, a namespace), except 202 when the client sent the deprecated
/// `orphanDependents: false` and the object is not gone yet.
fn delete_status(gone: bool, opts: &DeleteOpts) -> StatusCode {
    if !gone && opts.orphan_dependents_false {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    }
}

pub(super) async fn delete_collection_handler(ctx: &Ctx, body: Body) -> Result<Response, ApiError> {
    let opts = DeleteOpts::from_request(ctx, body).await?;
    let (labels, fields) = selectors(ctx)?;
    let listed = list_objects(
        ctx,
        ListParams {
            def: &ctx.def,
            namespace: ctx.ns(),
            labels: &labels,
            fields: &fields,
            limit: None,
            cont: None,
            revision: None,
        },
    )
    .await?;
    let mut items = Vec::new();
    for obj in listed.items {
        let name = meta_str(&obj, "name").unwrap_or_default().to_string();
        let ns = meta_str(&obj, "namespace").map(str::to_string);
        match delete_one(&ctx.sh, &ctx.def, ns.as_deref(), &name, &opts).await {
            Ok((o, _)) => items.push(o),
            Err(e) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "kind": ctx.def.list_kind,
            "apiVersion": ctx.def.api_version(),
            "metadata": {"resourceVersion": listed.revision.to_string()},
            "items": items,
        }),
    ))
}
