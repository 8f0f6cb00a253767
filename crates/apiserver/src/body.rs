//! Request decoding: the size-limited body, JSON or YAML objects, query parameters, and what the
//! `Accept` header asks for (plain JSON, a meta.k8s.io Table, partial object metadata).

use std::collections::HashMap;

use axum::body::Body;
use bytes::Bytes;
use http::HeaderMap;
use http_body_util::BodyExt;
use serde_json::Value;

use crate::error::ApiError;

/// Reads the whole body within `timeout`, failing with 413 above `limit` bytes and 408 when the
/// client is too slow (a trickled body cannot hold a handler forever). An oversized body is
/// still drained (up to a bound) so that the client sees the 413 instead of a broken connection.
pub async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(timeout, read_body_unbounded(headers, body, limit)).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::new(
            408,
            "Timeout",
            format!(
                "the request body was not received within {} s",
                timeout.as_secs()
            ),
        )),
    }
}

async fn read_body_unbounded(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let drain_cap = limit.saturating_mul(8);
    if declared.is_some_and(|n| n > drain_cap) {
        return Err(ApiError::too_large(limit));
    }
    let mut body = body;
    let mut buf = bytes::BytesMut::new();
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame
            .map_err(|e| ApiError::bad_request(format!("failed to read the request body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            total += data.len();
            if total <= limit {
                buf.extend_from_slice(&data);
            } else if total > drain_cap {
                break;
            }
        }
    }
    if total > limit {
        return Err(ApiError::too_large(limit));
    }
    Ok(buf.freeze())
}

/// The media type of the request body, without parameters.
pub fn content_type(headers: &HeaderMap) -> String {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default()
}

/// Decodes a JSON (or, for YAML media types, YAML) document.
pub fn parse_document(bytes: &[u8], media: &str) -> Result<Value, ApiError> {
    if media.contains("protobuf") || media.contains("cbor") {
        return Err(ApiError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml (got {media:?})"
            ),
        ));
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request("the request body is empty"));
    }
    if media.contains("yaml") {
        let s = std::str::from_utf8(bytes)
            .map_err(|_| ApiError::bad_request("the request body is not valid UTF-8"))?;
        return ferrovirt_api::yaml::from_str::<Value>(s)
            .map_err(|e| ApiError::bad_request(format!("error decoding YAML body: {e}")));
    }
    serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(format!(
            "the body of the request could not be decoded as JSON: {e}"
        ))
    })
}

/// Decodes an object body: a JSON/YAML map.
pub fn parse_object(bytes: &[u8], media: &str) -> Result<Value, ApiError> {
    let v = if media == "application/vnd.kubernetes.protobuf" {
        crate::proto::decode(bytes).map_err(|e| match e {
            crate::proto::ProtoError::Malformed(_) => ApiError::bad_request(e.to_string()),
            crate::proto::ProtoError::Unsupported(_) => {
                ApiError::new(415, "UnsupportedMediaType", e.to_string())
            }
        })?
    } else {
        parse_document(bytes, media)?
    };
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    Ok(v)
}

/// Decoded query parameters (last value wins).
#[derive(Debug, Clone, Default)]
pub struct Query(HashMap<String, String>);

impl Query {
    pub fn parse(q: Option<&str>) -> Self {
        // application/x-www-form-urlencoded (`+` is a space, invalid escapes stay as they
        // are), by the `form_urlencoded` crate.
        let map = form_urlencoded::parse(q.unwrap_or_default().as_bytes())
            .into_owned()
            .collect();
        Self(map)
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(String::as_str).filter(|v| !v.is_empty())
    }

    pub fn flag(&self, k: &str) -> bool {
        matches!(self.0.get(k).map(String::as_str), Some("true" | "1"))
    }

    pub fn int(&self, k: &str) -> Result<Option<i64>, ApiError> {
        self.get(k)
            .map(|v| {
                v.parse()
                    .map_err(|_| ApiError::bad_request(format!("invalid value for {k}: {v:?}")))
            })
            .transpose()
    }
}

/// What representation the client asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Representation {
    Object,
    /// meta.k8s.io Table (`v1` or `v1beta1`).
    Table {
        beta: bool,
    },
    /// PartialObjectMetadata / PartialObjectMetadataList.
    Metadata {
        beta: bool,
    },
}

/// Parses the `Accept` header: the first media range with an `as=` we support wins.
pub fn representation(headers: &HeaderMap) -> Representation {
    let accept = headers
        .get(http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    for range in accept.split(',') {
        let mut as_ = None;
        let mut version = None;
        for param in range.split(';').skip(1) {
            match param.trim().split_once('=') {
                Some(("as", v)) => as_ = Some(v.trim()),
                Some(("v", v)) => version = Some(v.trim()),
                _ => {}
            }
        }
        let beta = version == Some("v1beta1");
        match as_ {
            Some("Table") => return Representation::Table { beta },
            Some("PartialObjectMetadata" | "PartialObjectMetadataList") => {
                return Representation::Metadata { beta };
            }
            _ => {}
        }
        if as_.is_none() && !range.trim().is_empty() {
            return Representation::Object;
        }
    }
    Representation::Object
}

/// Whether the client asked for aggregated discovery (apidiscovery.k8s.io/v2).
pub fn wants_aggregated_discovery(headers: &HeaderMap) -> Option<&'static str> {
    let accept = headers
        .get(http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    for range in accept.split(',') {
        if range.contains("as=APIGroupDiscoveryList") && range.contains("g=apidiscovery.k8s.io") {
            if range.contains("v=v2beta1") {
                return Some("v2beta1");
            }
            if range.contains("v=v2") {
                return Some("v2");
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = Query::parse(Some(
            "labelSelector=app%3Dweb%2Ctier+in+(a)&watch=1&limit=5&x=",
        ));
        assert_eq!(q.get("labelSelector"), Some("app=web,tier in (a)"));
        assert!(q.flag("watch"));
        assert!(!q.flag("nope"));
        assert_eq!(q.int("limit").unwrap(), Some(5));
        assert_eq!(q.get("x"), None);
        let q = Query::parse(Some("bad=%zz%4&&plus=a+b%2B"));
        assert_eq!(q.get("bad"), Some("%zz%4"));
        assert_eq!(q.get("plus"), Some("a b+"));
    }

    #[test]
    fn accept() {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::ACCEPT,
            "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json"
                .parse()
                .unwrap(),
        );
        assert_eq!(representation(&h), Representation::Table { beta: false });
        h.insert(http::header::ACCEPT, "application/json".parse().unwrap());
        assert_eq!(representation(&h), Representation::Object);
        h.insert(
            http::header::ACCEPT,
            "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json"
                .parse()
                .unwrap(),
        );
        assert_eq!(wants_aggregated_discovery(&h), Some("v2"));
    }

    #[test]
    fn documents() {
        assert!(parse_object(b"{\"a\":1}", "application/json").is_ok());
        assert_eq!(
            parse_object(b"a: 1\nb: [x]\n", "application/yaml").unwrap()["b"][0],
            "x"
        );
        assert_eq!(
            parse_object(b"{bad", "application/json").unwrap_err().code,
            400
        );
        assert_eq!(
            parse_object(b"[1]", "application/json").unwrap_err().code,
            400
        );
        assert_eq!(parse_object(b"", "application/json").unwrap_err().code, 400);
    }

    #[test]
    fn hostile_yaml_bodies_are_400() {
        // Billion laughs: nine levels of tenfold aliases.
        let mut bomb = String::from("a0: &a0 [x,x,x,x,x,x,x,x,x,x]\n");
        for i in 1..10 {
            let items = vec![format!("*a{}", i - 1); 10].join(",");
            bomb.push_str(&format!("a{i}: &a{i} [{items}]\n"));
        }
        let deep = format!("{}1{}", "[".repeat(50_000), "]".repeat(50_000));
        for body in [bomb, deep] {
            let e = parse_document(body.as_bytes(), "application/yaml").unwrap_err();
            assert_eq!(e.code, 400, "{e}");
            assert!(e.message.starts_with("error decoding YAML body"), "{e}");
        }
        let ok = parse_document(b"kind: X\nmetadata: {name: a}\n", "application/yaml").unwrap();
        assert_eq!(ok["metadata"]["name"], "a");
    }
}
