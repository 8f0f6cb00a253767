//! Upload tokens (CDI's `UploadTokenRequest` answers): short-lived bearer strings that allow
//! one thing, uploading into the claim `namespace/pvc` until `expires` (Unix seconds).
//!
//! A token is `base64url(payload) "." base64url(HMAC-SHA256(key, payload))` with the payload
//! `v1\n<namespace>\n<pvc>\n<expires>`. The key is a server secret ([`UploadKey`], 32 random
//! bytes kept in a 0600 file of the server's data directory, so tokens survive a restart).
//! Verification checks the MAC in constant time (ring) before looking at the payload.

use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

/// How long a token is valid by default.
pub const DEFAULT_TTL_SECS: u64 = 300;

/// Why a token was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("the upload token is malformed")]
    Malformed,
    #[error("the upload token's signature is invalid")]
    BadSignature,
    #[error("the upload token expired")]
    Expired,
}

/// What a valid token allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub namespace: String,
    pub pvc: String,
    /// Unix seconds.
    pub expires: u64,
}

/// The server's token signing key.
pub struct UploadKey(hmac::Key);

impl std::fmt::Debug for UploadKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UploadKey(..)")
    }
}

impl UploadKey {
    /// A key from secret bytes.
    pub fn from_bytes(secret: &[u8]) -> UploadKey {
        UploadKey(hmac::Key::new(hmac::HMAC_SHA256, secret))
    }

    /// A fresh random key.
    pub fn generate() -> Result<UploadKey, std::io::Error> {
        Ok(UploadKey::from_bytes(&random_secret()?))
    }

    /// The key stored in `path`, created (32 random bytes, mode 0600) when absent.
    pub fn load_or_create(path: &Path) -> Result<UploadKey, std::io::Error> {
        match std::fs::read(path) {
            Ok(b) if b.len() >= 32 => return Ok(UploadKey::from_bytes(&b)),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let secret = random_secret()?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&secret)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(UploadKey::from_bytes(&secret))
    }

    /// A token for `namespace/pvc`, valid until `now + ttl` (Unix seconds).
    pub fn sign(&self, namespace: &str, pvc: &str, now: u64, ttl: u64) -> String {
        let payload = format!("v1\n{namespace}\n{pvc}\n{}", now.saturating_add(ttl));
        let tag = hmac::sign(&self.0, payload.as_bytes());
        format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(payload.as_bytes()),
            URL_SAFE_NO_PAD.encode(tag.as_ref())
        )
    }

    /// What `token` allows at `now` (Unix seconds).
    pub fn verify(&self, token: &str, now: u64) -> Result<Grant, TokenError> {
        let (p, t) = token.trim().split_once('.').ok_or(TokenError::Malformed)?;
        let payload = URL_SAFE_NO_PAD
            .decode(p)
            .map_err(|_| TokenError::Malformed)?;
        let tag = URL_SAFE_NO_PAD
            .decode(t)
            .map_err(|_| TokenError::Malformed)?;
        hmac::verify(&self.0, &payload, &tag).map_err(|_| TokenError::BadSignature)?;
        let text = String::from_utf8(payload).map_err(|_| TokenError::Malformed)?;
        let mut parts = text.split('\n');
        let (Some("v1"), Some(ns), Some(pvc), Some(exp), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(TokenError::Malformed);
        };
        let expires: u64 = exp.parse().map_err(|_| TokenError::Malformed)?;
        if now >= expires {
            return Err(TokenError::Expired);
        }
        Ok(Grant {
            namespace: ns.into(),
            pvc: pvc.into(),
            expires,
        })
    }
}

fn random_secret() -> Result<[u8; 32], std::io::Error> {
    let mut b = [0u8; 32];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| std::io::Error::other("no system randomness"))?;
    Ok(b)
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_and_verifies() {
        let k = UploadKey::from_bytes(&[7u8; 32]);
        let t = k.sign("default", "disk1", 1000, 300);
        assert_eq!(
            k.verify(&t, 1000),
            Ok(Grant {
                namespace: "default".into(),
                pvc: "disk1".into(),
                expires: 1300
            })
        );
        assert!(k.verify(&t, 1299).is_ok());
    }

    #[test]
    fn expired_tokens_are_refused() {
        let k = UploadKey::from_bytes(&[7u8; 32]);
        let t = k.sign("default", "disk1", 1000, 300);
        assert_eq!(k.verify(&t, 1300), Err(TokenError::Expired));
        assert_eq!(k.verify(&t, 99_999), Err(TokenError::Expired));
    }

    #[test]
    fn tampered_or_foreign_tokens_are_refused() {
        let k = UploadKey::from_bytes(&[7u8; 32]);
        let other = UploadKey::from_bytes(&[8u8; 32]);
        let t = k.sign("default", "disk1", 1000, 300);
        assert_eq!(other.verify(&t, 1000), Err(TokenError::BadSignature));
        // Another claim (or a later expiry) with the original MAC.
        let (_, mac) = t.split_once('.').unwrap();
        let forged = format!(
            "{}.{mac}",
            URL_SAFE_NO_PAD.encode("v1\ndefault\ndisk2\n1300")
        );
        assert_eq!(k.verify(&forged, 1000), Err(TokenError::BadSignature));
        let later = format!(
            "{}.{mac}",
            URL_SAFE_NO_PAD.encode("v1\ndefault\ndisk1\n999999")
        );
        assert_eq!(k.verify(&later, 1000), Err(TokenError::BadSignature));
        for bad in ["", "abc", "a.b", "!!.??", &format!("{t}x")] {
            assert!(k.verify(bad, 1000).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn key_file_is_created_private_and_reused() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub/upload.key");
        let k1 = UploadKey::load_or_create(&p).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let k2 = UploadKey::load_or_create(&p).unwrap();
        let t = k1.sign("ns", "c", 10, 60);
        assert!(k2.verify(&t, 20).is_ok());
        let k3 = UploadKey::generate().unwrap();
        assert_eq!(k3.verify(&t, 20), Err(TokenError::BadSignature));
    }
}
