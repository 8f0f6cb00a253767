//! get and list: label/field selectors, `limit`/`continue` pagination at a fixed revision, and
//! the representation the client asked for (object, Table, partial metadata).

use axum::response::Response;
use base64::Engine;
use ferrovirt_api::registry::ResourceDef;
use ferrovirt_store::{ListOptions, StoreError};
use http::StatusCode;
use serde_json::{Value, json};

use super::{Ctx, from_storage, json_response, load};
use crate::body::{Representation, representation};
use crate::error::ApiError;
use crate::objects::decode;
use crate::selectors::{FieldSelector, LabelSelector};
use crate::{resources, table};

/// A decoded continue token: the revision of the first page and the last key returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContinueToken {
    pub revision: i64,
    pub start_after: String,
}

impl ContinueToken {
    pub fn encode(&self) -> String {
        let v = json!({"v": "meta.k8s.io/v1", "rv": self.revision, "start": self.start_after});
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
    }

    pub fn decode(s: &str) -> Result<Self, ApiError> {
        let bad = || {
            ApiError::bad_request(
                "continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)",
            )
        };
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(s.trim_end_matches('='))
            .map_err(|_| bad())?;
        let v: Value = serde_json::from_slice(&raw).map_err(|_| bad())?;
        match (v["v"].as_str(), v["rv"].as_i64(), v["start"].as_str()) {
            (Some("meta.k8s.io/v1"), Some(revision), Some(start)) if revision > 0 => Ok(Self {
                revision,
                start_after: start.to_string(),
            }),
            _ => Err(bad()),
        }
    }
}

/// Selectors from `labelSelector` / `fieldSelector`.
pub(crate) fn selectors(ctx: &Ctx) -> Result<(LabelSelector, FieldSelector), ApiError> {
    let ls = LabelSelector::parse(ctx.q.get("labelSelector").unwrap_or_default())
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let fs = FieldSelector::parse(ctx.q.get("fieldSelector").unwrap_or_default())
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok((ls, fs))
}

/// Parameters of one list.
pub(crate) struct ListParams<'a> {
    pub def: &'a ResourceDef,
    pub namespace: Option<&'a str>,
    pub labels: &'a LabelSelector,
    pub fields: &'a FieldSelector,
    pub limit: Option<usize>,
    pub cont: Option<ContinueToken>,
    /// Read at this revision (resourceVersionMatch=Exact).
    pub revision: Option<i64>,
}

/// The result of a list: matching objects, the revision read, and the next continue token.
pub(crate) struct Listed {
    pub items: Vec<Value>,
    pub revision: i64,
    pub cont: Option<String>,
}

/// Every object of `def` (in `namespace`, or all), unfiltered, in one page at the current
/// revision.
pub(crate) async fn list_all(
    ctx: &Ctx,
    def: &ResourceDef,
    namespace: Option<&str>,
) -> Result<Listed, ApiError> {
    list_objects(
        ctx,
        ListParams {
            def,
            namespace,
            labels: &LabelSelector::default(),
            fields: &FieldSelector::default(),
            limit: None,
            cont: None,
            revision: None,
        },
    )
    .await
}

/// Lists matching objects, page by page, at one revision.
pub(crate) async fn list_objects(ctx: &Ctx, p: ListParams<'_>) -> Result<Listed, ApiError> {
    let prefix = resources::list_prefix(p.def, p.namespace);
    let mut start_after = p.cont.as_ref().map(|c| c.start_after.clone());
    let mut revision = p.cont.as_ref().map(|c| c.revision).or(p.revision);
    let page = p.limit.map(|l| l.max(50)).unwrap_or(500);
    let mut items = Vec::new();
    loop {
        let res = ctx
            .sh
            .store
            .list(
                &prefix,
                ListOptions {
                    start_after: start_after.clone(),
                    limit: Some(page),
                    revision,
                },
            )
            .await
            .map_err(|e| match e {
                StoreError::Compacted { .. } if p.cont.is_some() => ApiError::expired(
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results.",
                ),
                other => ApiError::from_store(other),
            })?;
        revision = Some(res.revision);
        let n = res.items.len();
        for (i, kv) in res.items.iter().enumerate() {
            start_after = Some(kv.key.clone());
            let obj = from_storage(p.def, decode(kv)?);
            if !p.labels.matches_object(&obj) || !p.fields.matches(&obj) {
                continue;
            }
            items.push(obj);
            if p.limit.is_some_and(|l| items.len() >= l) {
                let more = i + 1 < n || res.more;
                let cont = more.then(|| {
                    ContinueToken {
                        revision: res.revision,
                        start_after: kv.key.clone(),
                    }
                    .encode()
                });
                return Ok(Listed {
                    items,
                    revision: res.revision,
                    cont,
                });
            }
        }
        if !res.more || n == 0 {
            return Ok(Listed {
                items,
                revision: res.revision,
                cont: None,
            });
        }
    }
}

/// GET on a collection.
pub(super) async fn list(ctx: &Ctx) -> Result<Response, ApiError> {
    let (labels, fields) = selectors(ctx)?;
    let limit = ctx.q.int("limit")?.filter(|l| *l > 0).map(|l| l as usize);
    let cont = ctx
        .q
        .get("continue")
        .map(ContinueToken::decode)
        .transpose()?;
    let exact = ctx.q.get("resourceVersionMatch") == Some("Exact");
    let revision = match ctx.q.get("resourceVersion") {
        Some(rv) if exact => Some(
            rv.parse::<i64>()
                .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?,
        ),
        _ => None,
    };
    let listed = list_objects(
        ctx,
        ListParams {
            def: &ctx.def,
            namespace: ctx.ns(),
            labels: &labels,
            fields: &fields,
            limit,
            cont,
            revision,
        },
    )
    .await?;
    let mut meta = json!({"resourceVersion": listed.revision.to_string()});
    if let Some(c) = listed.cont {
        meta["continue"] = Value::String(c);
    }
    Ok(json_response(
        StatusCode::OK,
        &list_body(ctx, listed.items, meta),
    ))
}

/// A list response body in the representation the client asked for.
pub(crate) fn list_body(ctx: &Ctx, items: Vec<Value>, meta: Value) -> Value {
    let def = &ctx.def;
    match representation(&ctx.headers) {
        Representation::Table { beta } => table::table(&table::TableRequest {
            def,
            objects: &items,
            list_meta: meta,
            include: table::include_object(ctx.q.get("includeObject")),
            beta,
        }),
        Representation::Metadata { beta } => json!({
            "kind": "PartialObjectMetadataList",
            "apiVersion": if beta { "meta.k8s.io/v1beta1" } else { "meta.k8s.io/v1" },
            "metadata": meta,
            "items": items.iter().map(|o| table::partial(o, beta)).collect::<Vec<_>>(),
        }),
        Representation::Object => json!({
            "kind": def.list_kind,
            "apiVersion": def.api_version(),
            "metadata": meta,
            "items": items,
        }),
    }
}

/// Renders one object in the requested representation.
pub(crate) fn render_one(ctx: &Ctx, obj: Value) -> Value {
    match representation(&ctx.headers) {
        Representation::Table { beta } => table::table(&table::TableRequest {
            def: &ctx.def,
            objects: std::slice::from_ref(&obj),
            list_meta: json!({"resourceVersion": obj.pointer("/metadata/resourceVersion").cloned().unwrap_or_default()}),
            include: table::include_object(ctx.q.get("includeObject")),
            beta,
        }),
        Representation::Metadata { beta } => table::partial(&obj, beta),
        Representation::Object => obj,
    }
}

/// GET on one object.
pub(super) async fn get(ctx: &Ctx, name: &str) -> Result<Response, ApiError> {
    let (obj, _) = load(&ctx.sh, &ctx.def, ctx.ns(), name)
        .await?
        .ok_or_else(|| ApiError::not_found(&ctx.def, name))?;
    Ok(json_response(StatusCode::OK, &render_one(ctx, obj)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continue_tokens() {
        let t = ContinueToken {
            revision: 42,
            start_after: "/registry/core/configmaps/ns/a".into(),
        };
        assert_eq!(ContinueToken::decode(&t.encode()).unwrap(), t);
        assert_eq!(ContinueToken::decode("!!!").unwrap_err().code, 400);
        let bogus = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("{\"rv\":1}");
        assert_eq!(ContinueToken::decode(&bogus).unwrap_err().code, 400);
    }
}
