//! Async QMP client over QEMU's unix socket.
//!
//! One background task reads the socket: replies are routed to the waiting caller by the `id` each
//! command carries, events are broadcast to every [`QmpClient::subscribe`]r. Commands take and
//! return raw `serde_json::Value`s ([`QmpClient::execute`]); typed helpers sit on top.
//!
//! Out-of-band execution (QMP's `oob` capability, negotiated when QEMU offers it):
//! [`QmpClient::execute_oob`] runs the few commands QEMU allows out of band (`migrate-recover`,
//! `migrate-pause`) in the monitor's own thread, even while QEMU's main loop is blocked — on
//! the target of a broken post-copy migration it can wait on a guest page that only the
//! recovery brings. QEMU then stops reading the monitor once 8 in-band commands wait
//! unanswered, which would keep the out-of-band one out too, so this client never lets more
//! than [`MAX_UNANSWERED`] in-band commands wait (counting those whose caller gave up).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{broadcast, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout};

use crate::error::{Error, Result};

/// How to connect and how long to wait.
#[derive(Debug, Clone)]
pub struct QmpOptions {
    /// Total time to keep retrying the connection (QEMU creates the socket shortly after start).
    pub connect_timeout: Duration,
    /// Pause between connection attempts.
    pub retry_interval: Duration,
    /// Deadline for the greeting and for each command's reply.
    pub command_timeout: Duration,
    /// Events buffered per subscriber before the slowest one starts losing them.
    pub event_capacity: usize,
}

impl Default for QmpOptions {
    fn default() -> Self {
        QmpOptions {
            connect_timeout: Duration::from_secs(10),
            retry_interval: Duration::from_millis(50),
            command_timeout: Duration::from_secs(30),
            event_capacity: 256,
        }
    }
}

/// An asynchronous QMP event, e.g. `SHUTDOWN` or `STOP`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QmpEvent {
    /// Event name as QEMU sends it (`"SHUTDOWN"`).
    pub event: String,
    #[serde(default)]
    pub data: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<Timestamp>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timestamp {
    pub seconds: i64,
    pub microseconds: i64,
}

/// The events the lifecycle code reacts to; anything else is `Other`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    Shutdown,
    Powerdown,
    Reset,
    Stop,
    Resume,
    Suspend,
    Wakeup,
    GuestPanicked,
    Other(String),
}

impl QmpEvent {
    pub fn kind(&self) -> EventKind {
        match self.event.as_str() {
            "SHUTDOWN" => EventKind::Shutdown,
            "POWERDOWN" => EventKind::Powerdown,
            "RESET" => EventKind::Reset,
            "STOP" => EventKind::Stop,
            "RESUME" => EventKind::Resume,
            "SUSPEND" => EventKind::Suspend,
            "WAKEUP" => EventKind::Wakeup,
            "GUEST_PANICKED" => EventKind::GuestPanicked,
            other => EventKind::Other(other.to_string()),
        }
    }

    /// `data.reason` of SHUTDOWN and RESET events (`"guest-shutdown"`, `"host-qmp-quit"`, …).
    pub fn reason(&self) -> Option<&str> {
        self.data.get("reason").and_then(Value::as_str)
    }

    /// `data.guest` of SHUTDOWN and RESET events: true when the guest initiated it.
    pub fn guest_initiated(&self) -> Option<bool> {
        self.data.get("guest").and_then(Value::as_bool)
    }
}

/// QEMU's run states (`query-status`); unknown future states decode as `Unknown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunState {
    Debug,
    Inmigrate,
    InternalError,
    IoError,
    Paused,
    Postmigrate,
    Prelaunch,
    FinishMigrate,
    RestoreVm,
    Running,
    SaveVm,
    Shutdown,
    Suspended,
    Watchdog,
    GuestPanicked,
    Colo,
    #[serde(other)]
    Unknown,
}

/// Reply of `query-status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusInfo {
    pub running: bool,
    pub status: RunState,
}

type Reply = std::result::Result<Value, (String, String)>;

/// The most in-band commands left waiting for QEMU's reply (QEMU suspends the monitor at 8,
/// out-of-band commands included) when out-of-band execution is on.
pub const MAX_UNANSWERED: usize = 4;

struct Shared {
    /// In-band commands sent and not answered yet, callers that timed out included.
    unanswered: Mutex<HashSet<u64>>,
    /// Signalled when a reply arrives (a slot among the unanswered may be free).
    answered: tokio::sync::Notify,
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    /// `None` once the connection is gone.
    pending: Mutex<Option<HashMap<u64, oneshot::Sender<Reply>>>>,
    /// `None` once the connection is gone, which closes every subscriber's channel.
    events: Mutex<Option<broadcast::Sender<QmpEvent>>>,
    next_id: AtomicU64,
}

/// A connected QMP session (capabilities negotiated).
pub struct QmpClient {
    shared: Arc<Shared>,
    reader: JoinHandle<()>,
    greeting: Value,
    command_timeout: Duration,
    path: PathBuf,
    /// Out-of-band execution negotiated.
    oob: bool,
}

impl std::fmt::Debug for QmpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QmpClient")
            .field("path", &self.path)
            .field("connected", &self.is_connected())
            .finish()
    }
}

impl Drop for QmpClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Writes `line` on the QMP socket with `fd` attached to its first byte (SCM_RIGHTS).
async fn send_with_fd(
    w: &tokio::net::unix::OwnedWriteHalf,
    line: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> std::io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    let stream: &UnixStream = w.as_ref();
    let fds = [fd];
    let mut sent = 0;
    while sent < line.len() {
        stream.writable().await?;
        let r = stream.try_io(tokio::io::Interest::WRITABLE, || {
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if sent == 0 {
                control.push(SendAncillaryMessage::ScmRights(&fds));
            }
            sendmsg(
                stream,
                &[std::io::IoSlice::new(&line[sent..])],
                &mut control,
                SendFlags::empty(),
            )
            .map_err(std::io::Error::from)
        });
        match r {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Connects to a unix socket, retrying while it does not exist or refuses, until `deadline`.
pub(crate) async fn connect_unix_retry(
    path: &Path,
    total: Duration,
    retry_interval: Duration,
) -> Result<UnixStream> {
    let deadline = Instant::now() + total;
    loop {
        match UnixStream::connect(path).await {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                return Err(Error::io(
                    format!("connecting to {} (gave up after {total:?})", path.display()),
                    e,
                ));
            }
            Err(_) => sleep(retry_interval).await,
        }
    }
}

impl QmpClient {
    /// Connects (retrying until `connect_timeout`), reads the greeting and negotiates capabilities.
    pub async fn connect(path: impl AsRef<Path>, opts: &QmpOptions) -> Result<QmpClient> {
        let path = path.as_ref();
        let stream = connect_unix_retry(path, opts.connect_timeout, opts.retry_interval).await?;
        Self::handshake(stream, path.to_path_buf(), opts).await
    }

    /// Runs the QMP handshake on an already connected stream.
    pub async fn handshake(
        stream: UnixStream,
        path: PathBuf,
        opts: &QmpOptions,
    ) -> Result<QmpClient> {
        let (read, write) = stream.into_split();
        let mut lines = BufReader::new(read);
        let mut first = String::new();
        let n = timeout(opts.command_timeout, lines.read_line(&mut first))
            .await
            .map_err(|_| Error::timeout("the QMP greeting", opts.command_timeout))?
            .map_err(|e| Error::io("reading the QMP greeting", e))?;
        if n == 0 {
            return Err(Error::Disconnected);
        }
        let greeting: Value = serde_json::from_str(first.trim())?;
        let Some(greeting) = greeting.get("QMP").cloned() else {
            return Err(Error::Protocol(format!(
                "expected a QMP greeting, got {}",
                first.trim()
            )));
        };
        let (events, _) = broadcast::channel(opts.event_capacity.max(1));
        let shared = Arc::new(Shared {
            unanswered: Mutex::new(HashSet::new()),
            answered: tokio::sync::Notify::new(),
            writer: tokio::sync::Mutex::new(write),
            pending: Mutex::new(Some(HashMap::new())),
            events: Mutex::new(Some(events)),
            next_id: AtomicU64::new(1),
        });
        let reader = tokio::spawn(read_loop(lines, shared.clone()));
        let oob = offers_oob(&greeting);
        let mut client = QmpClient {
            shared,
            reader,
            greeting,
            command_timeout: opts.command_timeout,
            path,
            oob: false,
        };
        let caps = oob.then(|| json!({"enable": ["oob"]}));
        client.execute("qmp_capabilities", caps).await?;
        client.oob = oob;
        Ok(client)
    }

    /// Whether out-of-band execution was negotiated.
    pub fn oob(&self) -> bool {
        self.oob
    }

    /// Executes `command` out of band (`exec-oob`): QEMU runs it in the monitor's thread at
    /// once, whatever its main loop does. Only commands QEMU marks `allow-oob` qualify.
    pub async fn execute_oob(
        &self,
        command: &str,
        arguments: Option<Value>,
        deadline: Duration,
    ) -> Result<Value> {
        if !self.oob {
            return Err(Error::Protocol(format!(
                "QEMU's monitor offers no out-of-band execution for {command}"
            )));
        }
        self.send_as("exec-oob", command, arguments, deadline, None)
            .await
    }

    /// The `QMP` object of the greeting (`version`, `capabilities`).
    pub fn greeting(&self) -> &Value {
        &self.greeting
    }

    /// QEMU's version from the greeting as (major, minor, micro).
    pub fn qemu_version(&self) -> Option<(u64, u64, u64)> {
        let q = self.greeting.get("version")?.get("qemu")?;
        Some((
            q.get("major")?.as_u64()?,
            q.get("minor")?.as_u64()?,
            q.get("micro")?.as_u64()?,
        ))
    }

    /// False once the socket has closed (QEMU exited or dropped us).
    pub fn is_connected(&self) -> bool {
        lock(&self.shared.pending).is_some()
    }

    /// A new receiver of every event from now on. Closed when the connection closes.
    pub fn subscribe(&self) -> broadcast::Receiver<QmpEvent> {
        match &*lock(&self.shared.events) {
            Some(tx) => tx.subscribe(),
            None => broadcast::channel(1).1,
        }
    }

    /// Executes a command and returns its `return` value, raw.
    pub async fn execute(&self, command: &str, arguments: Option<Value>) -> Result<Value> {
        self.execute_with_timeout(command, arguments, self.command_timeout)
            .await
    }

    /// [`execute`](Self::execute) with an explicit reply deadline.
    pub async fn execute_with_timeout(
        &self,
        command: &str,
        arguments: Option<Value>,
        deadline: Duration,
    ) -> Result<Value> {
        self.send(command, arguments, deadline, None).await
    }

    /// Executes a command with a file descriptor attached (SCM_RIGHTS), as `getfd` and
    /// `add-fd` want: QEMU keeps its own copy of `fd`.
    pub async fn execute_with_fd(
        &self,
        command: &str,
        arguments: Option<Value>,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<Value> {
        self.send(command, arguments, self.command_timeout, Some(fd))
            .await
    }

    async fn send(
        &self,
        command: &str,
        arguments: Option<Value>,
        deadline: Duration,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<Value> {
        self.send_as("execute", command, arguments, deadline, fd)
            .await
    }

    /// Sends `command` under `verb` (`execute`, `exec-oob`) and waits for its reply.
    async fn send_as(
        &self,
        verb: &str,
        command: &str,
        arguments: Option<Value>,
        deadline: Duration,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<Value> {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        if verb == "execute" && self.oob {
            // A slot among the in-band commands QEMU may hold: waited for (replies free
            // them) within the command's deadline.
            loop {
                let freed = self.shared.answered.notified();
                {
                    let mut waiting = lock(&self.shared.unanswered);
                    if may_queue(waiting.len()) {
                        waiting.insert(id);
                        break;
                    }
                }
                let left = deadline.saturating_sub(started.elapsed());
                if timeout(left, freed).await.is_err() {
                    return Err(Error::Protocol(format!(
                        "QEMU's monitor has {MAX_UNANSWERED} commands unanswered (its main \
                         loop is blocked): {command} is not queued, so that out-of-band \
                         commands still get through"
                    )));
                }
            }
        }
        let deadline = deadline.saturating_sub(started.elapsed());
        let (tx, rx) = oneshot::channel();
        match &mut *lock(&self.shared.pending) {
            Some(map) => {
                map.insert(id, tx);
            }
            None => return Err(Error::Disconnected),
        }
        let mut msg = json!({ verb: command });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        msg["id"] = json!(id);
        let mut line = serde_json::to_vec(&msg)?;
        line.push(b'\n');
        let written = {
            let mut w = self.shared.writer.lock().await;
            match fd {
                None => w.write_all(&line).await,
                Some(fd) => send_with_fd(&w, &line, fd).await,
            }
        };
        if let Err(e) = written {
            self.forget(id);
            return Err(Error::io(format!("sending QMP command {command}"), e));
        }
        match timeout(deadline, rx).await {
            Err(_) => {
                self.forget(id);
                Err(Error::timeout(
                    format!("the reply to QMP command {command}"),
                    deadline,
                ))
            }
            Ok(Err(_)) => Err(Error::Disconnected),
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err((class, desc)))) => Err(Error::Command {
                command: command.to_string(),
                class,
                desc,
            }),
        }
    }

    /// Executes a command and decodes its `return` value into `T`.
    pub async fn execute_as<T: DeserializeOwned>(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<T> {
        let v = self.execute(command, arguments).await?;
        Ok(serde_json::from_value(v)?)
    }

    fn forget(&self, id: u64) {
        if let Some(map) = &mut *lock(&self.shared.pending) {
            map.remove(&id);
        }
    }

    /// `query-status`.
    pub async fn query_status(&self) -> Result<StatusInfo> {
        self.execute_as("query-status", None).await
    }

    /// `system_powerdown`: presses the ACPI power button.
    pub async fn system_powerdown(&self) -> Result<()> {
        self.execute("system_powerdown", None).await.map(drop)
    }

    /// `stop`: pauses the vCPUs.
    pub async fn stop(&self) -> Result<()> {
        self.execute("stop", None).await.map(drop)
    }

    /// `cont`: resumes the vCPUs.
    pub async fn cont(&self) -> Result<()> {
        self.execute("cont", None).await.map(drop)
    }

    /// `system_reset`: hard reset, like the reset button.
    pub async fn system_reset(&self) -> Result<()> {
        self.execute("system_reset", None).await.map(drop)
    }

    /// `quit`: QEMU exits at once. A connection closed before the reply counts as success.
    pub async fn quit(&self) -> Result<()> {
        match self.execute("quit", None).await {
            Ok(_) => Ok(()),
            Err(e) if e.is_disconnect() => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// Whether QEMU's greeting offers out-of-band execution.
fn offers_oob(greeting: &Value) -> bool {
    greeting["capabilities"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c == "oob"))
}

/// Whether another in-band command may be sent with `waiting` unanswered ones.
fn may_queue(waiting: usize) -> bool {
    waiting < MAX_UNANSWERED
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn read_loop(mut lines: BufReader<OwnedReadHalf>, shared: Arc<Shared>) {
    let mut line = String::new();
    loop {
        line.clear();
        match lines.read_line(&mut line).await {
            Ok(0) => break,
            Ok(_) => dispatch(line.trim(), &shared),
            Err(e) => {
                tracing::debug!("QMP read failed: {e}");
                break;
            }
        }
    }
    // Connection gone: fail waiting callers, close subscribers.
    lock(&shared.pending).take();
    lock(&shared.events).take();
}

fn dispatch(line: &str, shared: &Shared) {
    if line.is_empty() {
        return;
    }
    let msg: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!("QMP: undecodable line {line:?}: {e}");
            return;
        }
    };
    if msg.get("event").is_some() {
        match serde_json::from_value::<QmpEvent>(msg) {
            Ok(ev) => {
                if let Some(tx) = &*lock(&shared.events) {
                    // No subscribers is fine: nobody wanted it.
                    let _ = tx.send(ev);
                }
            }
            Err(e) => tracing::warn!("QMP: malformed event {line:?}: {e}"),
        }
        return;
    }
    let reply: Reply = if let Some(v) = msg.get("return") {
        Ok(v.clone())
    } else if let Some(err) = msg.get("error") {
        let text = |k: &str| {
            err.get(k)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        Err((text("class"), text("desc")))
    } else {
        tracing::warn!("QMP: unexpected message {line:?}");
        return;
    };
    let Some(id) = msg.get("id").and_then(Value::as_u64) else {
        tracing::warn!("QMP: reply without our id: {line:?}");
        return;
    };
    if lock(&shared.unanswered).remove(&id) {
        shared.answered.notify_waiters();
    }
    let waiter = lock(&shared.pending)
        .as_mut()
        .and_then(|map| map.remove(&id));
    if let Some(tx) = waiter {
        let _ = tx.send(reply);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A scripted QMP server: sends the greeting, answers capabilities, then hands each further
    /// command to `respond`, which returns the lines to write back.
    fn fake_qemu<F>(dir: &Path, respond: F) -> PathBuf
    where
        F: Fn(&Value) -> Vec<Value> + Send + 'static,
    {
        let path = dir.join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let (r, mut w) = stream.into_split();
            let mut r = BufReader::new(r);
            let greeting = json!({"QMP": {"version": {"qemu": {"major": 7, "minor": 2, "micro": 22},
                "package": ""}, "capabilities": ["oob"]}});
            w.write_all(format!("{greeting}\n").as_bytes())
                .await
                .unwrap();
            let mut line = String::new();
            loop {
                line.clear();
                if r.read_line(&mut line).await.unwrap_or(0) == 0 {
                    return;
                }
                let cmd: Value = serde_json::from_str(&line).unwrap();
                let out = if cmd["execute"] == "qmp_capabilities" {
                    vec![json!({"return": {}, "id": cmd["id"]})]
                } else {
                    respond(&cmd)
                };
                if out.is_empty() && cmd["execute"] == "quit" {
                    return; // close without replying
                }
                for v in out {
                    w.write_all(format!("{v}\n").as_bytes()).await.unwrap();
                }
            }
        });
        path
    }

    fn opts() -> QmpOptions {
        QmpOptions {
            connect_timeout: Duration::from_secs(2),
            command_timeout: Duration::from_secs(2),
            ..QmpOptions::default()
        }
    }

    #[tokio::test]
    async fn out_of_band_commands_pass_a_blocked_main_loop() {
        let dir = tempfile::tempdir().unwrap();
        // A QEMU whose main loop is blocked: in-band commands are never answered, the
        // out-of-band migrate-recover is.
        let path = fake_qemu(dir.path(), |cmd| {
            if cmd["exec-oob"] == "migrate-recover" {
                assert_eq!(cmd["arguments"]["uri"], "unix:/x");
                vec![json!({"return": {}, "id": cmd["id"]})]
            } else {
                vec![]
            }
        });
        let qmp = QmpClient::connect(&path, &opts()).await.unwrap();
        assert!(qmp.oob(), "negotiated: the greeting offers it");
        let short = Duration::from_millis(50);
        for _ in 0..MAX_UNANSWERED {
            let e = qmp
                .execute_with_timeout("query-migrate", None, short)
                .await
                .unwrap_err();
            assert!(e.to_string().contains("query-migrate"), "{e}");
        }
        // The next in-band command is not even sent (it waits for a slot, in vain): QEMU
        // would stop reading at 8.
        let e = qmp
            .execute_with_timeout("query-migrate", None, short)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("4 commands unanswered"), "{e}");
        qmp.execute_oob(
            "migrate-recover",
            Some(json!({"uri": "unix:/x"})),
            Duration::from_secs(2),
        )
        .await
        .unwrap();
        assert!(!may_queue(MAX_UNANSWERED) && may_queue(MAX_UNANSWERED - 1));
        assert!(!offers_oob(&json!({"capabilities": []})));
    }

    #[tokio::test]
    async fn handshake_execute_and_typed_status() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_qemu(dir.path(), |cmd| match cmd["execute"].as_str().unwrap() {
            "query-status" => vec![json!({"return": {"status": "running", "singlestep": false,
                                                       "running": true}, "id": cmd["id"]})],
            "query-name" => vec![json!({"return": {"name": "vm1"}, "id": cmd["id"]})],
            _ => vec![
                json!({"error": {"class": "CommandNotFound", "desc": "nope"},
                             "id": cmd["id"]}),
            ],
        });
        let qmp = QmpClient::connect(&path, &opts()).await.unwrap();
        assert_eq!(qmp.qemu_version(), Some((7, 2, 22)));
        let st = qmp.query_status().await.unwrap();
        assert_eq!(
            st,
            StatusInfo {
                running: true,
                status: RunState::Running
            }
        );
        let raw = qmp.execute("query-name", None).await.unwrap();
        assert_eq!(raw, json!({"name": "vm1"}));
        let err = qmp.execute("bogus", Some(json!({"a": 1}))).await;
        match err {
            Err(Error::Command {
                command,
                class,
                desc,
            }) => {
                assert_eq!(command, "bogus");
                assert_eq!(class, "CommandNotFound");
                assert_eq!(desc, "nope");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn connect_retries_until_the_socket_appears() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().to_path_buf();
        let path = p.join("qmp.sock");
        tokio::spawn(async move {
            sleep(Duration::from_millis(300)).await;
            fake_qemu(&p, |cmd| vec![json!({"return": {}, "id": cmd["id"]})]);
        });
        let qmp = QmpClient::connect(&path, &opts()).await.unwrap();
        qmp.stop().await.unwrap();
    }

    #[tokio::test]
    async fn connect_gives_up_after_its_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let o = QmpOptions {
            connect_timeout: Duration::from_millis(200),
            ..opts()
        };
        let started = Instant::now();
        let err = QmpClient::connect(dir.path().join("absent.sock"), &o)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn events_reach_subscribers_and_replies_match_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_qemu(dir.path(), |cmd| match cmd["execute"].as_str().unwrap() {
            // an event arrives before the reply, as QEMU does for stop
            "stop" => vec![
                json!({"event": "STOP", "data": {},
                       "timestamp": {"seconds": 1, "microseconds": 2}}),
                json!({"return": {}, "id": cmd["id"]}),
            ],
            "system_powerdown" => vec![
                json!({"return": {}, "id": cmd["id"]}),
                json!({"event": "POWERDOWN", "data": {}}),
                json!({"event": "SHUTDOWN", "data": {"guest": true, "reason": "guest-shutdown"}}),
            ],
            _ => vec![json!({"return": {}, "id": cmd["id"]})],
        });
        let qmp = QmpClient::connect(&path, &opts()).await.unwrap();
        let mut events = qmp.subscribe();
        qmp.stop().await.unwrap();
        let ev = events.recv().await.unwrap();
        assert_eq!(ev.kind(), EventKind::Stop);
        assert_eq!(
            ev.timestamp,
            Some(Timestamp {
                seconds: 1,
                microseconds: 2
            })
        );
        qmp.system_powerdown().await.unwrap();
        assert_eq!(events.recv().await.unwrap().kind(), EventKind::Powerdown);
        let sd = events.recv().await.unwrap();
        assert_eq!(sd.kind(), EventKind::Shutdown);
        assert_eq!(sd.reason(), Some("guest-shutdown"));
        assert_eq!(sd.guest_initiated(), Some(true));
    }

    #[tokio::test]
    async fn concurrent_commands_get_their_own_replies() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_qemu(dir.path(), |cmd| {
            vec![json!({"return": {"echo": cmd["arguments"]["n"]}, "id": cmd["id"]})]
        });
        let qmp = Arc::new(QmpClient::connect(&path, &opts()).await.unwrap());
        let mut tasks = Vec::new();
        for n in 0..20 {
            let q = qmp.clone();
            tasks.push(tokio::spawn(async move {
                let v = q.execute("echo", Some(json!({ "n": n }))).await.unwrap();
                assert_eq!(v["echo"], n);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    }

    #[tokio::test]
    async fn disconnect_fails_waiters_and_closes_event_channels() {
        let dir = tempfile::tempdir().unwrap();
        // `quit` closes the connection without a reply
        let path = fake_qemu(dir.path(), |_| Vec::new());
        let qmp = QmpClient::connect(&path, &opts()).await.unwrap();
        let mut events = qmp.subscribe();
        qmp.quit().await.unwrap();
        assert!(matches!(
            events.recv().await,
            Err(broadcast::error::RecvError::Closed)
        ));
        assert!(!qmp.is_connected());
        assert!(matches!(
            qmp.execute("query-status", None).await,
            Err(Error::Disconnected)
        ));
        assert!(matches!(
            qmp.subscribe().recv().await,
            Err(broadcast::error::RecvError::Closed)
        ));
    }

    #[tokio::test]
    async fn unanswered_command_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_qemu(dir.path(), |_| vec![json!({"event": "RESUME"})]);
        let qmp = QmpClient::connect(&path, &opts()).await.unwrap();
        let err = qmp
            .execute_with_timeout("cont", None, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
    }

    #[tokio::test]
    async fn rejects_a_peer_that_is_not_qmp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(b"{\"hello\": 1}\n").await.unwrap();
            sleep(Duration::from_secs(1)).await;
        });
        let err = QmpClient::connect(&path, &opts()).await.unwrap_err();
        assert!(matches!(err, Error::Protocol(_)), "{err}");
    }

    #[test]
    fn run_states_decode_including_unknown_ones() {
        let s: RunState = serde_json::from_value(json!("finish-migrate")).unwrap();
        assert_eq!(s, RunState::FinishMigrate);
        let s: RunState = serde_json::from_value(json!("some-future-state")).unwrap();
        assert_eq!(s, RunState::Unknown);
    }

    #[test]
    fn event_kinds() {
        let ev = |name: &str| QmpEvent {
            event: name.into(),
            data: Value::Null,
            timestamp: None,
        };
        assert_eq!(ev("RESET").kind(), EventKind::Reset);
        assert_eq!(ev("RESUME").kind(), EventKind::Resume);
        assert_eq!(
            ev("BLOCK_JOB_COMPLETED").kind(),
            EventKind::Other("BLOCK_JOB_COMPLETED".into())
        );
    }
}
