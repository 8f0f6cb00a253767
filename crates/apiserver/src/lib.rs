//! ferrovirt's Kubernetes-compatible REST API server: discovery, OpenAPI, CRUD, patch, watch,
//! Table output, metav1.Status errors, Events and garbage collection, generic over JSON objects
//! and backed by a [`ferrovirt_store::Store`]. The resource table comes from
//! [`ferrovirt_api::registry`]; admission from [`ferrovirt_api::admission`].
//!
//! Start it with [`Server::start`] (tests, the binary) or [`run`] (until Ctrl-C / SIGTERM):
//!
//! ```no_run
//! # async fn demo() -> Result<(), ferrovirt_apiserver::ServerError> {
//! use ferrovirt_apiserver::{Server, ServerOptions};
//! let server = Server::start(ServerOptions {
//!     data_dir: "/var/lib/ferrovirt".into(),
//!     listen: "127.0.0.1:6443".parse().expect("address"),
//!     datastore_endpoint: None, // SQLite in the data dir; or etcd URLs
//!     ..Default::default()
//! })
//! .await?;
//! // In-process clients (controllers, agent) use kube-rs with `server.kubeconfig_path`.
//! println!("{} {}", server.url(), server.kubeconfig_path.display());
//! server.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! First start creates `DATA_DIR/tls/{ca.crt,ca.key,serving.crt,serving.key}`, `DATA_DIR/token` and
//! `DATA_DIR/kubeconfig.yaml` (rewritten on every start with the bound address); later starts
//! reuse the CA, certificate and token. Servers sharing one etcd share these through
//! [`bootstrap`] data. Every request except `/healthz`, `/livez` and `/readyz`
//! needs an identity (the admin token, a ServiceAccount token or a client certificate of
//! `DATA_DIR/tls/client-ca.crt`) and RBAC's permission ([`auth`]).

pub mod audit;
pub mod auth;
mod body;
pub mod bootstrap;
mod cluster_config;
mod cluster_metrics;
mod crd;
mod discovery;
mod error;
mod events;
mod gc;
mod gc_index;
mod handlers;
mod limits;
mod metrics;
mod objects;
mod openapi;
mod openapi_pb;
pub mod patch;
mod platform;
mod printers;
mod proto;
mod quota;
mod resources;
mod routing;
mod schema;
pub mod selectors;
mod server;
mod smp;
mod table;
mod timefmt;
mod tls;
mod watch;
mod watch_decode;

pub use auth::certs::client_kubeconfig;
pub use error::{ApiError, ServerError};
pub use events::{EventRecord, record_event};
pub use server::{ENCRYPTED_PREFIXES, Server, ServerOptions, encryption_key_file, run};
pub use tls::{private_dir, private_file};
