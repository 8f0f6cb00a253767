//! URL path parsing: which discovery document, OpenAPI document or resource path a request names.

/// A parsed resource URL, e.g. `/apis/kubevirt.io/v1/namespaces/default/virtualmachines/vm1/status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourcePath {
    pub group: String,
    pub version: String,
    pub namespace: Option<String>,
    pub plural: String,
    pub name: Option<String>,
    pub subresource: Option<String>,
    /// Legacy `/watch/` prefix.
    pub watch: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Version,
    Health,
    /// `/metrics`: request counters (Prometheus text).
    Metrics,
    /// `/api`
    CoreVersions,
    /// `/apis`
    Groups,
    /// `/apis/{group}`
    Group(String),
    /// `/api/v1` or `/apis/{group}/{version}`
    GroupVersion(String, String),
    OpenApiV2,
    OpenApiV3Root,
    /// `/openapi/v3/{api/v1 | apis/g/v}`
    OpenApiV3(String),
    Resource(ResourcePath),
    NotFound,
}

/// Parses a request path.
pub fn parse(path: &str) -> Route {
    let decoded: Vec<String> = path
        .trim_end_matches('/')
        .split('/')
        .skip(1)
        .map(percent_decode)
        .collect();
    let segs: Vec<&str> = decoded.iter().map(String::as_str).collect();
    match segs.as_slice() {
        ["version"] => Route::Version,
        ["healthz" | "livez" | "readyz", ..] => Route::Health,
        ["metrics"] => Route::Metrics,
        ["api"] => Route::CoreVersions,
        ["apis"] => Route::Groups,
        ["apis", g] => Route::Group(g.to_string()),
        ["api", v] => Route::GroupVersion(String::new(), v.to_string()),
        ["apis", g, v] => Route::GroupVersion(g.to_string(), v.to_string()),
        ["openapi", "v2"] => Route::OpenApiV2,
        ["openapi", "v3"] => Route::OpenApiV3Root,
        ["openapi", "v3", rest @ ..] => Route::OpenApiV3(rest.join("/")),
        ["api", v, rest @ ..] => resource("", v, rest),
        ["apis", g, v, rest @ ..] => resource(g, v, rest),
        _ => Route::NotFound,
    }
}

/// Decodes `%XX` escapes in one path segment (the `percent-encoding` crate: invalid escapes
/// stay as they are; invalid UTF-8 becomes U+FFFD).
fn percent_decode(seg: &str) -> String {
    percent_encoding::percent_decode_str(seg)
        .decode_utf8_lossy()
        .into_owned()
}

fn resource(group: &str, version: &str, rest: &[&str]) -> Route {
    let (watch, rest) = match rest {
        ["watch", r @ ..] => (true, r),
        r => (false, r),
    };
    // Decoded segments must stay single path segments (keys are built from them).
    if rest
        .iter()
        .any(|s| s.is_empty() || s.contains('/') || *s == "." || *s == "..")
    {
        return Route::NotFound;
    }
    let mk = |namespace: Option<&str>, plural: &str, name: Option<&str>, sub: Option<&str>| {
        Route::Resource(ResourcePath {
            group: group.to_string(),
            version: version.to_string(),
            namespace: namespace.map(str::to_string),
            plural: plural.to_string(),
            name: name.map(str::to_string),
            subresource: sub.map(str::to_string),
            watch,
        })
    };
    match rest {
        // namespace subresources: /api/v1/namespaces/{name}/status|finalize
        ["namespaces", name, sub @ ("status" | "finalize")] if group.is_empty() => {
            mk(None, "namespaces", Some(name), Some(sub))
        }
        ["namespaces", ns, plural] => mk(Some(ns), plural, None, None),
        ["namespaces", ns, plural, name] => mk(Some(ns), plural, Some(name), None),
        ["namespaces", ns, plural, name, sub] => mk(Some(ns), plural, Some(name), Some(sub)),
        [plural] => mk(None, plural, None, None),
        [plural, name] => mk(None, plural, Some(name), None),
        [plural, name, sub] => mk(None, plural, Some(name), Some(sub)),
        _ => Route::NotFound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(r: Route) -> ResourcePath {
        match r {
            Route::Resource(p) => p,
            other => panic!("not a resource: {other:?}"),
        }
    }

    #[test]
    fn paths() {
        assert_eq!(parse("/api"), Route::CoreVersions);
        assert_eq!(
            parse("/api/v1"),
            Route::GroupVersion(String::new(), "v1".into())
        );
        assert_eq!(
            parse("/apis/kubevirt.io"),
            Route::Group("kubevirt.io".into())
        );
        assert_eq!(
            parse("/openapi/v3/apis/kubevirt.io/v1"),
            Route::OpenApiV3("apis/kubevirt.io/v1".into())
        );
        let p = res(parse(
            "/apis/kubevirt.io/v1/namespaces/d/virtualmachines/vm1/status",
        ));
        assert_eq!(
            (
                p.namespace.as_deref(),
                p.plural.as_str(),
                p.name.as_deref(),
                p.subresource.as_deref()
            ),
            (Some("d"), "virtualmachines", Some("vm1"), Some("status"))
        );
        let p = res(parse("/api/v1/namespaces"));
        assert_eq!((p.plural.as_str(), p.namespace), ("namespaces", None));
        let p = res(parse("/api/v1/namespaces/x"));
        assert_eq!(
            (p.plural.as_str(), p.name.as_deref()),
            ("namespaces", Some("x"))
        );
        let p = res(parse("/api/v1/namespaces/x/status"));
        assert_eq!(
            (p.plural.as_str(), p.subresource.as_deref()),
            ("namespaces", Some("status"))
        );
        let p = res(parse("/api/v1/watch/namespaces/d/configmaps"));
        assert!(p.watch && p.namespace.as_deref() == Some("d"));
        assert_eq!(parse("/api/v1/namespaces//configmaps"), Route::NotFound);
        assert_eq!(parse("/nothing"), Route::NotFound);
        let p = res(parse(
            "/apis/rbac.authorization.k8s.io/v1/clusterroles/system%3Aadmin",
        ));
        assert_eq!(p.name.as_deref(), Some("system:admin"));
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(
            parse("/api/v1/namespaces/a%2Fb/configmaps"),
            Route::NotFound
        );
        assert_eq!(
            parse("/api/v1/namespaces/default/configmaps/.."),
            Route::NotFound
        );
        assert_eq!(percent_decode("%zz"), "%zz");
    }
}
