//! Helper macros for declaring API types with the derives and serde conventions every
//! Kubernetes-style type shares (camelCase, `None` fields omitted, schemars schema).

/// Declare a struct with `Serialize`, `Deserialize`, `JsonSchema`, `Clone`, `Debug`,
/// `Default`, `PartialEq`, camelCase field names and `Option` fields skipped when `None`.
macro_rules! kstruct {
    ($(#[$m:meta])* pub struct $name:ident { $($body:tt)* }) => {
        #[serde_with::skip_serializing_none]
        #[derive(
            serde::Serialize,
            serde::Deserialize,
            schemars::JsonSchema,
            Clone,
            Debug,
            Default,
            PartialEq,
        )]
        #[serde(rename_all = "camelCase")]
        $(#[$m])*
        pub struct $name { $($body)* }
    };
}

/// Declare a string enum (serialized as its variant name unless renamed) with an `Unknown`-free
/// closed set of values.
macro_rules! kenum {
    ($(#[$m:meta])* pub enum $name:ident { $($body:tt)* }) => {
        #[derive(
            serde::Serialize,
            serde::Deserialize,
            schemars::JsonSchema,
            Clone,
            Copy,
            Debug,
            PartialEq,
            Eq,
            Hash,
        )]
        $(#[$m])*
        pub enum $name { $($body)* }
    };
}

/// Declare a top-level resource: apiVersion, kind, metadata, spec and (optionally) status.
macro_rules! resource {
    ($(#[$m:meta])* $name:ident, $spec:ty, $status:ty) => {
        kstruct! {
            $(#[$m])*
            pub struct $name {
                /// The versioned schema of this object (`group/version`); the server converts
                /// between the versions it serves.
                pub api_version: Option<String>,
                /// The REST resource kind of this object, in CamelCase.
                pub kind: Option<String>,
                /// Standard object metadata: name, namespace, labels, annotations, owners.
                #[serde(default)]
                pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
                /// The desired state, written by the user.
                pub spec: Option<$spec>,
                /// The observed state, written by the system; read-only for users.
                pub status: Option<$status>,
            }
        }
    };
    ($(#[$m:meta])* $name:ident, $spec:ty) => {
        kstruct! {
            $(#[$m])*
            pub struct $name {
                /// The versioned schema of this object (`group/version`).
                pub api_version: Option<String>,
                /// The REST resource kind of this object, in CamelCase.
                pub kind: Option<String>,
                /// Standard object metadata: name, namespace, labels, annotations, owners.
                #[serde(default)]
                pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
                /// The desired state, written by the user.
                pub spec: Option<$spec>,
            }
        }
    };
}

/// A struct with no fields, serialized as `{}` (e.g. `masquerade: {}`, `pod: {}`).
macro_rules! kempty {
    ($(#[$m:meta])* $name:ident) => {
        #[derive(
            serde::Serialize,
            serde::Deserialize,
            schemars::JsonSchema,
            Clone,
            Debug,
            Default,
            PartialEq,
        )]
        #[schemars(extend("properties" = {}))]
        $(#[$m])*
        pub struct $name {}
    };
}
