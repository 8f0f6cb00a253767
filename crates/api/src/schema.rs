//! OpenAPI v3 schemas generated from the Rust types (schemars), and the unknown-field check
//! the API server uses for `fieldValidation=Strict`.

use std::collections::HashMap;
use std::sync::OnceLock;

use schemars::JsonSchema;
use schemars::generate::SchemaSettings;
use serde_json::{Map, Value};

use crate::registry::ResourceDef;
use crate::{cdi, hco, kubevirt, network};

/// Generate the inlined OpenAPI v3 schema of `T`.
pub fn schema_of<T: JsonSchema>() -> Value {
    let settings = SchemaSettings::openapi3().with(|s| {
        s.inline_subschemas = true;
        s.meta_schema = None;
    });
    let generator = settings.into_generator();
    let mut v = generator.into_root_schema_for::<T>().to_value();
    if let Some(obj) = v.as_object_mut() {
        obj.remove("$schema");
        obj.remove("title");
        obj.remove("components");
        obj.remove("definitions");
        obj.remove("$defs");
    }
    normalize(&mut v);
    // Kubernetes' published schemas never require `metadata` (k8s-openapi's structs hold it
    // unconditionally, so kubectl's validation refused `kubectl create -f` of a TokenReview
    // sent without one).
    if let Some(Value::Array(req)) = v.get_mut("required") {
        req.retain(|r| r != "metadata");
        if req.is_empty() {
            v.as_object_mut().map(|o| o.remove("required"));
        }
    }
    v
}

/// Make a schemars schema look like a Kubernetes structural schema: integer formats that
/// OpenAPI knows, no `null` defaults, no titles.
fn normalize(v: &mut Value) {
    match v {
        Value::Object(map) => {
            map.remove("title");
            // Defaults are applied by admission, not by the schema (and metadata may not
            // carry one in a structural schema). Only a schema's `default` keyword goes: a
            // property named `default` (`multus.default`) stays.
            map.remove("default");
            if let Some(Value::Object(props)) = map.get_mut("properties") {
                for (_, child) in props.iter_mut() {
                    normalize(child);
                    describe_from_items(child);
                }
            }
            if let Some(Value::Array(values)) = map.get_mut("enum") {
                values.retain(|v| !v.is_null());
            }
            // Structural schemas forbid properties together with additionalProperties: a
            // flattened catch-all map becomes x-kubernetes-preserve-unknown-fields.
            if map.contains_key("properties")
                && map.get("additionalProperties") == Some(&Value::Bool(true))
            {
                map.remove("additionalProperties");
                map.insert("x-kubernetes-preserve-unknown-fields".into(), true.into());
            }
            if let Some(Value::String(f)) = map.get("format") {
                let replaced = match f.as_str() {
                    "uint8" | "uint16" | "int8" | "int16" => Some("int32"),
                    "uint32" | "uint64" | "uint" => Some("int64"),
                    "uint128" | "int128" => Some("int64"),
                    _ => None,
                };
                if let Some(r) = replaced {
                    map.insert("format".into(), Value::String(r.into()));
                }
            }
            for (key, child) in map.iter_mut() {
                if key != "properties" {
                    normalize(child);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(normalize),
        _ => {}
    }
}

/// A list field without a description of its own takes its items' description ("A guest
/// disk …" for `disks`), so `kubectl explain` has something to say about it.
fn describe_from_items(field: &mut Value) {
    let Some(m) = field.as_object_mut() else {
        return;
    };
    if m.contains_key("description") {
        return;
    }
    let from_items = m
        .get("items")
        .and_then(|i| i.get("description"))
        .and_then(Value::as_str)
        .map(str::to_string);
    if let Some(d) = from_items {
        m.insert("description".into(), Value::String(d));
    }
}

fn generate(def: &ResourceDef) -> Value {
    use k8s_openapi::api::{
        apps, authentication, authorization, coordination, core, events, rbac, storage,
    };
    use kubevirt::{instancetype as it, misc, snapshot, vm, vmi};
    match (def.group, def.kind) {
        ("", "Namespace") => schema_of::<core::v1::Namespace>(),
        ("", "Node") => schema_of::<core::v1::Node>(),
        ("", "PersistentVolume") => schema_of::<core::v1::PersistentVolume>(),
        ("", "PersistentVolumeClaim") => schema_of::<core::v1::PersistentVolumeClaim>(),
        ("", "Secret") => schema_of::<core::v1::Secret>(),
        ("", "ConfigMap") => schema_of::<core::v1::ConfigMap>(),
        ("", "Event") => schema_of::<core::v1::Event>(),
        ("", "ServiceAccount") => schema_of::<core::v1::ServiceAccount>(),
        ("", "ResourceQuota") => schema_of::<core::v1::ResourceQuota>(),
        ("", "Pod") => schema_of::<core::v1::Pod>(),
        ("rbac.authorization.k8s.io", "Role") => schema_of::<rbac::v1::Role>(),
        ("rbac.authorization.k8s.io", "ClusterRole") => schema_of::<rbac::v1::ClusterRole>(),
        ("rbac.authorization.k8s.io", "RoleBinding") => schema_of::<rbac::v1::RoleBinding>(),
        ("rbac.authorization.k8s.io", "ClusterRoleBinding") => {
            schema_of::<rbac::v1::ClusterRoleBinding>()
        }
        ("authentication.k8s.io", "SelfSubjectReview") => {
            schema_of::<authentication::v1::SelfSubjectReview>()
        }
        ("authentication.k8s.io", "TokenReview") => schema_of::<authentication::v1::TokenReview>(),
        ("authorization.k8s.io", "SelfSubjectAccessReview") => {
            schema_of::<authorization::v1::SelfSubjectAccessReview>()
        }
        ("authorization.k8s.io", "SubjectAccessReview") => {
            schema_of::<authorization::v1::SubjectAccessReview>()
        }
        ("", "Service") => schema_of::<core::v1::Service>(),
        ("", "Endpoints") => schema_of::<core::v1::Endpoints>(),
        ("discovery.k8s.io", "EndpointSlice") => {
            schema_of::<k8s_openapi::api::discovery::v1::EndpointSlice>()
        }
        ("storage.k8s.io", "StorageClass") => schema_of::<storage::v1::StorageClass>(),
        ("coordination.k8s.io", "Lease") => schema_of::<coordination::v1::Lease>(),
        ("events.k8s.io", "Event") => schema_of::<events::v1::Event>(),
        ("apps", "ControllerRevision") => schema_of::<apps::v1::ControllerRevision>(),
        ("kubevirt.io", "VirtualMachine") => schema_of::<vm::VirtualMachine>(),
        ("kubevirt.io", "VirtualMachineInstance") => schema_of::<vmi::VirtualMachineInstance>(),
        ("kubevirt.io", "VirtualMachineInstanceMigration") => {
            schema_of::<misc::VirtualMachineInstanceMigration>()
        }
        ("kubevirt.io", "VirtualMachineInstanceReplicaSet") => {
            schema_of::<misc::VirtualMachineInstanceReplicaSet>()
        }
        ("kubevirt.io", "KubeVirt") => schema_of::<misc::KubeVirt>(),
        ("kubevirt.io", "VirtualMachineInstancePreset") => {
            schema_of::<kubevirt::preset::VirtualMachineInstancePreset>()
        }
        ("pool.kubevirt.io", "VirtualMachinePool") => {
            schema_of::<kubevirt::pool::VirtualMachinePool>()
        }
        ("upload.cdi.kubevirt.io", "UploadTokenRequest") => schema_of::<cdi::UploadTokenRequest>(),
        (_, "VirtualMachineInstancetype") => schema_of::<it::VirtualMachineInstancetype>(),
        (_, "VirtualMachineClusterInstancetype") => {
            schema_of::<it::VirtualMachineClusterInstancetype>()
        }
        (_, "VirtualMachinePreference") => schema_of::<it::VirtualMachinePreference>(),
        (_, "VirtualMachineClusterPreference") => {
            schema_of::<it::VirtualMachineClusterPreference>()
        }
        (_, "VirtualMachineSnapshot") => schema_of::<snapshot::VirtualMachineSnapshot>(),
        (_, "VirtualMachineSnapshotContent") => {
            schema_of::<snapshot::VirtualMachineSnapshotContent>()
        }
        (_, "VirtualMachineRestore") => schema_of::<snapshot::VirtualMachineRestore>(),
        (_, "VirtualMachineExport") => schema_of::<kubevirt::export::VirtualMachineExport>(),
        (_, "VirtualMachineClone") => schema_of::<kubevirt::clone::VirtualMachineClone>(),
        (_, "MigrationPolicy") => schema_of::<misc::MigrationPolicy>(),
        ("snapshot.storage.k8s.io", "VolumeSnapshot") => {
            schema_of::<crate::volumesnapshot::VolumeSnapshot>()
        }
        ("snapshot.storage.k8s.io", "VolumeSnapshotContent") => {
            schema_of::<crate::volumesnapshot::VolumeSnapshotContent>()
        }
        ("snapshot.storage.k8s.io", "VolumeSnapshotClass") => {
            schema_of::<crate::volumesnapshot::VolumeSnapshotClass>()
        }
        (_, "DataVolume") => schema_of::<cdi::DataVolume>(),
        (_, "DataSource") => schema_of::<cdi::DataSource>(),
        (_, "StorageProfile") => schema_of::<cdi::StorageProfile>(),
        (_, "CDI") => schema_of::<cdi::Cdi>(),
        (_, "NetworkAttachmentDefinition") => schema_of::<network::NetworkAttachmentDefinition>(),
        ("k8s.cni.cncf.io", "IPAMClaim") => schema_of::<network::IPAMClaim>(),
        (_, "HyperConverged") => schema_of::<hco::HyperConverged>(),
        ("ssp.kubevirt.io", "SSP") => schema_of::<hco::operands::Ssp>(),
        (_, "NetworkAddonsConfig") => schema_of::<hco::operands::NetworkAddonsConfig>(),
        ("apiextensions.k8s.io", "CustomResourceDefinition") => crd_schema(),
        (crate::backup::GROUP, k) => crate::backup::schema(k).unwrap_or_else(free_form_object),
        (crate::udn::GROUP, k) => crate::udn::schema(k).unwrap_or_else(free_form_object),
        (crate::nmstate::GROUP, k) => crate::nmstate::schema(k).unwrap_or_else(free_form_object),
        _ => free_form_object(),
    }
}

/// The CustomResourceDefinition kind (served read-only): typed metadata, a free-form spec and
/// status (the published JSONSchemaProps type is recursive and cannot be inlined).
fn crd_schema() -> Value {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let text = |d: &str| {
        let mut m = Map::new();
        m.insert("type".into(), "string".into());
        m.insert("description".into(), d.into());
        Value::Object(m)
    };
    let free = |d: &str| {
        let mut v = free_form_object();
        v["description"] = d.into();
        v
    };
    let mut props = Map::new();
    props.insert("apiVersion".into(), text("apiextensions.k8s.io/v1"));
    props.insert("kind".into(), text("CustomResourceDefinition"));
    props.insert("metadata".into(), schema_of::<ObjectMeta>());
    props.insert(
        "spec".into(),
        free("The group, names, scope and versions (with schemas) of the resource."),
    );
    props.insert(
        "status".into(),
        free("Conditions (Established, NamesAccepted), accepted names and stored versions."),
    );
    let mut m = Map::new();
    m.insert("type".into(), "object".into());
    m.insert(
        "description".into(),
        "A resource kind served by this API server, described as a CustomResourceDefinition."
            .into(),
    );
    m.insert("properties".into(), Value::Object(props));
    Value::Object(m)
}

/// `{type: object, x-kubernetes-preserve-unknown-fields: true}`: accepts anything.
pub fn free_form_object() -> Value {
    let mut m = Map::new();
    m.insert("type".into(), "object".into());
    m.insert("x-kubernetes-preserve-unknown-fields".into(), true.into());
    Value::Object(m)
}

fn cache() -> &'static HashMap<(&'static str, &'static str), Value> {
    static CACHE: OnceLock<HashMap<(&'static str, &'static str), Value>> = OnceLock::new();
    CACHE.get_or_init(|| {
        crate::registry::resources()
            .iter()
            .map(|d| ((d.group, d.kind), with_gvk(d, generate(d))))
            .collect()
    })
}

/// The OpenAPI v3 schema of a served kind (cached; computed once per process).
pub fn openapi_schema(def: &ResourceDef) -> Value {
    cache()
        .get(&(def.group, def.kind))
        .cloned()
        .unwrap_or_else(|| with_gvk(def, generate(def)))
}

/// Tag a root schema with `x-kubernetes-group-version-kind`, which kubectl uses to find the
/// schema of a kind in `/openapi/v3` (explain, client-side validation).
fn with_gvk(def: &ResourceDef, mut schema: Value) -> Value {
    if let Some(m) = schema.as_object_mut() {
        let mut gvk = Map::new();
        gvk.insert("group".into(), def.group.into());
        gvk.insert("kind".into(), def.kind.into());
        gvk.insert("version".into(), def.version.into());
        m.insert(
            "x-kubernetes-group-version-kind".into(),
            Value::Array(vec![Value::Object(gvk)]),
        );
    }
    schema
}

/// Field paths (`.spec.template.spec.domain.foo`) present in `obj` but absent from the kind's
/// schema. Free-form places (`x-kubernetes-preserve-unknown-fields`, maps of arbitrary values,
/// objects without declared properties such as `managedFields[].fieldsV1`) are not descended.
pub fn unknown_fields(def: &ResourceDef, obj: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let owned;
    let schema = match cache().get(&(def.group, def.kind)) {
        Some(s) => s,
        None => {
            owned = generate(def);
            &owned
        }
    };
    walk(schema, obj, &mut String::new(), &mut out, 0);
    out
}

/// Properties declared by a schema, merging `allOf`/`anyOf`/`oneOf` branches. `None` when the
/// schema declares no `properties` at all (free-form).
fn declared<'a>(schema: &'a Map<String, Value>, acc: &mut Vec<&'a Map<String, Value>>) -> bool {
    let mut any = false;
    if let Some(Value::Object(p)) = schema.get("properties") {
        acc.push(p);
        any = true;
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(Value::Array(branches)) = schema.get(key) {
            for b in branches {
                if let Value::Object(b) = b {
                    any |= declared(b, acc);
                }
            }
        }
    }
    any
}

fn additional(schema: &Map<String, Value>) -> Option<&Value> {
    if let Some(a) = schema.get("additionalProperties") {
        return Some(a);
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(Value::Array(branches)) = schema.get(key) {
            for b in branches {
                if let Some(a) = b.as_object().and_then(additional) {
                    return Some(a);
                }
            }
        }
    }
    None
}

fn items(schema: &Map<String, Value>) -> Option<&Value> {
    if let Some(i) = schema.get("items") {
        return Some(i);
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(Value::Array(branches)) = schema.get(key) {
            for b in branches {
                if let Some(i) = b.as_object().and_then(items) {
                    return Some(i);
                }
            }
        }
    }
    None
}

const MAX_DEPTH: usize = 64;

fn walk(schema: &Value, v: &Value, path: &mut String, out: &mut Vec<String>, depth: usize) {
    let Some(schema) = schema.as_object() else {
        return;
    };
    if depth > MAX_DEPTH
        || schema
            .get("x-kubernetes-preserve-unknown-fields")
            .and_then(Value::as_bool)
            .unwrap_or(false)
    {
        return;
    }
    match v {
        Value::Object(map) => {
            let mut props = Vec::new();
            let has_props = declared(schema, &mut props);
            let extra = additional(schema);
            if !has_props && extra.is_none() {
                return; // free-form object
            }
            for (k, child) in map {
                let len = path.len();
                path.push('.');
                path.push_str(k);
                if let Some(s) = props.iter().find_map(|p| p.get(k)) {
                    walk(s, child, path, out, depth + 1);
                } else {
                    match extra {
                        Some(Value::Bool(true)) => {}
                        Some(s @ Value::Object(_)) => walk(s, child, path, out, depth + 1),
                        _ => out.push(path.clone()),
                    }
                }
                path.truncate(len);
            }
        }
        Value::Array(list) => {
            if let Some(item_schema) = items(schema) {
                for (i, child) in list.iter().enumerate() {
                    let len = path.len();
                    path.push_str(&format!("[{i}]"));
                    walk(item_schema, child, path, out, depth + 1);
                    path.truncate(len);
                }
            }
        }
        _ => {}
    }
}

/// Remove the fields [`unknown_fields`] reports (what Kubernetes' pruning does for CRDs with
/// `fieldValidation=Ignore`) and return their paths. ferrovirt's types model a subset of
/// KubeVirt's API, so callers may prefer to keep unknown fields and only warn.
pub fn prune_unknown_fields(def: &ResourceDef, obj: &mut Value) -> Vec<String> {
    let unknown = unknown_fields(def, obj);
    for path in &unknown {
        remove_path(obj, path);
    }
    unknown
}

/// Remove the member named by a `.a.b[0].c` path (keys containing `.` or `[` are not
/// addressable this way and are left alone).
fn remove_path(obj: &mut Value, path: &str) {
    let mut segments: Vec<Segment> = Vec::new();
    for part in path.split('.').skip(1) {
        let (key, rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        segments.push(Segment::Key(key));
        for idx in rest.split('[').filter(|s| !s.is_empty()) {
            match idx.trim_end_matches(']').parse() {
                Ok(i) => segments.push(Segment::Index(i)),
                Err(_) => return,
            }
        }
    }
    let Some((Segment::Key(last), parents)) = segments.split_last() else {
        return;
    };
    let mut cur = obj;
    for seg in parents {
        let next = match seg {
            Segment::Key(k) => cur.get_mut(*k),
            Segment::Index(i) => cur.get_mut(*i),
        };
        match next {
            Some(n) => cur = n,
            None => return,
        }
    }
    if let Some(m) = cur.as_object_mut() {
        m.remove(*last);
    }
}

enum Segment<'a> {
    Key(&'a str),
    Index(usize),
}
