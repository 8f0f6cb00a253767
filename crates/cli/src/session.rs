//! A connected CLI session: the kube-rs client, the default namespace and the server's resource
//! types (from discovery), with `Api<DynamicObject>` handles and raw GETs for what kube-rs has no
//! typed call for (Table output).

use kube::Api;
use kube::api::DynamicObject;
use serde_json::Value;

use crate::error::CliError;
use crate::resources::{Catalog, ResourceInfo};
use crate::target::Target;

/// kubectl's Accept header for server-side printing.
pub const TABLE_ACCEPT: &str = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json";

/// Client, namespace and discovery.
#[derive(Clone)]
pub struct Session {
    pub client: kube::Client,
    pub namespace: String,
    pub catalog: Catalog,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

/// The URL path of a resource collection (`name` None) or object.
pub fn resource_path(r: &ResourceInfo, namespace: Option<&str>, name: Option<&str>) -> String {
    let mut p = if r.group.is_empty() {
        format!("/api/{}", r.version)
    } else {
        format!("/apis/{}/{}", r.group, r.version)
    };
    if r.namespaced
        && let Some(ns) = namespace
    {
        p.push_str(&format!("/namespaces/{ns}"));
    }
    p.push('/');
    p.push_str(&r.plural);
    if let Some(n) = name {
        p.push('/');
        p.push_str(n);
    }
    p
}

/// Percent-encodes a query parameter value (everything but RFC 3986's unreserved
/// characters, by the `percent-encoding` crate).
pub fn query_escape(s: &str) -> String {
    const UNRESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    percent_encoding::utf8_percent_encode(s, UNRESERVED).to_string()
}

impl Session {
    /// Connects and reads discovery.
    pub async fn connect(target: &Target) -> Result<Session, CliError> {
        let client = target.client().await?;
        let catalog = Catalog::fetch(&client).await?;
        Ok(Session {
            client,
            namespace: target.namespace.clone(),
            catalog,
        })
    }

    pub fn resolve(&self, typed: &str) -> Result<ResourceInfo, CliError> {
        self.catalog.resolve(typed).cloned()
    }

    /// An `Api<DynamicObject>` in `namespace` (default: the session's) or cluster-wide.
    pub fn api(&self, r: &ResourceInfo, namespace: Option<&str>) -> Api<DynamicObject> {
        let ar = r.api_resource();
        if r.namespaced {
            Api::namespaced_with(
                self.client.clone(),
                namespace.unwrap_or(&self.namespace),
                &ar,
            )
        } else {
            Api::all_with(self.client.clone(), &ar)
        }
    }

    /// Across all namespaces.
    pub fn api_all(&self, r: &ResourceInfo) -> Api<DynamicObject> {
        Api::all_with(self.client.clone(), &r.api_resource())
    }

    /// GETs a path with an Accept header and decodes the JSON answer.
    pub async fn get_json(&self, path_and_query: &str, accept: &str) -> Result<Value, CliError> {
        let req = http::Request::builder()
            .method("GET")
            .uri(path_and_query)
            .header("Accept", accept)
            .body(Vec::new())
            .map_err(|e| CliError::Transport(e.to_string()))?;
        let text = self.client.request_text(req).await?;
        serde_json::from_str(&text)
            .map_err(|e| CliError::Transport(format!("decoding {path_and_query}: {e}")))
    }

    /// An object as JSON (with apiVersion and kind).
    pub async fn get_object(
        &self,
        r: &ResourceInfo,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, CliError> {
        let obj = self.api(r, namespace).get(name).await?;
        Ok(object_json(r, obj))
    }
}

/// A DynamicObject as JSON, with its type filled in from the resource.
pub fn object_json(r: &ResourceInfo, obj: DynamicObject) -> Value {
    let mut v = serde_json::to_value(obj).unwrap_or_default();
    if v["apiVersion"].as_str().unwrap_or_default().is_empty() {
        v["apiVersion"] = Value::String(r.api_version());
    }
    if v["kind"].as_str().unwrap_or_default().is_empty() {
        v["kind"] = Value::String(r.kind.clone());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        let r = ResourceInfo {
            group: "kubevirt.io".into(),
            version: "v1".into(),
            kind: "VirtualMachine".into(),
            plural: "virtualmachines".into(),
            singular: "virtualmachine".into(),
            short_names: vec![],
            namespaced: true,
            verbs: vec![],
        };
        assert_eq!(
            resource_path(&r, Some("ns"), Some("a")),
            "/apis/kubevirt.io/v1/namespaces/ns/virtualmachines/a"
        );
        assert_eq!(
            resource_path(&r, None, None),
            "/apis/kubevirt.io/v1/virtualmachines"
        );
        let node = ResourceInfo {
            group: String::new(),
            version: "v1".into(),
            plural: "nodes".into(),
            namespaced: false,
            ..r
        };
        assert_eq!(resource_path(&node, Some("ns"), None), "/api/v1/nodes");
        assert_eq!(query_escape("app=a,b c"), "app%3Da%2Cb%20c");
    }
}
