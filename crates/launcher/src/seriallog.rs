//! The bounded serial log. QEMU does not write `serial.log` itself: its serial chardev's
//! `logfile` is a FIFO next to the log ([`fifo_path`]), and the launcher copies what arrives
//! into the log, rotating it to `<log>.1` before it would pass its bound, so a guest printing
//! without end costs at most twice the bound on disk. [`RotatingLog`] is the file side
//! (synchronous, testable); [`spawn`] wires the FIFO to it.

use std::io::Write;
use std::path::{Path, PathBuf};

use tokio::io::AsyncReadExt;

use crate::error::{Error, Result};

/// The FIFO QEMU writes the serial log into.
pub fn fifo_path(log: &Path) -> PathBuf {
    let mut name = log.file_name().unwrap_or_default().to_os_string();
    name.push(".fifo");
    log.with_file_name(name)
}

/// The older half of a rotated log.
pub fn rotated_path(log: &Path) -> PathBuf {
    let mut name = log.file_name().unwrap_or_default().to_os_string();
    name.push(".1");
    log.with_file_name(name)
}

/// A log file that never grows past `max` bytes: when a write would pass it, the file is
/// renamed to `<log>.1` and a new one begun.
#[derive(Debug)]
pub struct RotatingLog {
    path: PathBuf,
    max: u64,
    file: std::fs::File,
    size: u64,
}

fn open_log(path: &Path, truncate: bool) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.create(true).mode(0o600);
    if truncate {
        o.write(true).truncate(true);
    } else {
        o.append(true);
    }
    o.open(path)
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))
}

impl RotatingLog {
    /// Opens (appending to) the log at `path`, bounded by `max` bytes (at least 1).
    pub fn open(path: &Path, max: u64) -> Result<Self> {
        let file = open_log(path, false)?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(RotatingLog {
            path: path.to_path_buf(),
            max: max.max(1),
            file,
            size,
        })
    }

    /// Appends `data`, rotating first when it would not fit. Of a chunk larger than the bound
    /// only its last `max` bytes are kept.
    pub fn write(&mut self, mut data: &[u8]) -> Result<()> {
        if data.len() as u64 > self.max {
            data = &data[data.len() - self.max as usize..];
        }
        if self.size + data.len() as u64 > self.max {
            let old = rotated_path(&self.path);
            std::fs::rename(&self.path, &old)
                .map_err(|e| Error::io(format!("rotating {}", self.path.display()), e))?;
            self.file = open_log(&self.path, true)?;
            self.size = 0;
        }
        self.file
            .write_all(data)
            .map_err(|e| Error::io(format!("writing {}", self.path.display()), e))?;
        self.size += data.len() as u64;
        Ok(())
    }
}

/// Creates the FIFO for `log` (replacing a stale one) and starts copying from it into the
/// bounded log. The FIFO is opened read-write so it never reports end-of-file while QEMU
/// restarts or has not opened it yet. The task ends when aborted.
pub fn spawn(log: &Path, max: u64) -> Result<tokio::task::JoinHandle<()>> {
    let fifo = fifo_path(log);
    let _ = std::fs::remove_file(&fifo);
    let out = std::process::Command::new("mkfifo")
        .args(["-m", "0600"])
        .arg(&fifo)
        .output()
        .map_err(|e| Error::io("running mkfifo", e))?;
    if !out.status.success() {
        return Err(Error::io(
            format!("mkfifo {}", fifo.display()),
            std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        ));
    }
    let mut rx = tokio::net::unix::pipe::OpenOptions::new()
        .read_write(true)
        .open_receiver(&fifo)
        .map_err(|e| Error::io(format!("opening {}", fifo.display()), e))?;
    let mut sink = RotatingLog::open(log, max)?;
    Ok(tokio::spawn(async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match rx.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if let Err(e) = sink.write(&buf[..n]) {
                        tracing::warn!("serial log: {e}");
                    }
                }
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_never_passes_its_bound() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("serial.log");
        let mut l = RotatingLog::open(&log, 100).unwrap();
        for _ in 0..50 {
            l.write(b"0123456789abcdef").unwrap();
            assert!(std::fs::metadata(&log).unwrap().len() <= 100);
        }
        assert!(std::fs::metadata(rotated_path(&log)).unwrap().len() <= 100);
        l.write(&[b'x'; 1000]).unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), vec![b'x'; 100]);
        assert_eq!(
            fifo_path(&log),
            d.path().join("serial.log.fifo"),
            "the FIFO sits beside the log"
        );
    }

    #[tokio::test]
    async fn copies_from_the_fifo() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("serial.log");
        let task = spawn(&log, 64).unwrap();
        {
            let mut w = std::fs::OpenOptions::new()
                .write(true)
                .open(fifo_path(&log))
                .unwrap();
            for _ in 0..20 {
                w.write_all(b"hello world\n").unwrap();
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        task.abort();
        let n = std::fs::metadata(&log).unwrap().len();
        assert!(n > 0 && n <= 64, "{n}");
    }
}
