//! Registry authentication, the pure parts: `WWW-Authenticate` challenges (Basic, and the
//! Bearer token flow's `realm`/`service`/`scope`), token responses, and credentials from a
//! `kubernetes.io/dockerconfigjson` Secret (`.dockerconfigjson`).

use base64::Engine;

use crate::error::StorageError;
use crate::http::BasicAuth;

/// A `WWW-Authenticate` challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
}

/// Parses `Basic realm="x"` or `Bearer realm="https://auth/token",service="reg",scope="…"`.
pub fn parse_challenge(header: &str) -> Option<Challenge> {
    let h = header.trim();
    let (scheme, params) = h.split_once(' ').unwrap_or((h, ""));
    match scheme.to_ascii_lowercase().as_str() {
        "basic" => Some(Challenge::Basic),
        "bearer" => {
            let params = parse_params(params);
            let get = |k: &str| {
                params
                    .iter()
                    .find(|(n, _)| n.eq_ignore_ascii_case(k))
                    .map(|(_, v)| v.clone())
            };
            Some(Challenge::Bearer {
                realm: get("realm")?,
                service: get("service"),
                scope: get("scope"),
            })
        }
        _ => None,
    }
}

/// `k=v` and `k="v, with commas"` pairs separated by commas.
fn parse_params(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' {
                break;
            }
            key.push(c);
            chars.next();
        }
        if chars.next().is_none() {
            break;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '"' => break,
                    '\\' => value.extend(chars.next()),
                    c => value.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == ',' {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        out.push((key.trim().to_string(), value.trim().to_string()));
    }
    out
}

/// The token of a token-endpoint response (`token`, or OAuth2's `access_token`).
pub fn parse_token(body: &[u8]) -> Result<String, StorageError> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| StorageError::invalid("registry token response", e.to_string()))?;
    v.get("token")
        .or_else(|| v.get("access_token"))
        .and_then(|t| t.as_str())
        .filter(|t| !t.is_empty())
        .map(String::from)
        .ok_or_else(|| {
            StorageError::invalid("registry token response", "no \"token\" in the response")
        })
}

/// The pull scope for a repository.
pub fn pull_scope(repository: &str) -> String {
    format!("repository:{repository}:pull")
}

/// Credentials for `registry` from a `.dockerconfigjson` document: `auths.<registry>` with
/// `auth` (base64 `user:password`) or `username`/`password`. Keys may carry a scheme and
/// path (`https://index.docker.io/v1/`).
pub fn docker_config_auth(
    config: &[u8],
    registry: &str,
) -> Result<Option<BasicAuth>, StorageError> {
    let bad = |m: String| StorageError::invalid(".dockerconfigjson", m);
    let v: serde_json::Value =
        serde_json::from_slice(config).map_err(|e| bad(format!("not JSON: {e}")))?;
    let Some(auths) = v.get("auths").and_then(|a| a.as_object()) else {
        return Ok(None);
    };
    let host_of = |k: &str| {
        let k = k.split_once("://").map_or(k, |(_, r)| r);
        k.split('/').next().unwrap_or(k).to_string()
    };
    let wanted: Vec<&str> = if registry == "docker.io" {
        vec!["docker.io", "index.docker.io", "registry-1.docker.io"]
    } else {
        vec![registry]
    };
    let Some(entry) = auths
        .iter()
        .find(|(k, _)| wanted.contains(&host_of(k).as_str()))
        .map(|(_, e)| e)
    else {
        return Ok(None);
    };
    if let Some(a) = entry.get("auth").and_then(|a| a.as_str()) {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(a.trim())
            .map_err(|e| bad(format!("auth of {registry} is not base64: {e}")))?;
        let s = String::from_utf8_lossy(&decoded);
        let (user, password) = s
            .split_once(':')
            .ok_or_else(|| bad(format!("auth of {registry} is not user:password")))?;
        return Ok(Some(BasicAuth {
            user: user.into(),
            password: password.into(),
        }));
    }
    match (
        entry.get("username").and_then(|u| u.as_str()),
        entry.get("password").and_then(|p| p.as_str()),
    ) {
        (Some(u), Some(p)) => Ok(Some(BasicAuth {
            user: u.into(),
            password: p.into(),
        })),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_challenges() {
        assert_eq!(
            parse_challenge(r#"Basic realm="basic-realm""#),
            Some(Challenge::Basic)
        );
        assert_eq!(
            parse_challenge(
                r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#
            ),
            Some(Challenge::Bearer {
                realm: "https://auth.example/token".into(),
                service: Some("registry.example".into()),
                scope: Some("repository:a/b:pull,push".into()),
            })
        );
        assert_eq!(
            parse_challenge("bearer realm=http://x/t"),
            Some(Challenge::Bearer {
                realm: "http://x/t".into(),
                service: None,
                scope: None
            })
        );
        assert_eq!(parse_challenge("Bearer service=x"), None);
        assert_eq!(parse_challenge("Negotiate"), None);
    }

    #[test]
    fn parses_tokens() {
        assert_eq!(parse_token(br#"{"token":"abc"}"#).unwrap(), "abc");
        assert_eq!(parse_token(br#"{"access_token":"xyz"}"#).unwrap(), "xyz");
        assert!(parse_token(br#"{"token":""}"#).is_err());
        assert!(parse_token(b"nope").is_err());
        assert_eq!(pull_scope("a/b"), "repository:a/b:pull");
    }

    #[test]
    fn reads_docker_config() {
        let auth = base64::engine::general_purpose::STANDARD.encode("u:p:w");
        let cfg = format!(
            r#"{{"auths":{{"127.0.0.1:5000":{{"auth":"{auth}"}},
            "https://index.docker.io/v1/":{{"username":"hub","password":"pw"}}}}}}"#
        );
        let a = docker_config_auth(cfg.as_bytes(), "127.0.0.1:5000")
            .unwrap()
            .unwrap();
        assert_eq!((a.user.as_str(), a.password.as_str()), ("u", "p:w"));
        let h = docker_config_auth(cfg.as_bytes(), "docker.io")
            .unwrap()
            .unwrap();
        assert_eq!(h.user, "hub");
        assert_eq!(docker_config_auth(cfg.as_bytes(), "quay.io").unwrap(), None);
        assert!(docker_config_auth(b"{", "x").is_err());
    }
}
