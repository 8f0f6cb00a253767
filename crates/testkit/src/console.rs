//! A serial console client for tests: connects to QEMU's serial chardev unix socket, keeps every
//! line the guest prints, waits for a line containing a pattern, and runs shell commands in the
//! guest's ttyS0 shell (output collected between unique markers).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

#[derive(Default)]
struct Buffer {
    lines: Vec<String>,
    partial: String,
    closed: bool,
}

/// A connected serial console. Lines are kept from the moment of connection; [`wait_for`]
/// consumes them in order, so waiting twice for the same text needs it printed twice.
///
/// [`wait_for`]: SerialConsole::wait_for
pub struct SerialConsole {
    writer: Mutex<UnixStream>,
    buf: Arc<(Mutex<Buffer>, Condvar)>,
    cursor: Mutex<usize>,
    seq: AtomicU64,
}

impl std::fmt::Debug for SerialConsole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialConsole").finish_non_exhaustive()
    }
}

impl SerialConsole {
    /// Connects to a unix socket, retrying until `timeout` while the socket does not exist yet.
    pub fn connect(path: &Path, timeout: Duration) -> anyhow::Result<SerialConsole> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("connecting to {}", path.display()));
                }
            }
        };
        Self::from_stream(stream)
    }

    /// Wraps any connected stream (e.g. a socket handed over by the launcher).
    pub fn from_stream(stream: UnixStream) -> anyhow::Result<SerialConsole> {
        let mut reader = stream.try_clone()?;
        let buf: Arc<(Mutex<Buffer>, Condvar)> = Arc::default();
        let shared = buf.clone();
        std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            loop {
                let n = match reader.read(&mut chunk) {
                    Ok(0) | Err(_) => 0,
                    Ok(n) => n,
                };
                let (lock, cv) = &*shared;
                let Ok(mut b) = lock.lock() else { return };
                if n == 0 {
                    b.closed = true;
                    if !b.partial.is_empty() {
                        let rest = std::mem::take(&mut b.partial);
                        b.lines.push(rest);
                    }
                    cv.notify_all();
                    return;
                }
                let text = String::from_utf8_lossy(&chunk[..n]).replace('\r', "");
                for ch in text.chars() {
                    if ch == '\n' {
                        let line = std::mem::take(&mut b.partial);
                        if std::env::var_os("FERROVIRT_TEST_SERIAL_ECHO").is_some() {
                            eprintln!("[serial] {line}");
                        }
                        b.lines.push(line);
                    } else {
                        b.partial.push(ch);
                    }
                }
                cv.notify_all();
            }
        });
        Ok(SerialConsole {
            writer: Mutex::new(stream),
            buf,
            cursor: Mutex::new(0),
            seq: AtomicU64::new(0),
        })
    }

    /// Waits for the next line (after the last one consumed) that contains `pattern`, and
    /// returns it. Fails after `timeout` or when the console closes, quoting what it saw.
    pub fn wait_for(&self, pattern: &str, timeout: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.buf;
        let mut cursor = self
            .cursor
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?;
        let mut b = lock.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        loop {
            while *cursor < b.lines.len() {
                let line = &b.lines[*cursor];
                *cursor += 1;
                if line.contains(pattern) {
                    return Ok(line.clone());
                }
            }
            let now = Instant::now();
            if b.closed || now >= deadline {
                let tail: Vec<&String> = b.lines.iter().rev().take(20).collect();
                let tail: Vec<&str> = tail.into_iter().rev().map(|s| s.as_str()).collect();
                bail!(
                    "{} waiting for {pattern:?} on the serial console; last lines:\n{}",
                    if b.closed {
                        "console closed"
                    } else {
                        "timed out"
                    },
                    tail.join("\n")
                );
            }
            b = cv
                .wait_timeout(b, deadline - now)
                .map_err(|_| anyhow::anyhow!("poisoned"))?
                .0;
        }
    }

    /// Every line printed so far (for diagnostics).
    pub fn transcript(&self) -> String {
        let (lock, _) = &*self.buf;
        match lock.lock() {
            Ok(b) => b.lines.join("\n"),
            Err(_) => String::new(),
        }
    }

    /// Types `line` and a newline into the console.
    pub fn send_line(&self, line: &str) -> anyhow::Result<()> {
        let mut w = self
            .writer
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?;
        w.write_all(line.as_bytes())?;
        w.write_all(b"\n")?;
        w.flush()?;
        Ok(())
    }

    /// Runs `cmd` in the guest's shell and returns its output lines (stdout and stderr) and exit
    /// code. The shell must be at a prompt (wait for the ready marker first).
    pub fn exec(&self, cmd: &str, timeout: Duration) -> anyhow::Result<(String, i32)> {
        let n = self.seq.fetch_add(1, Ordering::SeqCst);
        // The quotes keep the echoed command line from matching the markers.
        self.send_line(&format!(
            "echo FV-BEGIN''-{n}; {cmd} 2>&1; echo FV-END''-{n} rc=$?"
        ))?;
        let begin = format!("FV-BEGIN-{n}");
        let end = format!("FV-END-{n} rc=");
        self.wait_for(&begin, timeout)?;
        let mut out = Vec::new();
        let deadline = Instant::now() + timeout;
        loop {
            let line = self.next_line(deadline.saturating_duration_since(Instant::now()))?;
            if let Some(pos) = line.find(&end) {
                let rc = line[pos + end.len()..].trim().parse().unwrap_or(-1);
                return Ok((out.join("\n"), rc));
            }
            out.push(line);
        }
    }

    fn next_line(&self, timeout: Duration) -> anyhow::Result<String> {
        self.wait_for("", timeout)
    }

    /// Writes `marker` and a newline at 512-byte `sector` of the guest's block device `dev`
    /// (e.g. `/dev/vdb`), flushed to the host.
    pub fn write_marker(&self, dev: &str, marker: &str, sector: u32) -> anyhow::Result<()> {
        let (out, rc) = self.exec(
            &format!("echo {marker} | dd of={dev} bs=512 seek={sector} conv=fsync && sync"),
            Duration::from_secs(30),
        )?;
        anyhow::ensure!(rc == 0, "writing {marker} to {dev}: {out}");
        Ok(())
    }

    /// The first `len` bytes at `sector` of `dev`, read past the guest's page cache, NULs
    /// dropped.
    pub fn read_marker(&self, dev: &str, sector: u32, len: usize) -> anyhow::Result<String> {
        let (out, _) = self.exec(
            &format!(
                "dd if={dev} bs=512 skip={sector} count=1 iflag=direct 2>/dev/null | head -c {len}; echo"
            ),
            Duration::from_secs(30),
        )?;
        Ok(out.replace('\0', "").trim().to_string())
    }
}
