//! Request dispatch: turns a parsed URL and method into discovery, OpenAPI, or a resource verb
//! (get, list, watch, create, update, patch, delete, deletecollection) and renders responses.

mod delete;
mod pods;
mod presets;
mod read;
mod scale;
mod services;
mod write;

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use ferrovirt_api::registry::ResourceDef;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use serde_json::Value;

pub(crate) use delete::{DeleteOpts, delete_one};
pub(crate) use pods::{is_pod, vmi_def};
pub(crate) use read::selectors as selectors_of;
pub(crate) use write::{WriteOpts, create, store_update};

use crate::body::Query;
use crate::error::ApiError;
use crate::routing::{self, ResourcePath, Route};
use crate::server::Shared;
use crate::{discovery, events, resources, watch};

/// The generic handler as an axum router (everything is the fallback).
pub(crate) fn router(sh: Arc<Shared>) -> Router {
    Router::new().fallback(dispatch).with_state(sh)
}

/// A JSON response.
pub(crate) fn json_response(code: StatusCode, v: &Value) -> Response {
    let mut resp = (code, serde_json::to_vec(v).unwrap_or_default()).into_response();
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Whether the first media range of `Accept` is the OpenAPI v2 protobuf type.
fn wants_openapi_protobuf(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .and_then(|a| a.split(',').next())
        .is_some_and(|first| first.trim().starts_with(crate::openapi_pb::MEDIA_TYPE))
}

/// An already serialized JSON response.
fn raw_json(body: bytes::Bytes) -> Response {
    let mut resp = (StatusCode::OK, body).into_response();
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Adds `Warning: 299 - "…"` headers.
pub(crate) fn with_warnings(mut resp: Response, warnings: &[String]) -> Response {
    for w in warnings {
        let text = format!("299 - {:?}", w.replace('"', "'"));
        if let Ok(v) = HeaderValue::from_str(&text) {
            resp.headers_mut().append(http::header::WARNING, v);
        }
    }
    resp
}

async fn dispatch(State(sh): State<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let route = routing::parse(parts.uri.path());
    let q = Query::parse(parts.uri.query());
    let is_get = parts.method == Method::GET || parts.method == Method::HEAD;
    let result = match route {
        Route::Resource(p) => {
            let user = parts
                .extensions
                .get::<Arc<crate::auth::rbac::UserInfo>>()
                .cloned();
            resource(sh, p, parts.method, parts.headers, body, q, user).await
        }
        Route::NotFound => Err(ApiError::path_not_found()),
        _ if !is_get => Err(ApiError::method_not_allowed(parts.method.as_str())),
        Route::Health => Ok("ok".into_response()),
        Route::Metrics => {
            let mut text = sh.requests.render();
            text.push_str(&crate::cluster_metrics::render(
                &crate::cluster_metrics::gather(&sh).await,
            ));
            if let Some(extra) = sh.extra_metrics {
                text.push('\n');
                text.push_str(extra().trim_end());
            }
            text.push('\n');
            let mut resp = text.into_response();
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            Ok(resp)
        }
        Route::Version => Ok(json_response(StatusCode::OK, &discovery::version())),
        Route::OpenApiV2 if wants_openapi_protobuf(&parts.headers) => {
            let mut resp = raw_json(sh.openapi().v2_pb.clone());
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static(crate::openapi_pb::RESPONSE_TYPE),
            );
            Ok(resp)
        }
        Route::OpenApiV2 => Ok(raw_json(sh.openapi().v2.clone())),
        Route::OpenApiV3Root => Ok(raw_json(sh.openapi().v3_root.clone())),
        Route::OpenApiV3(path) => sh.openapi().v3_doc(&path).map(raw_json),
        discovery_route => discovery::serve(&sh.resources, &discovery_route, &parts.headers),
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

/// Everything a resource verb needs to know about its request.
pub(crate) struct Ctx {
    pub sh: Arc<Shared>,
    pub def: ResourceDef,
    pub namespace: Option<String>,
    pub q: Query,
    pub headers: HeaderMap,
    /// Who sent the request (set by the authentication layer).
    pub user: Option<Arc<crate::auth::rbac::UserInfo>>,
}

impl Ctx {
    pub fn ns(&self) -> Option<&str> {
        self.namespace.as_deref()
    }
}

fn verb_allowed(def: &ResourceDef, verb: &str) -> Result<(), ApiError> {
    if def.verbs.contains(&verb) {
        Ok(())
    } else {
        Err(ApiError::method_not_allowed(verb))
    }
}

async fn resource(
    sh: Arc<Shared>,
    p: ResourcePath,
    method: Method,
    headers: HeaderMap,
    body: Body,
    q: Query,
    user: Option<Arc<crate::auth::rbac::UserInfo>>,
) -> Result<Response, ApiError> {
    let def = sh
        .resources
        .lookup(&p.group, &p.version, &p.plural)
        .cloned()
        .ok_or_else(ApiError::path_not_found)?;
    if p.namespace.is_some() && !def.namespaced {
        return Err(ApiError::path_not_found());
    }
    if def.namespaced && p.namespace.is_none() && (p.name.is_some() || method == Method::POST) {
        return Err(ApiError::path_not_found());
    }
    let watching = p.watch || q.flag("watch");
    let deprecated = ferrovirt_api::registry::deprecation_warning(&def);
    let user_agent = headers
        .get(http::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    // Records the request's latency when the handling below ends.
    let _timer = sh.requests.count(
        crate::metrics::verb(method.as_str(), p.name.is_some(), watching),
        def.group,
        def.plural,
        user_agent,
    );
    if pods::is_pod(&def) {
        let ctx = Ctx {
            sh,
            def,
            namespace: p.namespace,
            q,
            headers,
            user: user.clone(),
        };
        let sub = p.subresource.as_deref();
        return pods::serve(ctx, method, p.name, sub, body, watching).await;
    }
    let scale = match p.subresource.as_deref() {
        Some("scale") => ferrovirt_api::registry::scale_subresource(&def),
        _ => None,
    };
    let status_only = match p.subresource.as_deref() {
        None => false,
        Some("scale") if scale.is_some() => false,
        Some("status") if def.has_status => true,
        Some("finalize") if def.kind == "Namespace" && def.group.is_empty() => false,
        Some(_) => return Err(ApiError::path_not_found()),
    };
    let ctx = Ctx {
        sh,
        def,
        namespace: p.namespace,
        q,
        headers,
        user,
    };
    let resp = match (&scale, &p.name) {
        (Some(sub), Some(name)) => scale::serve(&ctx, sub, &method, name, body).await,
        _ => verb(ctx, method, p.name, body, status_only, watching).await,
    };
    match deprecated {
        Some(w) => resp.map(|r| with_warnings(r, &[w])),
        None => resp,
    }
}

/// Runs the verb a method and path name.
async fn verb(
    ctx: Ctx,
    method: Method,
    name: Option<String>,
    body: Body,
    status_only: bool,
    watching: bool,
) -> Result<Response, ApiError> {
    match (method.as_str(), name) {
        ("GET", None) if watching => {
            verb_allowed(&ctx.def, "watch")?;
            watch::serve(ctx, None).await
        }
        ("GET", Some(name)) if watching => {
            verb_allowed(&ctx.def, "watch")?;
            watch::serve(ctx, Some(name)).await
        }
        ("GET", None) => {
            verb_allowed(&ctx.def, "list")?;
            read::list(&ctx).await
        }
        ("GET", Some(name)) => {
            verb_allowed(&ctx.def, "get")?;
            read::get(&ctx, &name).await
        }
        ("POST", None) => {
            verb_allowed(&ctx.def, "create")?;
            write::create_handler(&ctx, body).await
        }
        ("PUT", Some(name)) => {
            verb_allowed(&ctx.def, "update")?;
            write::update_handler(&ctx, &name, body, status_only).await
        }
        ("PATCH", Some(name)) => {
            verb_allowed(&ctx.def, "patch")?;
            write::patch_handler(&ctx, &name, body, status_only).await
        }
        ("DELETE", Some(name)) if !status_only => {
            verb_allowed(&ctx.def, "delete")?;
            delete::delete_handler(&ctx, &name, body).await
        }
        ("DELETE", None) => {
            verb_allowed(&ctx.def, "deletecollection")?;
            delete::delete_collection_handler(&ctx, body).await
        }
        (m, _) => Err(ApiError::method_not_allowed(m)),
    }
}

/// Loads one object in the kind's external form, with its revision.
pub(crate) async fn load(
    sh: &Shared,
    def: &ResourceDef,
    ns: Option<&str>,
    name: &str,
) -> Result<Option<(Value, i64)>, ApiError> {
    let key = resources::object_key(def, ns, name);
    let Some(kv) = sh.store.get(&key).await.map_err(ApiError::from_store)? else {
        return Ok(None);
    };
    let obj = crate::objects::decode(&kv)?;
    Ok(Some((from_storage(def, obj), kv.mod_revision)))
}

/// Stored form → the kind's external form (events.k8s.io events are stored as core/v1).
/// Objects of a kind served in several versions are stored once and read back with the
/// requested apiVersion.
pub(crate) fn from_storage(def: &ResourceDef, obj: Value) -> Value {
    if resources::is_events_v1(def) {
        return events::core_to_v1(&obj);
    }
    let mut obj = obj;
    let want = def.api_version();
    if obj.get("apiVersion").and_then(Value::as_str) != Some(want.as_str()) {
        obj["apiVersion"] = Value::String(want);
    }
    obj
}

/// The kind's external form → stored form: events.k8s.io events as core/v1, other kinds in
/// their storage version (`kubevirt.io/v1alpha3` objects are stored as `kubevirt.io/v1`).
pub(crate) fn to_storage(def: &ResourceDef, obj: Value) -> Value {
    if resources::is_events_v1(def) {
        return events::v1_to_core(&obj);
    }
    let stored = ferrovirt_api::registry::storage_version(def);
    let mut obj = obj;
    if stored != def.version && obj.is_object() {
        obj["apiVersion"] = Value::String(format!("{}/{stored}", def.group));
    }
    obj
}
