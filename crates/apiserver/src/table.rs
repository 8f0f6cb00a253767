//! meta.k8s.io Table output for `kubectl get`: a NAME column, the kind's printer columns
//! (evaluated with the JSONPath subset, dates rendered as ages), and the row objects as asked by
//! `includeObject` (None, Metadata — the default — or Object). Also PartialObjectMetadata.

use ferrovirt_api::registry::{self, PrinterColumn, ResourceDef};
use serde_json::{Value, json};

use crate::{printers, timefmt};
use ferrovirt_api::jsonpath::JsonPath;

/// `includeObject`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncludeObject {
    None,
    Metadata,
    Object,
}

pub fn include_object(q: Option<&str>) -> IncludeObject {
    match q {
        Some("None") => IncludeObject::None,
        Some("Object") => IncludeObject::Object,
        _ => IncludeObject::Metadata,
    }
}

/// What to render.
pub struct TableRequest<'a> {
    pub def: &'a ResourceDef,
    pub objects: &'a [Value],
    pub list_meta: Value,
    pub include: IncludeObject,
    /// meta.k8s.io/v1beta1 instead of v1.
    pub beta: bool,
}

/// PartialObjectMetadata for one object.
pub fn partial(obj: &Value, beta: bool) -> Value {
    json!({
        "kind": "PartialObjectMetadata",
        "apiVersion": if beta { "meta.k8s.io/v1beta1" } else { "meta.k8s.io/v1" },
        "metadata": obj.get("metadata").cloned().unwrap_or_else(|| json!({})),
    })
}

fn column_definition(c: &PrinterColumn) -> Value {
    let (type_, format) = match c.type_ {
        "date" => ("date", ""),
        t => (t, ""),
    };
    json!({
        "name": c.name,
        "type": type_,
        "format": format,
        "description": c.description,
        "priority": c.priority,
    })
}

/// One cell: the column's value, dates as ages, missing as null.
fn cell(def: &ResourceDef, col: &PrinterColumn, path: Option<&JsonPath>, obj: &Value) -> Value {
    if col.json_path == registry::COMPUTED {
        return printers::cell(def, col.name, obj);
    }
    let Some(path) = path else { return Value::Null };
    let found = path.eval(obj);
    let v = match found.as_slice() {
        [] => return Value::Null,
        [one] => (*one).clone(),
        many => Value::String(
            many.iter()
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect::<Vec<_>>()
                .join(","),
        ),
    };
    match (col.type_, v) {
        (_, Value::Null) => Value::Null,
        ("date", Value::String(s)) => Value::String(timefmt::age_of(&s)),
        ("integer" | "number", v @ Value::Number(_)) => v,
        ("boolean", v @ Value::Bool(_)) => v,
        (_, Value::String(s)) => Value::String(s),
        (_, other) => Value::String(other.to_string()),
    }
}

/// The Table for `objects`.
pub fn table(req: &TableRequest<'_>) -> Value {
    let cols = registry::table_columns(req.def);
    let paths: Vec<Option<JsonPath>> = cols
        .iter()
        .map(|c| JsonPath::parse(c.json_path).ok())
        .collect();
    // A kind that lists its own `Name` column (Events: last, wide) has no leading NAME.
    let own_name = cols.iter().any(|c| c.name == "Name");
    let mut defs = vec![json!({
        "name": "Name",
        "type": "string",
        "format": "name",
        "description": "Name must be unique within a namespace. Is required when creating resources, although some resources may allow a client to request the generation of an appropriate name automatically. Name is primarily intended for creation idempotence and configuration definition.",
        "priority": 0,
    })];
    if own_name {
        defs.clear();
    }
    defs.extend(cols.iter().map(column_definition));
    let rows: Vec<Value> = req
        .objects
        .iter()
        .map(|o| {
            let mut cells = Vec::with_capacity(cols.len() + 1);
            if !own_name {
                cells.push(printers::name_cell(req.def, o));
            }
            cells.extend(
                cols.iter()
                    .zip(&paths)
                    .map(|(c, p)| cell(req.def, c, p.as_ref(), o)),
            );
            let mut row = json!({"cells": cells});
            match req.include {
                IncludeObject::None => {}
                IncludeObject::Metadata => row["object"] = partial(o, req.beta),
                IncludeObject::Object => row["object"] = o.clone(),
            }
            row
        })
        .collect();
    json!({
        "kind": "Table",
        "apiVersion": if req.beta { "meta.k8s.io/v1beta1" } else { "meta.k8s.io/v1" },
        "metadata": req.list_meta,
        "columnDefinitions": defs,
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_table() {
        let defs = registry::resources();
        let Some(vm) = defs.iter().find(|d| d.kind == "VirtualMachine") else {
            panic!("VirtualMachine is served")
        };
        let obj = json!({
            "metadata": {"name": "vm1", "creationTimestamp": timefmt::format_rfc3339(timefmt::now_secs() - 30)},
            "status": {"printableStatus": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        });
        let t = table(&TableRequest {
            def: vm,
            objects: std::slice::from_ref(&obj),
            list_meta: json!({}),
            include: IncludeObject::Metadata,
            beta: false,
        });
        let names: Vec<&str> = t["columnDefinitions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(names[0], "Name");
        assert!(names.contains(&"Age") && names.contains(&"Ready"));
        let cells = t["rows"][0]["cells"].as_array().unwrap();
        assert_eq!(cells[0], "vm1");
        let age_idx = names.iter().position(|n| *n == "Age").unwrap();
        assert!(cells[age_idx].as_str().unwrap().ends_with('s'));
        let ready_idx = names.iter().position(|n| *n == "Ready").unwrap();
        assert_eq!(cells[ready_idx], "True");
        assert_eq!(t["rows"][0]["object"]["kind"], "PartialObjectMetadata");
    }
}
