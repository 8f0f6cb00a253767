//! Manifests of the OCI distribution API, parsed without I/O: OCI image manifests and image
//! indexes, Docker schema 2 manifests and manifest lists. [`parse`] tells them apart (by the
//! response's Content-Type, the document's `mediaType`, or its shape), [`pick_platform`]
//! chooses the linux/amd64 entry of an index, and [`disk_layers`] checks the layers of an
//! image manifest. Digests are `sha256:<hex>` ([`sha256_digest`]).

use serde::Deserialize;

use crate::error::StorageError;

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";

/// The `Accept` header of manifest requests: every kind this module parses.
pub fn accept_header() -> String {
    [OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST].join(", ")
}

/// The largest manifest accepted (the registry's own limit is 4 MiB).
pub const MAX_MANIFEST_BYTES: usize = 4 << 20;

/// A blob reference.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default)]
    pub platform: Option<Platform>,
}

/// The platform of an index entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
}

/// An image manifest (OCI or Docker schema 2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageManifest {
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

/// What a manifest request returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Manifest {
    Image(ImageManifest),
    /// An OCI image index or Docker manifest list.
    Index(Vec<Descriptor>),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    schema_version: Option<u32>,
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Option<Vec<Descriptor>>,
    #[serde(default)]
    manifests: Option<Vec<Descriptor>>,
}

fn bad(m: impl Into<String>) -> StorageError {
    StorageError::invalid("image manifest", m)
}

/// Parses a manifest body; `content_type` is the response's Content-Type (may be empty).
pub fn parse(content_type: &str, body: &[u8]) -> Result<Manifest, StorageError> {
    if body.len() > MAX_MANIFEST_BYTES {
        return Err(bad(format!(
            "{} bytes is larger than the {MAX_MANIFEST_BYTES} bytes allowed",
            body.len()
        )));
    }
    let raw: Raw = serde_json::from_slice(body).map_err(|e| bad(format!("not JSON: {e}")))?;
    let ct = content_type.split(';').next().unwrap_or("").trim();
    let media = match ct {
        OCI_MANIFEST | OCI_INDEX | DOCKER_MANIFEST | DOCKER_LIST => ct.to_string(),
        _ => match (&raw.media_type, &raw.manifests, &raw.layers) {
            (Some(m), _, _) => m.clone(),
            (None, Some(_), _) => OCI_INDEX.to_string(),
            (None, None, Some(_)) => OCI_MANIFEST.to_string(),
            _ => String::new(),
        },
    };
    if raw.schema_version.is_some_and(|v| v != 2) {
        return Err(bad(format!(
            "schemaVersion {} is not supported (only 2)",
            raw.schema_version.unwrap_or_default()
        )));
    }
    match media.as_str() {
        OCI_INDEX | DOCKER_LIST => {
            let m = raw
                .manifests
                .ok_or_else(|| bad("an index without \"manifests\""))?;
            Ok(Manifest::Index(m))
        }
        OCI_MANIFEST | DOCKER_MANIFEST => {
            let config = raw
                .config
                .ok_or_else(|| bad("a manifest without \"config\""))?;
            let layers = raw
                .layers
                .ok_or_else(|| bad("a manifest without \"layers\""))?;
            for d in std::iter::once(&config).chain(&layers) {
                if !super::reference::valid_digest(&d.digest) {
                    return Err(bad(format!(
                        "digest {:?} is not sha256:<64 hex digits>",
                        d.digest
                    )));
                }
            }
            Ok(Manifest::Image(ImageManifest { config, layers }))
        }
        other => Err(bad(format!("unsupported media type {other:?}"))),
    }
}

/// The entry of an index for `os`/`architecture` (variants ignored); an index with one
/// entry and no platform is taken as is.
pub fn pick_platform<'a>(
    entries: &'a [Descriptor],
    os: &str,
    architecture: &str,
) -> Result<&'a Descriptor, StorageError> {
    if let Some(d) = entries.iter().find(|d| {
        d.platform
            .as_ref()
            .is_some_and(|p| p.os == os && p.architecture == architecture)
    }) {
        return Ok(d);
    }
    if let [only] = entries
        && only.platform.is_none()
    {
        return Ok(only);
    }
    let have: Vec<String> = entries
        .iter()
        .filter_map(|d| d.platform.as_ref())
        .map(|p| format!("{}/{}", p.os, p.architecture))
        .collect();
    Err(StorageError::Refused(format!(
        "the image index has no {os}/{architecture} image (it has: {})",
        if have.is_empty() {
            "none".into()
        } else {
            have.join(", ")
        }
    )))
}

/// How a layer is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerCompression {
    None,
    Gzip,
    Zstd,
}

/// The compression a layer media type declares (`None` for a media type that is no tar
/// layer at all).
pub fn layer_compression(media_type: &str) -> Option<LayerCompression> {
    match media_type {
        OCI_LAYER_TAR | "application/vnd.docker.image.rootfs.diff.tar" => {
            Some(LayerCompression::None)
        }
        OCI_LAYER_GZIP | DOCKER_LAYER_GZIP => Some(LayerCompression::Gzip),
        OCI_LAYER_ZSTD => Some(LayerCompression::Zstd),
        // Layers without a media type are tar (+ whatever their magic bytes say).
        "" => Some(LayerCompression::None),
        _ => None,
    }
}

/// Checks that every layer is a tar layer of at most `max_bytes`; returns them in order.
pub fn disk_layers(m: &ImageManifest, max_bytes: u64) -> Result<&[Descriptor], StorageError> {
    if m.layers.is_empty() {
        return Err(StorageError::Refused("the image has no layers".into()));
    }
    for l in &m.layers {
        if layer_compression(&l.media_type).is_none() {
            return Err(StorageError::Refused(format!(
                "layer {} has media type {:?}, which is no tar layer",
                l.digest, l.media_type
            )));
        }
        if l.size > max_bytes {
            return Err(StorageError::Refused(format!(
                "layer {} is {} bytes, more than the {max_bytes} bytes allowed",
                l.digest, l.size
            )));
        }
    }
    Ok(&m.layers)
}

/// `sha256:<hex>` of `data`.
pub fn sha256_digest(data: &[u8]) -> String {
    format!(
        "sha256:{}",
        hex(ring::digest::digest(&ring::digest::SHA256, data).as_ref())
    )
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: char) -> String {
        format!("sha256:{}", n.to_string().repeat(64))
    }

    #[test]
    fn parses_oci_and_docker_manifests() {
        let body = format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}",
            "config":{{"mediaType":"{OCI_CONFIG}","digest":"{}","size":2}},
            "layers":[{{"mediaType":"{OCI_LAYER_GZIP}","digest":"{}","size":10}}]}}"#,
            d('a'),
            d('b')
        );
        let Manifest::Image(m) = parse("", body.as_bytes()).unwrap() else {
            panic!()
        };
        assert_eq!(m.layers[0].size, 10);
        assert_eq!(disk_layers(&m, 10).unwrap().len(), 1);
        assert!(disk_layers(&m, 9).is_err());
        // Docker schema 2 by Content-Type, without mediaType in the body.
        let body = format!(
            r#"{{"schemaVersion":2,"config":{{"digest":"{}","size":2}},
            "layers":[{{"mediaType":"{DOCKER_LAYER_GZIP}","digest":"{}","size":1}}]}}"#,
            d('a'),
            d('c')
        );
        let m = parse(
            &format!("{DOCKER_MANIFEST}; charset=utf-8"),
            body.as_bytes(),
        )
        .unwrap();
        assert!(matches!(m, Manifest::Image(_)));
    }

    #[test]
    fn refuses_bad_manifests() {
        assert!(parse("", b"not json").is_err());
        assert!(parse("", br#"{"schemaVersion":1,"layers":[]}"#).is_err());
        assert!(parse("", br#"{"mediaType":"text/plain"}"#).is_err());
        let bad_digest =
            br#"{"config":{"digest":"md5:x","size":1},"layers":[{"digest":"md5:y","size":1}]}"#;
        assert!(parse("", bad_digest).is_err());
        assert!(parse("", &vec![b' '; MAX_MANIFEST_BYTES + 1]).is_err());
        let art = ImageManifest {
            config: Descriptor {
                media_type: OCI_CONFIG.into(),
                digest: d('a'),
                size: 1,
                platform: None,
            },
            layers: vec![Descriptor {
                media_type: "application/x-helm".into(),
                digest: d('b'),
                size: 1,
                platform: None,
            }],
        };
        let e = disk_layers(&art, 100).unwrap_err().to_string();
        assert!(e.contains("no tar layer"), "{e}");
    }

    #[test]
    fn picks_linux_amd64_from_an_index() {
        let body = format!(
            r#"{{"schemaVersion":2,"mediaType":"{DOCKER_LIST}","manifests":[
              {{"mediaType":"{DOCKER_MANIFEST}","digest":"{}","size":5,
                "platform":{{"architecture":"arm64","os":"linux","variant":"v8"}}}},
              {{"mediaType":"{DOCKER_MANIFEST}","digest":"{}","size":6,
                "platform":{{"architecture":"amd64","os":"linux"}}}}]}}"#,
            d('1'),
            d('2')
        );
        let Manifest::Index(entries) = parse("", body.as_bytes()).unwrap() else {
            panic!()
        };
        assert_eq!(
            pick_platform(&entries, "linux", "amd64").unwrap().digest,
            d('2')
        );
        let e = pick_platform(&entries, "linux", "s390x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("linux/arm64, linux/amd64"), "{e}");
        let one = vec![Descriptor {
            media_type: OCI_MANIFEST.into(),
            digest: d('3'),
            size: 1,
            platform: None,
        }];
        assert_eq!(
            pick_platform(&one, "linux", "amd64").unwrap().digest,
            d('3')
        );
    }

    #[test]
    fn layer_media_types() {
        assert_eq!(
            layer_compression(OCI_LAYER_ZSTD),
            Some(LayerCompression::Zstd)
        );
        assert_eq!(
            layer_compression(DOCKER_LAYER_GZIP),
            Some(LayerCompression::Gzip)
        );
        assert_eq!(
            layer_compression(OCI_LAYER_TAR),
            Some(LayerCompression::None)
        );
        assert_eq!(layer_compression("application/json"), None);
        assert_eq!(
            sha256_digest(b""),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
