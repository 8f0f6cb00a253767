//! A launcher the agent started early (`ferrovirt launcher --dir DIR --early-cgroup NAME`,
//! docs/scale.md "Start path"): before anything else, while its process still has one
//! thread, it joins the VM's cgroups (the ~12 ms first write of a pid to `cgroup.procs` now
//! overlaps the agent's volume and network work), then waits on stdin for the agent's word.
//! `g` + a network namespace path + NUL: it enters that namespace (the whole process: no
//! thread exists yet, and every thread it starts later, QEMU's spawner included, inherits
//! it) and goes on as an ordinary launcher, which finds itself in its cgroups already
//! ([`crate::cgroup::join`] skips them). Anything else, or EOF (the start failed, or the
//! agent is gone): it exits having written nothing, so no exit report marks the VMI.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The most the launcher reads of a word (a path under `/run/netns` is far shorter).
pub const WORD_MAX: usize = 4096;

/// The word that lets an early launcher run: `g`, the network namespace's path (empty
/// without one), a NUL.
pub fn go_word(netns: Option<&Path>) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let mut w = vec![b'g'];
    if let Some(p) = netns {
        w.extend_from_slice(p.as_os_str().as_bytes());
    }
    w.push(0);
    w
}

/// What the agent said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Word {
    /// Run, inside this network namespace when given.
    Go(Option<PathBuf>),
    /// Exit without running anything.
    Stop,
}

/// Reads the agent's word from `input`: up to the first NUL, at most [`WORD_MAX`] bytes.
/// EOF before a NUL, or anything but a `g` word, is [`Word::Stop`].
pub fn read_word(mut input: impl Read) -> Word {
    use std::os::unix::ffi::OsStrExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 256];
    loop {
        match input.read(&mut chunk) {
            Ok(0) => return Word::Stop,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return Word::Stop,
        }
        if let Some(end) = buf.iter().position(|&b| b == 0) {
            return match buf[..end].split_first() {
                Some((b'g', [])) => Word::Go(None),
                Some((b'g', path)) => Word::Go(Some(std::ffi::OsStr::from_bytes(path).into())),
                _ => Word::Stop,
            };
        }
        if buf.len() >= WORD_MAX {
            return Word::Stop;
        }
    }
}

/// Moves this process into the cgroups named `name` (created when missing); a failure is
/// logged and left to [`crate::cgroup::join`], which joins where it is not listed.
pub fn join_cgroups(name: &str) {
    let Some(h) = crate::cgroup::detect(Path::new("/sys/fs/cgroup")) else {
        return;
    };
    let pid = std::process::id().to_string();
    for dir in crate::cgroup::cgroup_dirs(&h, name) {
        let procs = dir.join("cgroup.procs");
        if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&procs, &pid)) {
            tracing::warn!("joining {} early: {e}", dir.display());
        }
    }
}

/// Enters the network namespace at `path`: the calling thread's, which is the whole process
/// while it has one thread.
pub fn enter_netns(path: &Path) -> Result<()> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path.display().to_string(), e))?;
    rustix::thread::move_into_link_name_space(
        std::os::fd::AsFd::as_fd(&f),
        Some(rustix::thread::LinkNameSpaceType::Network),
    )
    .map_err(|e| Error::io(format!("entering {}", path.display()), e.into()))
}

/// The early launcher's first steps: join the cgroups `name`, wait for the word on `input`
/// and enter the namespace it names. `Ok(false)`: told to stop.
pub fn prepare(name: &str, input: impl Read) -> Result<bool> {
    join_cgroups(name);
    match read_word(input) {
        Word::Stop => Ok(false),
        Word::Go(None) => Ok(true),
        Word::Go(Some(ns)) => enter_netns(&ns).map(|()| true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words() {
        assert_eq!(read_word(&go_word(None)[..]), Word::Go(None));
        let p = Path::new("/run/netns/fv-abc");
        assert_eq!(read_word(&go_word(Some(p))[..]), Word::Go(Some(p.into())));
        // Bytes after the NUL are not read as part of it.
        assert_eq!(read_word(&b"g\0junk"[..]), Word::Go(None));
        assert_eq!(read_word(&b""[..]), Word::Stop);
        assert_eq!(read_word(&b"g/run/netns/x"[..]), Word::Stop);
        assert_eq!(read_word(&b"x\0"[..]), Word::Stop);
        assert_eq!(read_word(&b"\0"[..]), Word::Stop);
        assert_eq!(read_word(&[b'g'; WORD_MAX + 10][..]), Word::Stop);
    }

    #[test]
    fn a_missing_namespace_is_an_error_naming_it() {
        let e = enter_netns(Path::new("/nonexistent/netns")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/netns"), "{e}");
    }
}
