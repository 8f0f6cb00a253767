//! Server lifecycle: [`ServerOptions`], [`Server::start`] (store, credentials, TLS listener,
//! background loops; authentication and authorization are [`crate::auth`]'s), and [`run`] for
//! the binary.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use ferrovirt_api::registry::{self, ResourceDef};
use ferrovirt_store::Store;
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;

use crate::error::ServerError;
use crate::resources::Resources;
use crate::{gc, handlers, tls};

/// How to run the API server.
#[derive(Clone)]
pub struct ServerOptions {
    /// Holds `tls/`, `token`, `kubeconfig.yaml` and (by default) the SQLite database.
    pub data_dir: PathBuf,
    /// Default `127.0.0.1:6443`; port 0 picks a free port (see [`Server::addr`]).
    pub listen: SocketAddr,
    /// `sqlite://PATH` or etcd URLs; None: SQLite in the data dir.
    pub datastore_endpoint: Option<String>,
    /// The etcd TLS files (`--datastore-cafile`, `--datastore-certfile`, `--datastore-keyfile`).
    pub datastore_tls: ferrovirt_store::DatastoreTls,
    /// An already opened store (tests, embedding); takes precedence over `datastore_endpoint`.
    /// Either way Secrets are encrypted in it with the keys in `DATA_DIR/encryption-keys`.
    pub store: Option<Arc<dyn Store>>,
    /// Served resources; None: [`ferrovirt_api::registry::resources`].
    pub resources: Option<Vec<ResourceDef>>,
    /// Extra subject alternative names for the serving certificate (first start only).
    pub extra_sans: Vec<String>,
    /// Largest accepted request body (413 above). Default 3 MiB.
    pub max_body_bytes: usize,
    /// How long a client may take to send a request body read by the API server (408 after).
    /// Default 60 s.
    pub body_timeout: Duration,
    /// Connection caps and the TLS-handshake / header-read (idle) timeouts.
    pub connection_limits: ferrovirt_serve::Limits,
    /// How often the garbage collector rescans when nothing prompts it. Default 30 s.
    pub gc_interval: Duration,
    /// How often watches get a BOOKMARK when asked for. Default 60 s.
    pub bookmark_interval: Duration,
    /// How often old revisions are compacted (None: never). Default 5 min.
    pub compact_interval: Option<Duration>,
    /// How many revisions compaction keeps. Default 10 000.
    pub compact_keep: i64,
    /// Routes served before the generic resource handler, behind the same authentication
    /// (e.g. `subresources.kubevirt.io`).
    pub extra_routes: Option<Router>,
    /// `group/version`s served by `extra_routes`, listed in `/apis` discovery.
    pub extra_groups: Vec<String>,
    /// Routes served **without** the bearer-token check, each authenticating its requests
    /// itself (VirtualMachineExport downloads: the export token), or need none (the web
    /// console's static files at `/ui/`). Paths they do not match go
    /// to the authenticated routes.
    pub public_routes: Option<Router>,
    /// The range Service ClusterIPs are allocated from (`--service-cidr`).
    pub service_cidr: ferrovirt_api::service::ServiceCidr,
    /// Where the audit log is appended (`--audit-log-path`; None: no audit log) and its level.
    pub audit_log: Option<(PathBuf, crate::audit::Level)>,
    /// More Prometheus text for `/metrics` from the same process (the controllers' series).
    pub extra_metrics: Option<fn() -> String>,
    /// How the bearer token the server presents to node N's agent endpoint is derived from
    /// its API token (`f(api_token, N)`); a joining node is given its own. None: joined nodes
    /// get none and their endpoints refuse the server.
    pub endpoint_token: Option<fn(&str, &str) -> String>,
    /// How long a node certificate (joining, renewal) is valid. Default 365 days.
    pub node_cert_lifetime: Duration,
}

impl std::fmt::Debug for ServerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerOptions")
            .field("data_dir", &self.data_dir)
            .field("listen", &self.listen)
            .field("datastore_endpoint", &self.datastore_endpoint)
            .field("max_body_bytes", &self.max_body_bytes)
            .finish_non_exhaustive()
    }
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("/var/lib/ferrovirt"),
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 6443),
            datastore_endpoint: None,
            datastore_tls: Default::default(),
            store: None,
            resources: None,
            extra_sans: Vec::new(),
            max_body_bytes: 3 * 1024 * 1024,
            body_timeout: Duration::from_secs(60),
            connection_limits: ferrovirt_serve::Limits::default(),
            gc_interval: Duration::from_secs(30),
            bookmark_interval: Duration::from_secs(60),
            compact_interval: Some(Duration::from_secs(300)),
            compact_keep: 10_000,
            extra_routes: None,
            extra_groups: Vec::new(),
            public_routes: None,
            audit_log: None,
            extra_metrics: None,
            endpoint_token: None,
            node_cert_lifetime: Duration::from_secs(365 * 86_400),
            service_cidr: ferrovirt_api::service::DEFAULT_SERVICE_CIDR
                .parse()
                .expect("the default service CIDR parses"),
        }
    }
}

/// State shared by every request and background loop.
pub(crate) struct Shared {
    pub store: Arc<dyn Store>,
    pub resources: Resources,
    /// Authentication keys and the RBAC policy ([`crate::auth`]).
    pub auth: crate::auth::Auth,
    /// The audit log, when one is kept.
    pub audit: Option<crate::audit::AuditLog>,
    pub max_body: usize,
    pub body_timeout: Duration,
    pub bookmark_interval: Duration,
    /// Wakes the garbage collector (deletions, deletionTimestamps).
    pub gc_kick: Notify,
    pub shutdown: watch::Receiver<bool>,
    /// Resource requests by verb, resource and user agent (`/metrics`).
    pub requests: crate::metrics::RequestCounter,
    /// [`ServerOptions::extra_metrics`].
    pub extra_metrics: Option<fn() -> String>,
    /// Store events decoded once for all watches ([`crate::watch_decode`]).
    pub decoded: crate::watch_decode::DecodeCache,
    /// The range Service ClusterIPs are allocated from.
    pub service_cidr: ferrovirt_api::service::ServiceCidr,
    /// Quota charges whose objects are not stored yet ([`crate::quota`]).
    pub quota_inflight: crate::quota::InFlight,
    openapi: std::sync::OnceLock<crate::openapi::Documents>,
}

impl Shared {
    /// The OpenAPI documents, built on first use.
    pub fn openapi(&self) -> &crate::openapi::Documents {
        self.openapi
            .get_or_init(|| crate::openapi::Documents::build(&self.resources))
    }
}

/// A running server.
pub struct Server {
    /// The bound address.
    pub addr: SocketAddr,
    /// `DATA_DIR/kubeconfig.yaml`, pointing at [`Server::addr`].
    pub kubeconfig_path: PathBuf,
    /// The admin bearer token.
    pub token: String,
    /// PEM of the CA that signed the serving certificate.
    pub ca_pem: String,
    pub store: Arc<dyn Store>,
    /// The routes the listener serves, authentication included: clients in this process call
    /// them directly ([`Server::router`]), without TLS and a loopback connection.
    router: axum::Router,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .field("kubeconfig_path", &self.kubeconfig_path)
            .finish_non_exhaustive()
    }
}

/// Store keys whose values are encrypted at rest: Secrets.
pub const ENCRYPTED_PREFIXES: &[&str] = &["/registry/core/secrets/"];

/// The key file for Secrets at rest in `data_dir`.
pub fn encryption_key_file(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("encryption-keys")
}

/// Opens the store and wraps it so that Secrets are encrypted at rest.
async fn open_store(opts: &ServerOptions) -> Result<Arc<dyn Store>, ServerError> {
    let raw = match &opts.store {
        Some(s) => s.clone(),
        None => {
            let endpoint = opts.datastore_endpoint.as_deref().unwrap_or("");
            ferrovirt_store::open_endpoint_tls(endpoint, &opts.datastore_tls, &opts.data_dir)
                .await?
        }
    };
    let key_file = encryption_key_file(&opts.data_dir);
    let enc = ferrovirt_store::EncryptingStore::new(raw, &key_file, ENCRYPTED_PREFIXES)?;
    tls::private_file(&key_file)?;
    Ok(Arc::new(enc))
}

async fn authenticate(State(sh): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let (method, uri) = (req.method().clone(), req.uri().clone());
    let started = std::time::Instant::now();
    let resp = match &sh.audit {
        Some(log) => crate::audit::around(&sh, log, req, next).await,
        None => crate::auth::check(&sh, req, next).await,
    };
    tracing::debug!(
        %method,
        %uri,
        status = resp.status().as_u16(),
        ms = started.elapsed().as_millis() as u64,
        "request"
    );
    resp
}

impl Server {
    /// Opens the store, creates or loads credentials, binds the listener and starts serving.
    pub async fn start(opts: ServerOptions) -> Result<Server, ServerError> {
        // In-process rustls clients (kube-rs) need a process-wide provider when more than one
        // is compiled in; the server itself always uses ring explicitly.
        let _ = rustls::crypto::ring::default_provider().install_default();
        // Secrets, the token, keys and the store live here: owner only (0700).
        tls::private_dir(&opts.data_dir)?;
        tls::private_file(&opts.data_dir.join("kubeconfig.yaml"))?;
        let store = open_store(&opts).await?;
        // The listen address is a SAN too: servers of one cluster each sign their own.
        let mut sans = opts.extra_sans.clone();
        if !opts.listen.ip().is_unspecified() {
            sans.push(opts.listen.ip().to_string());
        }
        let pki = tls::load_or_create(&opts.data_dir, &sans)?;
        let client_ca = crate::auth::certs::load_or_create(&opts.data_dir)?;
        let tls_cfg = crate::auth::certs::server_config(&pki, &client_ca)?;
        let token_keys = crate::auth::tokens::TokenKeys::load_or_create(&opts.data_dir)?;
        let join_token = crate::auth::join::load_or_create(&opts.data_dir, &pki.ca_pem)?;
        tracing::info!(
            path = %opts.data_dir.join(crate::auth::join::TOKEN_FILE).display(),
            "node join token (`ferrovirt agent --server URL --token-file PATH`)"
        );
        let listener = TcpListener::bind(opts.listen)
            .await
            .map_err(|e| ServerError::io(opts.listen, e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| ServerError::io(opts.listen, e))?;
        let host = if addr.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else if addr.is_ipv6() {
            format!("[{}]", addr.ip())
        } else {
            addr.ip().to_string()
        };
        let kubeconfig_path = tls::write_kubeconfig(
            &opts.data_dir,
            &format!("https://{host}:{}", addr.port()),
            &pki,
        )?;

        let (stop, shutdown) = watch::channel(false);
        let shared = Arc::new(Shared {
            store: store.clone(),
            resources: Resources::new(opts.resources.clone().unwrap_or_else(registry::resources))
                .with_extra_groups(&opts.extra_groups),
            auth: crate::auth::Auth {
                admin_token: pki.token.clone(),
                policy: Default::default(),
                tokens: token_keys,
                node_certs: Default::default(),
                service_accounts: Default::default(),
            },
            service_cidr: opts.service_cidr,
            audit: match &opts.audit_log {
                Some((path, level)) => {
                    Some(crate::audit::AuditLog::open(path, *level).map_err(|e| {
                        ServerError::Config(format!(
                            "opening the audit log {}: {e}",
                            path.display()
                        ))
                    })?)
                }
                None => None,
            },
            max_body: opts.max_body_bytes,
            body_timeout: opts.body_timeout,
            bookmark_interval: opts.bookmark_interval,
            gc_kick: Notify::new(),
            shutdown,
            requests: Default::default(),
            extra_metrics: opts.extra_metrics,
            decoded: Default::default(),
            quota_inflight: Default::default(),
            openapi: Default::default(),
        });
        gc::ensure_system_namespaces(&shared)
            .await
            .map_err(|e| ServerError::Config(format!("creating system namespaces: {e}")))?;
        crate::crd::sync(&shared)
            .await
            .map_err(|e| ServerError::Config(format!("writing CustomResourceDefinitions: {e}")))?;
        crate::auth::ensure_defaults(&shared)
            .await
            .map_err(|e| ServerError::Config(format!("writing the default RBAC roles: {e}")))?;
        crate::platform::ensure_hyperconverged(&shared)
            .await
            .map_err(|e| ServerError::Config(format!("creating the HyperConverged: {e}")))?;
        shared.auth.policy.prime(shared.store.as_ref()).await?;
        shared.auth.node_certs.prime(shared.store.as_ref()).await?;

        let mut app = crate::auth::routes(shared.clone()).merge(handlers::router(shared.clone()));
        if let Some(extra) = opts.extra_routes.clone() {
            app = extra.merge(app);
        }
        let mut app = app.layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            authenticate,
        ));
        if let Some(public) = opts.public_routes.clone() {
            app = public.merge(app);
        }
        app = crate::auth::join::routes(Arc::new(crate::auth::join::JoinState {
            secret: join_token.secret.clone(),
            store: store.clone(),
            client_ca: client_ca.clone(),
            node_certs: shared.auth.node_certs.clone(),
            lifetime: opts.node_cert_lifetime,
            endpoint_token: opts.endpoint_token.map(|f| (pki.token.clone(), f)),
        }))
        .merge(app);

        let mut tasks = JoinSet::new();
        let mut stopping = shared.shutdown.clone();
        let router = app.clone();
        tasks.spawn(ferrovirt_serve::serve(
            "API server",
            listener,
            tokio_rustls::TlsAcceptor::from(tls_cfg),
            app,
            opts.connection_limits,
            async move {
                let _ = stopping.wait_for(|stop| *stop).await;
            },
        ));
        tasks.spawn(gc::run(shared.clone(), opts.gc_interval));
        tasks.spawn(crate::quota::run(shared.clone()));
        tasks.spawn(
            shared
                .auth
                .policy
                .clone()
                .run(shared.store.clone(), shared.shutdown.clone()),
        );
        tasks.spawn(
            shared
                .auth
                .node_certs
                .clone()
                .run(shared.store.clone(), shared.shutdown.clone()),
        );
        tasks.spawn(
            shared
                .auth
                .service_accounts
                .clone()
                .run(shared.store.clone(), shared.shutdown.clone()),
        );
        tasks.spawn(crate::auth::nodecreds::forget_deleted_nodes(
            shared.store.clone(),
            shared.shutdown.clone(),
        ));
        {
            let (store, mut shutdown) = (shared.store.clone(), shared.shutdown.clone());
            tasks.spawn(async move {
                let grace = crate::auth::nodecreds::ORPHAN_GRACE;
                tokio::select! {
                    r = crate::auth::nodecreds::sweep_orphans(store.as_ref(), grace) => {
                        if let Err(e) = r {
                            tracing::warn!("sweeping the records of deleted nodes: {e}");
                        }
                    }
                    _ = shutdown.changed() => {}
                }
            });
        }
        tasks.spawn(crate::auth::tokens::default_service_accounts(
            shared.clone(),
        ));
        if let Some(every) = opts.compact_interval {
            tasks.spawn(gc::compact_loop(shared.clone(), every, opts.compact_keep));
        }
        tracing::info!(%addr, "API server listening");
        Ok(Server {
            addr,
            kubeconfig_path,
            token: pki.token,
            ca_pem: pki.ca_pem,
            store,
            router,
            stop,
            tasks,
        })
    }

    /// The server's routes as the listener serves them (authentication, authorization, audit
    /// and limits included), for a client in this process to call without a connection. A
    /// request needs its credentials (e.g. `Authorization: Bearer` [`Server::token`]); it has
    /// no peer certificate and cannot upgrade (no WebSocket subresources).
    pub fn router(&self) -> axum::Router {
        self.router.clone()
    }

    /// `https://ADDR`
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Stops accepting, ends open connections and watches, and stops background loops.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        self.tasks.shutdown().await;
    }

    /// Waits until a background task ends (normally never).
    pub async fn wait(&mut self) {
        let _ = self.tasks.join_next().await;
    }
}

/// Runs the server until Ctrl-C / SIGTERM.
pub async fn run(opts: ServerOptions) -> Result<(), ServerError> {
    let mut server = Server::start(opts).await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| ServerError::io("SIGTERM handler", e))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = server.wait() => {}
    }
    server.shutdown().await;
    Ok(())
}
