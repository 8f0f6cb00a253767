//! The repository's keys and sealed objects: HKDF-SHA256 derives, from the encryption Secret's
//! key and the repository's random salt, one key that names chunks (HMAC-SHA256 of the
//! plaintext, so an id leaks nothing about the data to whoever can list the bucket) and one
//! AES-256-GCM key that seals every object (chunks, indexes, manifests, catalog entries).
//!
//! A sealed object is `MAGIC || nonce (12 random bytes) || AES-256-GCM(zstd(plaintext))`, the
//! object's own name as associated data: an object copied under another name does not open.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use crate::BackupError;

/// The first bytes of every sealed object (format version 1).
pub const MAGIC: &[u8; 6] = b"FVBK1\0";
/// The shortest key material accepted from the Secret.
pub const MIN_KEY_LEN: usize = 16;
/// The largest plaintext an object may decompress to (a chunk is 4 MiB; an index of a 16 TiB
/// disk is ~300 MiB of JSON): a bound against decompression bombs in a hostile bucket.
pub const MAX_PLAINTEXT: usize = 512 << 20;

/// The derived keys of one repository.
pub struct Keys {
    id_key: hmac::Key,
    seal_key: LessSafeKey,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(..)")
    }
}

struct Len(usize);
impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

fn expand(prk: &hkdf::Prk, info: &'static [u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    let infos = [info];
    // 32 bytes from HKDF-SHA256 never exceeds its 255 * 32 byte limit.
    #[allow(clippy::expect_used)]
    prk.expand(&infos, Len(32))
        .and_then(|okm| okm.fill(&mut out))
        .expect("HKDF output of 32 bytes");
    out
}

impl Keys {
    /// Derives the keys from the Secret's key material and the repository's salt.
    pub fn derive(secret: &[u8], salt: &[u8]) -> Result<Self, BackupError> {
        if secret.len() < MIN_KEY_LEN {
            return Err(BackupError::KeyTooShort {
                len: secret.len(),
                min: MIN_KEY_LEN,
            });
        }
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, salt).extract(secret);
        let id = expand(&prk, b"ferrovirt-backup v1 chunk id");
        let seal = expand(&prk, b"ferrovirt-backup v1 seal");
        let unbound = UnboundKey::new(&AES_256_GCM, &seal).map_err(|_| BackupError::Crypto)?;
        Ok(Self {
            id_key: hmac::Key::new(hmac::HMAC_SHA256, &id),
            seal_key: LessSafeKey::new(unbound),
        })
    }

    /// The id of a chunk: HMAC-SHA256 of its plaintext under the id key, in hex.
    pub fn chunk_id(&self, plaintext: &[u8]) -> String {
        to_hex(hmac::sign(&self.id_key, plaintext).as_ref())
    }

    /// Compresses (zstd, `level`) and seals `plaintext` as the object named `name`.
    pub fn seal(&self, name: &str, plaintext: &[u8], level: i32) -> Result<Vec<u8>, BackupError> {
        let mut body = zstd::bulk::compress(plaintext, level).map_err(BackupError::Compress)?;
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| BackupError::Crypto)?;
        self.seal_key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(name.as_bytes()),
                &mut body,
            )
            .map_err(|_| BackupError::Crypto)?;
        let mut out = Vec::with_capacity(MAGIC.len() + NONCE_LEN + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Opens an object sealed as `name`; `limit` bounds the decompressed size. Any tampering,
    /// a wrong key or a wrong name gives [`BackupError::Corrupt`] naming the object.
    pub fn open(&self, name: &str, sealed: &[u8], limit: usize) -> Result<Vec<u8>, BackupError> {
        let corrupt = |why: &str| BackupError::Corrupt {
            object: name.to_string(),
            reason: why.to_string(),
        };
        if sealed.len() < MAGIC.len() + NONCE_LEN || &sealed[..MAGIC.len()] != MAGIC {
            return Err(corrupt("not a sealed object (bad header)"));
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&sealed[MAGIC.len()..MAGIC.len() + NONCE_LEN]);
        let mut body = sealed[MAGIC.len() + NONCE_LEN..].to_vec();
        let plain = self
            .seal_key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(name.as_bytes()),
                &mut body,
            )
            .map_err(|_| corrupt("authentication failed (altered bytes or another key)"))?;
        decompress_bounded(plain, limit.min(MAX_PLAINTEXT))
            .map_err(|e| corrupt(&format!("zstd: {e}")))
    }

    /// Opens a chunk and checks that its plaintext hashes to its id.
    pub fn open_chunk(&self, id: &str, name: &str, sealed: &[u8]) -> Result<Vec<u8>, BackupError> {
        let plain = self.open(name, sealed, crate::format::CHUNK_SIZE)?;
        if self.chunk_id(&plain) != id {
            return Err(BackupError::Corrupt {
                object: name.to_string(),
                reason: "content does not hash to the chunk id".into(),
            });
        }
        Ok(plain)
    }
}

/// zstd decompression that refuses output beyond `limit` bytes (the frame's declared size is
/// not trusted).
fn decompress_bounded(data: &[u8], limit: usize) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let dec = zstd::stream::read::Decoder::new(data)?;
    let mut out = Vec::new();
    dec.take(limit as u64 + 1).read_to_end(&mut out)?;
    if out.len() > limit {
        return Err(std::io::Error::other(format!(
            "decompresses to more than {limit} bytes"
        )));
    }
    Ok(out)
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// `n` random bytes from the system generator.
pub fn random_bytes(n: usize) -> Result<Vec<u8>, BackupError> {
    let mut v = vec![0u8; n];
    SystemRandom::new()
        .fill(&mut v)
        .map_err(|_| BackupError::Crypto)?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(secret: &[u8]) -> Keys {
        Keys::derive(secret, b"salt-salt-salt-s").unwrap()
    }

    #[test]
    fn seal_open_round_trip_and_name_binding() {
        let k = keys(b"0123456789abcdef0123");
        let sealed = k.seal("chunks/ab/abcd", b"hello hello hello", 3).unwrap();
        assert_eq!(
            k.open("chunks/ab/abcd", &sealed, 1 << 20).unwrap(),
            b"hello hello hello"
        );
        // the same bytes under another name do not open
        assert!(matches!(
            k.open("chunks/ab/other", &sealed, 1 << 20),
            Err(BackupError::Corrupt { .. })
        ));
        // another key does not open
        let other = keys(b"another key, 16+ bytes");
        assert!(other.open("chunks/ab/abcd", &sealed, 1 << 20).is_err());
        // a flipped bit does not open
        let mut bad = sealed.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(k.open("chunks/ab/abcd", &bad, 1 << 20).is_err());
    }

    #[test]
    fn ids_are_keyed_and_nonces_fresh() {
        let a = keys(b"0123456789abcdef0123");
        let b = keys(b"fedcba9876543210fedc");
        assert_ne!(a.chunk_id(b"x"), b.chunk_id(b"x"));
        assert_eq!(a.chunk_id(b"x"), a.chunk_id(b"x"));
        assert_eq!(a.chunk_id(b"x").len(), 64);
        assert_ne!(a.seal("n", b"x", 1).unwrap(), a.seal("n", b"x", 1).unwrap());
    }

    #[test]
    fn short_keys_are_refused() {
        assert!(matches!(
            Keys::derive(b"short", b"salt"),
            Err(BackupError::KeyTooShort { len: 5, .. })
        ));
    }

    #[test]
    fn decompression_bomb_is_refused() {
        let k = keys(b"0123456789abcdef0123");
        let big = vec![0u8; 8 << 20];
        let sealed = k.seal("c", &big, 1).unwrap();
        let err = k.open("c", &sealed, 4 << 20).unwrap_err();
        assert!(err.to_string().contains("more than"), "{err}");
    }
}
