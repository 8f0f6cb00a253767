//! Serial console client: connect to the console's unix socket, wait for output, type lines.
//!
//! Output is examined line by line (CR and LF both end a line); [`Pattern::Prompt`] also matches
//! the unterminated last line, for shell prompts. Everything read is kept in a bounded transcript
//! that timeout errors quote, so a failing test shows what the guest printed.

use std::path::Path;
use std::time::Duration;

use regex::Regex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::time::{Instant, timeout_at};

use crate::error::{Error, Result};
use crate::qmp::connect_unix_retry;

/// How much console output the transcript keeps.
pub const TRANSCRIPT_LIMIT: usize = 256 * 1024;
/// How much of the transcript a timeout error quotes.
const ERROR_TAIL: usize = 2000;

/// What to wait for.
#[derive(Debug, Clone)]
pub enum Pattern {
    /// A complete line containing this text.
    Substring(String),
    /// A complete line matching this regex (captures are returned).
    Regex(Regex),
    /// Text anywhere in the output, including an unterminated last line (prompts).
    Prompt(String),
}

impl Pattern {
    pub fn substring(s: impl Into<String>) -> Pattern {
        Pattern::Substring(s.into())
    }

    pub fn regex(re: &str) -> Result<Pattern> {
        Ok(Pattern::Regex(Regex::new(re)?))
    }

    pub fn prompt(s: impl Into<String>) -> Pattern {
        Pattern::Prompt(s.into())
    }

    fn matches(&self, line: &str, complete: bool) -> Option<Vec<Option<String>>> {
        match self {
            Pattern::Substring(s) if complete => line.contains(s.as_str()).then(Vec::new),
            Pattern::Regex(re) if complete => re.captures(line).map(|c| {
                c.iter()
                    .skip(1)
                    .map(|m| m.map(|m| m.as_str().to_string()))
                    .collect()
            }),
            Pattern::Prompt(s) => line.contains(s.as_str()).then(Vec::new),
            _ => None,
        }
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pattern::Substring(s) => write!(f, "a line containing {s:?}"),
            Pattern::Regex(r) => write!(f, "a line matching /{r}/"),
            Pattern::Prompt(s) => write!(f, "output containing {s:?}"),
        }
    }
}

/// A successful match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsoleMatch {
    /// The matching line, without line terminators.
    pub line: String,
    /// Regex capture groups 1.. (empty for substring patterns).
    pub captures: Vec<Option<String>>,
}

/// Output of [`SerialConsole::exec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub exit_code: i32,
    /// The command's output lines, joined with `\n`.
    pub output: String,
}

/// A connection to a VM's serial console socket.
#[derive(Debug)]
pub struct SerialConsole {
    stream: UnixStream,
    /// Bytes read but not yet examined by a wait.
    pending: Vec<u8>,
    transcript: String,
    next_token: u64,
}

impl SerialConsole {
    /// Connects, retrying until `connect_timeout` while the socket does not exist yet.
    pub async fn connect(path: impl AsRef<Path>, connect_timeout: Duration) -> Result<Self> {
        let stream =
            connect_unix_retry(path.as_ref(), connect_timeout, Duration::from_millis(50)).await?;
        Ok(SerialConsole {
            stream,
            pending: Vec::new(),
            transcript: String::new(),
            next_token: 1,
        })
    }

    /// Everything read so far (the last [`TRANSCRIPT_LIMIT`] bytes).
    pub fn transcript(&self) -> &str {
        &self.transcript
    }

    /// Reads until a line matches `pattern`; output after that line stays for the next wait.
    pub async fn wait_for(&mut self, pattern: &Pattern, wait: Duration) -> Result<ConsoleMatch> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(m) = self.scan(pattern) {
                return Ok(m);
            }
            let mut buf = [0u8; 4096];
            let n = match timeout_at(deadline, self.stream.read(&mut buf)).await {
                Err(_) => {
                    return Err(Error::timeout(
                        format!(
                            "{pattern} on the serial console; last output:\n{}",
                            self.tail()
                        ),
                        wait,
                    ));
                }
                Ok(r) => r.map_err(|e| Error::io("reading the serial console", e))?,
            };
            if n == 0 {
                return Err(Error::Disconnected);
            }
            self.record(&buf[..n]);
            self.pending.extend_from_slice(&buf[..n]);
        }
    }

    /// Looks for a match in `pending`, consuming examined complete lines.
    fn scan(&mut self, pattern: &Pattern) -> Option<ConsoleMatch> {
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n' || b == b'\r') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let text = clean(&line[..line.len() - 1]);
            if text.is_empty() {
                continue;
            }
            if let Some(captures) = pattern.matches(&text, true) {
                return Some(ConsoleMatch {
                    line: text,
                    captures,
                });
            }
        }
        let partial = clean(&self.pending);
        if let Some(captures) = pattern.matches(&partial, false) {
            self.pending.clear();
            return Some(ConsoleMatch {
                line: partial,
                captures,
            });
        }
        None
    }

    fn record(&mut self, bytes: &[u8]) {
        self.transcript.push_str(&String::from_utf8_lossy(bytes));
        if self.transcript.len() > TRANSCRIPT_LIMIT {
            let mut cut = self.transcript.len() - TRANSCRIPT_LIMIT;
            while !self.transcript.is_char_boundary(cut) {
                cut += 1;
            }
            self.transcript.drain(..cut);
        }
    }

    fn tail(&self) -> &str {
        let t = &self.transcript;
        let mut start = t.len().saturating_sub(ERROR_TAIL);
        while !t.is_char_boundary(start) {
            start += 1;
        }
        &t[start..]
    }

    /// Types `line` followed by a carriage return (what a terminal sends for Enter).
    pub async fn send_line(&mut self, line: &str) -> Result<()> {
        let mut bytes = line.as_bytes().to_vec();
        bytes.push(b'\r');
        self.send_raw(&bytes).await
    }

    /// Writes bytes as they are.
    pub async fn send_raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream
            .write_all(bytes)
            .await
            .map_err(|e| Error::io("writing to the serial console", e))
    }

    /// Runs a shell command in the guest (a POSIX shell must own the console) and returns its
    /// exit code and output. Output lines are told apart from the echoed input by markers.
    pub async fn exec(&mut self, command: &str, wait: Duration) -> Result<ExecOutput> {
        let token = format!("FVX{}x{}", std::process::id(), self.next_token);
        self.next_token += 1;
        // The markers are printed with the token split so the echoed command line never matches.
        let (a, b) = token.split_at(3);
        self.send_line(&format!(
            "echo '{a}''{b}'-B; {command}; echo '{a}''{b}'-E $?"
        ))
        .await?;
        let deadline = Instant::now() + wait;
        let begin = Regex::new(&format!("^{token}-B$"))?;
        let end = Regex::new(&format!("^{token}-E (\\d+)$"))?;
        self.wait_for(&Pattern::Regex(begin), wait).await?;
        let mut output = Vec::new();
        let any = Pattern::Substring(String::new());
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let m = self.wait_for(&any, left).await?;
            if let Some(c) = end.captures(&m.line) {
                let exit_code = c[1].parse().unwrap_or(-1);
                return Ok(ExecOutput {
                    exit_code,
                    output: output.join("\n"),
                });
            }
            output.push(m.line);
        }
    }
}

/// Decodes a console line and drops terminal escape sequences and control characters.
fn clean(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ params final-byte(0x40..=0x7e)
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if ('\u{40}'..='\u{7e}').contains(&c) {
                        break;
                    }
                }
            } else {
                chars.next();
            }
        } else if !c.is_control() || c == '\t' {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, BufReader};
    use tokio::net::UnixListener;

    fn console_server(dir: &Path, script: &'static [&'static [u8]]) -> std::path::PathBuf {
        let path = dir.join("serial.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            for chunk in script {
                s.write_all(chunk).await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        path
    }

    #[tokio::test]
    async fn waits_across_chunks_and_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = console_server(
            dir.path(),
            &[
                b"booting...\r\nFERROVIRT-BO",
                b"OT serial=abc uuid=1234\r\nnext line\r\n",
                b"/ # ",
            ],
        );
        let mut c = SerialConsole::connect(&path, Duration::from_secs(2))
            .await
            .unwrap();
        let re = Pattern::regex(r"FERROVIRT-BOOT serial=(\S+) uuid=(\S+)").unwrap();
        let m = c.wait_for(&re, Duration::from_secs(2)).await.unwrap();
        assert_eq!(m.line, "FERROVIRT-BOOT serial=abc uuid=1234");
        assert_eq!(
            m.captures,
            vec![Some("abc".to_string()), Some("1234".to_string())]
        );
        let m = c
            .wait_for(&Pattern::substring("next"), Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(m.line, "next line");
        c.wait_for(&Pattern::prompt("/ # "), Duration::from_secs(2))
            .await
            .unwrap();
        assert!(c.transcript().contains("booting..."));
    }

    #[tokio::test]
    async fn timeout_quotes_the_output() {
        let dir = tempfile::tempdir().unwrap();
        let path = console_server(dir.path(), &[b"kernel panic here\r\n"]);
        let mut c = SerialConsole::connect(&path, Duration::from_secs(2))
            .await
            .unwrap();
        let err = c
            .wait_for(&Pattern::substring("login:"), Duration::from_millis(300))
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("kernel panic here"), "{msg}");
    }

    #[tokio::test]
    async fn substring_does_not_match_an_unterminated_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = console_server(dir.path(), &[b"value=12"]);
        let mut c = SerialConsole::connect(&path, Duration::from_secs(2))
            .await
            .unwrap();
        assert!(
            c.wait_for(&Pattern::substring("value=12"), Duration::from_millis(200))
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn exec_separates_echo_from_output() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.sock");
        let listener = UnixListener::bind(&path).unwrap();
        // A fake shell: echoes the command line back (like a tty), then prints the markers.
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let (r, mut w) = s.into_split();
            let mut r = BufReader::new(r);
            let mut line = Vec::new();
            r.read_until(b'\r', &mut line).await.unwrap();
            let cmd = String::from_utf8(line.clone()).unwrap();
            let token = cmd
                .split("echo '")
                .nth(1)
                .unwrap()
                .split("'-B")
                .next()
                .unwrap()
                .replace("''", "");
            let reply = format!(
                "/ # {}\n{token}-B\r\nhello\r\nworld\r\n{token}-E 3\r\n/ # ",
                cmd.trim_end()
            );
            w.write_all(reply.as_bytes()).await.unwrap();
            tokio::time::sleep(Duration::from_secs(2)).await;
        });
        let mut c = SerialConsole::connect(&path, Duration::from_secs(2))
            .await
            .unwrap();
        let out = c
            .exec("printf 'hello\\nworld\\n'; false", Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(out.exit_code, 3);
        assert_eq!(out.output, "hello\nworld");
    }

    #[test]
    fn clean_strips_escapes() {
        assert_eq!(clean(b"\x1b[6n/ # ls\x1b[0m\t"), "/ # ls\t");
        assert_eq!(clean(b"a\x07b"), "ab");
    }
}
