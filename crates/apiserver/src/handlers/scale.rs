//! The `/scale` subresource of scalable kinds (VirtualMachinePool, VirtualMachineInstance-
//! ReplicaSet): GET answers an autoscaling/v1 Scale, PUT and PATCH (JSON, merge or strategic
//! merge, applied to the Scale) set the object's desired replicas through the ordinary update
//! path (admission, generation bump). A Scale with a `resourceVersion` must match the object
//! (409 otherwise); without one a concurrent write is retried, so `kubectl scale` does not
//! fail because the controller just wrote the status.

use axum::body::Body;
use axum::response::Response;
use ferrovirt_api::registry::ScaleSubresource;
use ferrovirt_api::scale::{replicas_of, scale_of, with_replicas};
use http::{Method, StatusCode};
use serde_json::Value;

use super::write::{Change, WriteOpts, apply_patch, update_object};
use super::{Ctx, json_response, load};
use crate::body::{content_type, parse_document, parse_object, read_body};
use crate::error::ApiError;

/// Serves `method` on `/…/{name}/scale`.
pub(super) async fn serve(
    ctx: &Ctx,
    sub: &ScaleSubresource,
    method: &Method,
    name: &str,
    body: Body,
) -> Result<Response, ApiError> {
    let current = || async {
        load(&ctx.sh, &ctx.def, ctx.ns(), name)
            .await?
            .map(|(obj, rev)| {
                let mut obj = obj;
                crate::objects::meta_mut(&mut obj)
                    .insert("resourceVersion".into(), Value::String(rev.to_string()));
                obj
            })
            .ok_or_else(|| ApiError::not_found(&ctx.def, name))
    };
    let media = content_type(&ctx.headers);
    let request = match method.as_str() {
        "GET" => {
            return Ok(json_response(
                StatusCode::OK,
                &scale_of(sub, &current().await?),
            ));
        }
        "PUT" | "PATCH" => {
            let bytes = read_body(&ctx.headers, body, ctx.sh.max_body, ctx.sh.body_timeout).await?;
            if method == Method::PUT {
                parse_object(&bytes, &media)?
            } else {
                parse_document(&bytes, "application/json")?
            }
        }
        m => return Err(ApiError::method_not_allowed(m)),
    };
    let opts = WriteOpts::from_ctx(ctx)?;
    for _ in 0..8 {
        let obj = current().await?;
        let scale = if method == Method::PUT {
            request.clone()
        } else {
            let mut s = scale_of(sub, &obj);
            apply_patch(&media, &mut s, &request)?;
            s
        };
        let explicit_rv = scale
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string);
        if let Some(rv) = &explicit_rv
            && obj
                .pointer("/metadata/resourceVersion")
                .and_then(Value::as_str)
                != Some(rv)
        {
            return Err(ApiError::stale(&ctx.def, name));
        }
        let n = replicas_of(&scale).map_err(|e| {
            ApiError::invalid(
                &ctx.def,
                name,
                vec![(e.reason.to_string(), e.field, e.message)],
            )
        })?;
        let new = with_replicas(sub, &obj, n);
        match update_object(ctx, name, Change::Replace(new), false, opts).await {
            Ok((stored, _)) => return Ok(json_response(StatusCode::OK, &scale_of(sub, &stored))),
            Err(e) if e.code == 409 && explicit_rv.is_none() => continue,
            Err(e) => return Err(e),
        }
    }
    Err(ApiError::stale(&ctx.def, name))
}
