//! The review endpoints, answered from the request's identity and the current policy, never
//! stored: authentication.k8s.io/v1 SelfSubjectReview, authorization.k8s.io/v1
//! SelfSubjectAccessReview and SubjectAccessReview (its caller needs `create` on
//! `subjectaccessreviews`, checked like any request), and the ServiceAccount TokenRequest
//! subresource ([`super::tokens`]). A resource of group "" written `plural.group` is read as
//! that group's resource ([`qualified_resource`]): kubectl's `auth can-i` sends it so for a
//! group whose discovery lists only subresources (`subresources.kubevirt.io`).

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

use super::rbac::{self, Attributes, UserInfo};
use crate::error::ApiError;
use crate::handlers::json_response;
use crate::server::Shared;

/// The review routes (merged before the generic resource handler).
pub(crate) fn routes(sh: Arc<Shared>) -> Router {
    Router::new()
        .route(
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            post(self_subject_review),
        )
        .route(
            "/apis/authentication.k8s.io/v1/tokenreviews",
            post(token_review),
        )
        .route(
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            post(self_subject_access_review),
        )
        .route(
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            post(subject_access_review),
        )
        .route(
            "/api/v1/namespaces/{ns}/serviceaccounts/{name}/token",
            post(super::tokens::token_request),
        )
        .with_state(sh)
}

/// Reads and decodes a request body (JSON, YAML or Kubernetes protobuf).
pub(crate) async fn read_object(
    sh: &Shared,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    let bytes = crate::body::read_body(headers, body, sh.max_body, sh.body_timeout).await?;
    let media = crate::body::content_type(headers);
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    crate::body::parse_object(&bytes, &media)
}

fn user_info_json(u: &UserInfo) -> Value {
    json!({"username": u.name, "uid": u.uid, "groups": u.groups})
}

async fn self_subject_review(Extension(user): Extension<Arc<UserInfo>>) -> Response {
    json_response(
        StatusCode::CREATED,
        &json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "SelfSubjectReview",
            "metadata": {"creationTimestamp": null},
            "status": {"userInfo": user_info_json(&user)},
        }),
    )
}

/// The audiences a TokenReview asks about: its `spec.audiences`, else the API server's.
pub fn review_audiences(spec: &Value) -> Vec<String> {
    let asked: Vec<String> = spec["audiences"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().filter(|a| !a.is_empty()).map(str::to_string))
        .collect();
    if asked.is_empty() {
        vec![super::tokens::ISSUER.to_string()]
    } else {
        asked
    }
}

/// `POST tokenreviews` (authentication.k8s.io/v1 TokenReview, as a kubelet or a metrics
/// endpoint delegates authentication; its caller needs `create` on `tokenreviews`, checked
/// like any request): the token of `spec.token` authenticated as a request's bearer token
/// would be, for one of `spec.audiences` (the API server's when none). The admin token is
/// valid for the API server's audience only.
async fn token_review(State(sh): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let mut review = read_object(&sh, &headers, body).await?;
        let token = review["spec"]["token"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if token.is_empty() {
            return Err(ApiError::new(
                400,
                "BadRequest",
                "token is required for TokenReview in authentication",
            ));
        }
        let audiences = review_audiences(&review["spec"]);
        let wanted: Vec<&str> = audiences.iter().map(String::as_str).collect();
        let admin = super::constant_time_eq(token.as_bytes(), sh.auth.admin_token.as_bytes());
        let user = if admin {
            wanted
                .contains(&super::tokens::ISSUER)
                .then(|| (super::admin_user(), vec![super::tokens::ISSUER.to_string()]))
        } else {
            super::tokens::authenticate_for(&sh, &token, &wanted).await
        };
        let status = match user {
            Some((mut u, named)) => {
                if !u.groups.iter().any(|g| g == super::AUTHENTICATED) {
                    u.groups.push(super::AUTHENTICATED.into());
                }
                // Which of the asked audiences the token names.
                let valid: Vec<String> = named
                    .into_iter()
                    .filter(|a| wanted.contains(&a.as_str()))
                    .collect();
                json!({"authenticated": true, "user": user_info_json(&u), "audiences": valid})
            }
            None => json!({"authenticated": false, "error": "invalid bearer token"}),
        };
        review["apiVersion"] = json!("authentication.k8s.io/v1");
        review["kind"] = json!("TokenReview");
        if !review["metadata"].is_object() {
            review["metadata"] = json!({});
        }
        review["metadata"]["creationTimestamp"] = Value::Null;
        review["status"] = status;
        Ok(json_response(StatusCode::CREATED, &review))
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

/// `(group, resource)` of a review: a resource named `plural.group` with an empty group is
/// that group's plural. kubectl's `auth can-i` sends the argument so when discovery lists no
/// such resource, as for `subresources.kubevirt.io` (whose discovery lists only
/// `virtualmachineinstances/console` and the like): `kubectl auth can-i get
/// virtualmachineinstances.subresources.kubevirt.io --subresource=console`. A plural never
/// contains a dot, so no real resource is read otherwise.
pub fn qualified_resource(group: &str, resource: &str) -> (String, String) {
    match resource.split_once('.') {
        Some((plural, g)) if group.is_empty() && !plural.is_empty() && !g.is_empty() => {
            (g.to_string(), plural.to_string())
        }
        _ => (group.to_string(), resource.to_string()),
    }
}

/// The attributes a review's spec asks about; a spec naming neither kind is refused.
fn spec_attributes(spec: &Value) -> Result<Attributes, ApiError> {
    let s = |v: &Value, k: &str| v[k].as_str().unwrap_or_default().to_string();
    if let Some(r) = spec.get("resourceAttributes").filter(|v| v.is_object()) {
        let (api_group, resource) = qualified_resource(&s(r, "group"), &s(r, "resource"));
        return Ok(Attributes {
            verb: s(r, "verb"),
            resource_request: true,
            api_group,
            resource,
            subresource: s(r, "subresource"),
            namespace: s(r, "namespace"),
            name: s(r, "name"),
            path: String::new(),
        });
    }
    if let Some(n) = spec.get("nonResourceAttributes").filter(|v| v.is_object()) {
        return Ok(Attributes {
            verb: s(n, "verb"),
            path: s(n, "path"),
            ..Default::default()
        });
    }
    Err(ApiError {
        details: Some(json!({"causes": [{"field": "spec.resourceAttributes",
            "message": "exactly one of nonResourceAttributes or resourceAttributes must be specified"}]})),
        ..ApiError::new(
            422,
            "Invalid",
            "spec.resourceAttributes: Invalid value: null: exactly one of nonResourceAttributes or resourceAttributes must be specified",
        )
    })
}

/// The review answered: the request echoed with `status.allowed` (and the reason).
async fn answer(
    sh: &Shared,
    mut review: Value,
    kind: &str,
    user: &UserInfo,
) -> Result<Response, ApiError> {
    let a = spec_attributes(&review["spec"])?;
    let decision = match super::node::node_of(user) {
        // A node is answered by the node authorizer first, as its requests are.
        Some(node) => match super::node::review(sh, node, &a).await {
            super::node::Verdict::Allow => rbac::Decision::Allow("the node authorizer".into()),
            super::node::Verdict::Deny(_) => rbac::Decision::Deny,
            super::node::Verdict::Rbac => rbac::authorize(&sh.auth.policy.get(), user, &a),
        },
        None => rbac::authorize(&sh.auth.policy.get(), user, &a),
    };
    let status = match &decision {
        rbac::Decision::Allow(why) => json!({"allowed": true, "reason": why}),
        rbac::Decision::Deny => json!({"allowed": false}),
    };
    review["apiVersion"] = json!("authorization.k8s.io/v1");
    review["kind"] = json!(kind);
    if !review["metadata"].is_object() {
        review["metadata"] = json!({});
    }
    review["metadata"]["creationTimestamp"] = Value::Null;
    review["status"] = status;
    Ok(json_response(StatusCode::CREATED, &review))
}

async fn self_subject_access_review(
    State(sh): State<Arc<Shared>>,
    Extension(user): Extension<Arc<UserInfo>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let r = async {
        let review = read_object(&sh, &headers, body).await?;
        answer(&sh, review, "SelfSubjectAccessReview", &user).await
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

async fn subject_access_review(
    State(sh): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let r = async {
        let review = read_object(&sh, &headers, body).await?;
        let spec = &review["spec"];
        let subject = UserInfo {
            name: spec["user"].as_str().unwrap_or_default().to_string(),
            uid: spec["uid"].as_str().unwrap_or_default().to_string(),
            groups: spec["groups"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|g| g.as_str().map(str::to_string))
                .collect(),
        };
        if subject.name.is_empty() && subject.groups.is_empty() {
            return Err(ApiError::new(
                422,
                "Invalid",
                "spec.user: Invalid value: \"\": at least one of user or group must be specified",
            ));
        }
        answer(&sh, review, "SubjectAccessReview", &subject).await
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dotted_resources_of_no_group_name_their_group() {
        let q = |g: &str, r: &str| qualified_resource(g, r);
        assert_eq!(
            q("", "virtualmachineinstances.subresources.kubevirt.io"),
            (
                "subresources.kubevirt.io".into(),
                "virtualmachineinstances".into()
            )
        );
        assert_eq!(q("", "pods"), ("".into(), "pods".into()));
        assert_eq!(
            q("kubevirt.io", "virtualmachines"),
            ("kubevirt.io".into(), "virtualmachines".into())
        );
        // A group already given wins; odd names stay as they are.
        assert_eq!(q("apps", "a.b"), ("apps".into(), "a.b".into()));
        assert_eq!(q("", ".x"), ("".into(), ".x".into()));
        assert_eq!(q("", "*"), ("".into(), "*".into()));
    }
}
