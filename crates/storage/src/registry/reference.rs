//! Image references (`[docker://][registry/]repository[:tag][@sha256:digest]`) and the
//! insecure-registry list: which registries are spoken to over plain HTTP. Pure functions.

use crate::error::StorageError;

/// The registry a reference without a registry part names (as `docker pull` does).
pub const DEFAULT_REGISTRY: &str = "docker.io";
/// Where Docker Hub's API really lives.
const DOCKER_HUB_API: &str = "registry-1.docker.io";

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ImageRef {
    /// `host[:port]` as written (`docker.io` when absent).
    pub registry: String,
    /// The repository path, e.g. `library/debian` or `fv/guest`.
    pub repository: String,
    /// The tag (`latest` when neither tag nor digest is given).
    pub tag: Option<String>,
    /// A pinned manifest digest (`sha256:<hex>`).
    pub digest: Option<String>,
}

impl ImageRef {
    /// What to ask `/v2/<name>/manifests/<reference>` for: the digest when pinned, else the tag.
    pub fn reference(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or("latest")
    }

    /// The host the registry API is served on (`registry-1.docker.io` for Docker Hub).
    pub fn api_host(&self) -> &str {
        if self.registry == DEFAULT_REGISTRY || self.registry == "index.docker.io" {
            DOCKER_HUB_API
        } else {
            &self.registry
        }
    }

    /// Whether the tag is `latest` (or absent) without a digest: Kubernetes' default pull
    /// policy is `Always` for those, `IfNotPresent` otherwise.
    pub fn is_latest(&self) -> bool {
        self.digest.is_none() && self.tag.as_deref().is_none_or(|t| t == "latest")
    }
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

fn valid_repo_component(c: &str) -> bool {
    !c.is_empty()
        && c.chars().all(|ch| {
            ch.is_ascii_lowercase() || ch.is_ascii_digit() || matches!(ch, '.' | '_' | '-')
        })
        && c.chars()
            .next()
            .is_some_and(|ch| ch.is_ascii_alphanumeric())
}

fn valid_tag(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 128
        && t.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        && !t.starts_with(['.', '-'])
}

/// Whether `d` is `sha256:` followed by 64 lower-case hex digits.
pub fn valid_digest(d: &str) -> bool {
    d.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
    })
}

/// Parses an image reference; `field` names the API field in errors. A `docker://` prefix
/// is accepted (CDI's registry URLs carry it); other schemes are refused.
pub fn parse(field: &'static str, s: &str) -> Result<ImageRef, StorageError> {
    let bad = |m: String| StorageError::invalid(field, format!("{s:?}: {m}"));
    let mut rest = s.trim();
    if let Some((scheme, after)) = rest.split_once("://") {
        if scheme != "docker" {
            return Err(bad(format!(
                "unsupported scheme {scheme:?} (only docker:// is supported)"
            )));
        }
        rest = after;
    }
    if rest.is_empty() {
        return Err(bad("empty image reference".into()));
    }
    let (name_tag, digest) = match rest.split_once('@') {
        Some((n, d)) => {
            if !valid_digest(d) {
                return Err(bad(format!("digest {d:?} is not sha256:<64 hex digits>")));
            }
            (n, Some(d.to_string()))
        }
        None => (rest, None),
    };
    // The registry is the first component when it looks like a host (has '.' or ':' or is
    // localhost); the tag is after the last ':' that follows the last '/'.
    let (registry, path) = match name_tag.split_once('/') {
        Some((first, after))
            if first.contains('.') || first.contains(':') || first == "localhost" =>
        {
            (first.to_string(), after)
        }
        _ => (DEFAULT_REGISTRY.to_string(), name_tag),
    };
    let (repo, tag) = match path.rsplit_once(':') {
        Some((r, t)) if !t.contains('/') => (r, Some(t.to_string())),
        _ => (path, None),
    };
    if let Some(t) = &tag
        && !valid_tag(t)
    {
        return Err(bad(format!("invalid tag {t:?}")));
    }
    if registry.is_empty() || registry.contains(['/', '@', ' ']) {
        return Err(bad(format!("invalid registry {registry:?}")));
    }
    if !repo.split('/').all(valid_repo_component) {
        return Err(bad(format!(
            "invalid repository {repo:?} (lower-case letters, digits, '.', '_', '-' and '/')"
        )));
    }
    let repository = if registry == DEFAULT_REGISTRY && !repo.contains('/') {
        format!("library/{repo}")
    } else {
        repo.to_string()
    };
    let tag = if tag.is_none() && digest.is_none() {
        Some("latest".to_string())
    } else {
        tag
    };
    Ok(ImageRef {
        registry,
        repository,
        tag,
        digest,
    })
}

/// Whether `registry` (`host[:port]`) is listed in `insecure`. Entries are `host[:port]`
/// (a scheme such as `http://` is ignored), or `*.domain[:port]` for every subdomain.
/// An entry without a port matches the host on any port.
pub fn is_insecure(registry: &str, insecure: &[String]) -> bool {
    let (host, port) = split_host_port(registry);
    insecure.iter().any(|entry| {
        let e = entry.trim();
        let e = e
            .split_once("://")
            .map_or(e, |(_, r)| r)
            .trim_end_matches('/');
        let (eh, ep) = split_host_port(e);
        let port_ok = ep.is_none() || ep == port;
        let host_ok = match eh.strip_prefix("*.") {
            Some(suffix) => host
                .strip_suffix(suffix)
                .is_some_and(|pre| pre.ends_with('.') && pre.len() > 1),
            None => eh.eq_ignore_ascii_case(host),
        };
        port_ok && host_ok && !eh.is_empty()
    })
}

fn split_host_port(s: &str) -> (&str, Option<&str>) {
    if let Some(rest) = s.strip_prefix('[') {
        // [v6]:port
        return match rest.split_once(']') {
            Some((h, p)) => (h, p.strip_prefix(':')),
            None => (s, None),
        };
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.chars().all(|c| c.is_ascii_digit()) => (h, Some(p)),
        _ => (s, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_references() {
        let r = parse("url", "docker://127.0.0.1:5000/fv/guest:v1").unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "fv/guest");
        assert_eq!(r.tag.as_deref(), Some("v1"));
        assert_eq!(r.reference(), "v1");
        assert_eq!(r.to_string(), "127.0.0.1:5000/fv/guest:v1");
        assert!(!r.is_latest());

        let r = parse("image", "quay.io/containerdisks/fedora").unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str()),
            ("quay.io", "containerdisks/fedora")
        );
        assert_eq!(r.reference(), "latest");
        assert!(r.is_latest());

        let r = parse("image", "busybox").unwrap();
        assert_eq!(r.registry, "docker.io");
        assert_eq!(r.repository, "library/busybox");
        assert_eq!(r.api_host(), "registry-1.docker.io");

        let d = format!("sha256:{}", "a".repeat(64));
        let r = parse("image", &format!("localhost:5000/x/y:t@{d}")).unwrap();
        assert_eq!(r.registry, "localhost:5000");
        assert_eq!(r.reference(), d);
        assert!(!r.is_latest());
        let r = parse("image", &format!("localhost/x@{d}")).unwrap();
        assert_eq!(r.tag, None);
    }

    #[test]
    fn refuses_bad_references() {
        for bad in [
            "",
            "oci-archive:///x.tar",
            "http://h/x",
            "h:5000/UPPER:tag",
            "h:5000/x:bad tag",
            "h:5000/x@sha256:short",
            "h:5000/../x",
            "h:5000//x",
        ] {
            let e = parse("spec.source.registry.url", bad).unwrap_err();
            assert!(
                e.to_string().contains("spec.source.registry.url"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn insecure_list_matches_hosts_ports_and_wildcards() {
        let list = vec![
            "127.0.0.1:5000".to_string(),
            "http://reg.local".to_string(),
            "*.corp.example:8443".to_string(),
        ];
        assert!(is_insecure("127.0.0.1:5000", &list));
        assert!(!is_insecure("127.0.0.1:5001", &list));
        assert!(!is_insecure("127.0.0.1", &list));
        assert!(is_insecure("reg.local", &list));
        assert!(is_insecure("reg.local:1234", &list));
        assert!(is_insecure("a.corp.example:8443", &list));
        assert!(!is_insecure("corp.example:8443", &list));
        assert!(!is_insecure("a.corp.example:443", &list));
        assert!(!is_insecure("evilcorp.example:8443", &list));
        assert!(!is_insecure("quay.io", &[]));
    }
}
