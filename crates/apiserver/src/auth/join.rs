//! Joining nodes (k3s-style, docs/nodes.md): the join token in `DATA_DIR/node-token` (0600,
//! created on first start; `K10<SHA-256 of the serving CA's DER>::<secret>`,
//! [`ferrovirt_api::jointoken`]) and the unauthenticated bootstrap endpoint
//! [`JOIN_PATH`](ferrovirt_api::jointoken::JOIN_PATH): the token's secret (compared in
//! constant time; a wrong one is 401), a node name (a DNS-1123 subdomain, else 422 naming
//! `nodeName`) and the node's public key (ECDSA P-256, else 422 naming `publicKey`) buy a
//! client certificate `CN=system:node:<name>, O=system:nodes` signed by the client CA. The
//! node's private key never leaves the node. The first join under a name records the SHA-256
//! of the node's password (k3s' node password) in the store outside the API; a later join
//! under that name with another password is 403, so the token alone cannot take over a
//! joined node's name. [`RENEW_PATH`] renews a node certificate for the node presenting its
//! current one (docs/nodes.md "Renewal").

use std::path::Path;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use ferrovirt_api::jointoken::{
    JOIN_PATH, JoinRequest, JoinResponse, JoinToken, NODE_USER_PREFIX, NODES_GROUP, RENEW_PATH,
    RenewRequest, RenewResponse,
};
use serde_json::json;

use super::certs::ClientCa;
use crate::error::{ApiError, ServerError};
use crate::tls::{private_file, write_private};

/// The token file's name in the data dir.
pub const TOKEN_FILE: &str = "node-token";
/// Largest join request body.
const MAX_BODY: usize = 16 * 1024;

/// SHA-256 of the first certificate in `ca_pem` (DER): the join token's CA hash.
pub fn ca_hash(ca_pem: &str) -> Result<[u8; 32], ServerError> {
    let der = crate::tls::pem_blocks(ca_pem, "CERTIFICATE")
        .into_iter()
        .next()
        .ok_or_else(|| ServerError::Tls("the serving CA file holds no certificate".into()))?;
    let d = ring::digest::digest(&ring::digest::SHA256, &der);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    Ok(out)
}

fn new_secret() -> String {
    let rng = ring::rand::SystemRandom::new();
    let mut b = [0u8; 32];
    ring::rand::SecureRandom::fill(&rng, &mut b).expect("the system RNG works");
    ferrovirt_api::jointoken::hex(&b)
}

/// Loads `DATA_DIR/node-token`, creating it when missing; its CA hash always follows the
/// current serving CA (the secret is kept).
pub fn load_or_create(data_dir: &Path, ca_pem: &str) -> Result<JoinToken, ServerError> {
    let path = data_dir.join(TOKEN_FILE);
    private_file(&path)?;
    let hash = ca_hash(ca_pem)?;
    let secret = match std::fs::read_to_string(&path) {
        Ok(s) => match JoinToken::parse(&s) {
            Ok(t) => t.secret,
            Err(e) => {
                return Err(ServerError::Config(format!("{}: {e}", path.display())));
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => new_secret(),
        Err(e) => return Err(ServerError::io(path.display(), e)),
    };
    let token = JoinToken {
        ca_hash: hash,
        secret,
    };
    let text = format!("{}\n", token.format());
    if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
        write_private(&path, &text)?;
    }
    Ok(token)
}

/// A node's public key as the join request carries it: an uncompressed P-256 point.
struct P256Key(Vec<u8>);

impl rcgen::PublicKeyData for P256Key {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }
    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

/// A join request's field problem: (field, message).
pub type FieldProblem = (&'static str, String);

/// Checks a join request's node name and public key (the secret is checked before):
/// the node name and the key's bytes. Pure.
pub fn validate(req: &JoinRequest) -> Result<(String, Vec<u8>), FieldProblem> {
    if !ferrovirt_api::jointoken::valid_secret(&req.node_password) {
        return Err((
            "nodePassword",
            "must be 16 to 256 printable characters without spaces".to_string(),
        ));
    }
    if !ferrovirt_api::admission::is_dns1123_subdomain(&req.node_name) {
        return Err((
            "nodeName",
            format!(
                "Invalid value: {:?}: a lowercase RFC 1123 subdomain must consist of lower case \
                 alphanumeric characters, '-' or '.', and must start and end with an \
                 alphanumeric character",
                req.node_name
            ),
        ));
    }
    let key = public_key(&req.public_key).ok_or_else(|| {
        (
            "publicKey",
            "must be an uncompressed ECDSA P-256 public key (65 bytes), base64".to_string(),
        )
    })?;
    Ok((req.node_name.clone(), key))
}

/// How a node's endpoint token is derived from the API token: `f(api_token, node)`.
pub type DeriveToken = fn(&str, &str) -> String;

/// Where the hash of a joined node name's password is kept (outside the API: no request reads
/// or writes it).
pub fn password_key(node: &str) -> String {
    format!("/ferrovirt/node-passwords/{node}")
}

fn password_hash(password: &str) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, password.as_bytes())
        .as_ref()
        .to_vec()
}

/// Whether `presented` is the password whose hash is `stored`. Pure.
pub fn password_matches(stored: &[u8], presented: &str) -> bool {
    super::constant_time_eq(stored, &password_hash(presented))
}

/// Records the name's password on its first join; later joins must present the same one:
/// Ok(()) or the 403 that refuses the name.
async fn claim_name(
    store: &dyn ferrovirt_store::Store,
    node: &str,
    password: &str,
) -> Result<(), ApiError> {
    let key = password_key(node);
    let taken = || {
        ApiError::forbidden(format!(
            "node name {node:?} is already joined by another node (its node password does not \
             match); pick another name, or join from the machine that holds it"
        ))
    };
    for _ in 0..3 {
        match store.get(&key).await.map_err(ApiError::from_store)? {
            Some(kv) if password_matches(&kv.value, password) => return Ok(()),
            Some(_) => return Err(taken()),
            None => match store.create(&key, password_hash(password)).await {
                Ok(_) => return Ok(()),
                // Another join under this name raced us: compare with its password.
                Err(ferrovirt_store::StoreError::AlreadyExists(_)) => continue,
                Err(e) => return Err(ApiError::from_store(e)),
            },
        }
    }
    Err(taken())
}

/// What the join endpoint needs.
pub struct JoinState {
    pub secret: String,
    /// Holds the node passwords' hashes.
    pub store: std::sync::Arc<dyn ferrovirt_store::Store>,
    pub client_ca: ClientCa,
    /// Where the issued certificate is recorded as the name's one valid certificate.
    pub node_certs: Arc<super::nodecreds::NodeCerts>,
    /// How long a node certificate is valid (`--node-cert-lifetime-seconds`).
    pub lifetime: std::time::Duration,
    /// The API token and how a node's endpoint token is derived from it.
    pub endpoint_token: Option<(String, DeriveToken)>,
}

fn invalid(field: &str, message: String) -> ApiError {
    ApiError {
        details: Some(json!({
            "kind": "JoinRequest",
            "causes": [{"reason": "FieldValueInvalid", "field": field, "message": message}],
        })),
        ..ApiError::new(
            422,
            "Invalid",
            format!("JoinRequest is invalid: {field}: {message}"),
        )
    }
}

async fn join(State(st): State<Arc<JoinState>>, body: Bytes) -> Response {
    if body.len() > MAX_BODY {
        return ApiError::too_large(MAX_BODY).into_response();
    }
    let req: JoinRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return ApiError::bad_request(format!("decoding the join request: {e}"))
                .into_response();
        }
    };
    if !super::constant_time_eq(req.secret.as_bytes(), st.secret.as_bytes()) {
        tracing::warn!(node = %req.node_name.escape_debug(), "join refused: wrong token secret");
        return super::unauthorized();
    }
    let (node, key) = match validate(&req) {
        Ok(v) => v,
        Err((field, msg)) => return invalid(field, msg).into_response(),
    };
    if let Err(e) = claim_name(st.store.as_ref(), &node, &req.node_password).await {
        tracing::warn!(%node, "join refused: {}", e.message);
        return e.into_response();
    }
    let user = format!("{NODE_USER_PREFIX}{node}");
    // The name's earlier certificates stop authenticating (a re-join replaces them).
    match issue_and_record(&st, &node, key, false).await {
        Ok(certificate) => {
            tracing::info!(%node, "node joined: issued a client certificate for {user}");
            let resp = JoinResponse {
                certificate,
                client_ca: st.client_ca.cert_pem.clone(),
                endpoint_token: st.endpoint_token.as_ref().map(|(t, f)| f(t, &node)),
            };
            (http::StatusCode::CREATED, axum::Json(resp)).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// Signs a node certificate for `key` valid for the configured lifetime and records it as
/// valid for `node` (`keep_old`: beside the unexpired ones, a renewal; else alone, a join).
async fn issue_and_record(
    st: &JoinState,
    node: &str,
    key: Vec<u8>,
    keep_old: bool,
) -> Result<String, ApiError> {
    let user = format!("{NODE_USER_PREFIX}{node}");
    let certificate = st
        .client_ca
        .issue_for_lifetime(
            &user,
            &[NODES_GROUP.to_string()],
            st.lifetime,
            &P256Key(key),
        )
        .map_err(|e| ApiError::internal(format!("signing the node certificate: {e}")))?;
    let der = crate::tls::pem_blocks(&certificate, "CERTIFICATE")
        .into_iter()
        .next()
        .ok_or_else(|| ApiError::internal("the signed node certificate holds no certificate"))?;
    let not_after = time::OffsetDateTime::now_utc().unix_timestamp()
        + i64::try_from(st.lifetime.as_secs()).unwrap_or(i64::MAX / 2);
    st.node_certs
        .record(st.store.as_ref(), node, &der, not_after, keep_old)
        .await?;
    Ok(certificate)
}

/// `POST /v1-ferrovirt/node-renew`: a node presenting its current, still valid node
/// certificate (verified by the TLS layer, recorded as valid) gets a new one for the same name
/// and a new public key; the old one stays valid until it expires.
async fn renew(
    State(st): State<Arc<JoinState>>,
    cert: Option<axum::Extension<ferrovirt_serve::PeerCertificate>>,
    body: Bytes,
) -> Response {
    if body.len() > MAX_BODY {
        return ApiError::too_large(MAX_BODY).into_response();
    }
    let Some(axum::Extension(cert)) = cert else {
        return ApiError::new(
            401,
            "Unauthorized",
            "renewing a node certificate needs the current node certificate as the client \
             certificate",
        )
        .into_response();
    };
    let node = super::certs::identity(&cert.0).and_then(|id| {
        let node = super::nodecreds::node_of_user(&id.name)?.to_string();
        id.groups.iter().any(|g| g == NODES_GROUP).then_some(node)
    });
    let Some(node) = node else {
        return ApiError::forbidden(format!(
            "only a node ({NODE_USER_PREFIX}<name> in {NODES_GROUP}) renews a node certificate"
        ))
        .into_response();
    };
    if let Err(e) = st.node_certs.check(st.store.as_ref(), &node, &cert.0).await {
        tracing::warn!(%node, "renewal refused: {}", e.message);
        return e.into_response();
    }
    let req: RenewRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return ApiError::bad_request(format!("decoding the renewal request: {e}"))
                .into_response();
        }
    };
    let Some(key) = public_key(&req.public_key) else {
        return invalid(
            "publicKey",
            "must be an uncompressed ECDSA P-256 public key (65 bytes), base64".to_string(),
        )
        .into_response();
    };
    match issue_and_record(&st, &node, key, true).await {
        Ok(certificate) => {
            tracing::info!(%node, "node certificate renewed for {NODE_USER_PREFIX}{node}");
            (
                http::StatusCode::CREATED,
                axum::Json(RenewResponse { certificate }),
            )
                .into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// The bytes of a base64 uncompressed P-256 point. Pure.
fn public_key(b64: &str) -> Option<Vec<u8>> {
    base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()
        .filter(|k| k.len() == 65 && k[0] == 4)
}

/// The join route (served without authentication: the secret is the credential).
pub fn routes(st: Arc<JoinState>) -> Router {
    Router::new()
        .route(JOIN_PATH, axum::routing::post(join))
        .route(RENEW_PATH, axum::routing::post(renew))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(st)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(name: &str, key: &str) -> JoinRequest {
        JoinRequest {
            secret: "s".into(),
            node_name: name.into(),
            public_key: key.into(),
            node_password: "0123456789abcdef".into(),
        }
    }

    #[test]
    fn validation_names_the_field() {
        let kp = rcgen::KeyPair::generate().unwrap();
        let key = base64::engine::general_purpose::STANDARD.encode(kp.public_key_raw());
        assert_eq!(validate(&req("node-1", &key)).unwrap().0, "node-1");
        for bad in ["Node_1", "", "a..b", "-x", "x/../y"] {
            assert_eq!(
                validate(&req(bad, &key)).unwrap_err().0,
                "nodeName",
                "{bad}"
            );
        }
        for bad in ["", "!!", "AAAA"] {
            assert_eq!(validate(&req("n", bad)).unwrap_err().0, "publicKey");
        }
        for bad in ["", "short", "with a space in it!"] {
            let mut r = req("n", &key);
            r.node_password = bad.into();
            assert_eq!(validate(&r).unwrap_err().0, "nodePassword");
        }
    }

    #[test]
    fn node_passwords_compare_by_hash() {
        let stored = password_hash("0123456789abcdef");
        assert!(password_matches(&stored, "0123456789abcdef"));
        assert!(!password_matches(&stored, "0123456789abcdeg"));
        assert!(!password_matches(&[], "0123456789abcdef"));
        assert_eq!(password_key("n1"), "/ferrovirt/node-passwords/n1");
    }

    #[test]
    fn token_file_is_private_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let pki = crate::tls::load_or_create(dir.path(), &[]).unwrap();
        let a = load_or_create(dir.path(), &pki.ca_pem).unwrap();
        let b = load_or_create(dir.path(), &pki.ca_pem).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.ca_hash, ca_hash(&pki.ca_pem).unwrap());
        use std::os::unix::fs::PermissionsExt;
        let p = dir.path().join(TOKEN_FILE);
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            JoinToken::parse(&std::fs::read_to_string(&p).unwrap()).unwrap(),
            a
        );
    }

    #[test]
    fn issued_node_certificate_carries_the_node_identity_and_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let ca = super::super::certs::load_or_create(dir.path()).unwrap();
        let kp = rcgen::KeyPair::generate().unwrap();
        let pem = ca
            .issue_for(
                "system:node:n1",
                &[NODES_GROUP.into()],
                1,
                &P256Key(kp.public_key_raw().to_vec()),
            )
            .unwrap();
        let der = crate::tls::pem_blocks(&pem, "CERTIFICATE").remove(0);
        let id = super::super::certs::identity(&der).unwrap();
        assert_eq!(id.name, "system:node:n1");
        assert_eq!(id.groups, vec![NODES_GROUP.to_string()]);
        use x509_parser::prelude::{FromDer, X509Certificate};
        let (_, cert) = X509Certificate::from_der(&der).unwrap();
        assert_eq!(
            cert.public_key().subject_public_key.data.as_ref(),
            kp.public_key_raw()
        );
    }
}
