//! QEMU guest-agent client over the host end of the `org.qemu.guest_agent.0` channel.
//!
//! The channel is a byte stream that may hold stale replies (a previous client timed out, the
//! agent restarted). Before the first command and after any timeout the client resynchronizes
//! with `guest-sync-delimited`: it sends 0xFF (the agent drops any partial input), then the sync
//! command, and skips everything up to the 0xFF sentinel that precedes the matching reply.
//! One command is in flight at a time; methods take `&mut self`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::time::{Instant, timeout, timeout_at};

use crate::error::{Error, Result};
use crate::qmp::connect_unix_retry;

/// Timeouts of the guest-agent client.
#[derive(Debug, Clone)]
pub struct QgaOptions {
    /// Time to keep retrying the host socket connection.
    pub connect_timeout: Duration,
    /// Deadline for the sync handshake (the agent may not be running yet).
    pub sync_timeout: Duration,
    /// Deadline for each command's reply.
    pub command_timeout: Duration,
}

impl Default for QgaOptions {
    fn default() -> Self {
        QgaOptions {
            connect_timeout: Duration::from_secs(5),
            sync_timeout: Duration::from_secs(5),
            command_timeout: Duration::from_secs(10),
        }
    }
}

/// `guest-info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct GuestAgentInfo {
    pub version: String,
    /// Spelled with an underscore on the wire (a QAPI legacy name).
    #[serde(default, rename = "supported_commands", alias = "supported-commands")]
    pub supported_commands: Vec<GuestAgentCommandInfo>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct GuestAgentCommandInfo {
    pub name: String,
    pub enabled: bool,
    #[serde(default)]
    pub success_response: bool,
}

/// `guest-get-osinfo`; every field is optional in the schema.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct GuestOsInfo {
    pub kernel_release: Option<String>,
    pub kernel_version: Option<String>,
    pub machine: Option<String>,
    pub id: Option<String>,
    pub name: Option<String>,
    pub pretty_name: Option<String>,
    pub version: Option<String>,
    pub version_id: Option<String>,
    pub variant: Option<String>,
    pub variant_id: Option<String>,
}

/// One entry of `guest-get-users`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct GuestUser {
    pub user: String,
    /// Seconds since the epoch.
    pub login_time: f64,
    #[serde(default)]
    pub domain: Option<String>,
}

/// One entry of `guest-get-fsinfo`. Disk details vary by agent version and stay raw.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct GuestFilesystemInfo {
    pub name: String,
    pub mountpoint: String,
    #[serde(rename = "type")]
    pub fs_type: String,
    #[serde(default)]
    pub used_bytes: Option<u64>,
    #[serde(default)]
    pub total_bytes: Option<u64>,
    #[serde(default)]
    pub disk: Vec<Value>,
}

/// One entry of `guest-network-get-interfaces`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct GuestNetworkInterface {
    pub name: String,
    #[serde(default)]
    pub hardware_address: Option<String>,
    #[serde(default)]
    pub ip_addresses: Vec<GuestIpAddress>,
    #[serde(default)]
    pub statistics: Option<Value>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct GuestIpAddress {
    /// `ipv4` or `ipv6`.
    pub ip_address_type: String,
    pub ip_address: String,
    pub prefix: u32,
}

/// `guest-shutdown` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShutdownMode {
    Powerdown,
    Halt,
    Reboot,
}

/// A guest-agent session.
#[derive(Debug)]
pub struct GuestAgent {
    path: PathBuf,
    opts: QgaOptions,
    stream: Option<BufReader<UnixStream>>,
    synced: bool,
    next_sync_id: u64,
}

impl GuestAgent {
    /// Connects to the host socket. Does not talk to the agent yet: the first command syncs.
    pub async fn connect(path: impl AsRef<Path>, opts: &QgaOptions) -> Result<GuestAgent> {
        let path = path.as_ref().to_path_buf();
        let stream =
            connect_unix_retry(&path, opts.connect_timeout, Duration::from_millis(50)).await?;
        Ok(GuestAgent {
            path,
            opts: opts.clone(),
            stream: Some(BufReader::new(stream)),
            synced: false,
            // Distinct per session, so a late reply to an older session's sync cannot match.
            next_sync_id: u64::from(std::process::id()) << 20
                | u64::from(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.subsec_micros())
                        .unwrap_or(0),
                ),
        })
    }

    /// Resynchronizes with the agent now.
    pub async fn sync(&mut self) -> Result<()> {
        let id = self.next_sync_id;
        self.next_sync_id += 1;
        let deadline = Instant::now() + self.opts.sync_timeout;
        let after = self.opts.sync_timeout;
        let stream = self.stream().await?;
        let mut msg = vec![0xFFu8];
        msg.extend(serde_json::to_vec(
            &json!({"execute": "guest-sync-delimited", "arguments": {"id": id}}),
        )?);
        msg.push(b'\n');
        let io = |e| Error::io("talking to the guest agent", e);
        stream.get_mut().write_all(&msg).await.map_err(io)?;
        let result = timeout_at(deadline, async {
            loop {
                // Bytes before the delimiter are discarded as they come, never collected.
                if !skip_past(stream, 0xFF).await.map_err(io)? {
                    return Err(Error::Disconnected);
                }
                let mut line = Vec::new();
                if read_capped(stream, b'\n', &mut line).await? == 0 {
                    return Err(Error::Disconnected);
                }
                let reply: Option<Value> = serde_json::from_slice(&line).ok();
                if reply
                    .as_ref()
                    .and_then(|r| r.get("return"))
                    .and_then(Value::as_u64)
                    == Some(id)
                {
                    return Ok(());
                }
            }
        })
        .await;
        match result {
            Ok(Ok(())) => {
                self.synced = true;
                Ok(())
            }
            Ok(Err(e)) => {
                self.drop_stream_on(&e);
                Err(e)
            }
            Err(_) => Err(Error::timeout("guest agent sync", after)),
        }
    }

    async fn stream(&mut self) -> Result<&mut BufReader<UnixStream>> {
        if self.stream.is_none() {
            let s = connect_unix_retry(
                &self.path,
                self.opts.connect_timeout,
                Duration::from_millis(50),
            )
            .await?;
            self.stream = Some(BufReader::new(s));
            self.synced = false;
        }
        Ok(self.stream.as_mut().expect("just set"))
    }

    fn drop_stream_on(&mut self, e: &Error) {
        self.synced = false;
        if e.is_disconnect() || matches!(e, Error::Io { .. }) {
            self.stream = None;
        }
    }

    /// Executes a command and returns its raw `return` value.
    pub async fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value> {
        let deadline = self.opts.command_timeout;
        self.execute_inner(command, arguments, deadline)
            .await?
            .ok_or_else(|| {
                Error::timeout(format!("the guest agent's reply to {command}"), deadline)
            })
    }

    /// Like [`execute`](Self::execute) with its own deadline (`guest-fsfreeze-freeze` may take
    /// longer than an ordinary command).
    pub async fn execute_with_timeout(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        deadline: Duration,
    ) -> Result<Value> {
        self.execute_inner(command, arguments, deadline)
            .await?
            .ok_or_else(|| {
                Error::timeout(format!("the guest agent's reply to {command}"), deadline)
            })
    }

    /// Executes a command and decodes its `return` value.
    pub async fn execute_as<T: DeserializeOwned>(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<T> {
        Ok(serde_json::from_value(
            self.execute(command, arguments).await?,
        )?)
    }

    /// Sends a command, waits up to `deadline` for a reply; `Ok(None)` when none came.
    async fn execute_inner(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        deadline: Duration,
    ) -> Result<Option<Value>> {
        if !self.synced {
            self.sync().await?;
        }
        let mut msg = json!({ "execute": command });
        if let Some(a) = arguments {
            msg["arguments"] = a;
        }
        let mut bytes = serde_json::to_vec(&msg)?;
        bytes.push(b'\n');
        let stream = self.stream().await?;
        let io = |e| Error::io(format!("guest agent command {command}"), e);
        let result = async {
            stream.get_mut().write_all(&bytes).await.map_err(io)?;
            timeout(deadline, async {
                let mut line = Vec::new();
                loop {
                    line.clear();
                    if read_capped(stream, b'\n', &mut line).await? == 0 {
                        return Err(Error::Disconnected);
                    }
                    let text = String::from_utf8_lossy(&line);
                    let text = text.trim_matches(|c: char| c.is_whitespace() || c == '\u{FFFD}');
                    if text.is_empty() {
                        continue;
                    }
                    let v: Value = serde_json::from_str(text)
                        .map_err(|e| Error::Protocol(format!("guest agent sent {text:?}: {e}")))?;
                    return Ok(v);
                }
            })
            .await
            .ok()
            .transpose()
        }
        .await;
        let reply = match result {
            Ok(Some(v)) => v,
            Ok(None) => {
                // A late reply may still come: resync before the next command.
                self.synced = false;
                return Ok(None);
            }
            Err(e) => {
                self.drop_stream_on(&e);
                return Err(e);
            }
        };
        if let Some(v) = reply.get("return") {
            Ok(Some(v.clone()))
        } else if let Some(err) = reply.get("error") {
            let text = |k: &str| {
                err.get(k)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string()
            };
            Err(Error::Command {
                command: command.to_string(),
                class: text("class"),
                desc: text("desc"),
            })
        } else {
            self.synced = false;
            Err(Error::Protocol(format!(
                "unexpected guest agent reply {reply}"
            )))
        }
    }

    /// `guest-ping`.
    pub async fn ping(&mut self) -> Result<()> {
        self.execute("guest-ping", None).await.map(drop)
    }

    /// `guest-info`: agent version and supported commands.
    pub async fn info(&mut self) -> Result<GuestAgentInfo> {
        self.execute_as("guest-info", None).await
    }

    /// `guest-get-osinfo`.
    pub async fn os_info(&mut self) -> Result<GuestOsInfo> {
        self.execute_as("guest-get-osinfo", None).await
    }

    /// `guest-get-host-name`.
    pub async fn host_name(&mut self) -> Result<String> {
        #[derive(Deserialize)]
        struct HostName {
            #[serde(rename = "host-name")]
            host_name: String,
        }
        let h: HostName = self.execute_as("guest-get-host-name", None).await?;
        Ok(h.host_name)
    }

    /// `guest-get-users`.
    pub async fn users(&mut self) -> Result<Vec<GuestUser>> {
        self.execute_as("guest-get-users", None).await
    }

    /// `guest-get-fsinfo`.
    pub async fn fs_info(&mut self) -> Result<Vec<GuestFilesystemInfo>> {
        self.execute_as("guest-get-fsinfo", None).await
    }

    /// `guest-network-get-interfaces`.
    pub async fn network_interfaces(&mut self) -> Result<Vec<GuestNetworkInterface>> {
        self.execute_as("guest-network-get-interfaces", None).await
    }

    /// `guest-shutdown`. The agent does not answer on success, so this waits at most
    /// `error_wait` for an error reply and otherwise reports success.
    pub async fn shutdown(&mut self, mode: ShutdownMode, error_wait: Duration) -> Result<()> {
        match self
            .execute_inner("guest-shutdown", Some(json!({ "mode": mode })), error_wait)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.is_disconnect() => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Asks the guest to reboot itself (KubeVirt's soft reboot).
    pub async fn reboot(&mut self) -> Result<()> {
        self.shutdown(ShutdownMode::Reboot, Duration::from_secs(2))
            .await
    }
}

/// The largest guest-agent reply read; a longer line is a protocol error (the guest is not
/// trusted to bound its own replies).
pub const MAX_REPLY_BYTES: usize = 1 << 20;

/// Reads up to and including `delim` into `out`, failing once more than [`MAX_REPLY_BYTES`]
/// arrived without it. Returns the bytes read (0: end of stream).
async fn read_capped(
    stream: &mut BufReader<UnixStream>,
    delim: u8,
    out: &mut Vec<u8>,
) -> Result<usize> {
    let io = |e| Error::io("reading from the guest agent", e);
    loop {
        let buf = stream.fill_buf().await.map_err(io)?;
        if buf.is_empty() {
            return Ok(out.len());
        }
        let (n, done) = match buf.iter().position(|b| *b == delim) {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if out.len() + n > MAX_REPLY_BYTES {
            stream.consume(n);
            return Err(Error::Protocol(format!(
                "the guest agent sent a reply over {MAX_REPLY_BYTES} bytes"
            )));
        }
        out.extend_from_slice(&buf[..n]);
        stream.consume(n);
        if done {
            return Ok(out.len());
        }
    }
}

/// Discards input up to and including `delim`; false at end of stream.
async fn skip_past(stream: &mut BufReader<UnixStream>, delim: u8) -> std::io::Result<bool> {
    loop {
        let buf = stream.fill_buf().await?;
        if buf.is_empty() {
            return Ok(false);
        }
        match buf.iter().position(|b| *b == delim) {
            Some(i) => {
                stream.consume(i + 1);
                return Ok(true);
            }
            None => {
                let n = buf.len();
                stream.consume(n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A fake agent: first writes `stale` bytes (garbage a previous session left behind), then
    /// answers sync and a few commands the way qemu-ga does.
    fn fake_agent(dir: &Path, stale: &'static [u8], answer_shutdown: bool) -> PathBuf {
        let path = dir.join("qga.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let (r, mut w) = stream.into_split();
            let mut r = BufReader::new(r);
            w.write_all(stale).await.unwrap();
            let mut line = Vec::new();
            loop {
                line.clear();
                if r.read_until(b'\n', &mut line).await.unwrap_or(0) == 0 {
                    return;
                }
                // qemu-ga discards input up to a 0xFF byte
                let start = line.iter().rposition(|&b| b == 0xFF).map_or(0, |i| i + 1);
                let cmd: Value = serde_json::from_slice(&line[start..]).unwrap();
                let out: Vec<u8> = match cmd["execute"].as_str().unwrap() {
                    "guest-sync-delimited" => {
                        let mut o = vec![0xFF];
                        o.extend(
                            format!("{}\n", json!({"return": cmd["arguments"]["id"]})).bytes(),
                        );
                        o
                    }
                    "guest-ping" => b"{\"return\": {}}\n".to_vec(),
                    "guest-get-host-name" => b"{\"return\": {\"host-name\": \"g1\"}}\n".to_vec(),
                    "guest-get-osinfo" => {
                        b"{\"return\": {\"id\": \"debian\", \"kernel-release\": \"6.1\"}}\n"
                            .to_vec()
                    }
                    "guest-network-get-interfaces" => format!(
                        "{}\n",
                        json!({"return": [{"name": "lo", "hardware-address": "00:00:00:00:00:00",
                            "ip-addresses": [{"ip-address-type": "ipv4",
                                              "ip-address": "127.0.0.1", "prefix": 8}]}]})
                    )
                    .into_bytes(),
                    "guest-shutdown" if answer_shutdown => {
                        b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"denied\"}}\n"
                            .to_vec()
                    }
                    "guest-shutdown" => Vec::new(),
                    _ => {
                        b"{\"error\": {\"class\": \"CommandNotFound\", \"desc\": \"x\"}}\n".to_vec()
                    }
                };
                w.write_all(&out).await.unwrap();
            }
        });
        path
    }

    fn opts() -> QgaOptions {
        QgaOptions {
            connect_timeout: Duration::from_secs(2),
            sync_timeout: Duration::from_secs(2),
            command_timeout: Duration::from_secs(2),
        }
    }

    #[tokio::test]
    async fn an_oversized_reply_is_refused_not_collected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qga.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let (r, mut w) = stream.into_split();
            let mut r = BufReader::new(r);
            let mut line = Vec::new();
            loop {
                line.clear();
                if r.read_until(b'\n', &mut line).await.unwrap_or(0) == 0 {
                    return;
                }
                let start = line.iter().rposition(|&b| b == 0xFF).map_or(0, |i| i + 1);
                let cmd: Value = serde_json::from_slice(&line[start..]).unwrap();
                if cmd["execute"] == "guest-sync-delimited" {
                    let mut o = vec![0xFF];
                    o.extend(format!("{}\n", json!({"return": cmd["arguments"]["id"]})).bytes());
                    w.write_all(&o).await.unwrap();
                } else {
                    // A hostile guest: a reply line of 3 MiB.
                    let mut o = b"{\"return\": \"".to_vec();
                    o.extend(std::iter::repeat_n(b'a', 3 << 20));
                    o.extend(b"\"}\n");
                    let _ = w.write_all(&o).await;
                }
            }
        });
        let mut qga = GuestAgent::connect(&path, &opts()).await.unwrap();
        let err = qga.host_name().await.unwrap_err();
        assert!(err.to_string().contains("over 1048576 bytes"), "{err}");
    }

    #[tokio::test]
    async fn sync_skips_stale_data_then_commands_work() {
        let dir = tempfile::tempdir().unwrap();
        let stale: &[u8] = b"{\"return\": {\"host-name\": \"stale\"}}\n\xff{\"return\": 7}\n";
        let path = fake_agent(dir.path(), stale, false);
        let mut qga = GuestAgent::connect(&path, &opts()).await.unwrap();
        qga.ping().await.unwrap();
        assert_eq!(qga.host_name().await.unwrap(), "g1");
        let os = qga.os_info().await.unwrap();
        assert_eq!(os.id.as_deref(), Some("debian"));
        assert_eq!(os.kernel_release.as_deref(), Some("6.1"));
        let ifs = qga.network_interfaces().await.unwrap();
        assert_eq!(ifs[0].ip_addresses[0].ip_address, "127.0.0.1");
        let err = qga.execute("guest-exec", None).await.unwrap_err();
        assert!(
            matches!(&err, Error::Command { class, .. } if class == "CommandNotFound"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn shutdown_without_reply_is_success_and_error_reply_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_agent(dir.path(), b"", false);
        let mut qga = GuestAgent::connect(&path, &opts()).await.unwrap();
        qga.shutdown(ShutdownMode::Reboot, Duration::from_millis(200))
            .await
            .unwrap();
        // the next command resyncs first and still works
        qga.ping().await.unwrap();

        let dir2 = tempfile::tempdir().unwrap();
        let path = fake_agent(dir2.path(), b"", true);
        let mut qga = GuestAgent::connect(&path, &opts()).await.unwrap();
        let err = qga
            .shutdown(ShutdownMode::Powerdown, Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Command { .. }), "{err}");
    }

    #[tokio::test]
    async fn silent_agent_times_out_in_sync() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qga.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (_s, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let mut qga = GuestAgent::connect(
            &path,
            &QgaOptions {
                sync_timeout: Duration::from_millis(200),
                ..opts()
            },
        )
        .await
        .unwrap();
        let err = qga.ping().await.unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
    }

    #[test]
    fn decodes_qemu_ga_7_2_shapes() {
        let info: GuestAgentInfo = serde_json::from_value(json!({
            "version": "7.2.22",
            "supported_commands": [{"enabled": true, "name": "guest-ping", "success-response": true}]
        }))
        .unwrap();
        assert_eq!(info.supported_commands[0].name, "guest-ping");
        let fs: Vec<GuestFilesystemInfo> = serde_json::from_value(json!([
            {"name": "vda1", "mountpoint": "/", "type": "ext4", "used-bytes": 1, "total-bytes": 2,
             "disk": [{"bus-type": "virtio", "bus": 0, "unit": 0, "target": 0}]}
        ]))
        .unwrap();
        assert_eq!(fs[0].fs_type, "ext4");
        assert_eq!(fs[0].total_bytes, Some(2));
        let users: Vec<GuestUser> =
            serde_json::from_value(json!([{"user": "root", "login-time": 1.5}])).unwrap();
        assert_eq!(users[0].user, "root");
        assert_eq!(
            serde_json::to_value(ShutdownMode::Reboot).unwrap(),
            json!("reboot")
        );
    }
}
