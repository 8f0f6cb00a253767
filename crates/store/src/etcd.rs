//! The etcd v3 backend ([`EtcdStore`]), for servers that share one datastore.
//!
//! Every key is stored under `key_prefix` (stripped again on the way out), so several
//! installations can share one etcd. Conditional writes are single etcd transactions:
//! create compares `create_revision == 0`; update and delete compare `mod_revision` with the
//! expected revision (and `version > 0`, so that a missing key never matches), and their
//! failure branch reads the key to report `NotFound` or `Conflict` with its current state.
//! etcd's own revisions are used unchanged. Watches start at `after + 1` with `prev_kv`; the
//! watchers of one prefix share one etcd watch ([`fanout`]).
//!
//! etcd does not report its compacted revision directly; [`Store::compacted_revision`] finds it
//! by a binary search for the oldest readable revision, after checking the last one it found or
//! compacted at (two reads, where the search took ~25; the API server asks at every watch).
//!
//! `https://` endpoints are reached over TLS (rustls, ring) trusting only the CA given, with a
//! client certificate when the members ask for one (`--client-cert-auth`). The client holds
//! every endpoint and balances over the reachable ones: when a member goes away, its channel
//! drops out and later requests go to the others. A request in flight on the dying member fails
//! with a transport error, which is returned (the API answers 5xx), never taken as success; a
//! write so reported may or may not have been applied, as with any etcd client. The balancer
//! may still pick a member that is gone: a request whose connection is refused never reached
//! etcd and is sent again (up to [`UNREACHED_RETRIES`] times), a write too. A watch whose
//! member goes away is opened again from the last revision it yielded (up to
//! [`WATCH_RESUMES`] times in a row), so its reader sees no gap and no repeat.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, CompactionOptions, Compare, CompareOp, ConnectOptions, DeleteOptions, EventType,
    GetOptions, KvClient, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse, WatchOptions,
};
use futures::StreamExt;

use crate::{
    EventKind, KeyValue, ListOptions, ListResult, Revision, Store, StoreError, WatchEvent,
    WatchStream,
};

mod fanout;

pub use fanout::FanoutOptions;

/// The largest etcd answer read (a whole list of a big collection). etcd is trusted; the bound
/// only keeps a corrupt length from allocating without limit.
const MAX_RESPONSE_BYTES: usize = 1 << 30;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// etcd's messages for reads below the compacted revision and above the current one.
const ERR_COMPACTED: &str = "required revision has been compacted";
const ERR_FUTURE_REV: &str = "required revision is a future revision";

/// The etcd store. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    prefix: String,
    fanout: Arc<fanout::Fanout>,
    /// The compacted revision last found or compacted at (another server may have compacted
    /// further since: checked before use).
    compacted_hint: Arc<AtomicI64>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// How often a request that reached no member is sent again.
const UNREACHED_RETRIES: u32 = 10;

/// Whether `e` says the request never reached a member: its connection was refused or could
/// not be made (the client balances over every endpoint and may still pick a member that has
/// gone). Such a request was not applied, so sending it again (a write too) is safe.
fn never_reached(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("connect error"))
}

/// Runs `f` again (after 20 ms, 40 ms, …) while it fails with [`never_reached`]; any other
/// answer, error or not, is returned as it is.
async fn retry_unreached<T, Fut>(mut f: impl FnMut() -> Fut) -> Result<T, etcd_client::Error>
where
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let mut attempt = 0u32;
    loop {
        match f().await {
            Err(e) if attempt < UNREACHED_RETRIES && never_reached(&e) => {
                attempt += 1;
                tracing::debug!(attempt, "etcd request reached no member ({e}); again");
                tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
            }
            r => return r,
        }
    }
}

/// The KV calls used here, each sent again while it reaches no member ([`retry_unreached`]).
struct Kv(KvClient);

impl Kv {
    async fn get(
        &self,
        key: impl Into<Vec<u8>>,
        options: Option<GetOptions>,
    ) -> Result<etcd_client::GetResponse, etcd_client::Error> {
        let key = key.into();
        retry_unreached(|| {
            let (mut c, key, options) = (self.0.clone(), key.clone(), options.clone());
            async move { c.get(key, options).await }
        })
        .await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, etcd_client::Error> {
        retry_unreached(|| {
            let (mut c, txn) = (self.0.clone(), txn.clone());
            async move { c.txn(txn).await }
        })
        .await
    }

    async fn compact(
        &self,
        revision: i64,
        options: Option<CompactionOptions>,
    ) -> Result<etcd_client::CompactionResponse, etcd_client::Error> {
        retry_unreached(|| {
            let (mut c, options) = (self.0.clone(), options.clone());
            async move { c.compact(revision, options).await }
        })
        .await
    }
}

fn backend(e: etcd_client::Error) -> StoreError {
    StoreError::Backend(format!("etcd: {e}"))
}

fn is_compacted(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains(ERR_COMPACTED))
}

fn is_future_rev(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains(ERR_FUTURE_REV))
}

impl EtcdStore {
    /// Connects to the etcd cluster at `endpoints` (`http://host:port`) and checks that it
    /// answers. Keys are stored under `key_prefix` (may be empty).
    pub async fn connect(endpoints: &[String], key_prefix: &str) -> Result<EtcdStore, StoreError> {
        Self::connect_tls(endpoints, key_prefix, None).await
    }

    /// [`connect`](Self::connect) over TLS when `tls` is given (needed for `https://`).
    pub async fn connect_tls(
        endpoints: &[String],
        key_prefix: &str,
        tls: Option<crate::endpoint::EtcdTls>,
    ) -> Result<EtcdStore, StoreError> {
        if endpoints.is_empty() {
            return Err(StoreError::Backend("etcd: no endpoints given".into()));
        }
        let https = endpoints.iter().any(|e| e.starts_with("https://"));
        if https && tls.is_none() {
            return Err(StoreError::Backend(
                "etcd: https endpoints need a CA (--datastore-cafile)".into(),
            ));
        }
        let mut options = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_keep_alive(KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT);
        if let Some(t) = tls {
            let mut cfg = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(&t.ca_pem));
            if let Some((cert, key)) = &t.identity {
                cfg = cfg.identity(etcd_client::Identity::from_pem(cert, key));
            }
            options = options.with_tls(cfg);
        }
        let client = Client::connect(endpoints, Some(options))
            .await
            .map_err(backend)?;
        let store = EtcdStore {
            client,
            prefix: key_prefix.to_owned(),
            fanout: Arc::new(fanout::Fanout::new(FanoutOptions::default())),
            compacted_hint: Arc::new(AtomicI64::new(0)),
        };
        tokio::time::timeout(CONNECT_TIMEOUT, store.current_revision())
            .await
            .map_err(|_| {
                StoreError::Backend(format!("etcd: no answer from {endpoints:?} in time"))
            })??;
        Ok(store)
    }

    /// The watchers of one prefix share one etcd watch; `options` says how (call before the
    /// first watch; tests and benchmarks set a small ring to exercise a lagging watcher).
    pub fn with_fanout(mut self, options: FanoutOptions) -> Self {
        self.fanout = Arc::new(fanout::Fanout::new(options));
        self
    }

    /// etcd watches this store (and its clones) opened so far: one per shared prefix, plus one
    /// per watcher that its prefix's shared watch could not serve.
    pub fn watches_opened(&self) -> u64 {
        self.fanout.opened()
    }

    /// Shared etcd watches open now (one per watched prefix).
    pub fn shared_watches(&self) -> usize {
        self.fanout.hubs()
    }

    /// Refuses a watch from an `after` older than the compacted revision, as SQLite does (etcd
    /// would accept a start at the compacted revision itself, where it may have lost events).
    async fn check_watchable(&self, after: Revision) -> Result<(), StoreError> {
        let probe = if after == 0 { 1 } else { after };
        if !self.readable_at(probe).await? {
            return Err(StoreError::Compacted {
                requested: after,
                compacted: self.compacted_revision().await?,
            });
        }
        Ok(())
    }

    /// A watch of `prefix` after `after` of its own (not shared), checked as [`Store::watch`]
    /// checks it: for a watcher its prefix's shared watch cannot serve any more.
    async fn watch_own(&self, prefix: &str, after: Revision) -> Result<WatchStream, StoreError> {
        self.check_watchable(after).await?;
        self.open_watch(prefix, after).await
    }

    /// Opens an etcd watch of `prefix` from `after + 1` with previous values; it resumes on
    /// another member when its member goes away ([`WatchState`]).
    async fn open_watch(&self, prefix: &str, after: Revision) -> Result<WatchStream, StoreError> {
        let full_prefix = self.full_key(prefix);
        let end = crate::prefix_end(&full_prefix).unwrap_or_else(|| vec![0]);
        let options = WatchOptions::new()
            .with_range(end.clone())
            .with_start_revision(after + 1)
            .with_prev_key();
        let key = non_empty(full_prefix);
        let stream = self
            .client
            .watch_client()
            .watch(key.clone(), Some(options))
            .await
            .map_err(backend)?;
        self.fanout.count_opened();
        let state = WatchState {
            store: self.clone(),
            stream,
            key,
            end,
            last: after,
            queued: VecDeque::new(),
            done: false,
            resumes: 0,
        };
        Ok(futures::stream::unfold(state, |mut st| async move {
            let item = st.next().await?;
            Some((item, st))
        })
        .boxed())
    }

    /// The KV client, taking answers up to [`MAX_RESPONSE_BYTES`] (gRPC's default of 4 MiB
    /// refused a whole list of 10,000 VMIs), with [`Kv`]'s retries.
    fn kv(&self) -> Kv {
        Kv(self
            .client
            .kv_client()
            .max_decoding_message_size(MAX_RESPONSE_BYTES))
    }

    fn full_key(&self, key: &str) -> Vec<u8> {
        format!("{}{key}", self.prefix).into_bytes()
    }

    /// A key for requests that only want a response header or an error (never empty: etcd
    /// refuses empty keys).
    fn probe_key(&self) -> Vec<u8> {
        non_empty(self.full_key(""))
    }

    /// Converts an etcd key-value, stripping our prefix.
    fn convert(&self, kv: &etcd_client::KeyValue) -> Result<KeyValue, StoreError> {
        let key = std::str::from_utf8(kv.key())
            .ok()
            .and_then(|k| k.strip_prefix(self.prefix.as_str()))
            .ok_or_else(|| {
                StoreError::Backend("etcd: key outside our prefix or not UTF-8".into())
            })?;
        Ok(KeyValue {
            key: key.to_owned(),
            value: kv.value().to_vec(),
            create_revision: kv.create_revision(),
            mod_revision: kv.mod_revision(),
        })
    }

    /// The failure branch of a conditional write: the key's current state from the `Get`.
    fn failed_write(
        &self,
        key: &str,
        expected: Revision,
        resp: &TxnResponse,
    ) -> Result<StoreError, StoreError> {
        let current = resp.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().cloned(),
            _ => None,
        });
        Ok(match current {
            None => StoreError::NotFound(key.to_owned()),
            Some(kv) => StoreError::Conflict {
                key: key.to_owned(),
                expected,
                current: Some(Box::new(self.convert(&kv)?)),
            },
        })
    }

    /// Maps a read error, filling in the compacted revision for `Compacted`.
    async fn read_error(&self, requested: Revision, e: etcd_client::Error) -> StoreError {
        if is_compacted(&e) {
            match self.compacted_revision().await {
                Ok(compacted) => StoreError::Compacted {
                    requested,
                    compacted,
                },
                Err(e) => e,
            }
        } else if is_future_rev(&e) {
            StoreError::Backend(format!("etcd: revision {requested} is a future revision"))
        } else {
            backend(e)
        }
    }

    /// Whether `revision` is not compacted away (a future revision counts as readable).
    async fn readable_at(&self, revision: Revision) -> Result<bool, StoreError> {
        let opts = GetOptions::new().with_count_only().with_revision(revision);
        match self.kv().get(self.probe_key(), Some(opts)).await {
            Ok(_) => Ok(true),
            Err(e) if is_compacted(&e) => Ok(false),
            Err(e) if is_future_rev(&e) => Ok(true),
            Err(e) => Err(backend(e)),
        }
    }

    fn event(&self, ev: &etcd_client::Event) -> Result<WatchEvent, StoreError> {
        let kv = ev
            .kv()
            .ok_or_else(|| StoreError::Backend("etcd: watch event without a key".into()))?;
        let revision = kv.mod_revision();
        let prev = ev.prev_kv().map(|p| self.convert(p)).transpose()?;
        Ok(match ev.event_type() {
            EventType::Put => {
                let kv = self.convert(kv)?;
                if kv.create_revision == kv.mod_revision {
                    WatchEvent {
                        kind: EventKind::Created,
                        revision,
                        kv,
                        prev: None,
                    }
                } else {
                    WatchEvent {
                        kind: EventKind::Modified,
                        revision,
                        kv,
                        prev,
                    }
                }
            }
            EventType::Delete => {
                // etcd's tombstone carries only the key; the last state comes from prev_kv.
                let last = match &prev {
                    Some(p) => KeyValue {
                        mod_revision: revision,
                        ..p.clone()
                    },
                    None => KeyValue {
                        mod_revision: revision,
                        ..self.convert(kv)?
                    },
                };
                WatchEvent {
                    kind: EventKind::Deleted,
                    revision,
                    kv: last,
                    prev,
                }
            }
        })
    }
}

/// etcd refuses an empty key, also as the start of a range; `\0` is the smallest one it takes.
fn non_empty(key: Vec<u8>) -> Vec<u8> {
    if key.is_empty() { vec![0] } else { key }
}

fn header_revision(resp: &TxnResponse) -> Result<Revision, StoreError> {
    resp.header()
        .map(|h| h.revision())
        .ok_or_else(|| StoreError::Backend("etcd: response without a header".into()))
}

#[async_trait]
impl Store for EtcdStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let resp = self
            .kv()
            .get(self.full_key(key), None)
            .await
            .map_err(backend)?;
        resp.kvs().first().map(|kv| self.convert(kv)).transpose()
    }

    async fn list(&self, prefix: &str, opts: ListOptions) -> Result<ListResult, StoreError> {
        let full_prefix = self.full_key(prefix);
        let end = crate::prefix_end(&full_prefix).unwrap_or_else(|| vec![0]);
        let mut start = non_empty(full_prefix);
        if let Some(after) = &opts.start_after {
            let mut after = self.full_key(after);
            after.push(0); // the smallest key greater than `after`
            start = start.max(after);
        }
        let requested = opts.revision.filter(|r| *r > 0);
        let mut get = GetOptions::new()
            .with_range(end)
            .with_revision(requested.unwrap_or(0));
        if let Some(limit) = opts.limit.filter(|l| *l > 0) {
            get = get.with_limit(i64::try_from(limit).unwrap_or(i64::MAX));
        }
        let resp = match self.kv().get(start, Some(get)).await {
            Ok(resp) => resp,
            Err(e) => return Err(self.read_error(requested.unwrap_or(0), e).await),
        };
        let revision = match requested {
            Some(r) => r,
            None => resp
                .header()
                .map(|h| h.revision())
                .ok_or_else(|| StoreError::Backend("etcd: response without a header".into()))?,
        };
        let items = resp
            .kvs()
            .iter()
            .map(|kv| self.convert(kv))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ListResult {
            items,
            revision,
            more: resp.more(),
        })
    }

    async fn create(&self, key: &str, value: Vec<u8>) -> Result<KeyValue, StoreError> {
        let full = self.full_key(key);
        let txn = Txn::new()
            .when([Compare::create_revision(full.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(full, value.clone(), None)]);
        let resp = self.kv().txn(txn).await.map_err(backend)?;
        if !resp.succeeded() {
            return Err(StoreError::AlreadyExists(key.to_owned()));
        }
        let revision = header_revision(&resp)?;
        Ok(KeyValue {
            key: key.to_owned(),
            value,
            create_revision: revision,
            mod_revision: revision,
        })
    }

    async fn update(
        &self,
        key: &str,
        value: Vec<u8>,
        expected: Revision,
    ) -> Result<KeyValue, StoreError> {
        let full = self.full_key(key);
        let txn = Txn::new()
            .when([
                Compare::version(full.clone(), CompareOp::Greater, 0),
                Compare::mod_revision(full.clone(), CompareOp::Equal, expected),
            ])
            .and_then([TxnOp::put(
                full.clone(),
                value.clone(),
                Some(PutOptions::new().with_prev_key()),
            )])
            .or_else([TxnOp::get(full, None)]);
        let resp = self.kv().txn(txn).await.map_err(backend)?;
        if !resp.succeeded() {
            return Err(self.failed_write(key, expected, &resp)?);
        }
        let revision = header_revision(&resp)?;
        let create_revision = resp
            .op_responses()
            .into_iter()
            .find_map(|op| match op {
                TxnOpResponse::Put(put) => put.prev_key().map(|p| p.create_revision()),
                _ => None,
            })
            .ok_or_else(|| StoreError::Backend("etcd: put without its previous value".into()))?;
        Ok(KeyValue {
            key: key.to_owned(),
            value,
            create_revision,
            mod_revision: revision,
        })
    }

    async fn delete(&self, key: &str, expected: Option<Revision>) -> Result<KeyValue, StoreError> {
        let full = self.full_key(key);
        let mut compares = vec![Compare::version(full.clone(), CompareOp::Greater, 0)];
        if let Some(expected) = expected {
            compares.push(Compare::mod_revision(
                full.clone(),
                CompareOp::Equal,
                expected,
            ));
        }
        let txn = Txn::new()
            .when(compares)
            .and_then([TxnOp::delete(
                full.clone(),
                Some(DeleteOptions::new().with_prev_key()),
            )])
            .or_else([TxnOp::get(full, None)]);
        let resp = self.kv().txn(txn).await.map_err(backend)?;
        if !resp.succeeded() {
            return Err(self.failed_write(key, expected.unwrap_or(0), &resp)?);
        }
        let revision = header_revision(&resp)?;
        let prev = resp
            .op_responses()
            .into_iter()
            .find_map(|op| match op {
                TxnOpResponse::Delete(del) => del.prev_kvs().first().cloned(),
                _ => None,
            })
            .ok_or_else(|| StoreError::Backend("etcd: delete without its previous value".into()))?;
        Ok(KeyValue {
            mod_revision: revision,
            ..self.convert(&prev)?
        })
    }

    async fn watch(&self, prefix: &str, after: Revision) -> Result<WatchStream, StoreError> {
        let after = after.max(0);
        self.check_watchable(after).await?;
        fanout::watch(self, prefix, after).await
    }

    async fn compact(&self, revision: Revision) -> Result<(), StoreError> {
        let opts = CompactionOptions::new().with_physical();
        match self.kv().compact(revision, Some(opts)).await {
            Ok(_) => {
                self.compacted_hint.fetch_max(revision, Ordering::Relaxed);
                Ok(())
            }
            // Already compacted at or beyond `revision`: nothing to do.
            Err(e) if is_compacted(&e) => Ok(()),
            Err(e) if is_future_rev(&e) => Err(StoreError::Backend(format!(
                "etcd: cannot compact at future revision {revision}"
            ))),
            Err(e) => Err(backend(e)),
        }
    }

    async fn current_revision(&self) -> Result<Revision, StoreError> {
        let resp = self
            .kv()
            .get(self.probe_key(), Some(GetOptions::new().with_count_only()))
            .await
            .map_err(backend)?;
        resp.header()
            .map(|h| h.revision())
            .ok_or_else(|| StoreError::Backend("etcd: response without a header".into()))
    }

    async fn compacted_revision(&self) -> Result<Revision, StoreError> {
        let hint = self.compacted_hint.load(Ordering::Relaxed);
        let mut lo = 1;
        if hint > 1 && !self.readable_at(hint - 1).await? {
            if self.readable_at(hint).await? {
                return Ok(hint);
            }
            lo = hint;
        } else if self.readable_at(1).await? {
            return Ok(0);
        }
        // Invariant: `lo` is compacted, `hi` is readable (the current revision always is).
        let mut hi = self.current_revision().await?;
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.readable_at(mid).await? {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        self.compacted_hint.store(hi, Ordering::Relaxed);
        Ok(hi)
    }
}

/// The state of one etcd watch stream.
struct WatchState {
    store: EtcdStore,
    stream: etcd_client::WatchStream,
    /// The watched key and range end (to resume on another member).
    key: Vec<u8>,
    end: Vec<u8>,
    /// The revision of the last event yielded (or `after`).
    last: Revision,
    queued: VecDeque<WatchEvent>,
    done: bool,
    /// Consecutive resumes without a message in between.
    resumes: u32,
}

/// How often a broken watch is resumed (from the last revision yielded, so nothing is lost or
/// repeated) before its error is returned.
const WATCH_RESUMES: u32 = 5;

impl WatchState {
    async fn next(&mut self) -> Option<Result<WatchEvent, StoreError>> {
        loop {
            if self.done {
                return None;
            }
            if let Some(event) = self.queued.pop_front() {
                self.last = event.revision;
                return Some(Ok(event));
            }
            let resp = match self.stream.message().await {
                Ok(Some(resp)) => {
                    self.resumes = 0;
                    resp
                }
                // The member serving the watch went away (stream error or end): the client
                // holds every endpoint, so the watch is opened again after the last revision
                // yielded, on a member that answers.
                broken => {
                    let why = match broken {
                        Err(e) => e.to_string(),
                        _ => "stream ended".to_string(),
                    };
                    if self.resumes >= WATCH_RESUMES {
                        self.done = true;
                        return Some(Err(StoreError::Backend(format!("etcd watch: {why}"))));
                    }
                    self.resumes += 1;
                    tokio::time::sleep(Duration::from_millis(200 * u64::from(self.resumes))).await;
                    tracing::info!(after = self.last, "etcd watch broken ({why}); resuming");
                    let options = WatchOptions::new()
                        .with_range(self.end.clone())
                        .with_start_revision(self.last + 1)
                        .with_prev_key();
                    if let Ok(stream) = self
                        .store
                        .client
                        .watch_client()
                        .watch(self.key.clone(), Some(options))
                        .await
                    {
                        self.stream = stream;
                    }
                    continue;
                }
            };
            if resp.canceled() {
                self.done = true;
                return Some(Err(if resp.compact_revision() > 0 {
                    StoreError::Compacted {
                        requested: self.last,
                        compacted: resp.compact_revision(),
                    }
                } else {
                    StoreError::Backend(format!("etcd watch canceled: {}", resp.cancel_reason()))
                }));
            }
            for ev in resp.events() {
                match self.store.event(ev) {
                    Ok(event) => self.queued.push_back(event),
                    Err(e) => {
                        self.done = true;
                        return Some(Err(e));
                    }
                }
            }
        }
    }
}
