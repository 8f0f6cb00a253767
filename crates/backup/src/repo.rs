//! A repository on a target: open with the key check, write a backup (chunks deduplicated
//! against what the repository holds, per-disk stats, progress), commit it (indexes, manifest,
//! then the catalog entry last), list, read manifests, restore a disk, verify every chunk.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::BackupError;
use crate::crypto::{Keys, random_bytes, to_hex};
use crate::format::{
    self, CHUNK_SIZE, CatalogEntry, ChunkRef, DiskEntry, FORMAT, Index, KEY_CHECK_NAME,
    KEY_CHECK_PLAINTEXT, Manifest, RepoConfig, Stats, paths,
};
use crate::target::{Target, open_store};

/// Chunks hashed, sealed and uploaded (or fetched) at the same time.
const IN_FLIGHT: usize = 4;
/// Chunks fetched at the same time by a restore: a GET of a stored chunk is mostly waiting
/// on the target (bench/backup.sh restore).
const RESTORE_IN_FLIGHT: usize = 16;
/// zstd level of chunks: fast, most of the gain on disk images.
const ZSTD_LEVEL: i32 = 1;
/// The largest index, manifest or catalog entry read back.
const MAX_RECORD: usize = 256 << 20;

/// An open repository.
#[derive(Clone)]
pub struct Repository {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    keys: Arc<Keys>,
}

impl std::fmt::Debug for Repository {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Repository({}/{})", self.store, self.prefix)
    }
}

/// Whether [`Repository::open`] may create a repository where none is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Create {
    IfMissing,
    Never,
}

/// A chunk that failed verification, with a backup and disk that use it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VerifyProblem {
    /// The object's name below the prefix (`chunks/ab/ab…`, `backups/x/manifest`, …).
    pub object: String,
    pub backup: String,
    pub disk: Option<String>,
    pub reason: String,
}

/// What `verify` checked and found.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VerifyReport {
    pub backups: Vec<String>,
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    pub problems: Vec<VerifyProblem>,
}

fn join(prefix: &str, name: &str) -> Path {
    let p = prefix.trim_matches('/');
    if p.is_empty() {
        Path::from(name)
    } else {
        Path::from(format!("{p}/{name}"))
    }
}

fn missing_or(e: object_store::Error, name: &str) -> BackupError {
    match e {
        object_store::Error::NotFound { .. } => BackupError::Missing {
            object: name.to_string(),
        },
        e => BackupError::Store(e),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BackupError> + Send + 'static,
) -> Result<T, BackupError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| BackupError::Task(e.to_string()))?
}

/// Reads until `buf` is full or the reader ends; the number of bytes read.
async fn read_full<R: AsyncRead + Unpin>(r: &mut R, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let m = r.read(&mut buf[n..]).await?;
        if m == 0 {
            break;
        }
        n += m;
    }
    Ok(n)
}

impl Repository {
    /// Opens the repository at `target` with the Secret's key; a wrong key is
    /// [`BackupError::WrongKey`]. With [`Create::IfMissing`] an empty target is initialised.
    pub async fn open(target: &Target, key: &[u8], create: Create) -> Result<Self, BackupError> {
        let store = open_store(target)?;
        Self::open_store(store, target.prefix(), key, create).await
    }

    /// [`Repository::open`] over an existing object store.
    pub async fn open_store(
        store: Arc<dyn ObjectStore>,
        prefix: &str,
        key: &[u8],
        create: Create,
    ) -> Result<Self, BackupError> {
        crate::target::check_prefix(prefix)?;
        let cfg_path = join(prefix, paths::CONFIG);
        let cfg = match store.get(&cfg_path).await {
            Ok(got) => {
                let bytes = got.bytes().await?;
                let cfg: RepoConfig =
                    serde_json::from_slice(&bytes).map_err(|e| BackupError::Corrupt {
                        object: paths::CONFIG.into(),
                        reason: e.to_string(),
                    })?;
                if cfg.format != FORMAT || cfg.chunk_size != CHUNK_SIZE {
                    return Err(BackupError::UnsupportedFormat(cfg.format));
                }
                cfg
            }
            Err(object_store::Error::NotFound { .. }) if create == Create::IfMissing => {
                let salt = random_bytes(16)?;
                let keys = Keys::derive(key, &salt)?;
                let check = keys.seal(KEY_CHECK_NAME, KEY_CHECK_PLAINTEXT, 1)?;
                let cfg = RepoConfig {
                    format: FORMAT,
                    chunk_size: CHUNK_SIZE,
                    salt: to_hex(&salt),
                    key_check: to_hex(&check),
                };
                store
                    .put(
                        &cfg_path,
                        PutPayload::from(serde_json::to_vec_pretty(&cfg)?),
                    )
                    .await?;
                cfg
            }
            Err(object_store::Error::NotFound { .. }) => return Err(BackupError::NotInitialized),
            Err(e) => return Err(e.into()),
        };
        let unhex = |s: &str| -> Result<Vec<u8>, BackupError> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(s.get(i..i + 2).unwrap_or("zz"), 16))
                .collect::<Result<_, _>>()
                .map_err(|_| BackupError::Corrupt {
                    object: paths::CONFIG.into(),
                    reason: "bad hex".into(),
                })
        };
        let keys = Keys::derive(key, &unhex(&cfg.salt)?)?;
        match keys.open(KEY_CHECK_NAME, &unhex(&cfg.key_check)?, 1024) {
            Ok(p) if p == KEY_CHECK_PLAINTEXT => {}
            _ => return Err(BackupError::WrongKey),
        }
        Ok(Self {
            store,
            prefix: prefix.trim_matches('/').to_string(),
            keys: Arc::new(keys),
        })
    }

    fn path(&self, name: &str) -> Path {
        join(&self.prefix, name)
    }

    pub(crate) fn path_of(&self, name: &str) -> Path {
        self.path(name)
    }

    pub(crate) fn store_ref(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    pub(crate) fn prefix_str(&self) -> &str {
        &self.prefix
    }

    pub(crate) async fn read_record<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        name: &str,
    ) -> Result<T, BackupError> {
        self.get_record(name).await
    }

    async fn get_raw(&self, name: &str) -> Result<Bytes, BackupError> {
        let got = self
            .store
            .get(&self.path(name))
            .await
            .map_err(|e| missing_or(e, name))?;
        got.bytes().await.map_err(|e| missing_or(e, name))
    }

    async fn get_record<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        name: &str,
    ) -> Result<T, BackupError> {
        let sealed = self.get_raw(name).await?;
        let keys = self.keys.clone();
        let name = name.to_string();
        blocking(move || {
            let plain = keys.open(&name, &sealed, MAX_RECORD)?;
            serde_json::from_slice(&plain).map_err(|e| BackupError::Corrupt {
                object: name,
                reason: e.to_string(),
            })
        })
        .await
    }

    async fn put_record<T: Serialize>(&self, name: &str, value: &T) -> Result<(), BackupError> {
        let plain = serde_json::to_vec(value)?;
        let sealed = self.keys.seal(name, &plain, 3)?;
        self.store
            .put(&self.path(name), PutPayload::from(sealed))
            .await?;
        Ok(())
    }

    /// The completed backups, oldest first.
    pub async fn list(&self) -> Result<Vec<CatalogEntry>, BackupError> {
        let base = self.path(paths::CATALOG);
        let metas: Vec<_> = self.store.list(Some(&base)).try_collect().await?;
        let mut out = Vec::new();
        for m in metas {
            let Some(name) = m.location.filename() else {
                continue;
            };
            if format::check_backup_name(name).is_err() {
                continue;
            }
            out.push(self.get_record(&paths::catalog(name)).await?);
        }
        out.sort_by(|a: &CatalogEntry, b| (&a.created_at, &a.name).cmp(&(&b.created_at, &b.name)));
        Ok(out)
    }

    /// A completed backup's catalog entry.
    pub async fn entry(&self, backup: &str) -> Result<CatalogEntry, BackupError> {
        format::check_backup_name(backup)?;
        match self.get_record(&paths::catalog(backup)).await {
            Err(BackupError::Missing { .. }) => Err(BackupError::BackupNotFound(backup.into())),
            r => r,
        }
    }

    /// A completed backup's manifest (only backups in the catalog are read).
    pub async fn manifest(&self, backup: &str) -> Result<Manifest, BackupError> {
        self.entry(backup).await?;
        self.get_record(&paths::manifest(backup)).await
    }

    /// A disk's index in a completed backup, checked.
    pub async fn index(&self, backup: &str, disk: &str) -> Result<Index, BackupError> {
        format::check_disk_name(disk)?;
        let m = self.manifest(backup).await?;
        if !m.disks.iter().any(|d| d.name == disk) {
            return Err(BackupError::DiskNotFound {
                backup: backup.into(),
                disk: disk.into(),
            });
        }
        let name = paths::index(backup, disk);
        let ix: Index = self.get_record(&name).await?;
        format::check_index(&ix, &name)?;
        Ok(ix)
    }

    /// Starts writing backup `name`; refused when the catalog already lists it. Puts the
    /// writer's lock, then waits (up to 10 minutes) while a garbage collection runs.
    pub async fn begin(&self, name: &str) -> Result<BackupWriter, BackupError> {
        self.begin_waiting(name, std::time::Duration::from_secs(600))
            .await
    }

    /// [`Repository::begin`], waiting at most `gc_wait` for a running collection
    /// ([`BackupError::GcRunning`] after that).
    pub async fn begin_waiting(
        &self,
        name: &str,
        gc_wait: std::time::Duration,
    ) -> Result<BackupWriter, BackupError> {
        format::check_backup_name(name)?;
        match self.store.head(&self.path(&paths::catalog(name))).await {
            Ok(_) => return Err(BackupError::AlreadyExists(name.into())),
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        let started_at = std::time::SystemTime::now();
        let lock = crate::gc::writer_lock(name);
        self.put_lock(&lock).await?;
        if let Err(e) = self.wait_for_gc(gc_wait).await {
            self.drop_lock(&lock).await?;
            return Err(e);
        }
        Ok(BackupWriter {
            repo: self.clone(),
            name: name.to_string(),
            started: Instant::now(),
            started_at,
            lock_refreshed: Instant::now(),
            disks: Vec::new(),
            claimed: Arc::new(Mutex::new(HashSet::new())),
        })
    }

    /// Writes disk `disk` of `backup` into `out` (zeros written as zeros); `progress` gets the
    /// bytes written so far. A chunk that is missing or does not open fails the restore naming
    /// the chunk.
    pub async fn restore_disk<W: AsyncWrite + Unpin>(
        &self,
        backup: &str,
        disk: &str,
        out: &mut W,
        progress: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<u64, BackupError> {
        let ix = self.index(backup, disk).await?;
        let zeros = Bytes::from(vec![0u8; CHUNK_SIZE]);
        let mut chunks = futures::stream::iter(ix.chunks.into_iter().map(|c| {
            let repo = self.clone();
            let zeros = zeros.clone();
            async move {
                match c.id {
                    None => Ok(zeros.slice(..c.len as usize)),
                    Some(id) => {
                        let plain = repo.read_chunk(&id).await?;
                        if plain.len() != c.len as usize {
                            return Err(BackupError::Corrupt {
                                object: paths::chunk(&id),
                                reason: format!("{} bytes, the index says {}", plain.len(), c.len),
                            });
                        }
                        Ok(Bytes::from(plain))
                    }
                }
            }
        }))
        .buffered(RESTORE_IN_FLIGHT);
        let mut written = 0u64;
        while let Some(data) = chunks.next().await {
            let data = data?;
            out.write_all(&data).await?;
            written += data.len() as u64;
            progress(written);
        }
        out.flush().await?;
        Ok(written)
    }

    /// The first chunk of `ix` missing from the target (looked up by HEAD, a few at a time),
    /// or `None`: an incremental backup checks the chunks it will take over unread, so one
    /// deleted from the bucket is uploaded again by a full read instead of being referenced.
    pub async fn first_missing_chunk(&self, ix: &Index) -> Result<Option<String>, BackupError> {
        let ids: std::collections::BTreeSet<String> =
            ix.chunks.iter().filter_map(|c| c.id.clone()).collect();
        let mut found = futures::stream::iter(ids.into_iter().map(|id| {
            let repo = self.clone();
            async move { repo.has_chunk(&id).await.map(|ok| (!ok).then_some(id)) }
        }))
        .buffer_unordered(IN_FLIGHT * 4);
        while let Some(r) = found.next().await {
            if let Some(missing) = r? {
                return Ok(Some(missing));
            }
        }
        Ok(None)
    }

    /// Fetches, opens and re-hashes one chunk.
    pub async fn read_chunk(&self, id: &str) -> Result<Vec<u8>, BackupError> {
        let name = paths::chunk(id);
        let sealed = self.get_raw(&name).await?;
        let keys = self.keys.clone();
        let id = id.to_string();
        blocking(move || keys.open_chunk(&id, &name, &sealed)).await
    }

    /// Re-reads and re-hashes every chunk of `backup` (or of every backup in the catalog),
    /// and opens every manifest and index; each failure is named in the report.
    pub async fn verify(
        &self,
        backup: Option<&str>,
        progress: &(dyn Fn(u64, u64) + Send + Sync),
    ) -> Result<VerifyReport, BackupError> {
        let names: Vec<String> = match backup {
            Some(b) => vec![self.entry(b).await?.name],
            None => self.list().await?.into_iter().map(|e| e.name).collect(),
        };
        let mut report = VerifyReport {
            backups: names.clone(),
            ..Default::default()
        };
        // id → (backup, disk, plaintext length), first user wins
        let mut chunks: BTreeMap<String, (String, String, u32)> = BTreeMap::new();
        for b in &names {
            let m = match self.get_record::<Manifest>(&paths::manifest(b)).await {
                Ok(m) => m,
                Err(e) => {
                    report
                        .problems
                        .push(problem(&paths::manifest(b), b, None, e));
                    continue;
                }
            };
            for d in &m.disks {
                let name = paths::index(b, &d.name);
                let ix = match self.get_record::<Index>(&name).await {
                    Ok(ix) => format::check_index(&ix, &name).map(|_| ix),
                    Err(e) => Err(e),
                };
                match ix {
                    Ok(ix) => {
                        for c in ix.chunks {
                            if let Some(id) = c.id {
                                chunks
                                    .entry(id)
                                    .or_insert_with(|| (b.clone(), d.name.clone(), c.len));
                            }
                        }
                    }
                    Err(e) => report.problems.push(problem(&name, b, Some(&d.name), e)),
                }
            }
        }
        let total = chunks.len() as u64;
        let mut results = futures::stream::iter(chunks.into_iter().map(|(id, user)| {
            let repo = self.clone();
            async move {
                let r = repo.read_chunk(&id).await;
                (id, user, r)
            }
        }))
        .buffer_unordered(IN_FLIGHT);
        while let Some((id, (b, d, len), r)) = results.next().await {
            report.chunks_checked += 1;
            match r {
                Ok(plain) if plain.len() == len as usize => {
                    report.bytes_checked += plain.len() as u64
                }
                Ok(plain) => report.problems.push(VerifyProblem {
                    object: paths::chunk(&id),
                    backup: b,
                    disk: Some(d),
                    reason: format!("{} bytes, the index says {len}", plain.len()),
                }),
                Err(e) => report
                    .problems
                    .push(problem(&paths::chunk(&id), &b, Some(&d), e)),
            }
            progress(report.chunks_checked, total);
        }
        report.problems.sort_by(|a, b| a.object.cmp(&b.object));
        Ok(report)
    }

    /// Bytes stored under the prefix (every object), for the target's status.
    pub async fn stored_bytes(&self) -> Result<u64, BackupError> {
        let base = if self.prefix.is_empty() {
            None
        } else {
            Some(Path::from(self.prefix.as_str()))
        };
        let metas: Vec<_> = self.store.list(base.as_ref()).try_collect().await?;
        Ok(metas.iter().map(|m| m.size).sum())
    }

    /// The object store below this repository (tests and tools).
    pub fn store(&self) -> (&Arc<dyn ObjectStore>, &str) {
        (&self.store, &self.prefix)
    }
}

/// Whether `target` answers: the bytes stored below its prefix (every object, a listing; no
/// key needed), for the BackupTarget's status.
pub async fn probe(target: &Target) -> Result<u64, BackupError> {
    let store = open_store(target)?;
    let p = target.prefix().trim_matches('/');
    let base = (!p.is_empty()).then(|| Path::from(p));
    let metas: Vec<_> = store.list(base.as_ref()).try_collect().await?;
    Ok(metas.iter().map(|m| m.size).sum())
}

fn problem(object: &str, backup: &str, disk: Option<&str>, e: BackupError) -> VerifyProblem {
    let reason = match e {
        BackupError::Corrupt { reason, .. } => reason,
        BackupError::Missing { .. } => "missing".into(),
        e => e.to_string(),
    };
    VerifyProblem {
        object: object.to_string(),
        backup: backup.to_string(),
        disk: disk.map(str::to_string),
        reason,
    }
}

/// A backup being written: disks one after the other, then [`BackupWriter::commit`].
/// Dropped without a commit, it leaves chunks (reused by the next backup) and no catalog entry.
pub struct BackupWriter {
    repo: Repository,
    name: String,
    started: Instant,
    /// When the writer's lock was first put (compared with the collection's `gc/last`).
    started_at: std::time::SystemTime,
    lock_refreshed: Instant,
    disks: Vec<DiskEntry>,
    /// Chunk ids already written or found by this backup.
    claimed: Arc<Mutex<HashSet<String>>>,
}

impl std::fmt::Debug for BackupWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BackupWriter({})", self.name)
    }
}

/// What one chunk cost.
enum Outcome {
    Zero(u32),
    New {
        len: u32,
        sealed: u64,
        id: String,
    },
    Dedup {
        len: u32,
        id: String,
    },
    /// Unchanged since the previous backup: its index entry (`None`: zeros), not read.
    Reused {
        len: u32,
        id: Option<String>,
    },
}

/// Adds one chunk's outcome to a disk's stats and index. A reused chunk of zeros counts as
/// reused and as zeros (so `bytes_read + bytes_reused` is the disk's size and `bytes_zero`
/// every zero byte of it, as in a full write).
fn account(stats: &mut Stats, refs: &mut Vec<ChunkRef>, o: Outcome) {
    match o {
        Outcome::Zero(len) => {
            stats.bytes_zero += len as u64;
            refs.push(ChunkRef { id: None, len });
        }
        Outcome::New { len, sealed, id } => {
            stats.bytes_new += len as u64;
            stats.chunks_new += 1;
            stats.bytes_uploaded += sealed;
            refs.push(ChunkRef { id: Some(id), len });
        }
        Outcome::Dedup { len, id } => {
            stats.bytes_deduplicated += len as u64;
            stats.chunks_deduplicated += 1;
            refs.push(ChunkRef { id: Some(id), len });
        }
        Outcome::Reused { len, id } => {
            stats.bytes_reused += len as u64;
            stats.chunks_reused += 1;
            if id.is_none() {
                stats.bytes_zero += len as u64;
            }
            refs.push(ChunkRef { id, len });
        }
    }
}

impl BackupWriter {
    /// The backup's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads `reader` to its end as disk `disk`: 4 MiB chunks, zeros marked, chunks already in
    /// the repository not uploaded; `progress` gets the disk's stats after every chunk. The
    /// index is written when the disk is done.
    pub async fn write_disk<R: AsyncRead + Unpin>(
        &mut self,
        disk: &str,
        mut reader: R,
        progress: &(dyn Fn(&Stats) + Send + Sync),
    ) -> Result<DiskEntry, BackupError> {
        format::check_disk_name(disk)?;
        if self.disks.iter().any(|d| d.name == disk) {
            return Err(BackupError::InvalidName {
                what: "duplicate disk",
                name: disk.into(),
            });
        }
        let mut stats = Stats::default();
        let mut refs: Vec<ChunkRef> = Vec::new();
        let mut pending = futures::stream::FuturesOrdered::new();
        let mut eof = false;
        loop {
            while !eof && pending.len() < IN_FLIGHT {
                let mut buf = vec![0u8; CHUNK_SIZE];
                let n = read_full(&mut reader, &mut buf).await?;
                if n == 0 {
                    eof = true;
                    break;
                }
                if n < CHUNK_SIZE {
                    eof = true;
                }
                buf.truncate(n);
                stats.bytes_read += n as u64;
                pending.push_back(self.store_chunk(buf));
            }
            match pending.next().await {
                None => break,
                Some(r) => {
                    account(&mut stats, &mut refs, r?);
                    progress(&stats);
                    if self.lock_refreshed.elapsed() >= crate::gc::HEARTBEAT {
                        self.repo
                            .put_lock(&crate::gc::writer_lock(&self.name))
                            .await?;
                        self.lock_refreshed = Instant::now();
                    }
                }
            }
        }
        self.finish_disk(disk, refs, stats).await
    }

    /// Writes disk `disk` incrementally: the chunks `changed` (indices, ascending) are read in
    /// order from `reader` (it holds exactly those chunks' bytes, nothing else), every other
    /// chunk is taken from `base` (the previous backup's index of this disk, of the same
    /// `size`) unread. A full index is written as by [`BackupWriter::write_disk`]; the reused
    /// chunks count as used by this backup (checked at commit after a concurrent collection).
    pub async fn write_disk_changed<R: AsyncRead + Unpin>(
        &mut self,
        disk: &str,
        base: &Index,
        size: u64,
        changed: &[u64],
        mut reader: R,
        progress: &(dyn Fn(&Stats) + Send + Sync),
    ) -> Result<DiskEntry, BackupError> {
        use futures::future::Either;
        format::check_disk_name(disk)?;
        if self.disks.iter().any(|d| d.name == disk) {
            return Err(BackupError::InvalidName {
                what: "duplicate disk",
                name: disk.into(),
            });
        }
        let slots = crate::incremental::plan_chunks(base, size, changed).map_err(|reason| {
            BackupError::Corrupt {
                object: format!("previous index of {disk}"),
                reason,
            }
        })?;
        let mut stats = Stats::default();
        let mut refs: Vec<ChunkRef> = Vec::new();
        let mut pending = futures::stream::FuturesOrdered::new();
        let mut slots = slots.into_iter();
        loop {
            while pending.len() < IN_FLIGHT {
                let Some(slot) = slots.next() else { break };
                match slot {
                    crate::incremental::Slot::Read { len } => {
                        let mut buf = vec![0u8; len as usize];
                        let n = read_full(&mut reader, &mut buf).await?;
                        if n != len as usize {
                            return Err(BackupError::Io(std::io::Error::new(
                                std::io::ErrorKind::UnexpectedEof,
                                format!("the changed chunks of {disk} ended early"),
                            )));
                        }
                        stats.bytes_read += n as u64;
                        pending.push_back(Either::Left(self.store_chunk(buf)));
                    }
                    crate::incremental::Slot::Reuse(c) => {
                        if let Some(id) = &c.id {
                            #[allow(clippy::unwrap_used)]
                            self.claimed.lock().unwrap().insert(id.clone());
                        }
                        let outcome = Outcome::Reused {
                            len: c.len,
                            id: c.id,
                        };
                        pending.push_back(Either::Right(futures::future::ready(Ok(outcome))));
                    }
                }
            }
            match pending.next().await {
                None => break,
                Some(r) => {
                    let r: Result<Outcome, BackupError> = r;
                    account(&mut stats, &mut refs, r?);
                    progress(&stats);
                    if self.lock_refreshed.elapsed() >= crate::gc::HEARTBEAT {
                        self.repo
                            .put_lock(&crate::gc::writer_lock(&self.name))
                            .await?;
                        self.lock_refreshed = Instant::now();
                    }
                }
            }
        }
        // Whatever the reader still holds is not part of the disk: a stream that lies.
        let mut extra = [0u8; 1];
        if reader.read(&mut extra).await? != 0 {
            return Err(BackupError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the changed chunks of {disk} hold more bytes than they name"),
            )));
        }
        self.finish_disk(disk, refs, stats).await
    }

    async fn finish_disk(
        &mut self,
        disk: &str,
        refs: Vec<ChunkRef>,
        stats: Stats,
    ) -> Result<DiskEntry, BackupError> {
        let size = refs.iter().map(|c| c.len as u64).sum();
        let ix = Index {
            disk: disk.to_string(),
            size,
            chunk_size: CHUNK_SIZE,
            chunks: refs,
        };
        let name = paths::index(&self.name, disk);
        self.repo.put_record(&name, &ix).await?;
        let entry = DiskEntry {
            name: disk.to_string(),
            size,
            stats,
        };
        self.disks.push(entry.clone());
        Ok(entry)
    }

    fn store_chunk(
        &self,
        buf: Vec<u8>,
    ) -> impl std::future::Future<Output = Result<Outcome, BackupError>> + use<> {
        let repo = self.repo.clone();
        let claimed = self.claimed.clone();
        async move {
            let len = buf.len() as u32;
            let keys = repo.keys.clone();
            let (buf, id) = blocking(move || {
                if format::is_zero(&buf) {
                    return Ok((buf, None));
                }
                let id = keys.chunk_id(&buf);
                Ok((buf, Some(id)))
            })
            .await?;
            let Some(id) = id else {
                return Ok(Outcome::Zero(len));
            };
            // claimed within this backup (written or being written by another future)
            #[allow(clippy::unwrap_used)]
            if !claimed.lock().unwrap().insert(id.clone()) {
                return Ok(Outcome::Dedup { len, id });
            }
            let name = paths::chunk(&id);
            let path = repo.path(&name);
            match repo.store.head(&path).await {
                Ok(_) => return Ok(Outcome::Dedup { len, id }),
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            let keys = repo.keys.clone();
            let sealed = blocking(move || keys.seal(&name, &buf, ZSTD_LEVEL)).await?;
            let n = sealed.len() as u64;
            repo.store.put(&path, PutPayload::from(sealed)).await?;
            Ok(Outcome::New { len, sealed: n, id })
        }
    }

    /// The disks written so far.
    pub fn disks(&self) -> &[DiskEntry] {
        &self.disks
    }

    /// Writes the manifest (`vms`, `objects`, the disks and their stats), then the catalog
    /// entry, last: from then on the backup is listed. If a garbage collection deleted chunks
    /// since this writer began, every chunk it uses is checked first
    /// ([`BackupError::ChunkCollected`] names a missing one; nothing is listed then).
    pub async fn commit(
        self,
        created_at: &str,
        vms: Vec<serde_json::Value>,
        objects: Vec<serde_json::Value>,
    ) -> Result<CatalogEntry, BackupError> {
        let mut stats = Stats::default();
        for d in &self.disks {
            stats.add(&d.stats);
        }
        if let Some(gc) = self.repo.modified_at(crate::gc::GC_LAST).await?
            && gc >= self.started_at
        {
            #[allow(clippy::unwrap_used)]
            let ids: Vec<String> = self.claimed.lock().unwrap().iter().cloned().collect();
            for id in ids {
                if !self.repo.has_chunk(&id).await? {
                    return Err(BackupError::ChunkCollected { id });
                }
            }
        }
        let manifest = Manifest {
            name: self.name.clone(),
            created_at: created_at.to_string(),
            vms,
            objects,
            disks: self.disks.clone(),
            stats,
            duration_seconds: self.started.elapsed().as_secs_f64(),
        };
        self.repo
            .put_record(&paths::manifest(&self.name), &manifest)
            .await?;
        let entry = CatalogEntry::of(&manifest);
        self.repo
            .put_record(&paths::catalog(&self.name), &entry)
            .await?;
        self.repo
            .drop_lock(&crate::gc::writer_lock(&self.name))
            .await?;
        Ok(entry)
    }
}

#[cfg(test)]
#[path = "repo_tests.rs"]
mod tests;
