//! ServiceAccount tokens: the TokenRequest subresource (`kubectl create token SA`) issues a
//! JWT (HS256 under `DATA_DIR/tls/sa-token.key`, 0600, via `jsonwebtoken`) with issuer,
//! audiences, expiry and the ServiceAccount's namespace, name and uid; a request bearing one
//! is `system:serviceaccount:NS:NAME` in `system:serviceaccounts` and
//! `system:serviceaccounts:NS` while the token is unexpired, names the API audience, and the
//! ServiceAccount still exists with the same uid (a deleted, or deleted and recreated,
//! ServiceAccount's tokens stop working). A token may be bound to a VirtualMachineInstance
//! (`boundObjectRef`, as Kubernetes binds a Pod's): it then also names the VMI's name and uid
//! and works only while that VMI exists with that uid and is not being deleted (the node
//! agent asks one for each serviceAccount volume, docs/access-control.md). Also the
//! ServiceAccount controller's one job here: a `default` ServiceAccount in every namespace.

use std::path::Path;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use ferrovirt_store::{EventKind, ListOptions, StoreError};
use http::{HeaderMap, StatusCode};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::rbac::UserInfo;
use crate::error::{ApiError, ServerError};
use crate::handlers::json_response;
use crate::objects::{decode, encode, meta_mut};
use crate::server::Shared;

/// The issuer, and the audience the API server accepts (Kubernetes' defaults).
pub const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
/// Shortest and default token lifetimes (Kubernetes': 10 min, 1 h).
pub const MIN_SECONDS: i64 = 600;
pub const DEFAULT_SECONDS: i64 = 3600;
/// Longest token lifetime: one year.
pub const MAX_SECONDS: i64 = 365 * 86_400;

/// The signing key.
#[derive(Clone)]
pub struct TokenKeys {
    secret: Arc<[u8]>,
}

impl std::fmt::Debug for TokenKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKeys(..)")
    }
}

/// The `kubernetes.io` claim.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KubeClaim {
    pub namespace: String,
    pub serviceaccount: SaRef,
    /// The VMI the token is bound to (Kubernetes' `pod` claim, for a VMI).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtualmachineinstance: Option<SaRef>,
}

/// The one kind a token may be bound to.
pub const BOUND_KIND: &str = "VirtualMachineInstance";
/// Its apiVersion.
pub const BOUND_API_VERSION: &str = "kubevirt.io/v1";

/// A binding asked for: the VMI's name and the uid it must have (when given).
pub type BoundRequest = (String, Option<String>);

/// A TokenRequest's `spec.boundObjectRef`, checked: `None` when absent; the VMI's name and the
/// uid it must have (when given). Refused (field, message) for another kind or apiVersion, or
/// without a name. Pure.
pub fn bound_ref(spec: &Value) -> Result<Option<BoundRequest>, (String, String)> {
    let r = &spec["boundObjectRef"];
    if r.is_null() {
        return Ok(None);
    }
    let f = |k: &str| format!("spec.boundObjectRef.{k}");
    if !r.is_object() {
        return Err(("spec.boundObjectRef".into(), "must be an object".into()));
    }
    if r["kind"].as_str() != Some(BOUND_KIND) {
        return Err((
            f("kind"),
            format!("{}: ferrovirt binds tokens to {BOUND_KIND} only", r["kind"]),
        ));
    }
    match r["apiVersion"].as_str() {
        None | Some(BOUND_API_VERSION) => {}
        Some(v) => {
            return Err((
                f("apiVersion"),
                format!("{v:?}: must be {BOUND_API_VERSION:?}"),
            ));
        }
    }
    let name = r["name"].as_str().filter(|n| !n.is_empty());
    let Some(name) = name else {
        return Err((f("name"), "Required value".into()));
    };
    let uid = r["uid"]
        .as_str()
        .filter(|u| !u.is_empty())
        .map(str::to_string);
    Ok(Some((name.to_string(), uid)))
}

/// Whether a stored VMI (if any) is the live object a token bound to `bound` names. Pure.
pub fn bound_object_live(vmi: Option<&Value>, bound: &SaRef) -> bool {
    vmi.is_some_and(|v| {
        v["metadata"]["uid"].as_str() == Some(bound.uid.as_str())
            && !v["metadata"]["deletionTimestamp"].is_string()
    })
}

fn vmi_key(sh: &Shared, ns: &str, name: &str) -> Option<String> {
    let def = sh
        .resources
        .lookup("kubevirt.io", "v1", "virtualmachineinstances")?;
    Some(crate::resources::object_key(def, Some(ns), name))
}

async fn stored_vmi(sh: &Shared, ns: &str, name: &str) -> Result<Option<Value>, ApiError> {
    let Some(key) = vmi_key(sh, ns, name) else {
        return Ok(None);
    };
    match sh.store.get(&key).await.map_err(ApiError::from_store)? {
        Some(kv) => Ok(Some(decode(&kv)?)),
        None => Ok(None),
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SaRef {
    pub name: String,
    pub uid: String,
}

/// The token's claims.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Claims {
    pub iss: String,
    pub sub: String,
    pub aud: Vec<String>,
    pub exp: i64,
    pub iat: i64,
    pub nbf: i64,
    #[serde(rename = "kubernetes.io")]
    pub kube: KubeClaim,
}

/// Why a token is not accepted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    #[error("invalid token: {0}")]
    Invalid(String),
}

impl TokenKeys {
    /// Loads `DATA_DIR/tls/sa-token.key`, creating it when missing.
    pub fn load_or_create(data_dir: &Path) -> Result<TokenKeys, ServerError> {
        let p = data_dir.join("tls/sa-token.key");
        crate::tls::private_file(&p)?;
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut key = [0u8; 32];
                ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut key)
                    .map_err(|_| ServerError::Tls("no randomness for the token key".into()))?;
                let t = base64::engine::general_purpose::STANDARD.encode(key);
                crate::tls::write_private(&p, &t)?;
                t
            }
            Err(e) => return Err(ServerError::io(p.display(), e)),
        };
        let secret = base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map_err(|e| ServerError::Config(format!("{}: {e}", p.display())))?;
        Ok(TokenKeys {
            secret: secret.into(),
        })
    }

    /// A key for tests.
    pub fn from_secret(secret: &[u8]) -> TokenKeys {
        TokenKeys {
            secret: secret.into(),
        }
    }

    /// Signs `claims`.
    pub fn sign(&self, claims: &Claims) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            claims,
            &EncodingKey::from_secret(&self.secret),
        )
        .unwrap_or_default()
    }

    /// The claims of a token signed by this key, unexpired (at `now`), from [`ISSUER`], for
    /// the API audience.
    pub fn verify(&self, token: &str, now: i64) -> Result<Claims, TokenError> {
        self.verify_for(token, now, &[ISSUER])
    }

    /// [`Self::verify`] for a token that must name one of `audiences` (a TokenReview's).
    pub fn verify_for(
        &self,
        token: &str,
        now: i64,
        audiences: &[&str],
    ) -> Result<Claims, TokenError> {
        let mut v = Validation::new(Algorithm::HS256);
        v.set_audience(audiences);
        v.set_issuer(&[ISSUER]);
        v.leeway = 0;
        v.validate_exp = false; // checked below against `now`
        v.validate_nbf = false;
        v.set_required_spec_claims(&["exp", "aud", "iss", "sub"]);
        let data =
            jsonwebtoken::decode::<Claims>(token, &DecodingKey::from_secret(&self.secret), &v)
                .map_err(|e| TokenError::Invalid(e.to_string()))?;
        let c = data.claims;
        if c.exp <= now {
            return Err(TokenError::Invalid("token has expired".into()));
        }
        if c.nbf > now + 60 {
            return Err(TokenError::Invalid("token is not valid yet".into()));
        }
        Ok(c)
    }
}

/// The user a ServiceAccount token names.
pub fn user_of(c: &Claims) -> UserInfo {
    let ns = &c.kube.namespace;
    UserInfo {
        name: format!("system:serviceaccount:{ns}:{}", c.kube.serviceaccount.name),
        uid: c.kube.serviceaccount.uid.clone(),
        groups: vec![
            "system:serviceaccounts".into(),
            format!("system:serviceaccounts:{ns}"),
        ],
    }
}

fn sa_key(ns: &str, name: &str) -> String {
    format!("/registry/core/serviceaccounts/{ns}/{name}")
}

fn now_secs() -> i64 {
    crate::timefmt::now_secs()
}

/// The identity of a ServiceAccount token, if it is valid and its ServiceAccount still exists
/// (same uid; from [`super::sacache`], else the store), and so does the VMI it is bound to.
pub(crate) async fn authenticate(sh: &Shared, token: &str) -> Option<UserInfo> {
    authenticate_for(sh, token, &[ISSUER]).await.map(|(u, _)| u)
}

/// [`authenticate`] for a token that must name one of `audiences`; with the audiences the
/// token names.
pub(crate) async fn authenticate_for(
    sh: &Shared,
    token: &str,
    audiences: &[&str],
) -> Option<(UserInfo, Vec<String>)> {
    let c = match sh.auth.tokens.verify_for(token, now_secs(), audiences) {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!("bearer token refused: {e}");
            return None;
        }
    };
    if let Some(bound) = &c.kube.virtualmachineinstance {
        // A bound token dies with its VMI (one store read: such tokens are used from guests).
        let vmi = stored_vmi(sh, &c.kube.namespace, &bound.name).await.ok()?;
        if !bound_object_live(vmi.as_ref(), bound) {
            tracing::debug!("bearer token refused: the VMI it is bound to is gone");
            return None;
        }
    }
    let key = sa_key(&c.kube.namespace, &c.kube.serviceaccount.name);
    // The cache of live ServiceAccounts answers without a store read; a miss (not seen yet,
    // another uid) is checked against the store.
    if sh
        .auth
        .service_accounts
        .known(&key, &c.kube.serviceaccount.uid)
    {
        return Some((user_of(&c), c.aud.clone()));
    }
    let kv = sh.store.get(&key).await.ok()??;
    let sa = decode(&kv).ok()?;
    if sa["metadata"]["uid"].as_str() != Some(c.kube.serviceaccount.uid.as_str())
        || sa["metadata"]["deletionTimestamp"].is_string()
    {
        tracing::debug!("bearer token refused: its ServiceAccount is gone");
        return None;
    }
    Some((user_of(&c), c.aud.clone()))
}

/// The lifetime a TokenRequest asks for, checked as Kubernetes does.
pub fn lifetime(spec: &Value) -> Result<i64, String> {
    match spec.get("expirationSeconds").filter(|v| !v.is_null()) {
        None => Ok(DEFAULT_SECONDS),
        Some(v) => match v.as_i64() {
            Some(s) if s < MIN_SECONDS => {
                Err("may not specify a duration less than 10 minutes".into())
            }
            Some(s) if s > MAX_SECONDS => {
                Err("may not specify a duration longer than 1 year".into())
            }
            Some(s) => Ok(s),
            None => Err("must be an integer".into()),
        },
    }
}

fn invalid(field: &str, message: &str) -> ApiError {
    ApiError {
        details: Some(
            json!({"kind": "TokenRequest", "group": "authentication.k8s.io",
            "causes": [{"field": field, "message": message, "reason": "FieldValueInvalid"}]}),
        ),
        ..ApiError::new(
            422,
            "Invalid",
            format!(
                "TokenRequest.authentication.k8s.io is invalid: {field}: Invalid value: {message}"
            ),
        )
    }
}

/// `POST /api/v1/namespaces/{ns}/serviceaccounts/{name}/token`.
pub(crate) async fn token_request(
    State(sh): State<Arc<Shared>>,
    UrlPath((ns, name)): UrlPath<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let r = async {
        let mut req = super::reviews::read_object(&sh, &headers, body).await?;
        let kv = sh
            .store
            .get(&sa_key(&ns, &name))
            .await
            .map_err(ApiError::from_store)?
            .ok_or_else(|| ApiError {
                details: Some(json!({"name": name, "kind": "serviceaccounts"})),
                ..ApiError::new(
                    404,
                    "NotFound",
                    format!("serviceaccounts {name:?} not found"),
                )
            })?;
        let sa = decode(&kv)?;
        let spec = req.get("spec").cloned().unwrap_or_else(|| json!({}));
        let seconds = lifetime(&spec).map_err(|m| invalid("spec.expirationSeconds", &m))?;
        let mut aud: Vec<String> = spec["audiences"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().map(str::to_string))
            .collect();
        if aud.is_empty() {
            aud.push(ISSUER.into());
        }
        let bound = match bound_ref(&spec).map_err(|(f, m)| invalid(&f, &m))? {
            None => None,
            Some((vmi_name, want_uid)) => {
                let vmi = stored_vmi(&sh, &ns, &vmi_name)
                    .await?
                    .ok_or_else(|| ApiError {
                        details: Some(json!({"name": vmi_name, "group": "kubevirt.io",
                        "kind": "virtualmachineinstances"})),
                        ..ApiError::new(
                            404,
                            "NotFound",
                            format!("virtualmachineinstances.kubevirt.io {vmi_name:?} not found"),
                        )
                    })?;
                let uid = vmi["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                if want_uid.as_ref().is_some_and(|w| *w != uid) {
                    return Err(ApiError::new(
                        409,
                        "Conflict",
                        format!(
                            "the UID in the bound object reference ({}) does not match the UID in record. The object might have been deleted and then recreated",
                            want_uid.unwrap_or_default()
                        ),
                    ));
                }
                if vmi["metadata"]["deletionTimestamp"].is_string() {
                    return Err(ApiError::new(
                        409,
                        "Conflict",
                        format!(
                            "virtualmachineinstances.kubevirt.io {vmi_name:?} is being deleted"
                        ),
                    ));
                }
                Some(SaRef {
                    name: vmi_name,
                    uid,
                })
            }
        };
        let now = now_secs();
        let claims = Claims {
            iss: ISSUER.into(),
            sub: format!("system:serviceaccount:{ns}:{name}"),
            aud: aud.clone(),
            exp: now + seconds,
            iat: now,
            nbf: now,
            kube: KubeClaim {
                namespace: ns.clone(),
                serviceaccount: SaRef {
                    name: name.clone(),
                    uid: sa["metadata"]["uid"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                },
                virtualmachineinstance: bound.clone(),
            },
        };
        let token = sh.auth.tokens.sign(&claims);
        req["apiVersion"] = json!("authentication.k8s.io/v1");
        req["kind"] = json!("TokenRequest");
        req["metadata"] = json!({"name": name, "namespace": ns, "creationTimestamp": null});
        let bound_json = bound.map(|b| {
            json!({"kind": BOUND_KIND, "apiVersion": BOUND_API_VERSION, "name": b.name, "uid": b.uid})
        });
        req["spec"] =
            json!({"audiences": aud, "expirationSeconds": seconds, "boundObjectRef": bound_json});
        req["status"] = json!({
            "token": token,
            "expirationTimestamp": crate::timefmt::format_rfc3339(now + seconds),
        });
        Ok(json_response(StatusCode::CREATED, &req))
    };
    r.await.unwrap_or_else(IntoResponse::into_response)
}

/// Creates the `default` ServiceAccount in `ns` when missing.
async fn ensure_default_sa(sh: &Shared, ns: &str) {
    let key = sa_key(ns, "default");
    if matches!(sh.store.get(&key).await, Ok(Some(_))) {
        return;
    }
    let mut sa = json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": ns}});
    let m = meta_mut(&mut sa);
    m.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
    m.insert(
        "creationTimestamp".into(),
        json!(crate::timefmt::now_rfc3339()),
    );
    match sh.store.create(&key, encode(&sa)).await {
        Ok(_) | Err(StoreError::AlreadyExists(_)) => {}
        Err(e) => tracing::warn!("creating the default ServiceAccount in {ns}: {e}"),
    }
}

const NS_PREFIX: &str = "/registry/core/namespaces/";

/// The ServiceAccount controller's part: a `default` ServiceAccount in every namespace (one
/// list of namespaces, then their watch).
pub(crate) async fn default_service_accounts(sh: Arc<Shared>) {
    let shutdown = sh.shutdown.clone();
    let sh = &*sh;
    let w = super::watchloop::Watched {
        store: sh.store.as_ref(),
        prefix: NS_PREFIX,
        what: "serviceaccounts (namespaces)",
    };
    super::watchloop::follow(
        w,
        shutdown,
        move || async move {
            let list = sh.store.list(NS_PREFIX, ListOptions::default()).await?;
            for kv in &list.items {
                if let Ok(ns) = decode(kv)
                    && !ns["metadata"]["deletionTimestamp"].is_string()
                    && let Some(name) = ns["metadata"]["name"].as_str()
                {
                    ensure_default_sa(sh, name).await;
                }
            }
            Ok(list.revision)
        },
        move |batch: Vec<ferrovirt_store::WatchEvent>| async move {
            for ev in batch {
                if ev.kind == EventKind::Created
                    && let Some(name) = ev.kv.key.strip_prefix(NS_PREFIX)
                {
                    ensure_default_sa(sh, name).await;
                }
            }
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(aud: &str, exp: i64) -> Claims {
        Claims {
            iss: ISSUER.into(),
            sub: "system:serviceaccount:a:sa".into(),
            aud: vec![aud.into()],
            exp,
            iat: 1000,
            nbf: 1000,
            kube: KubeClaim {
                namespace: "a".into(),
                serviceaccount: SaRef {
                    name: "sa".into(),
                    uid: "u1".into(),
                },
                virtualmachineinstance: None,
            },
        }
    }

    #[test]
    fn valid_token_names_the_service_account() {
        let k = TokenKeys::from_secret(b"0123456789abcdef0123456789abcdef");
        let t = k.sign(&claims(ISSUER, 5000));
        let c = k.verify(&t, 2000).unwrap();
        let u = user_of(&c);
        assert_eq!(u.name, "system:serviceaccount:a:sa");
        assert_eq!(
            u.groups,
            vec!["system:serviceaccounts", "system:serviceaccounts:a"]
        );
    }

    #[test]
    fn expired_wrong_audience_tampered_and_foreign_tokens_are_refused() {
        let k = TokenKeys::from_secret(b"0123456789abcdef0123456789abcdef");
        // expired
        let t = k.sign(&claims(ISSUER, 5000));
        assert!(k.verify(&t, 5000).is_err());
        // another audience (a token meant for some other service)
        let t = k.sign(&claims("https://vault.example", 5000));
        assert!(k.verify(&t, 2000).is_err());
        // tampered payload: claims another ServiceAccount, signature unchanged
        let t = k.sign(&claims(ISSUER, 5000));
        let parts: Vec<&str> = t.split('.').collect();
        let mut c = claims(ISSUER, 5000);
        c.kube.serviceaccount.name = "admin".into();
        let forged = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(serde_json::to_vec(&c).unwrap());
        let tampered = format!("{}.{forged}.{}", parts[0], parts[2]);
        assert!(k.verify(&tampered, 2000).is_err());
        // signed by another key
        let other = TokenKeys::from_secret(b"another key another key another k");
        assert!(k.verify(&other.sign(&claims(ISSUER, 5000)), 2000).is_err());
        // "alg: none"
        let none_header = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"alg":"none","typ":"JWT"}"#);
        assert!(
            k.verify(&format!("{none_header}.{}.", parts[1]), 2000)
                .is_err()
        );
    }

    #[test]
    fn lifetimes() {
        assert_eq!(lifetime(&json!({})), Ok(DEFAULT_SECONDS));
        assert_eq!(lifetime(&json!({"expirationSeconds": 7200})), Ok(7200));
        assert!(lifetime(&json!({"expirationSeconds": 60})).is_err());
        assert!(lifetime(&json!({"expirationSeconds": MAX_SECONDS + 1})).is_err());
    }

    #[test]
    fn bound_object_refs() {
        assert_eq!(bound_ref(&json!({})), Ok(None));
        assert_eq!(bound_ref(&json!({"boundObjectRef": null})), Ok(None));
        assert_eq!(
            bound_ref(&json!({"boundObjectRef": {"kind": "VirtualMachineInstance",
                "apiVersion": "kubevirt.io/v1", "name": "vm", "uid": "u"}})),
            Ok(Some(("vm".into(), Some("u".into()))))
        );
        assert_eq!(
            bound_ref(&json!({"boundObjectRef": {"kind": "VirtualMachineInstance", "name": "vm"}})),
            Ok(Some(("vm".into(), None)))
        );
        let field = |v: Value| bound_ref(&v).unwrap_err().0;
        assert_eq!(
            field(json!({"boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "p"}})),
            "spec.boundObjectRef.kind"
        );
        assert_eq!(
            field(
                json!({"boundObjectRef": {"kind": "VirtualMachineInstance", "apiVersion": "v1", "name": "p"}})
            ),
            "spec.boundObjectRef.apiVersion"
        );
        assert_eq!(
            field(json!({"boundObjectRef": {"kind": "VirtualMachineInstance"}})),
            "spec.boundObjectRef.name"
        );
        assert_eq!(
            field(json!({"boundObjectRef": "vm"})),
            "spec.boundObjectRef"
        );
    }

    #[test]
    fn a_bound_token_lives_with_its_vmi() {
        let b = SaRef {
            name: "vm".into(),
            uid: "u1".into(),
        };
        let vmi = |uid: &str| json!({"metadata": {"name": "vm", "uid": uid}});
        assert!(bound_object_live(Some(&vmi("u1")), &b));
        // gone, recreated under the same name, being deleted
        assert!(!bound_object_live(None, &b));
        assert!(!bound_object_live(Some(&vmi("u2")), &b));
        let mut deleting = vmi("u1");
        deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        assert!(!bound_object_live(Some(&deleting), &b));
        // The binding travels in the signed claims.
        let k = TokenKeys::from_secret(b"0123456789abcdef0123456789abcdef");
        let mut c = claims(ISSUER, 5000);
        c.kube.virtualmachineinstance = Some(b.clone());
        let back = k.verify(&k.sign(&c), 2000).unwrap();
        assert_eq!(back.kube.virtualmachineinstance, Some(b));
    }
}
