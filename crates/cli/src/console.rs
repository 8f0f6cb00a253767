//! `ferrovirt console VMI`: the VMI's serial console over the console websocket. On a terminal
//! it switches to raw mode and Ctrl+] leaves; in a pipe it sends all of stdin, then prints what
//! the guest answers until the guest is quiet for a moment (so scripts can run commands).

use std::io::{IsTerminal, Write};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

use crate::error::CliError;
use crate::target::Target;

/// Ctrl+] — the escape byte that ends an interactive session, as in virtctl.
pub const ESCAPE: u8 = 0x1d;

/// The console websocket path of a VMI.
pub fn path(namespace: &str, name: &str) -> String {
    format!(
        "/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/{name}/console"
    )
}

/// Splits input at the escape byte: (bytes to send, whether the escape was typed).
pub fn split_escape(input: &[u8]) -> (&[u8], bool) {
    match input.iter().position(|b| *b == ESCAPE) {
        Some(i) => (&input[..i], true),
        None => (input, false),
    }
}

struct RawMode;

impl RawMode {
    fn enable() -> Result<RawMode, CliError> {
        crossterm::terminal::enable_raw_mode().map_err(|e| CliError::Io {
            context: "switching the terminal to raw mode".into(),
            source: e,
        })?;
        Ok(RawMode)
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = crossterm::terminal::disable_raw_mode();
    }
}

/// Runs the console session. `quiet` is how long a piped session waits for more output after
/// stdin ended and the guest stopped printing.
pub async fn run(target: &Target, name: &str, quiet: Duration) -> Result<(), CliError> {
    let ws = target.websocket(&path(&target.namespace, name)).await?;
    let (mut sink, mut stream) = ws.split();
    let interactive = std::io::stdin().is_terminal();
    let mut rx = crate::wsio::stdin_chunks(1024);
    let _raw = if interactive {
        eprintln!("Successfully connected to {name} console. The escape sequence is ^]");
        Some(RawMode::enable()?)
    } else {
        None
    };
    let mut stdout = std::io::stdout();
    let mut stdin_open = true;
    loop {
        let idle = if stdin_open || interactive {
            Duration::from_secs(24 * 3600)
        } else {
            quiet
        };
        tokio::select! {
            input = rx.recv(), if stdin_open => match input {
                Some(bytes) => {
                    let (send, escaped) = split_escape(&bytes);
                    if !send.is_empty() {
                        let msg = Message::Binary(bytes::Bytes::copy_from_slice(send));
                        sink.send(msg).await.map_err(|e| CliError::Transport(e.to_string()))?;
                    }
                    if escaped {
                        break;
                    }
                }
                None => stdin_open = false,
            },
            msg = stream.next() => match msg {
                Some(Ok(Message::Binary(b))) => write_out(&mut stdout, &b)?,
                Some(Ok(Message::Text(t))) => write_out(&mut stdout, t.as_bytes())?,
                Some(Ok(Message::Close(_))) | None => break,
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(CliError::Transport(e.to_string())),
            },
            _ = tokio::time::sleep(idle) => break,
        }
    }
    let _ = sink.send(Message::Close(None)).await;
    Ok(())
}

fn write_out(out: &mut std::io::Stdout, b: &[u8]) -> Result<(), CliError> {
    out.write_all(b)
        .and_then(|_| out.flush())
        .map_err(|e| CliError::Io {
            context: "writing to stdout".into(),
            source: e,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_splits_input() {
        assert_eq!(split_escape(b"ls\n"), (&b"ls\n"[..], false));
        assert_eq!(split_escape(b"ab\x1dcd"), (&b"ab"[..], true));
        assert_eq!(split_escape(b"\x1d"), (&b""[..], true));
        assert!(path("ns", "v").ends_with("/namespaces/ns/virtualmachineinstances/v/console"));
    }
}
