//! OpenAPI documents built from the resource table and the per-kind schemas: `/openapi/v2`
//! (Swagger 2.0, JSON) and `/openapi/v3` (root index plus one document per group/version). Every
//! definition carries `x-kubernetes-group-version-kind`; every write operation lists the
//! `fieldValidation` query parameter so kubectl uses server-side field validation.

use std::hash::{Hash, Hasher};

use bytes::Bytes;
use ferrovirt_api::registry::ResourceDef;
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::resources::Resources;
use crate::schema;

/// Definition name, e.g. `io.k8s.api.core.v1.ConfigMap`, `io.kubevirt.v1.VirtualMachine`.
pub fn definition_name(def: &ResourceDef) -> String {
    if def.group.is_empty() {
        return format!("io.k8s.api.core.v1.{}", def.kind);
    }
    if let Some(short) = def.group.strip_suffix(".k8s.io") {
        let first = short.split('.').next().unwrap_or(short);
        return format!("io.k8s.api.{first}.{}.{}", def.version, def.kind);
    }
    let reversed: Vec<&str> = def.group.split('.').rev().collect();
    format!("{}.{}.{}", reversed.join("."), def.version, def.kind)
}

fn gvk(def: &ResourceDef) -> Value {
    json!({"group": def.group, "version": def.version, "kind": def.kind})
}

fn base_path(def: &ResourceDef) -> String {
    let root = if def.group.is_empty() {
        format!("/api/{}", def.version)
    } else {
        format!("/apis/{}/{}", def.group, def.version)
    };
    if def.namespaced {
        format!("{root}/namespaces/{{namespace}}/{}", def.plural)
    } else {
        format!("{root}/{}", def.plural)
    }
}

/// Query parameters of an operation (v3 form when `v3`).
fn params(names: &[&str], def: &ResourceDef, item: bool, v3: bool) -> Vec<Value> {
    let p = |name: &str, in_: &str, required: bool| {
        if v3 {
            json!({"name": name, "in": in_, "required": required, "schema": {"type": "string", "uniqueItems": true}})
        } else {
            json!({"name": name, "in": in_, "required": required, "type": "string", "uniqueItems": true})
        }
    };
    let mut out = Vec::new();
    if def.namespaced {
        out.push(p("namespace", "path", true));
    }
    if item {
        out.push(p("name", "path", true));
    }
    out.extend(names.iter().map(|n| p(n, "query", false)));
    out
}

fn operation(
    def: &ResourceDef,
    action: &str,
    op_params: Vec<Value>,
    v3: bool,
    with_body: bool,
) -> Value {
    let schema_ref = if v3 {
        json!({"$ref": format!("#/components/schemas/{}", definition_name(def))})
    } else {
        json!({"$ref": format!("#/definitions/{}", definition_name(def))})
    };
    let mut op = json!({
        "operationId": format!("{action}{}{}", def.kind, def.version),
        "parameters": op_params,
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": gvk(def),
    });
    if v3 {
        op["responses"] = json!({"200": {"description": "OK", "content": {"application/json": {"schema": schema_ref.clone()}}}});
        if with_body {
            let media = if action == "patch" {
                vec![
                    "application/json-patch+json",
                    "application/merge-patch+json",
                    "application/strategic-merge-patch+json",
                ]
            } else {
                vec!["application/json", "application/yaml"]
            };
            let content: Map<String, Value> = media
                .into_iter()
                .map(|m| (m.to_string(), json!({"schema": if action == "patch" { json!({"type": "object"}) } else { schema_ref.clone() }})))
                .collect();
            op["requestBody"] = json!({"content": content, "required": true});
        }
    } else {
        op["responses"] = json!({"200": {"description": "OK", "schema": schema_ref}});
        if with_body && let Some(ps) = op["parameters"].as_array_mut() {
            ps.push(json!({"name": "body", "in": "body", "required": true, "schema": {"type": "object"}}));
        }
    }
    op
}

const WRITE_PARAMS: &[&str] = &["dryRun", "fieldManager", "fieldValidation", "pretty"];
const LIST_PARAMS: &[&str] = &[
    "allowWatchBookmarks",
    "continue",
    "fieldSelector",
    "labelSelector",
    "limit",
    "resourceVersion",
    "resourceVersionMatch",
    "sendInitialEvents",
    "timeoutSeconds",
    "watch",
];

/// Path items for one kind.
fn paths_for(def: &ResourceDef, v3: bool, out: &mut Map<String, Value>) {
    let base = base_path(def);
    let has = |v: &str| def.verbs.contains(&v);
    let mut coll = Map::new();
    if has("list") {
        coll.insert(
            "get".into(),
            operation(def, "list", params(LIST_PARAMS, def, false, v3), v3, false),
        );
    }
    if has("create") {
        coll.insert(
            "post".into(),
            operation(def, "post", params(WRITE_PARAMS, def, false, v3), v3, true),
        );
    }
    if has("deletecollection") {
        coll.insert(
            "delete".into(),
            operation(
                def,
                "deletecollection",
                params(LIST_PARAMS, def, false, v3),
                v3,
                false,
            ),
        );
    }
    out.insert(base.clone(), Value::Object(coll));
    let mut item = Map::new();
    if has("get") {
        item.insert(
            "get".into(),
            operation(def, "get", params(&["pretty"], def, true, v3), v3, false),
        );
    }
    if has("update") {
        item.insert(
            "put".into(),
            operation(def, "put", params(WRITE_PARAMS, def, true, v3), v3, true),
        );
    }
    if has("patch") {
        item.insert(
            "patch".into(),
            operation(def, "patch", params(WRITE_PARAMS, def, true, v3), v3, true),
        );
    }
    if has("delete") {
        item.insert(
            "delete".into(),
            operation(
                def,
                "delete",
                params(
                    &["dryRun", "gracePeriodSeconds", "propagationPolicy"],
                    def,
                    true,
                    v3,
                ),
                v3,
                false,
            ),
        );
    }
    out.insert(format!("{base}/{{name}}"), Value::Object(item));
    if def.has_status {
        let mut st = Map::new();
        st.insert(
            "get".into(),
            operation(def, "get", params(&["pretty"], def, true, v3), v3, false),
        );
        if has("update") {
            st.insert(
                "put".into(),
                operation(def, "put", params(WRITE_PARAMS, def, true, v3), v3, true),
            );
            st.insert(
                "patch".into(),
                operation(def, "patch", params(WRITE_PARAMS, def, true, v3), v3, true),
            );
        }
        out.insert(format!("{base}/{{name}}/status"), Value::Object(st));
    }
}

fn definition(def: &ResourceDef) -> Value {
    let mut s = schema::kind_schema(def);
    if let Some(m) = s.as_object_mut() {
        m.insert("x-kubernetes-group-version-kind".into(), json!([gvk(def)]));
    }
    s
}

/// The Swagger 2.0 document.
pub fn v2(res: &Resources) -> Value {
    let mut paths = Map::new();
    let mut defs = Map::new();
    for def in res.all() {
        paths_for(def, false, &mut paths);
        defs.insert(definition_name(def), definition(def));
    }
    json!({
        "swagger": "2.0",
        "info": {"title": "ferrovirt", "version": format!("v1.{}.0", crate::discovery::KUBE_MINOR)},
        "paths": paths,
        "definitions": defs,
    })
}

fn gv_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

fn v3_for(res: &Resources, group: &str, version: &str) -> Option<Value> {
    let mut paths = Map::new();
    let mut schemas = Map::new();
    for def in res.in_group_version(group, version) {
        paths_for(def, true, &mut paths);
        schemas.insert(definition_name(def), definition(def));
    }
    if schemas.is_empty() {
        return None;
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "ferrovirt", "version": format!("v1.{}.0", crate::discovery::KUBE_MINOR)},
        "paths": paths,
        "components": {"schemas": schemas},
    }))
}

fn hash_of(v: &Value) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.to_string().hash(&mut h);
    format!("{:016X}", h.finish())
}

/// Every OpenAPI document, serialized once (the resource table is fixed for a server's life).
pub struct Documents {
    pub v2: Bytes,
    /// The v2 document as gnostic protobuf.
    pub v2_pb: Bytes,
    pub v3_root: Bytes,
    /// By path (`api/v1`, `apis/kubevirt.io/v1`).
    pub v3: std::collections::HashMap<String, Bytes>,
}

impl Documents {
    pub fn build(res: &Resources) -> Self {
        let mut v3 = std::collections::HashMap::new();
        for g in res.groups() {
            for v in &g.versions {
                if let Some(doc) = v3_for(res, &g.name, v) {
                    v3.insert(gv_path(&g.name, v), Bytes::from(doc.to_string()));
                }
            }
        }
        let v2_doc = v2(res);
        Self {
            v2_pb: Bytes::from(crate::openapi_pb::encode(&v2_doc)),
            v2: Bytes::from(v2_doc.to_string()),
            v3_root: Bytes::from(v3_root(res).to_string()),
            v3,
        }
    }

    /// `/openapi/v3/{path}`.
    pub fn v3_doc(&self, path: &str) -> Result<Bytes, ApiError> {
        self.v3
            .get(path)
            .cloned()
            .ok_or_else(ApiError::path_not_found)
    }
}

/// `/openapi/v3`: the index of group/version documents.
pub fn v3_root(res: &Resources) -> Value {
    let mut paths = Map::new();
    for g in res.groups() {
        for v in &g.versions {
            if let Some(doc) = v3_for(res, &g.name, v) {
                let p = gv_path(&g.name, v);
                paths.insert(
                    p.clone(),
                    json!({"serverRelativeURL": format!("/openapi/v3/{p}?hash={}", hash_of(&doc))}),
                );
            }
        }
    }
    json!({"paths": paths})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents() {
        let res = Resources::new(ferrovirt_api::registry::resources());
        let v2 = v2(&res);
        let d = &v2["definitions"]["io.kubevirt.v1.VirtualMachine"];
        assert_eq!(
            d["x-kubernetes-group-version-kind"][0]["kind"],
            "VirtualMachine"
        );
        let root = v3_root(&res);
        let url = root["paths"]["apis/kubevirt.io/v1"]["serverRelativeURL"]
            .as_str()
            .unwrap();
        assert!(url.starts_with("/openapi/v3/apis/kubevirt.io/v1?hash="));
        let docs = Documents::build(&res);
        let doc: Value =
            serde_json::from_slice(&docs.v3_doc("apis/kubevirt.io/v1").unwrap()).unwrap();
        assert!(docs.v3_doc("apis/nope/v1").is_err());
        let patch = &doc["paths"]["/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/{name}"]
            ["patch"];
        assert_eq!(
            patch["x-kubernetes-group-version-kind"]["kind"],
            "VirtualMachine"
        );
        assert!(
            patch["parameters"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == "fieldValidation")
        );
        assert_eq!(
            definition_name(res.lookup("", "v1", "configmaps").unwrap()),
            "io.k8s.api.core.v1.ConfigMap"
        );
    }
}
