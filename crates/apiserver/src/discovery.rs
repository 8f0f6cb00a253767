//! Discovery documents: `/version`, `/api`, `/apis`, `/apis/{g}`, `/api/v1`, `/apis/{g}/{v}`,
//! and the aggregated form (apidiscovery.k8s.io/v2 APIGroupDiscoveryList) when asked for.

use axum::response::{IntoResponse, Response};
use ferrovirt_api::registry::{ResourceDef, scale_subresource};
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::{Value, json};

use crate::body::wants_aggregated_discovery;
use crate::error::ApiError;
use crate::handlers::json_response;
use crate::resources::Resources;
use crate::routing::Route;

/// The Kubernetes version this server reports.
pub const KUBE_MINOR: &str = "33";

pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": KUBE_MINOR,
        "gitVersion": format!("v1.{KUBE_MINOR}.0+ferrovirt-{}", env!("CARGO_PKG_VERSION")),
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
        "goVersion": "rust",
        "compiler": "rustc",
        "platform": "linux/amd64",
    })
}

fn status_verbs(def: &ResourceDef) -> Vec<&'static str> {
    if def.verbs.contains(&"update") {
        vec!["get", "patch", "update"]
    } else {
        vec!["get"]
    }
}

fn api_resource(def: &ResourceDef) -> Vec<Value> {
    let mut r = json!({
        "name": def.plural,
        "singularName": def.singular,
        "namespaced": def.namespaced,
        "kind": def.kind,
        "verbs": def.verbs,
    });
    if !def.short_names.is_empty() {
        r["shortNames"] = json!(def.short_names);
    }
    if !def.categories.is_empty() {
        r["categories"] = json!(def.categories);
    }
    let mut out = vec![r];
    if def.has_status {
        out.push(json!({
            "name": format!("{}/status", def.plural),
            "singularName": "",
            "namespaced": def.namespaced,
            "kind": def.kind,
            "verbs": status_verbs(def),
        }));
    }
    if crate::handlers::is_pod(def) {
        out.push(json!({
            "name": "pods/eviction",
            "singularName": "",
            "namespaced": true,
            "group": "policy",
            "version": "v1",
            "kind": "Eviction",
            "verbs": ["create"],
        }));
    }
    if scale_subresource(def).is_some() {
        out.push(json!({
            "name": format!("{}/scale", def.plural),
            "singularName": "",
            "namespaced": def.namespaced,
            "group": "autoscaling",
            "version": "v1",
            "kind": "Scale",
            "verbs": ["get", "patch", "update"],
        }));
    }
    out
}

fn resource_list(res: &Resources, group: &str, version: &str) -> Option<Value> {
    let defs: Vec<&ResourceDef> = res.in_group_version(group, version).collect();
    if defs.is_empty() {
        return None;
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": gv,
        "resources": defs.into_iter().flat_map(api_resource).collect::<Vec<_>>(),
    }))
}

fn api_group(name: &str, versions: &[String]) -> Value {
    let vs: Vec<Value> = versions
        .iter()
        .map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
        .collect();
    json!({
        "name": name,
        "versions": vs,
        "preferredVersion": vs.first().cloned().unwrap_or_default(),
    })
}

fn aggregated_resource(def: &ResourceDef) -> Value {
    let kind = json!({"group": def.group, "version": def.version, "kind": def.kind});
    let mut r = json!({
        "resource": def.plural,
        "responseKind": kind,
        "scope": if def.namespaced { "Namespaced" } else { "Cluster" },
        "singularResource": def.singular,
        "verbs": def.verbs,
    });
    if !def.short_names.is_empty() {
        r["shortNames"] = json!(def.short_names);
    }
    if !def.categories.is_empty() {
        r["categories"] = json!(def.categories);
    }
    let mut subresources = Vec::new();
    if def.has_status {
        subresources.push(json!({
            "subresource": "status",
            "responseKind": kind,
            "verbs": status_verbs(def),
        }));
    }
    if crate::handlers::is_pod(def) {
        subresources.push(json!({
            "subresource": "eviction",
            "responseKind": {"group": "policy", "version": "v1", "kind": "Eviction"},
            "verbs": ["create"],
        }));
    }
    if scale_subresource(def).is_some() {
        subresources.push(json!({
            "subresource": "scale",
            "responseKind": {"group": "autoscaling", "version": "v1", "kind": "Scale"},
            "verbs": ["get", "patch", "update"],
        }));
    }
    if !subresources.is_empty() {
        r["subresources"] = Value::Array(subresources);
    }
    r
}

/// APIGroupDiscoveryList for the core group (`core == true`) or all named groups.
fn aggregated(res: &Resources, core: bool, version: &str) -> Value {
    let items: Vec<Value> = res
        .groups()
        .into_iter()
        .filter(|g| g.name.is_empty() == core)
        .map(|g| {
            let versions: Vec<Value> = g
                .versions
                .iter()
                .map(|v| {
                    json!({
                        "version": v,
                        "resources": res.in_group_version(&g.name, v).map(aggregated_resource).collect::<Vec<_>>(),
                        "freshness": "Current",
                    })
                })
                .collect();
            json!({"metadata": {"name": g.name, "creationTimestamp": null}, "versions": versions})
        })
        .collect();
    json!({
        "kind": "APIGroupDiscoveryList",
        "apiVersion": format!("apidiscovery.k8s.io/{version}"),
        "metadata": {},
        "items": items,
    })
}

fn aggregated_response(v: &Value, version: &str) -> Response {
    let mut resp = (StatusCode::OK, serde_json::to_vec(v).unwrap_or_default()).into_response();
    let ct = format!("application/json;g=apidiscovery.k8s.io;v={version};as=APIGroupDiscoveryList");
    if let Ok(h) = HeaderValue::from_str(&ct) {
        resp.headers_mut().insert(http::header::CONTENT_TYPE, h);
    }
    resp.headers_mut()
        .insert(http::header::VARY, HeaderValue::from_static("Accept"));
    resp
}

/// Serves a discovery route.
pub fn serve(res: &Resources, route: &Route, headers: &HeaderMap) -> Result<Response, ApiError> {
    let ok = |v: Value| Ok(json_response(StatusCode::OK, &v));
    match route {
        Route::CoreVersions => match wants_aggregated_discovery(headers) {
            Some(v) => Ok(aggregated_response(&aggregated(res, true, v), v)),
            None => ok(json!({
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}],
            })),
        },
        Route::Groups => match wants_aggregated_discovery(headers) {
            Some(v) => Ok(aggregated_response(&aggregated(res, false, v), v)),
            None => ok(json!({
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": res
                    .groups()
                    .iter()
                    .filter(|g| !g.name.is_empty())
                    .map(|g| api_group(&g.name, &g.versions))
                    .collect::<Vec<_>>(),
            })),
        },
        Route::Group(name) => {
            let g = res
                .groups()
                .into_iter()
                .find(|g| &g.name == name && !name.is_empty())
                .ok_or_else(ApiError::path_not_found)?;
            let mut doc = api_group(&g.name, &g.versions);
            doc["kind"] = json!("APIGroup");
            doc["apiVersion"] = json!("v1");
            ok(doc)
        }
        Route::GroupVersion(g, v) => resource_list(res, g, v)
            .map(|d| json_response(StatusCode::OK, &d))
            .ok_or_else(ApiError::path_not_found),
        _ => Err(ApiError::path_not_found()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents() {
        let res = Resources::new(ferrovirt_api::registry::resources());
        let core = resource_list(&res, "", "v1").unwrap();
        let names: Vec<&str> = core["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert!(names.contains(&"configmaps") && names.contains(&"namespaces/status"));
        let pools = resource_list(&res, "pool.kubevirt.io", "v1beta1").unwrap();
        let scale = pools["resources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == "virtualmachinepools/scale")
            .expect("the pool's scale subresource is listed");
        assert_eq!(
            (&scale["group"], &scale["kind"]),
            (&json!("autoscaling"), &json!("Scale"))
        );
        let agg = aggregated(&res, false, "v2");
        assert!(
            agg["items"]
                .as_array()
                .unwrap()
                .iter()
                .any(|g| g["metadata"]["name"] == "kubevirt.io")
        );
        assert!(resource_list(&res, "nope", "v1").is_none());
    }
}
