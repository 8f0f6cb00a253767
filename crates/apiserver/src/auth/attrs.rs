//! A request's authorizer [`Attributes`] from its method, path and query, as Kubernetes'
//! request-info parser reads them: `/api/v1/…` and `/apis/GROUP/VERSION/…` are resource
//! requests (verb from the method: GET one → get, GET many → list, `watch=true` or the
//! `/watch/` prefix → watch, POST → create, PUT → update, PATCH → patch, DELETE one → delete,
//! DELETE many → deletecollection), the segment after a name is the subresource (later
//! segments, e.g. `portforward/22`, are not part of it); everything else is a non-resource
//! path with the lower-case method as verb. Pure.

use super::rbac::Attributes;

/// The attributes of one request.
pub fn of_request(method: &http::Method, path: &str, query: Option<&str>) -> Attributes {
    let segs: Vec<String> = path
        .trim_end_matches('/')
        .split('/')
        .skip(1)
        .map(|s| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        })
        .collect();
    let non_resource = || Attributes {
        verb: method.as_str().to_ascii_lowercase(),
        path: path.to_string(),
        ..Default::default()
    };
    let (group, rest) = match segs
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["api", _v, rest @ ..] if !rest.is_empty() => (String::new(), to_owned(rest)),
        ["apis", g, _v, rest @ ..] if !rest.is_empty() => (g.to_string(), to_owned(rest)),
        _ => return non_resource(),
    };
    let (watch_prefix, rest) = match rest.split_first() {
        Some((w, r)) if w == "watch" => (true, r.to_vec()),
        _ => (false, rest),
    };
    let (namespace, parts) = match rest.as_slice() {
        [ns_kw, ns, more @ ..] if ns_kw == "namespaces" && !more.is_empty() => {
            (ns.clone(), more.to_vec())
        }
        // `/api/v1/namespaces/NAME`: the namespace object is in its own namespace.
        [ns_kw, ns] if ns_kw == "namespaces" => (ns.clone(), rest.clone()),
        _ => (String::new(), rest),
    };
    let (resource, name, subresource) = match parts.as_slice() {
        [] => return non_resource(),
        [r] => (r.clone(), String::new(), String::new()),
        [r, n] => (r.clone(), n.clone(), String::new()),
        [r, n, s, ..] => (r.clone(), n.clone(), s.clone()),
    };
    let watch_param = query.is_some_and(|q| {
        form_urlencoded::parse(q.as_bytes()).any(|(k, v)| k == "watch" && (v == "true" || v == "1"))
    });
    let verb = match *method {
        http::Method::GET | http::Method::HEAD if watch_prefix || watch_param => "watch",
        http::Method::GET | http::Method::HEAD if name.is_empty() => "list",
        http::Method::GET | http::Method::HEAD => "get",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE if name.is_empty() => "deletecollection",
        http::Method::DELETE => "delete",
        _ => return non_resource(),
    };
    Attributes {
        verb: verb.to_string(),
        resource_request: true,
        api_group: group,
        resource,
        subresource,
        namespace,
        name,
        path: path.to_string(),
    }
}

fn to_owned(s: &[&str]) -> Vec<String> {
    s.iter().map(|x| x.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Method;

    fn a(m: Method, p: &str, q: Option<&str>) -> (String, String, String, String, String, String) {
        let x = of_request(&m, p, q);
        assert!(x.resource_request, "{p}");
        (
            x.verb,
            x.api_group,
            x.resource,
            x.subresource,
            x.namespace,
            x.name,
        )
    }

    fn t(
        v: &str,
        g: &str,
        r: &str,
        s: &str,
        ns: &str,
        n: &str,
    ) -> (String, String, String, String, String, String) {
        (v.into(), g.into(), r.into(), s.into(), ns.into(), n.into())
    }

    #[test]
    fn resource_requests() {
        assert_eq!(
            a(
                Method::GET,
                "/apis/kubevirt.io/v1/namespaces/b/virtualmachines",
                None
            ),
            t("list", "kubevirt.io", "virtualmachines", "", "b", "")
        );
        assert_eq!(
            a(
                Method::GET,
                "/apis/kubevirt.io/v1/virtualmachines",
                Some("watch=true&x=1")
            ),
            t("watch", "kubevirt.io", "virtualmachines", "", "", "")
        );
        assert_eq!(
            a(Method::GET, "/api/v1/watch/namespaces/a/secrets", None),
            t("watch", "", "secrets", "", "a", "")
        );
        assert_eq!(
            a(Method::GET, "/api/v1/namespaces/b/secrets/s", None),
            t("get", "", "secrets", "", "b", "s")
        );
        assert_eq!(
            a(
                Method::PUT,
                "/apis/subresources.kubevirt.io/v1/namespaces/a/virtualmachines/vm/start",
                None
            ),
            t(
                "update",
                "subresources.kubevirt.io",
                "virtualmachines",
                "start",
                "a",
                "vm"
            )
        );
        assert_eq!(
            a(
                Method::GET,
                "/apis/subresources.kubevirt.io/v1/namespaces/a/virtualmachineinstances/vm/portforward/22/tcp",
                None
            ),
            t(
                "get",
                "subresources.kubevirt.io",
                "virtualmachineinstances",
                "portforward",
                "a",
                "vm"
            )
        );
        assert_eq!(
            a(Method::GET, "/api/v1/namespaces/a", None),
            t("get", "", "namespaces", "", "a", "a")
        );
        assert_eq!(
            a(Method::GET, "/api/v1/namespaces", None),
            t("list", "", "namespaces", "", "", "")
        );
        assert_eq!(
            a(Method::DELETE, "/api/v1/namespaces/a/configmaps", None),
            t("deletecollection", "", "configmaps", "", "a", "")
        );
        assert_eq!(
            a(
                Method::POST,
                "/api/v1/namespaces/a/serviceaccounts/sa/token",
                None
            ),
            t("create", "", "serviceaccounts", "token", "a", "sa")
        );
        assert_eq!(
            a(
                Method::PATCH,
                "/apis/rbac.authorization.k8s.io/v1/clusterroles/system%3Aadmin",
                None
            ),
            t(
                "patch",
                "rbac.authorization.k8s.io",
                "clusterroles",
                "",
                "",
                "system:admin"
            )
        );
    }

    #[test]
    fn non_resource_requests() {
        for p in [
            "/api",
            "/apis",
            "/api/v1",
            "/apis/kubevirt.io/v1",
            "/version",
            "/openapi/v3",
        ] {
            let x = of_request(&Method::GET, p, None);
            assert!(!x.resource_request, "{p}");
            assert_eq!((x.verb.as_str(), x.path.as_str()), ("get", p));
        }
    }
}
