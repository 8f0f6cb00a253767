//! The node join token (k3s-style): `K10<CA hash>::<secret>`, where `<CA hash>` is the
//! lowercase hex SHA-256 of the DER bytes of the API server's serving CA certificate and
//! `<secret>` the shared secret the server checks before it signs a node's certificate. An
//! agent given the token can check the server it reaches (the CA hash) before it sends
//! anything, and prove it may join (the secret). k3s hashes the PEM bundle it serves at
//! `/cacerts`; ferrovirt hashes the CA certificate's DER, which the server presents in its TLS
//! handshake, so the check needs no request at all (docs/nodes.md). Pure: parsing and
//! formatting only.

/// The prefix of every token (k3s' "secure token" format version).
pub const PREFIX: &str = "K10";

/// A parsed join token.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    /// SHA-256 of the serving CA certificate (DER).
    pub ca_hash: [u8; 32],
    /// The secret (printable ASCII, no whitespace, 16..=256 bytes).
    pub secret: String,
}

impl std::fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret is never printed.
        f.debug_struct("JoinToken")
            .field("ca_hash", &hex(&self.ca_hash))
            .finish_non_exhaustive()
    }
}

/// Why a token does not parse (the message never contains the secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("a join token starts with {PREFIX} (K10<CA hash>::<secret>)")]
    Prefix,
    #[error("the join token's CA hash must be 64 hex digits (SHA-256), followed by '::'")]
    CaHash,
    #[error("the join token's secret must be 16 to 256 printable characters without spaces")]
    Secret,
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Whether `s` may be a token secret.
pub fn valid_secret(s: &str) -> bool {
    (16..=256).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_graphic())
}

impl JoinToken {
    /// Parses a token; surrounding whitespace (a file's trailing newline) is ignored.
    pub fn parse(s: &str) -> Result<JoinToken, TokenError> {
        let s = s.trim();
        let rest = s.strip_prefix(PREFIX).ok_or(TokenError::Prefix)?;
        let (hash, secret) = rest.split_once("::").ok_or(TokenError::CaHash)?;
        let ca_hash = unhex32(hash).ok_or(TokenError::CaHash)?;
        if !valid_secret(secret) {
            return Err(TokenError::Secret);
        }
        Ok(JoinToken {
            ca_hash,
            secret: secret.to_string(),
        })
    }

    /// The token's text form.
    pub fn format(&self) -> String {
        format!("{PREFIX}{}::{}", hex(&self.ca_hash), self.secret)
    }

    /// The CA hash as lowercase hex.
    pub fn ca_hash_hex(&self) -> String {
        hex(&self.ca_hash)
    }
}

/// Where an agent asks to join: `POST` a [`JoinRequest`], answered with a [`JoinResponse`].
pub const JOIN_PATH: &str = "/v1-ferrovirt/node-join";

/// The prefix of a node's user name (Kubernetes' node identity).
pub const NODE_USER_PREFIX: &str = "system:node:";
/// The group every node is in.
pub const NODES_GROUP: &str = "system:nodes";

/// The user name in the API server's own client certificate, presented to joined agents'
/// endpoints (mutual TLS beside the derived bearer token; docs/nodes.md).
pub const SERVER_USER: &str = "system:ferrovirt-server";
/// The group in the API server's client certificate: a group of its own (not
/// `system:masters`: the certificate is for agent endpoints, never for the API).
pub const SERVER_GROUP: &str = "system:ferrovirt-servers";

/// The body of a join request.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JoinRequest {
    /// The token's secret.
    pub secret: String,
    /// The node name: a DNS-1123 subdomain.
    pub node_name: String,
    /// The node's ECDSA P-256 public key: the uncompressed point (65 bytes), base64.
    pub public_key: String,
    /// The node's password (k3s' node password): the first join under a name records its
    /// hash, and later joins under that name must present the same password, so the token
    /// alone does not let another machine take over a joined node's name.
    #[serde(default)]
    pub node_password: String,
}

/// The answer to a join request.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JoinResponse {
    /// PEM of the client certificate `CN=system:node:<name>, O=system:nodes`.
    pub certificate: String,
    /// PEM of the client CA that signed it (it also signs the server's own client
    /// certificate, which the agent accepts on its endpoint).
    pub client_ca: String,
    /// The bearer token the API server presents to this node's endpoint (derived for this
    /// node alone; it opens nothing else).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_token: Option<String>,
}

/// Where a joined node renews its certificate: `POST` a [`RenewRequest`] over TLS with its
/// current, still valid node certificate as the client certificate; answered with a
/// [`RenewResponse`].
pub const RENEW_PATH: &str = "/v1-ferrovirt/node-renew";

/// The body of a renewal request.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RenewRequest {
    /// The node's new ECDSA P-256 public key: the uncompressed point (65 bytes), base64.
    pub public_key: String,
}

/// The answer to a renewal request.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RenewResponse {
    /// PEM of the new client certificate (same subject as the one that asked).
    pub certificate: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let t = JoinToken {
            ca_hash: std::array::from_fn(|i| i as u8),
            secret: "0123456789abcdef0123".into(),
        };
        let s = t.format();
        assert!(s.starts_with("K10000102"));
        assert_eq!(JoinToken::parse(&format!("{s}\n")).unwrap(), t);
        assert!(!format!("{t:?}").contains("0123456789abcdef0123"));
        assert_eq!(JoinToken::parse("K20abc::x"), Err(TokenError::Prefix));
        assert_eq!(
            JoinToken::parse("K10abc::0123456789abcdef"),
            Err(TokenError::CaHash)
        );
        let h = hex(&t.ca_hash);
        assert_eq!(
            JoinToken::parse(&format!("K10{h}0123")),
            Err(TokenError::CaHash)
        );
        assert_eq!(
            JoinToken::parse(&format!("K10{h}::short")),
            Err(TokenError::Secret)
        );
        assert_eq!(
            JoinToken::parse(&format!("K10{h}::has a space in it!!")),
            Err(TokenError::Secret)
        );
        let zz = format!("zz{}", &h[2..]);
        assert_eq!(
            JoinToken::parse(&format!("K10{zz}::0123456789abcdef")),
            Err(TokenError::CaHash)
        );
        // A k3s-style user:password secret is one secret.
        let p = JoinToken::parse(&format!("K10{h}::node:0123456789abcdef")).unwrap();
        assert_eq!(p.secret, "node:0123456789abcdef");
        // Errors never echo the secret.
        let e = JoinToken::parse(&format!("K10{h}::sec ret")).unwrap_err();
        assert!(!e.to_string().contains("sec ret"));
    }
}
