//! A minimal blocking QMP client for tests (raw JSON): connect, negotiate capabilities, run
//! commands, skip asynchronous events. The launcher has the full async client.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// A connected QMP session.
pub struct QmpClient {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// Events received while waiting for command replies.
    pub events: Vec<Value>,
}

impl std::fmt::Debug for QmpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QmpClient").finish_non_exhaustive()
    }
}

impl QmpClient {
    /// Connects (retrying until `timeout`) and leaves capabilities negotiation mode.
    pub fn connect(path: &Path, timeout: Duration) -> anyhow::Result<QmpClient> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(e).with_context(|| format!("connecting {}", path.display())),
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut c = QmpClient {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
            events: Vec::new(),
        };
        let greeting = c.read_message()?;
        if greeting.get("QMP").is_none() {
            bail!("unexpected QMP greeting: {greeting}");
        }
        c.execute("qmp_capabilities", json!({}))?;
        Ok(c)
    }

    fn read_message(&mut self) -> anyhow::Result<Value> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            bail!("QMP connection closed");
        }
        Ok(serde_json::from_str(&line)?)
    }

    /// Runs `command` with `arguments` and returns its `return` value.
    pub fn execute(&mut self, command: &str, arguments: Value) -> anyhow::Result<Value> {
        let mut msg = json!({ "execute": command });
        if arguments.as_object().is_some_and(|o| !o.is_empty()) {
            msg["arguments"] = arguments;
        }
        self.writer.write_all(format!("{msg}\n").as_bytes())?;
        loop {
            let reply = self.read_message()?;
            if reply.get("event").is_some() {
                self.events.push(reply);
                continue;
            }
            if let Some(err) = reply.get("error") {
                bail!("QMP {command} failed: {err}");
            }
            return Ok(reply.get("return").cloned().unwrap_or(Value::Null));
        }
    }
}
