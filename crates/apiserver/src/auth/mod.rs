//! Access control for every request: authentication (the admin bearer token → `system:admin`
//! in `system:masters`; a client certificate of the client CA → CN/O; a ServiceAccount
//! token → `system:serviceaccount:NS:NAME`), then RBAC authorization of the request's
//! attributes against the watch-fed policy, 401/403 as metav1.Status with Kubernetes'
//! messages. Also the review endpoints: SelfSubjectReview (`kubectl auth whoami`),
//! SelfSubjectAccessReview and SubjectAccessReview (`kubectl auth can-i`). A websocket
//! request may carry its bearer token in a subprotocol instead of a header ([`wsproto`]).

pub mod attrs;
pub mod cache;
pub mod certs;
pub mod clone;
pub mod defaults;
pub mod escalation;
pub mod join;
pub mod node;
pub mod nodecreds;
pub mod rbac;
mod reviews;
pub mod sacache;
pub mod tokens;
pub mod udnaddr;
pub mod watchloop;
pub mod wsproto;

use std::sync::Arc;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use ferrovirt_store::StoreError;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::objects::{decode, encode, meta_mut};
use crate::server::Shared;
use rbac::{Attributes, UserInfo};

pub(crate) use reviews::routes;

/// The group every authenticated user is in.
pub const AUTHENTICATED: &str = "system:authenticated";

/// The admin token's identity.
pub fn admin_user() -> UserInfo {
    UserInfo {
        name: "system:admin".into(),
        uid: String::new(),
        groups: vec![rbac::MASTERS.into(), AUTHENTICATED.into()],
    }
}

/// Authentication state: the admin token, the ServiceAccount token keys and the policy.
pub(crate) struct Auth {
    pub admin_token: String,
    pub policy: Arc<cache::PolicyCache>,
    pub tokens: tokens::TokenKeys,
    /// The node certificates still valid ([`nodecreds`]).
    pub node_certs: Arc<nodecreds::NodeCerts>,
    /// The ServiceAccounts tokens may name ([`sacache`]).
    pub service_accounts: Arc<sacache::ServiceAccounts>,
}

fn bearer(req: &Request) -> Option<&str> {
    req.headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim)
}

/// Compares in time independent of where the inputs differ (`subtle`).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(a, b).into()
}

/// Who sent `req`: a bearer token (admin or ServiceAccount) when one is sent, else a verified
/// client certificate; None when neither identifies anyone; Err (a 401 saying why) for a
/// node certificate (`CN=system:node:<n>`) that is not, or no longer, recorded as valid for
/// that node ([`nodecreds`]).
async fn authenticate(
    sh: &Shared,
    token: Option<String>,
    cert: Option<ferrovirt_serve::PeerCertificate>,
) -> Result<Option<UserInfo>, ApiError> {
    let mut user = match token {
        Some(t) if constant_time_eq(t.as_bytes(), sh.auth.admin_token.as_bytes()) => {
            return Ok(Some(admin_user()));
        }
        Some(t) => match tokens::authenticate(sh, &t).await {
            Some(u) => u,
            None => return Ok(None),
        },
        None => {
            let Some(cert) = cert else { return Ok(None) };
            let Some(u) = certs::identity(&cert.0) else {
                return Ok(None);
            };
            if let Some(node) = nodecreds::node_of_user(&u.name) {
                sh.auth
                    .node_certs
                    .check(sh.store.as_ref(), node, &cert.0)
                    .await?;
            }
            u
        }
    };
    if !user.groups.iter().any(|g| g == AUTHENTICATED) {
        user.groups.push(AUTHENTICATED.into());
    }
    Ok(Some(user))
}

/// Kubernetes' 403: `<resource>.<group> "<name>" is forbidden: User "u" cannot …`.
pub fn forbidden(user: &UserInfo, a: &Attributes) -> ApiError {
    let msg = rbac::forbidden_message(user, a);
    let qualified = if a.api_group.is_empty() {
        a.resource.clone()
    } else {
        format!("{}.{}", a.resource, a.api_group)
    };
    let message = match (a.resource_request, a.name.is_empty()) {
        (false, _) => format!("forbidden: {msg}"),
        (true, true) => format!("{qualified} is forbidden: {msg}"),
        (true, false) => format!("{qualified} {:?} is forbidden: {msg}", a.name),
    };
    ApiError {
        details: a
            .resource_request
            .then(|| json!({"name": a.name, "group": a.api_group, "kind": a.resource})),
        ..ApiError::forbidden(message)
    }
}

/// Refuses an RBAC write that would grant what its requester does not hold
/// ([`escalation`]): 403 with Kubernetes' message, 404 for a binding to a missing role.
/// `url_name` is the name in the request path (empty for a create); `old` the stored object
/// of an update. Writes of other kinds pass.
pub(crate) fn check_rbac_write(
    sh: &Shared,
    user: Option<&UserInfo>,
    def: &ferrovirt_api::registry::ResourceDef,
    ns: Option<&str>,
    url_name: &str,
    obj: &Value,
    old: Option<&Value>,
) -> Result<(), ApiError> {
    clone::check(
        sh,
        user,
        def.kind,
        def.group,
        ns.unwrap_or_default(),
        obj,
        old,
    )?;
    udnaddr::check(user, def.group, def.kind, obj, old)?;
    if def.group != escalation::RBAC_GROUP {
        return Ok(());
    }
    // Every request through the router is authenticated first; fail closed otherwise.
    let user = user.ok_or_else(|| ApiError::forbidden("forbidden: no user on the request"))?;
    let policy = sh.auth.policy.get();
    let ns = ns.unwrap_or_default();
    let refusal = match escalation::check_write(&policy, user, def.plural, ns, url_name, obj, old) {
        Ok(()) => return Ok(()),
        Err(r) => r,
    };
    let name = crate::objects::name_of(obj);
    let message = refusal.message(user);
    let qualified = format!("{}.{}", def.plural, def.group);
    let details = json!({"name": name, "group": def.group, "kind": def.plural});
    if let escalation::Refusal::RoleNotFound { resource, name } = &refusal {
        return Err(ApiError {
            details: Some(json!({"name": name, "group": def.group, "kind": resource})),
            ..ApiError::new(404, "NotFound", message)
        });
    }
    let message = if name.is_empty() {
        format!("{qualified} is forbidden: {message}")
    } else {
        format!("{qualified} {name:?} is forbidden: {message}")
    };
    Err(ApiError {
        details: Some(details),
        ..ApiError::forbidden(message)
    })
}

/// 401 without keep-alive: an unauthenticated client's connection cannot linger.
fn unauthorized() -> Response {
    unauthorized_with(ApiError::unauthorized())
}

/// [`unauthorized`] with its own Status.
fn unauthorized_with(e: ApiError) -> Response {
    let mut resp = e.into_response();
    resp.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    resp
}

/// The authentication and authorization layer: health checks pass; an unidentified request
/// is answered 401 (and its connection closed); a request RBAC does not allow, 403. An
/// allowed request carries its [`UserInfo`] as an extension.
pub(crate) async fn check(sh: &Shared, mut req: Request, next: Next) -> Response {
    if matches!(req.uri().path(), "/healthz" | "/livez" | "/readyz") {
        return next.run(req).await;
    }
    // A browser's websocket carries its token in a subprotocol; it is taken out of the request
    // either way, so the handlers (and the protocol they choose) never see it.
    let ws_token = match wsproto::extract(req.headers()) {
        Ok(Some(t)) => {
            wsproto::rewrite(req.headers_mut(), &t.remaining);
            Some(t.token)
        }
        Ok(None) => None,
        Err(e) => {
            tracing::debug!("websocket token refused: {e}");
            return unauthorized();
        }
    };
    let identified = {
        let token = bearer(&req).map(str::to_string).or(ws_token);
        let cert = req
            .extensions()
            .get::<ferrovirt_serve::PeerCertificate>()
            .cloned();
        authenticate(sh, token, cert).await
    };
    let user = match identified {
        Ok(Some(u)) => u,
        Ok(None) => return unauthorized(),
        Err(e) if e.code == 401 => {
            tracing::warn!("refused: {}", e.message);
            return unauthorized_with(e);
        }
        Err(e) => return e.into_response(),
    };
    let user = match impersonate(sh, user, req.headers()) {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    let a = attrs::of_request(req.method(), req.uri().path(), req.uri().query());
    let verdict = match node::node_of(&user) {
        Some(n) => {
            let n = n.to_string();
            let (r, verdict) = node_verdict(sh, &n, &a, req).await;
            req = match r {
                Ok(r) => r,
                Err(resp) => return resp,
            };
            verdict
        }
        None => node::Verdict::Rbac,
    };
    let denied = match verdict {
        node::Verdict::Allow => None,
        node::Verdict::Deny(why) => Some(why),
        node::Verdict::Rbac => {
            (!rbac::authorize(&sh.auth.policy.get(), &user, &a).allowed()).then(String::new)
        }
    };
    if let Some(why) = denied {
        tracing::debug!(user = %user.name, verb = %a.verb, resource = %a.resource, ns = %a.namespace, %why, "forbidden");
        let mut err = forbidden(&user, &a);
        if !why.is_empty() {
            err.message = format!("{}: {why}", err.message);
        }
        let mut resp = err.into_response();
        resp.extensions_mut().insert(Arc::new(user));
        return resp;
    }
    let user = Arc::new(user);
    req.extensions_mut().insert(user.clone());
    let mut resp = next.run(req).await;
    // For the audit log.
    resp.extensions_mut().insert(user);
    resp
}

/// The node authorizer's verdict on `req` for node `node` ([`node`]), with the request given
/// back (its body re-attached when the decision read it) or the response that ends it.
async fn node_verdict(
    sh: &Shared,
    node: &str,
    a: &Attributes,
    req: Request,
) -> (Result<Request, Response>, node::Verdict) {
    let need = node::needs(a);
    let (req, body) = if matches!(
        need,
        node::Need::BodyName | node::Need::BodyMeta | node::Need::TokenBinding
    ) {
        let (parts, body) = req.into_parts();
        match axum::body::to_bytes(body, sh.max_body).await {
            Ok(b) => (
                Request::from_parts(parts, axum::body::Body::from(b.clone())),
                Some(b),
            ),
            Err(_) => {
                let resp = ApiError::too_large(sh.max_body).into_response();
                return (Err(resp), node::Verdict::Rbac);
            }
        }
    } else {
        (req, None)
    };
    let facts = node::gather(sh, a, &need, body.as_deref()).await;
    (Ok(req), node::decide(node, a, &facts))
}

/// Kubernetes' user impersonation (`kubectl --as=U --as-group=G`): the `Impersonate-User`,
/// `-Group` and `-Uid` headers switch the identity when the real user may `impersonate`
/// each of them (`users`, `serviceaccounts` in their namespace, `groups`, `uids`); user
/// extras are refused by name rather than dropped.
fn impersonate(
    sh: &Shared,
    user: UserInfo,
    headers: &http::HeaderMap,
) -> Result<UserInfo, ApiError> {
    let values = |name: &str| -> Vec<String> {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok().map(str::to_string))
            .collect()
    };
    let (names, groups, uids) = (
        values("impersonate-user"),
        values("impersonate-group"),
        values("impersonate-uid"),
    );
    if let Some(h) = headers
        .keys()
        .find(|k| k.as_str().starts_with("impersonate-extra-"))
    {
        return Err(ApiError::bad_request(format!(
            "impersonating user extras ({h}) is not supported"
        )));
    }
    let Some(name) = names.first().cloned() else {
        if groups.is_empty() && uids.is_empty() {
            return Ok(user);
        }
        return Err(ApiError::bad_request(
            "impersonating groups or a uid requires impersonating a user (Impersonate-User)",
        ));
    };
    let policy = sh.auth.policy.get();
    let check = |resource: &str, namespace: &str, name: &str| -> Result<(), ApiError> {
        let a = Attributes {
            verb: "impersonate".into(),
            resource_request: true,
            resource: resource.into(),
            namespace: namespace.into(),
            name: name.into(),
            ..Default::default()
        };
        if rbac::authorize(&policy, &user, &a).allowed() {
            Ok(())
        } else {
            Err(forbidden(&user, &a))
        }
    };
    let mut target = UserInfo {
        name: name.clone(),
        uid: uids.first().cloned().unwrap_or_default(),
        groups: groups.clone(),
    };
    match name
        .strip_prefix("system:serviceaccount:")
        .and_then(|r| r.split_once(':'))
    {
        Some((ns, sa)) => {
            check("serviceaccounts", ns, sa)?;
            if groups.is_empty() {
                target.groups = vec![
                    "system:serviceaccounts".into(),
                    format!("system:serviceaccounts:{ns}"),
                ];
            }
        }
        None => check("users", "", &name)?,
    }
    for g in &groups {
        check("groups", "", g)?;
    }
    for u in &uids {
        check("uids", "", u)?;
    }
    if !target.groups.iter().any(|g| g == AUTHENTICATED) {
        target.groups.push(AUTHENTICATED.into());
    }
    Ok(target)
}

/// Writes the default ClusterRoles and ClusterRoleBindings ([`defaults`]).
pub(crate) async fn ensure_defaults(sh: &Shared) -> Result<(), ApiError> {
    let now = crate::timefmt::now_rfc3339();
    for d in defaults::objects() {
        let plural = if d["kind"] == "ClusterRole" {
            "clusterroles"
        } else {
            "clusterrolebindings"
        };
        let name = d["metadata"]["name"].as_str().unwrap_or_default();
        let key = format!("{}{plural}/{name}", cache::RBAC_PREFIX);
        let stored = sh.store.get(&key).await.map_err(ApiError::from_store)?;
        let old = stored.as_ref().map(decode).transpose()?;
        let Some(mut want) = defaults::reconcile(&d, old.as_ref()) else {
            continue;
        };
        let result = match &stored {
            None => {
                let m = meta_mut(&mut want);
                m.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
                m.insert("creationTimestamp".into(), Value::String(now.clone()));
                sh.store.create(&key, encode(&want)).await
            }
            Some(kv) => sh.store.update(&key, encode(&want), kv.mod_revision).await,
        };
        match result {
            // Another server wrote it first.
            Ok(_) | Err(StoreError::AlreadyExists(_)) | Err(StoreError::Conflict { .. }) => {}
            Err(e) => return Err(ApiError::from_store(e)),
        }
    }
    Ok(())
}
