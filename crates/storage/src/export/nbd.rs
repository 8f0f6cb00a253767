//! A flattened layer chain read through `qemu-nbd`: the server is started read-only on a
//! unix socket in a private directory, serving exactly the given `json:` description, and
//! this minimal NBD client (fixed-newstyle handshake, `NBD_OPT_EXPORT_NAME`, simple replies)
//! reads it from start to end in [`super::CHUNK`]s — or only the chunks [`open_chunks`] is
//! given (an incremental backup's changed chunks). qemu-nbd exits when the client goes
//! (dropping the stream kills it in any case).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::process::{Child, Command};

use super::{CHUNK, ExportRead, socket_dir};
use crate::error::StorageError;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const OPT_EXPORT_NAME: u32 = 1;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const CMD_READ: u16 = 0;
const CMD_DISC: u16 = 2;

fn tool(message: impl Into<String>) -> StorageError {
    StorageError::Tool {
        tool: "qemu-nbd".into(),
        message: message.into(),
    }
}

/// What keeps the server alive while the stream is read: the child (killed on drop) and its
/// socket directory (removed on drop).
struct Server {
    _child: Child,
    dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The stderr of a qemu-nbd that exits within a second (it failed), else `None` (it is killed
/// on drop).
async fn exit_reason(child: &mut Child) -> Option<String> {
    let status = tokio::time::timeout(Duration::from_secs(1), child.wait())
        .await
        .ok()?
        .ok()?;
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err).await;
    }
    Some(format!("exited with {status}: {}", err.trim()))
}

/// Serves `spec` (a `json:` image description) with qemu-nbd and opens it for reading.
pub async fn open(spec: &str) -> Result<ExportRead, StorageError> {
    let (read, _) = open_chunks(spec, |_| None).await?;
    Ok(read)
}

/// [`open`], reading only the [`super::CHUNK`]-sized chunks `select(size)` names (indices in
/// ascending order; `None`: every chunk). The stream's items are those chunks in order, the
/// last chunk of the image possibly shorter; the answer's second part is the chunks chosen.
/// An index past the end is refused.
pub async fn open_chunks(
    spec: &str,
    select: impl FnOnce(u64) -> Option<Vec<u64>>,
) -> Result<(ExportRead, Vec<u64>), StorageError> {
    let dir = socket_dir()?;
    let sock = dir.join("nbd.sock");
    let child = Command::new("qemu-nbd")
        .arg("--read-only")
        .arg("--shared=1")
        .arg(format!("--socket={}", sock.display()))
        .arg(spec)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(tool(format!("cannot start: {e}")));
        }
    };
    let mut conn = None;
    for _ in 0..200 {
        if let Ok(Some(status)) = child.try_wait() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err).await;
            }
            let _ = std::fs::remove_dir_all(&dir);
            return Err(tool(format!("exited with {status}: {}", err.trim())));
        }
        if let Ok(s) = UnixStream::connect(&sock).await {
            conn = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let Some(mut conn) = conn else {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(tool("its socket did not appear within 5 s"));
    };
    let size = match handshake(&mut conn).await {
        Ok(size) => size,
        Err(e) => {
            // qemu-nbd may take the connection and then fail to open the image (a lock still
            // held by a QEMU that is just stopping): its own reason is on its stderr, which
            // says more than the reset connection (and which callers recognise as busy).
            let why = exit_reason(&mut child).await;
            let _ = std::fs::remove_dir_all(&dir);
            return Err(tool(match why {
                Some(why) => format!("{why} (the handshake failed: {e})"),
                None => e.to_string(),
            }));
        }
    };
    let server = Server { _child: child, dir };
    let count = size.div_ceil(CHUNK as u64);
    let chosen: Vec<u64> = select(size).unwrap_or_else(|| (0..count).collect());
    if let Some(bad) = chosen.iter().find(|&&i| i >= count) {
        return Err(StorageError::invalid(
            "chunk",
            format!("chunk {bad} is past the end ({count} chunks)"),
        ));
    }
    let todo: VecDeque<(u64, u32)> = chosen
        .iter()
        .map(|&i| {
            let off = i * CHUNK as u64;
            (off, (size - off).min(CHUNK as u64) as u32)
        })
        .collect();
    let bytes: u64 = todo.iter().map(|(_, l)| u64::from(*l)).sum();
    let state = Reading {
        conn,
        todo,
        cookie: 0,
        _server: server,
    };
    let stream = futures::stream::unfold(Some(state), |st| async move {
        let mut st = st?;
        let Some((offset, len)) = st.todo.pop_front() else {
            let _ = st.disconnect().await;
            return None;
        };
        match st.read_at(offset, len).await {
            Ok(b) => Some((Ok(b), Some(st))),
            Err(e) => Some((Err(e), None)),
        }
    });
    Ok((
        ExportRead {
            size: bytes,
            stream: Box::pin(stream),
        },
        chosen,
    ))
}

/// Fixed-newstyle negotiation of the default export; answers its size.
async fn handshake(c: &mut UnixStream) -> std::io::Result<u64> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    if c.read_u64().await? != NBDMAGIC || c.read_u64().await? != IHAVEOPT {
        return Err(bad("not a newstyle NBD server"));
    }
    let flags = c.read_u16().await?;
    if flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(bad("the server is not fixed-newstyle"));
    }
    let no_zeroes = flags & FLAG_NO_ZEROES != 0;
    let ours = u32::from(FLAG_FIXED_NEWSTYLE | if no_zeroes { FLAG_NO_ZEROES } else { 0 });
    let mut msg = Vec::with_capacity(20);
    msg.extend_from_slice(&ours.to_be_bytes());
    msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
    msg.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
    msg.extend_from_slice(&0u32.to_be_bytes());
    c.write_all(&msg).await?;
    let size = c.read_u64().await?;
    let _transmission_flags = c.read_u16().await?;
    if !no_zeroes {
        let mut zeroes = [0u8; 124];
        c.read_exact(&mut zeroes).await?;
    }
    Ok(size)
}

struct Reading {
    conn: UnixStream,
    /// The (offset, length) reads still to do, in order.
    todo: VecDeque<(u64, u32)>,
    cookie: u64,
    _server: Server,
}

impl Reading {
    fn request(&mut self, cmd: u16, offset: u64, len: u32) -> [u8; 28] {
        self.cookie += 1;
        let mut r = [0u8; 28];
        r[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        r[6..8].copy_from_slice(&cmd.to_be_bytes());
        r[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        r[16..24].copy_from_slice(&offset.to_be_bytes());
        r[24..28].copy_from_slice(&len.to_be_bytes());
        r
    }

    async fn read_at(&mut self, offset: u64, len: u32) -> std::io::Result<Bytes> {
        let req = self.request(CMD_READ, offset, len);
        self.conn.write_all(&req).await?;
        let magic = self.conn.read_u32().await?;
        let error = self.conn.read_u32().await?;
        let cookie = self.conn.read_u64().await?;
        if magic != SIMPLE_REPLY_MAGIC || cookie != self.cookie {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "unexpected NBD reply",
            ));
        }
        if error != 0 {
            return Err(std::io::Error::other(format!(
                "NBD read at {offset} failed with error {error}"
            )));
        }
        let mut buf = BytesMut::zeroed(len as usize);
        self.conn.read_exact(&mut buf).await?;
        Ok(buf.freeze())
    }

    async fn disconnect(&mut self) -> std::io::Result<()> {
        let req = self.request(CMD_DISC, 0, 0);
        self.conn.write_all(&req).await
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use crate::snapshot;

    /// A volume with a snapshot, written below and above it, read flattened through
    /// qemu-nbd, equals `qemu-img convert` of the same chain; its snapshot equals the bottom.
    #[tokio::test]
    async fn a_chain_reads_flattened_and_a_snapshot_reads_its_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let img = dir.join("disk.img");
        crate::provisioner::create_sparse(&img, 8 << 20).unwrap();
        let io = |fmt: &str, cmd: &str, file: &str| {
            let ok = std::process::Command::new("qemu-io")
                .args(["-f", fmt, "-c", cmd])
                .arg(dir.join(file))
                .output()
                .unwrap();
            assert!(ok.status.success(), "{ok:?}");
        };
        io("raw", "write -P 0x11 0 1M", "disk.img");
        let handle = snapshot::take(dir).unwrap();
        assert_eq!(handle, "disk.img");
        let top = snapshot::read_chain(dir).unwrap().top().file.clone();
        io("qcow2", "write -P 0x22 5M 1M", &top);
        let read_all = |h: Option<&'static str>| {
            let dir = dir.to_path_buf();
            async move {
                let r = super::super::open(&dir, h).await.unwrap();
                let size = r.size;
                let chunks: Vec<_> = r.stream.collect().await;
                let mut all = Vec::new();
                for c in chunks {
                    all.extend_from_slice(&c.unwrap());
                }
                assert_eq!(all.len() as u64, size);
                all
            }
        };
        let live = read_all(None).await;
        assert_eq!(live.len(), 8 << 20);
        assert!(live[..1 << 20].iter().all(|b| *b == 0x11));
        assert!(live[5 << 20..6 << 20].iter().all(|b| *b == 0x22));
        let flat = dir.join("flat.img");
        snapshot::export_raw(dir, None, &flat).unwrap();
        assert_eq!(live, std::fs::read(&flat).unwrap());
        let snap = read_all(Some("disk.img")).await;
        assert!(snap[5 << 20..6 << 20].iter().all(|b| *b == 0));
        assert_eq!(snap, std::fs::read(&img).unwrap());
    }
}
