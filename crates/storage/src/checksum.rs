//! Checksums of imported data, written as `<algorithm>:<hex digest>` (CDI's `checksum`
//! notation, e.g. `sha256:9f86d0…`). Supported: sha1, sha256, sha384, sha512.

use crate::error::StorageError;

/// A hash algorithm the importer can verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Algorithm {
    Sha1,
    Sha256,
    Sha384,
    Sha512,
}

impl Algorithm {
    fn ring(self) -> &'static ring::digest::Algorithm {
        match self {
            Algorithm::Sha1 => &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
            Algorithm::Sha256 => &ring::digest::SHA256,
            Algorithm::Sha384 => &ring::digest::SHA384,
            Algorithm::Sha512 => &ring::digest::SHA512,
        }
    }

    /// The digest length in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            Algorithm::Sha1 => 20,
            Algorithm::Sha256 => 32,
            Algorithm::Sha384 => 48,
            Algorithm::Sha512 => 64,
        }
    }

    /// The name used in the notation.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Sha1 => "sha1",
            Algorithm::Sha256 => "sha256",
            Algorithm::Sha384 => "sha384",
            Algorithm::Sha512 => "sha512",
        }
    }
}

/// An expected checksum.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Checksum {
    pub algorithm: Algorithm,
    /// Lower-case hex digest.
    pub hex: String,
}

impl std::fmt::Display for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.algorithm.name(), self.hex)
    }
}

/// Parse `sha256:<hex>` (algorithm case-insensitive, hex of the right length).
pub fn parse(s: &str) -> Result<Checksum, StorageError> {
    let bad = |m: String| StorageError::invalid("checksum", m);
    let (algo, hex) = s
        .trim()
        .split_once(':')
        .ok_or_else(|| bad(format!("{s:?} is not of the form <algorithm>:<hex digest>")))?;
    let algorithm = match algo.to_ascii_lowercase().as_str() {
        "sha1" => Algorithm::Sha1,
        "sha256" => Algorithm::Sha256,
        "sha384" => Algorithm::Sha384,
        "sha512" => Algorithm::Sha512,
        other => return Err(bad(format!("unsupported algorithm {other:?}"))),
    };
    let hex = hex.to_ascii_lowercase();
    if hex.len() != algorithm.digest_len() * 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad(format!(
            "a {} digest has {} hex digits",
            algorithm.name(),
            algorithm.digest_len() * 2
        )));
    }
    Ok(Checksum { algorithm, hex })
}

/// An incremental hasher.
pub struct Hasher(ring::digest::Context);

impl std::fmt::Debug for Hasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hasher")
    }
}

impl Hasher {
    pub fn new(algorithm: Algorithm) -> Self {
        Hasher(ring::digest::Context::new(algorithm.ring()))
    }

    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// The lower-case hex digest.
    pub fn finish(self) -> String {
        to_hex(self.0.finish().as_ref())
    }
}

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Compare a computed digest with the expected one.
pub fn verify(expected: &Checksum, actual_hex: &str) -> Result<(), StorageError> {
    if expected.hex == actual_hex {
        Ok(())
    } else {
        Err(StorageError::ChecksumMismatch {
            expected: expected.to_string(),
            actual: format!("{}:{actual_hex}", expected.algorithm.name()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ABC256: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    #[test]
    fn parses_and_verifies() {
        let c = parse(&format!("SHA256:{}", ABC256.to_uppercase())).unwrap();
        assert_eq!(c.algorithm, Algorithm::Sha256);
        assert_eq!(c.hex, ABC256);
        let mut h = Hasher::new(c.algorithm);
        h.update(b"a");
        h.update(b"bc");
        verify(&c, &h.finish()).unwrap();
        assert_eq!(c.to_string(), format!("sha256:{ABC256}"));
    }

    #[test]
    fn rejects_bad_notation() {
        assert!(parse("sha256").is_err());
        assert!(parse("md5:d41d8cd98f00b204e9800998ecf8427e").is_err());
        assert!(parse("sha256:abc").is_err());
        assert!(parse(&format!("sha256:{}", "z".repeat(64))).is_err());
        assert!(parse(&format!("sha1:{}", "a".repeat(40))).is_ok());
    }

    #[test]
    fn mismatch_names_both() {
        let c = parse(&format!("sha256:{ABC256}")).unwrap();
        let e = verify(&c, &"0".repeat(64)).unwrap_err().to_string();
        assert!(e.contains(ABC256) && e.contains("000000"), "{e}");
    }
}
