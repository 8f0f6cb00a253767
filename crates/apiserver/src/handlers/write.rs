//! create, update and patch (JSON, merge, strategic merge), for main resources and `/status`:
//! metadata rules (generateName, uid, generation bumps on spec changes only, immutable fields),
//! optimistic concurrency, field validation, admission, and finalizer completion.

use axum::body::Body;
use axum::response::Response;
use ferrovirt_api::admission::{self, Operation};
use ferrovirt_api::registry::ResourceDef;
use ferrovirt_store::StoreError;
use http::StatusCode;
use serde_json::{Value, json};

use super::{Ctx, json_response, load, read::render_one, to_storage, with_warnings};
use crate::body::{content_type, parse_document, parse_object, read_body};
use crate::error::ApiError;
use crate::objects::{
    self, encode, finalizers, generate_name, is_deleting, meta_mut, meta_str, name_of,
    resource_version, spec_part, validate_name,
};
use crate::server::Shared;
use crate::{limits, patch, resources, schema, smp, timefmt};

/// `fieldValidation` levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldValidation {
    Ignore,
    Warn,
    Strict,
}

/// Options common to writes.
#[derive(Debug, Clone, Copy)]
pub struct WriteOpts {
    pub dry_run: bool,
    pub validation: FieldValidation,
}

impl Default for WriteOpts {
    fn default() -> Self {
        Self {
            dry_run: false,
            validation: FieldValidation::Ignore,
        }
    }
}

impl WriteOpts {
    pub(super) fn from_ctx(ctx: &Ctx) -> Result<Self, ApiError> {
        let validation = match ctx.q.get("fieldValidation") {
            None | Some("Warn") => FieldValidation::Warn,
            Some("Strict") => FieldValidation::Strict,
            Some("Ignore") => FieldValidation::Ignore,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "fieldValidation: unsupported value {other:?}: supported values: \"Ignore\", \"Warn\", \"Strict\""
                )));
            }
        };
        let dry_run = match ctx.q.get("dryRun") {
            None => false,
            Some("All") => true,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "unsupported dryRun value {other:?}"
                )));
            }
        };
        Ok(Self {
            dry_run,
            validation,
        })
    }
}

/// Applies the field-validation level: Strict fails, Warn returns warnings.
fn check_unknown_fields(
    def: &ResourceDef,
    obj: &Value,
    opts: WriteOpts,
) -> Result<Vec<String>, ApiError> {
    if opts.validation == FieldValidation::Ignore {
        return Ok(Vec::new());
    }
    let unknown = schema::unknown_fields(def, obj);
    if unknown.is_empty() {
        return Ok(Vec::new());
    }
    let msgs: Vec<String> = unknown
        .iter()
        .map(|f| format!("unknown field {f:?}"))
        .collect();
    if opts.validation == FieldValidation::Strict {
        return Err(ApiError::bad_request(format!(
            "{kind} in version {version:?} cannot be handled as a {kind}: strict decoding error: {}",
            msgs.join(", "),
            kind = def.kind,
            version = def.version,
        )));
    }
    Ok(msgs)
}

/// Checks (and fills in) apiVersion and kind against the URL's resource.
fn check_type_meta(def: &ResourceDef, obj: &mut Value) -> Result<(), ApiError> {
    let want_av = def.api_version();
    let m = obj
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("the request body must be a JSON object"))?;
    match m.get("apiVersion").and_then(Value::as_str) {
        None | Some("") => {
            m.insert("apiVersion".into(), Value::String(want_av));
        }
        Some(av) if av == want_av => {}
        Some(av) => {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({av}) does not match the expected API version ({want_av})"
            )));
        }
    }
    match m.get("kind").and_then(Value::as_str) {
        None | Some("") => {
            m.insert("kind".into(), Value::String(def.kind.to_string()));
        }
        Some(k) if k == def.kind => {}
        Some(k) => {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                def.kind
            )));
        }
    }
    if !m.get("metadata").is_none_or(Value::is_object) {
        return Err(ApiError::bad_request("metadata must be an object"));
    }
    Ok(())
}

fn check_namespace(
    def: &ResourceDef,
    url_ns: Option<&str>,
    obj: &mut Value,
) -> Result<(), ApiError> {
    let body_ns = objects::namespace_of(obj).map(str::to_string);
    if !def.namespaced {
        meta_mut(obj).remove("namespace");
        return Ok(());
    }
    match (url_ns, body_ns.as_deref()) {
        (Some(u), Some(b)) if u != b => Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        )),
        (Some(u), _) => {
            meta_mut(obj).insert("namespace".into(), Value::String(u.to_string()));
            Ok(())
        }
        (None, _) => Err(ApiError::bad_request("a namespace is required")),
    }
}

fn run_admission(
    def: &ResourceDef,
    op: Operation,
    obj: &mut Value,
    old: Option<&Value>,
) -> Result<(), ApiError> {
    crate::quota::validate(def, obj)?;
    admission::admit(def, op, obj, old)
        .map_err(|inv| ApiError::from_invalid(def, name_of(obj), inv))
}

async fn require_namespace(sh: &Shared, ns: &str) -> Result<(), ApiError> {
    let Some(nsdef) = sh.resources.lookup("", "v1", "namespaces") else {
        return Ok(());
    };
    match load(sh, nsdef, None, ns).await? {
        None => Err(ApiError::not_found(nsdef, ns)),
        Some((o, _)) if is_deleting(&o) => Err(ApiError::forbidden(format!(
            "unable to create new content in namespace {ns} because it is being terminated"
        ))),
        Some(_) => Ok(()),
    }
}

/// The size and metadata limits ([`limits`]): 413 for an object over the size limit, 422 naming
/// each bad metadata field.
fn check_limits(def: &ResourceDef, obj: &Value) -> Result<(), ApiError> {
    if let Some(n) = limits::oversized(obj) {
        return Err(ApiError::new(
            413,
            "RequestEntityTooLarge",
            format!(
                "{} {}: the object would be {n} bytes, more than the limit of {} bytes",
                def.kind,
                limits::shown(name_of(obj)),
                limits::MAX_OBJECT_BYTES
            ),
        ));
    }
    let causes = limits::metadata_problems(obj);
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(def, name_of(obj), causes))
    }
}

/// Creates an object (admission, metadata, store). Returns the stored object and warnings.
pub(crate) async fn create(
    sh: &Shared,
    def: &ResourceDef,
    ns: Option<&str>,
    mut obj: Value,
    opts: WriteOpts,
) -> Result<(Value, Vec<String>), ApiError> {
    check_type_meta(def, &mut obj)?;
    check_namespace(def, ns, &mut obj)?;
    let mut warnings = check_unknown_fields(def, &obj, opts)?;
    check_limits(def, &obj)?;
    let gen_prefix = meta_str(&obj, "generateName")
        .unwrap_or_default()
        .to_string();
    let explicit = name_of(&obj).to_string();
    if explicit.is_empty() && gen_prefix.is_empty() {
        return Err(ApiError::invalid(
            def,
            "",
            vec![(
                "FieldValueRequired".into(),
                "metadata.name".into(),
                "Required value: name or generateName is required".into(),
            )],
        ));
    }
    if def.namespaced {
        require_namespace(sh, ns.unwrap_or_default()).await?;
    }
    if def.has_status
        && let Some(m) = obj.as_object_mut()
    {
        m.remove("status");
    }
    if def.kind == "Namespace" && def.group.is_empty() {
        obj["status"] = json!({"phase": "Active"});
        obj["spec"] = json!({"finalizers": ["kubernetes"]});
    }
    for attempt in 0..5 {
        let mut o = obj.clone();
        let name = if explicit.is_empty() {
            generate_name(&gen_prefix)
        } else {
            explicit.clone()
        };
        if let Err(msg) = validate_name(def, &name) {
            return Err(ApiError::invalid_field(def, &name, "metadata.name", msg));
        }
        {
            let m = meta_mut(&mut o);
            m.insert("name".into(), Value::String(name.clone()));
            for f in [
                "resourceVersion",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "selfLink",
                "managedFields",
            ] {
                m.remove(f);
            }
            m.insert(
                "uid".into(),
                Value::String(uuid::Uuid::new_v4().to_string()),
            );
            m.insert(
                "creationTimestamp".into(),
                Value::String(timefmt::now_rfc3339()),
            );
            m.insert("generation".into(), json!(1));
        }
        if super::presets::applies_to(def) {
            warnings.extend(super::presets::apply(sh, def, ns.unwrap_or_default(), &mut o).await?);
        }
        if def.group == "kubevirt.io" && def.plural == "virtualmachineinstances" {
            // KubeVirt's VMI mutating webhook: guest memory over the memoryOvercommit
            // percentage becomes the request (before the defaulting copies guest over), and
            // a VMI without a CPU model gets the cluster's default one.
            let d = crate::cluster_config::VmiDefaults::read(sh).await;
            ferrovirt_api::kubevirt::overcommit::apply_memory_overcommit(&mut o, &d.overcommit);
            ferrovirt_api::kubevirt::cpu_model::apply_default_model(&mut o, d.cpu_model.as_deref());
        }
        run_admission(def, Operation::Create, &mut o, None)?;
        let key = resources::object_key(def, ns, &name);
        if opts.dry_run {
            return Ok((o, warnings));
        }
        let reserved = if super::services::applies_to(def) {
            super::services::allocate(sh, def, &mut o, None).await?
        } else {
            Vec::new()
        };
        let charges = match ns {
            Some(ns) if def.namespaced => crate::quota::charge(sh, def, ns, &o).await,
            _ => Ok(Vec::new()),
        };
        let charges = match charges {
            Ok(c) => c,
            Err(e) => {
                super::services::release_keys(sh, &o, &reserved).await;
                return Err(e);
            }
        };
        let stored = to_storage(def, o.clone());
        let created = sh.store.create(&key, encode(&stored)).await;
        if created.is_err() {
            super::services::release_keys(sh, &o, &reserved).await;
            crate::quota::refund(sh, charges).await;
        } else {
            crate::quota::settle(sh, &charges);
        }
        match created {
            Ok(kv) => {
                meta_mut(&mut o).insert(
                    "resourceVersion".into(),
                    Value::String(kv.mod_revision.to_string()),
                );
                return Ok((o, warnings));
            }
            Err(StoreError::AlreadyExists(_)) if explicit.is_empty() && attempt < 4 => continue,
            Err(StoreError::AlreadyExists(_)) => return Err(ApiError::already_exists(def, &name)),
            Err(e) => return Err(ApiError::from_store(e)),
        }
    }
    Err(ApiError::internal("could not generate a unique name"))
}

/// Builds the object to store from the current one and the requested one.
fn merge_for_update(def: &ResourceDef, old: &Value, new: Value, status_only: bool) -> Value {
    let mut out = if status_only {
        let mut o = old.clone();
        match new.get("status") {
            Some(s) => o["status"] = s.clone(),
            None => {
                if let Some(m) = o.as_object_mut() {
                    m.remove("status");
                }
            }
        }
        o
    } else {
        let mut n = new;
        if def.has_status {
            match old.get("status") {
                Some(s) => n["status"] = s.clone(),
                None => {
                    if let Some(m) = n.as_object_mut() {
                        m.remove("status");
                    }
                }
            }
        }
        n
    };
    let old_meta = old.get("metadata").cloned().unwrap_or_default();
    let spec_changed = spec_part(old) != spec_part(&out);
    let m = meta_mut(&mut out);
    for f in [
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "namespace",
        "name",
    ] {
        match old_meta.get(f) {
            Some(v) => m.insert(f.into(), v.clone()),
            None => m.remove(f),
        };
    }
    let generation = old_meta
        .get("generation")
        .and_then(Value::as_i64)
        .unwrap_or(1);
    m.insert(
        "generation".into(),
        json!(if spec_changed {
            generation + 1
        } else {
            generation
        }),
    );
    m.remove("managedFields");
    out
}

/// Writes `new` over the stored object at revision `rev`, deleting it instead when it is being
/// deleted and has no finalizers left. Returns the object as stored.
pub(crate) async fn store_update(
    sh: &Shared,
    def: &ResourceDef,
    new: Value,
    rev: i64,
) -> Result<Result<Value, StoreError>, ApiError> {
    let key = resources::object_key(def, objects::namespace_of(&new), name_of(&new));
    if let Some(done) = finalize_if_done(sh, def, &key, &new, rev).await? {
        return Ok(done);
    }
    let stored = to_storage(def, new.clone());
    Ok(sh.store.update(&key, encode(&stored), rev).await.map(|kv| {
        let mut o = new;
        meta_mut(&mut o).insert(
            "resourceVersion".into(),
            Value::String(kv.mod_revision.to_string()),
        );
        o
    }))
}

/// When `obj` is being deleted and nothing holds it (no finalizers; for namespaces, no spec
/// finalizers either), deletes it at `rev` and returns the outcome.
pub(crate) async fn finalize_if_done(
    sh: &Shared,
    def: &ResourceDef,
    key: &str,
    obj: &Value,
    rev: i64,
) -> Result<Option<Result<Value, StoreError>>, ApiError> {
    let spec_fins = obj
        .pointer("/spec/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty())
        && def.kind == "Namespace";
    if !is_deleting(obj) || !finalizers(obj).is_empty() || spec_fins {
        return Ok(None);
    }
    let res = sh.store.delete(key, Some(rev)).await.map(|kv| {
        let mut o = obj.clone();
        meta_mut(&mut o).insert(
            "resourceVersion".into(),
            Value::String(kv.mod_revision.to_string()),
        );
        o
    });
    if res.is_ok() && super::services::applies_to(def) {
        super::services::release_dropped(sh, obj, None).await;
    }
    sh.gc_kick.notify_one();
    Ok(Some(res))
}

/// How a write computes the new object from the current one.
pub(super) enum Change<'a> {
    Replace(Value),
    Patch { media: &'a str, patch: Value },
}

pub(super) async fn update_object(
    ctx: &Ctx,
    name: &str,
    change: Change<'_>,
    status_only: bool,
    opts: WriteOpts,
) -> Result<(Value, Vec<String>), ApiError> {
    let def = &ctx.def;
    let mut change = change;
    if let Change::Replace(v) = &mut change {
        match name_of(v) {
            "" => {
                meta_mut(v).insert("name".into(), Value::String(name.to_string()));
            }
            n if n != name => {
                return Err(ApiError::bad_request(format!(
                    "the name of the object ({n}) does not match the name on the URL ({name})"
                )));
            }
            _ => {}
        }
    }
    for _ in 0..8 {
        let (old, rev) = load(&ctx.sh, def, ctx.ns(), name)
            .await?
            .ok_or_else(|| ApiError::not_found(def, name))?;
        let (mut new, explicit_rv) = match &change {
            Change::Replace(v) => (v.clone(), resource_version(v)?),
            Change::Patch { media, patch } => {
                let mut target = old.clone();
                apply_patch(media, &mut target, patch)?;
                let rv = patch
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty());
                let explicit = match rv {
                    Some(s) => Some(s.parse::<i64>().map_err(|_| {
                        ApiError::bad_request(format!("invalid resourceVersion {s:?}"))
                    })?),
                    None => None,
                };
                (target, explicit)
            }
        };
        check_type_meta(def, &mut new)?;
        if name_of(&new) != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({}) does not match the name on the URL ({name})",
                name_of(&new)
            )));
        }
        check_namespace(def, ctx.ns(), &mut new)?;
        if explicit_rv.is_some_and(|r| r != rev) {
            return Err(ApiError::stale(def, name));
        }
        // A uid in the body is a precondition (as in Kubernetes): a write meant for an
        // object that has since been deleted and recreated under the same name is refused.
        let (want_uid, actual_uid) = (
            new.pointer("/metadata/uid").and_then(Value::as_str),
            old.pointer("/metadata/uid").and_then(Value::as_str),
        );
        if let (Some(want), Some(actual)) = (want_uid, actual_uid)
            && !want.is_empty()
            && want != actual
        {
            return Err(ApiError::conflict(
                def,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {want}, UID in object meta: {actual}"
                ),
            ));
        }
        let warnings = check_unknown_fields(def, &new, opts)?;
        let mut merged = merge_for_update(def, &old, new, status_only);
        check_limits(def, &merged)?;
        if is_deleting(&old) {
            let old_f = finalizers(&old);
            if finalizers(&merged).iter().any(|f| !old_f.contains(f)) {
                return Err(ApiError::invalid_field(
                    def,
                    name,
                    "metadata.finalizers",
                    "Forbidden: no new finalizers can be added if the object is being deleted"
                        .into(),
                ));
            }
        }
        run_admission(def, Operation::Update, &mut merged, Some(&old))?;
        crate::auth::check_rbac_write(
            &ctx.sh,
            ctx.user.as_deref(),
            def,
            ctx.ns(),
            name,
            &merged,
            Some(&old),
        )?;
        meta_mut(&mut merged).insert("resourceVersion".into(), Value::String(rev.to_string()));
        if merged == old || opts.dry_run {
            return Ok((merged, warnings));
        }
        let services = super::services::applies_to(def) && !status_only;
        let reserved = if services {
            super::services::allocate(&ctx.sh, def, &mut merged, Some(&old)).await?
        } else {
            Vec::new()
        };
        // A migration entering Scheduling holds a second launcher Pod: quota first.
        let charges = match crate::quota::charge_migration(&ctx.sh, def, &old, &merged).await {
            Ok(c) => c,
            Err(e) => {
                if services {
                    super::services::release_keys(&ctx.sh, &merged, &reserved).await;
                }
                return Err(e);
            }
        };
        let written = store_update(&ctx.sh, def, merged.clone(), rev).await;
        let ok = matches!(&written, Ok(Ok(_)));
        crate::quota::after_migration_update(&ctx.sh, def, &old, &merged, charges, ok).await;
        if services {
            match &written {
                Ok(Ok(obj)) => super::services::release_dropped(&ctx.sh, &old, Some(obj)).await,
                _ => super::services::release_keys(&ctx.sh, &merged, &reserved).await,
            }
        }
        match written? {
            Ok(obj) => return Ok((obj, warnings)),
            Err(StoreError::Conflict { .. }) if explicit_rv.is_none() => continue,
            Err(StoreError::Conflict { .. }) => return Err(ApiError::stale(def, name)),
            Err(StoreError::NotFound(_)) => return Err(ApiError::not_found(def, name)),
            Err(e) => return Err(ApiError::from_store(e)),
        }
    }
    Err(ApiError::stale(def, name))
}

/// Applies a patch of media type `media` to `target`.
pub(crate) fn apply_patch(media: &str, target: &mut Value, p: &Value) -> Result<(), ApiError> {
    let res = match media {
        "application/json-patch+json" => patch::json_patch(target, p),
        "application/merge-patch+json" => {
            patch::merge_patch(target, p);
            Ok(())
        }
        "application/strategic-merge-patch+json" => {
            smp::strategic_merge(target, p);
            Ok(())
        }
        other => return Err(ApiError::unsupported_media_type(other)),
    };
    res.map_err(|e| match e {
        patch::PatchError::Invalid(m) => ApiError::bad_request(m),
        patch::PatchError::Failed(m) => ApiError::new(422, "Invalid", m),
        patch::PatchError::TooLarge(m) => ApiError::new(413, "RequestEntityTooLarge", m),
    })?;
    if !target.is_object() {
        return Err(ApiError::bad_request(
            "the patch replaced the object with a non-object",
        ));
    }
    Ok(())
}

fn respond(ctx: &Ctx, code: StatusCode, obj: Value, warnings: &[String]) -> Response {
    with_warnings(json_response(code, &render_one(ctx, obj)), warnings)
}

pub(super) async fn create_handler(ctx: &Ctx, body: Body) -> Result<Response, ApiError> {
    let opts = WriteOpts::from_ctx(ctx)?;
    let bytes = read_body(&ctx.headers, body, ctx.sh.max_body, ctx.sh.body_timeout).await?;
    let obj = parse_object(&bytes, &content_type(&ctx.headers))?;
    crate::auth::check_rbac_write(
        &ctx.sh,
        ctx.user.as_deref(),
        &ctx.def,
        ctx.ns(),
        "",
        &obj,
        None,
    )?;
    let (obj, warnings) = create(&ctx.sh, &ctx.def, ctx.ns(), obj, opts).await?;
    Ok(respond(ctx, StatusCode::CREATED, obj, &warnings))
}

pub(super) async fn update_handler(
    ctx: &Ctx,
    name: &str,
    body: Body,
    status_only: bool,
) -> Result<Response, ApiError> {
    let opts = WriteOpts::from_ctx(ctx)?;
    let bytes = read_body(&ctx.headers, body, ctx.sh.max_body, ctx.sh.body_timeout).await?;
    let obj = parse_object(&bytes, &content_type(&ctx.headers))?;
    let (obj, warnings) = update_object(ctx, name, Change::Replace(obj), status_only, opts).await?;
    Ok(respond(ctx, StatusCode::OK, obj, &warnings))
}

pub(super) async fn patch_handler(
    ctx: &Ctx,
    name: &str,
    body: Body,
    status_only: bool,
) -> Result<Response, ApiError> {
    let opts = WriteOpts::from_ctx(ctx)?;
    let media = content_type(&ctx.headers);
    if media == "application/apply-patch+yaml" {
        return apply_handler(ctx, name, body, status_only, opts).await;
    }
    if !matches!(
        media.as_str(),
        "application/json-patch+json"
            | "application/merge-patch+json"
            | "application/strategic-merge-patch+json"
    ) {
        return Err(ApiError::unsupported_media_type(&media));
    }
    let bytes = read_body(&ctx.headers, body, ctx.sh.max_body, ctx.sh.body_timeout).await?;
    let patch = parse_document(&bytes, "application/json")?;
    let (obj, warnings) = update_object(
        ctx,
        name,
        Change::Patch {
            media: &media,
            patch,
        },
        status_only,
        opts,
    )
    .await?;
    Ok(respond(ctx, StatusCode::OK, obj, &warnings))
}

/// Server-side apply, approximated: without field ownership tracking, the applied
/// configuration is strategic-merged into the live object (created when absent). Requires
/// `fieldManager`, like the real thing; `force` is accepted and has no effect.
async fn apply_handler(
    ctx: &Ctx,
    name: &str,
    body: Body,
    status_only: bool,
    opts: WriteOpts,
) -> Result<Response, ApiError> {
    if ctx.q.get("fieldManager").is_none() {
        return Err(ApiError::bad_request(
            "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
        ));
    }
    let bytes = read_body(&ctx.headers, body, ctx.sh.max_body, ctx.sh.body_timeout).await?;
    let mut applied = parse_object(&bytes, "application/yaml")?;
    if let Some(m) = applied.get_mut("metadata").and_then(Value::as_object_mut) {
        m.remove("resourceVersion");
        m.remove("managedFields");
    }
    let exists = load(&ctx.sh, &ctx.def, ctx.ns(), name).await?.is_some();
    if !exists && !status_only {
        match name_of(&applied) {
            "" => {
                meta_mut(&mut applied).insert("name".into(), Value::String(name.to_string()));
            }
            n if n != name => {
                return Err(ApiError::bad_request(format!(
                    "the name of the object ({n}) does not match the name on the URL ({name})"
                )));
            }
            _ => {}
        }
        crate::auth::check_rbac_write(
            &ctx.sh,
            ctx.user.as_deref(),
            &ctx.def,
            ctx.ns(),
            name,
            &applied,
            None,
        )?;
        match create(&ctx.sh, &ctx.def, ctx.ns(), applied.clone(), opts).await {
            Ok((obj, warnings)) => return Ok(respond(ctx, StatusCode::CREATED, obj, &warnings)),
            Err(e) if e.code == 409 && e.reason == "AlreadyExists" => {}
            Err(e) => return Err(e),
        }
    }
    let (obj, warnings) = update_object(
        ctx,
        name,
        Change::Patch {
            media: "application/strategic-merge-patch+json",
            patch: applied,
        },
        status_only,
        opts,
    )
    .await?;
    Ok(respond(ctx, StatusCode::OK, obj, &warnings))
}
