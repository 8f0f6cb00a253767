//! Byte streams carried over KubeVirt's `plain.kubevirt.io` websockets (binary frames): the
//! bridge between such a websocket and a local socket or stdin/stdout, used by `vnc`'s proxy
//! and `port-forward`.

use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;

use crate::error::CliError;

/// Reads stdin on a plain thread and hands over its chunks (at most `chunk` bytes); the
/// channel closes at end of input. Not tokio's stdin: that reads on the blocking pool, and a read
/// that never returns would keep the process alive after the remote side closed.
pub fn stdin_chunks(chunk: usize) -> tokio::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    std::thread::spawn(move || {
        use std::io::Read;
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; chunk.max(1)];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            }
        }
    });
    rx
}

fn ws_err(e: impl std::fmt::Display) -> CliError {
    CliError::Transport(format!("stream: {e}"))
}

/// What the bridge does when the local side's input ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnLocalEof {
    /// Close the websocket (and so the remote connection) at once.
    Close,
    /// Keep receiving until the remote side closes: a websocket cannot half-close, so this
    /// is how `echo REQUEST | … --stdio` still gets its answer.
    Drain,
}

/// Copies bytes both ways between a websocket (binary frames) and a byte stream until either
/// side closes.
pub async fn bridge<S, IO>(ws: WebSocketStream<S>, io: IO) -> Result<(), CliError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    IO: AsyncRead + AsyncWrite + Unpin,
{
    bridge_with(ws, io, OnLocalEof::Close).await
}

/// [`bridge`] with a choice of what the end of local input means.
pub async fn bridge_with<S, IO>(
    ws: WebSocketStream<S>,
    io: IO,
    on_eof: OnLocalEof,
) -> Result<(), CliError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let (mut sink, mut stream) = ws.split();
    let (mut r, mut w) = tokio::io::split(io);
    let up = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = r.read(&mut buf).await.map_err(ws_err)?;
            if n == 0 {
                break;
            }
            sink.send(Message::Binary(bytes::Bytes::copy_from_slice(&buf[..n])))
                .await
                .map_err(ws_err)?;
        }
        if on_eof == OnLocalEof::Close {
            let _ = sink.send(Message::Close(None)).await;
        }
        Ok::<(), CliError>(())
    };
    let down = async {
        while let Some(m) = stream.next().await {
            match m.map_err(ws_err)? {
                Message::Binary(b) => w.write_all(&b).await.map_err(ws_err)?,
                Message::Text(t) => w.write_all(t.as_bytes()).await.map_err(ws_err)?,
                Message::Close(_) => break,
                _ => {}
            }
            w.flush().await.map_err(ws_err)?;
        }
        let _ = w.shutdown().await;
        Ok::<(), CliError>(())
    };
    tokio::pin!(up, down);
    tokio::select! {
        r = &mut up => match (r, on_eof) {
            (Ok(()), OnLocalEof::Drain) => down.await,
            (r, _) => r,
        },
        r = &mut down => r,
    }
}
