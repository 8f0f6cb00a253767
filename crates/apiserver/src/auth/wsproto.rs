//! Bearer tokens carried in a websocket subprotocol, as the Kubernetes apiserver accepts them:
//! browsers cannot set an `Authorization` header on a WebSocket, so a client offers
//! `base64url.bearer.authorization.k8s.io.<base64url(token), unpadded>` next to the protocol
//! it speaks (e.g. `plain.kubevirt.io`). [`extract`] is the pure decision: only a websocket
//! upgrade request is looked at, at most one token protocol, valid unpadded base64url of UTF-8
//! text, and at least one other protocol left for the server to choose. The caller removes the
//! token protocol from the request ([`rewrite`]) so nothing downstream sees it.

use base64::Engine;
use http::HeaderMap;
use http::header::{CONNECTION, SEC_WEBSOCKET_PROTOCOL, UPGRADE};

/// The subprotocol prefix Kubernetes reads a bearer token from.
pub const PREFIX: &str = "base64url.bearer.authorization.k8s.io.";

/// A token found in the subprotocols and the protocols that remain without it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WsToken {
    pub token: String,
    pub remaining: Vec<String>,
}

/// Why a token subprotocol was refused (answered 401).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WsTokenError {
    #[error("multiple base64url.bearer.authorization tokens specified")]
    Multiple,
    #[error("invalid base64url.bearer.authorization token encoding")]
    Encoding,
    #[error("invalid base64url.bearer.authorization token")]
    Empty,
    #[error("missing additional subprotocol next to the bearer token subprotocol")]
    NoOtherProtocol,
}

/// Whether `headers` ask for a websocket upgrade (`Connection: upgrade`, `Upgrade: websocket`).
pub fn is_websocket(headers: &HeaderMap) -> bool {
    let connection_upgrade = headers.get_all(CONNECTION).iter().any(|v| {
        v.to_str()
            .unwrap_or_default()
            .split(',')
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
    });
    let upgrade_ws = headers.get_all(UPGRADE).iter().any(|v| {
        v.to_str()
            .unwrap_or_default()
            .split(',')
            .any(|t| t.trim().eq_ignore_ascii_case("websocket"))
    });
    connection_upgrade && upgrade_ws
}

/// The bearer token of a websocket request's subprotocols: None when the request is no
/// websocket upgrade or offers no token protocol.
pub fn extract(headers: &HeaderMap) -> Result<Option<WsToken>, WsTokenError> {
    if !is_websocket(headers) {
        return Ok(None);
    }
    let mut token = None;
    let mut remaining = Vec::new();
    for value in headers.get_all(SEC_WEBSOCKET_PROTOCOL) {
        for proto in value.to_str().unwrap_or_default().split(',') {
            let proto = proto.trim();
            if proto.is_empty() {
                continue;
            }
            let Some(encoded) = proto.strip_prefix(PREFIX) else {
                remaining.push(proto.to_string());
                continue;
            };
            if token.is_some() {
                return Err(WsTokenError::Multiple);
            }
            let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(encoded)
                .map_err(|_| WsTokenError::Encoding)?;
            let text = String::from_utf8(bytes).map_err(|_| WsTokenError::Encoding)?;
            if text.is_empty() {
                return Err(WsTokenError::Empty);
            }
            token = Some(text);
        }
    }
    let Some(token) = token else {
        return Ok(None);
    };
    if remaining.is_empty() {
        return Err(WsTokenError::NoOtherProtocol);
    }
    Ok(Some(WsToken { token, remaining }))
}

/// Replaces the request's subprotocols by `remaining` (the token protocol removed).
pub fn rewrite(headers: &mut HeaderMap, remaining: &[String]) {
    headers.remove(SEC_WEBSOCKET_PROTOCOL);
    if let Ok(v) = http::HeaderValue::from_str(&remaining.join(", ")) {
        headers.insert(SEC_WEBSOCKET_PROTOCOL, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws(protocols: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, "Upgrade".parse().unwrap());
        h.insert(UPGRADE, "websocket".parse().unwrap());
        for p in protocols {
            h.append(SEC_WEBSOCKET_PROTOCOL, p.parse().unwrap());
        }
        h
    }

    fn enc(t: &str) -> String {
        format!(
            "{PREFIX}{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(t)
        )
    }

    #[test]
    fn token_next_to_kubevirt_protocol() {
        let h = ws(&[&format!("plain.kubevirt.io, {}", enc("s3cr?t>~"))]);
        assert_eq!(
            extract(&h).unwrap(),
            Some(WsToken {
                token: "s3cr?t>~".into(),
                remaining: vec!["plain.kubevirt.io".into()]
            })
        );
    }

    #[test]
    fn protocols_in_several_headers() {
        let h = ws(&[&enc("abc"), "base64.channel.k8s.io", "plain.kubevirt.io"]);
        let t = extract(&h).unwrap().unwrap();
        assert_eq!(t.token, "abc");
        assert_eq!(t.remaining, ["base64.channel.k8s.io", "plain.kubevirt.io"]);
    }

    #[test]
    fn no_token_protocol_is_none() {
        assert_eq!(extract(&ws(&["plain.kubevirt.io"])).unwrap(), None);
        assert_eq!(extract(&ws(&[])).unwrap(), None);
    }

    #[test]
    fn not_a_websocket_is_ignored() {
        let mut h = HeaderMap::new();
        h.insert(SEC_WEBSOCKET_PROTOCOL, enc("abc").parse().unwrap());
        assert_eq!(extract(&h).unwrap(), None);
        h.insert(CONNECTION, "keep-alive, Upgrade".parse().unwrap());
        h.insert(UPGRADE, "h2c".parse().unwrap());
        assert_eq!(extract(&h).unwrap(), None);
    }

    #[test]
    fn refusals() {
        let two = ws(&[&enc("a"), &enc("b"), "plain.kubevirt.io"]);
        assert_eq!(extract(&two), Err(WsTokenError::Multiple));
        let bad = ws(&[&format!("{PREFIX}not*base64"), "plain.kubevirt.io"]);
        assert_eq!(extract(&bad), Err(WsTokenError::Encoding));
        let padded = ws(&[&format!("{PREFIX}YQ=="), "plain.kubevirt.io"]);
        assert_eq!(extract(&padded), Err(WsTokenError::Encoding));
        let not_utf8 = format!(
            "{PREFIX}{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode([0xff, 0xfe])
        );
        assert_eq!(
            extract(&ws(&[&not_utf8, "plain.kubevirt.io"])),
            Err(WsTokenError::Encoding)
        );
        assert_eq!(
            extract(&ws(&[PREFIX, "plain.kubevirt.io"])),
            Err(WsTokenError::Empty)
        );
        assert_eq!(
            extract(&ws(&[&enc("abc")])),
            Err(WsTokenError::NoOtherProtocol)
        );
    }

    #[test]
    fn rewrite_leaves_only_the_other_protocols() {
        let mut h = ws(&[&enc("abc"), "plain.kubevirt.io"]);
        let t = extract(&h).unwrap().unwrap();
        rewrite(&mut h, &t.remaining);
        let all: Vec<_> = h.get_all(SEC_WEBSOCKET_PROTOCOL).iter().collect();
        assert_eq!(all, ["plain.kubevirt.io"]);
    }
}
