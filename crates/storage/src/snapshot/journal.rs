//! The journal of an online layer merge in a volume's `chain.json` (docs/snapshots.md,
//! "Order and crashes").
//!
//! An online merge runs QEMU jobs under the running VM, then rewrites the record. Between the
//! two the record would name a chain the VM no longer runs: after an active commit pivoted,
//! the guest writes the raw bottom while the record still names the qcow2 top above it. So
//! before the launcher is asked to merge, [`begin_online`] writes a [`Journal`] into the
//! record (atomic rename): the chain the merge will leave and the files to delete after it.
//! The record's `layers` stay the old chain until the journal is resolved.
//!
//! A pending journal is resolved ([`resolve`], pure) from facts, never guessed:
//!
//! - [`Facts::Running`]: the VM's QEMU still runs the volume: the layer files its disk
//!   actually runs (asked of the launcher) are recorded — the merge's result, the old chain,
//!   or (streams only) the old chain less the layers a finished stream step dropped;
//! - [`Facts::Gone`]: no QEMU has the volume open. A stream leaves the old chain reading the
//!   same bytes at every point, so the old chain is kept (the next merge does it again). An
//!   active commit is decided by the launcher's **pivot marker**
//!   ([`marker_name`]): the launcher pauses the guest's vCPUs before `job-complete` and writes
//!   the marker (synced) after the pivot and before it resumes them. Marker present: the
//!   guest may have written the raw bottom since, the result (the bottom alone) is recorded.
//!   Marker absent: no guest write happened after a pivot (if there was one at all), so the
//!   old chain reads the guest's last bytes and is kept.
//!
//! [`read_resolved`] resolves a pending journal for the offline users of a volume (a VM's
//! start, offline snapshot, revert, export, offline merge) from the files, after checking
//! that no QEMU holds the volume's images (QEMU's byte-range locks on them, from
//! `/proc/locks`); the
//! node agent resolves a running VMI's volume through its launcher.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{Chain, Detached, Layer, read_chain, write_chain};
use crate::error::StorageError;

/// An online merge in progress, recorded before the launcher runs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Journal {
    /// Names the launcher's pivot marker ([`marker_name`]).
    pub id: String,
    /// The merge commits everything into the raw bottom (an active commit), else it streams.
    pub commit: bool,
    /// The live chain after the merge, bottom first.
    pub layers: Vec<Layer>,
    /// The detached layers after the merge.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub detached: Vec<Detached>,
    /// Layer files to delete once the result is recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub delete: Vec<String>,
}

/// What is known when a pending journal is resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Facts {
    /// The VM's QEMU runs the volume's disk on these layer files, bottom first.
    Running(Vec<String>),
    /// No QEMU has the volume open; `pivoted`: the launcher's pivot marker exists.
    Gone { pivoted: bool },
}

/// A resolved journal: the chain to record and the files to delete after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub chain: Chain,
    pub delete: Vec<String>,
    /// Whether the merge's result was recorded (else the old chain, or part of a stream).
    pub merged: bool,
}

/// The file the launcher writes in the volume directory once an active commit of merge `id`
/// pivoted (before the guest runs on).
pub fn marker_name(id: &str) -> String {
    format!(".merge-{id}.pivoted")
}

/// Whether `id` may name a marker file: lowercase letters, digits and `-`.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn names(layers: &[Layer]) -> Vec<String> {
    layers.iter().map(|l| l.file.clone()).collect()
}

/// The frozen layers of `chain` (live below the top, or detached).
fn frozen(chain: &Chain, name: &str) -> bool {
    chain.layers[..chain.layers.len() - 1]
        .iter()
        .any(|l| l.file == name)
        || chain.detached.iter().any(|d| d.file == name)
}

/// `chain` with `layers`/`detached` replaced, its releases kept where still frozen.
fn with_layers(chain: &Chain, layers: Vec<Layer>, detached: Vec<Detached>) -> Chain {
    let mut next = Chain {
        layers,
        next: chain.next,
        detached,
        released: Default::default(),
        journal: None,
    };
    next.released = chain
        .released
        .iter()
        .filter(|r| frozen(&next, r))
        .cloned()
        .collect();
    next
}

/// Decides what a record with a pending journal means (pure; see the module doc). `None`
/// when there is no journal. A running chain that is neither the record's, the result nor
/// (for streams) the record less whole layers is refused: nothing is decided from it.
pub fn resolve(chain: &Chain, facts: &Facts) -> Result<Option<Resolved>, StorageError> {
    let Some(j) = &chain.journal else {
        return Ok(None);
    };
    let result = || Resolved {
        chain: with_layers(chain, j.layers.clone(), j.detached.clone()),
        delete: j.delete.clone(),
        merged: true,
    };
    let old = || Resolved {
        chain: with_layers(chain, chain.layers.clone(), chain.detached.clone()),
        delete: Vec::new(),
        merged: false,
    };
    match facts {
        Facts::Gone { pivoted } => Ok(Some(if j.commit && *pivoted {
            result()
        } else {
            old()
        })),
        Facts::Running(files) => {
            if *files == names(&j.layers) {
                return Ok(Some(result()));
            }
            if *files == names(&chain.layers) {
                return Ok(Some(old()));
            }
            // Some stream steps ended: the running chain is the record less whole layers,
            // with the same bottom and top.
            let kept: Vec<Layer> = chain
                .layers
                .iter()
                .filter(|l| files.contains(&l.file))
                .cloned()
                .collect();
            let partial = !j.commit
                && names(&kept) == *files
                && kept.first() == chain.layers.first()
                && kept.last() == chain.layers.last();
            if !partial {
                return Err(StorageError::invalid(
                    "chain.json",
                    format!(
                        "the running disk's chain ({}) is neither the recorded one ({}) nor \
                         the merge's result ({})",
                        files.join(", "),
                        names(&chain.layers).join(", "),
                        names(&j.layers).join(", ")
                    ),
                ));
            }
            let delete = j
                .delete
                .iter()
                .filter(|f| chain.layers.iter().any(|l| &l.file == *f) && !files.contains(f))
                .cloned()
                .collect();
            Ok(Some(Resolved {
                chain: with_layers(chain, kept, chain.detached.clone()),
                delete,
                merged: false,
            }))
        }
    }
}

/// A journal names only plain files, keeps the raw bottom raw, and never deletes a layer it
/// keeps (a hand-edited record is refused, as any hostile `chain.json`).
pub(super) fn validate(chain: &Chain) -> Result<(), StorageError> {
    let Some(j) = &chain.journal else {
        return Ok(());
    };
    let bad = |m: String| Err(StorageError::invalid("chain.json", m));
    if !valid_id(&j.id) {
        return bad(format!("journal id {:?} is not a plain name", j.id));
    }
    let result = Chain {
        layers: j.layers.clone(),
        next: chain.next,
        detached: j.detached.clone(),
        released: Default::default(),
        journal: None,
    };
    super::validate_chain(&result)?;
    if result.layers[0] != chain.layers[0] {
        return bad("the journal's chain does not start at the volume's bottom".into());
    }
    for f in &j.delete {
        if !super::plain_name(f) {
            return bad(format!("journal file {f:?} is not a plain file name"));
        }
        let kept = result.layers.iter().any(|l| &l.file == f)
            || result.detached.iter().any(|d| &d.file == f);
        let recorded = chain.layers.iter().any(|l| &l.file == f)
            || chain.detached.iter().any(|d| &d.file == f);
        if kept || !recorded {
            return bad(format!(
                "the journal deletes {f:?}, which is not a layer it drops"
            ));
        }
    }
    Ok(())
}

/// Records `journal` in the volume's record before the launcher runs the merge. The record
/// must still be `planned` (the chain the merge was planned from) with no journal pending.
pub fn begin_online(dir: &Path, planned: &Chain, journal: Journal) -> Result<(), StorageError> {
    let mut now = read_chain(dir)?;
    if now.journal.is_some() {
        return Err(StorageError::invalid(
            "chain.json",
            "an earlier online merge's journal is still pending",
        ));
    }
    if now.layers != planned.layers || now.detached != planned.detached || now.next != planned.next
    {
        return Err(StorageError::invalid(
            "chain.json",
            "the volume's chain changed before its layers were merged online",
        ));
    }
    let _ = std::fs::remove_file(dir.join(marker_name(&journal.id)));
    now.journal = Some(journal);
    validate(&now)?;
    write_chain(dir, &now)
}

/// Resolves the pending journal of the volume in `dir` from `facts`: the resolved chain is
/// recorded (atomic rename), then the merged-away files and the pivot marker are deleted.
/// Returns the resolution (`None`: no journal was pending).
pub fn resolve_on_disk(dir: &Path, facts: &Facts) -> Result<Option<Resolved>, StorageError> {
    let chain = read_chain(dir)?;
    let Some(resolved) = resolve(&chain, facts)? else {
        return Ok(None);
    };
    write_chain(dir, &resolved.chain)?;
    for f in &resolved.delete {
        let _ = std::fs::remove_file(dir.join(f));
    }
    if let Some(j) = &chain.journal {
        let _ = std::fs::remove_file(dir.join(marker_name(&j.id)));
    }
    Ok(Some(resolved))
}

/// Whether a QEMU holds the file `(dev, ino)` open, from `/proc/locks` (pure): QEMU locks
/// bytes 100–299 of every image it opens (its permissions and the ones it does not share),
/// read-only backings included.
pub fn qemu_holds(proc_locks: &str, dev: u64, ino: u64) -> bool {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let file = format!("{major:02x}:{minor:02x}:{ino}");
    proc_locks.lines().any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        // `N: OFDLCK ADVISORY READ -1 fe:00:123 100 101`, `N: -> …` for a blocked waiter.
        let Some(at) = f.iter().position(|x| *x == file) else {
            return false;
        };
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
        let start = num(at + 1).unwrap_or(0);
        let end = f
            .get(at + 2)
            .map_or(u64::MAX, |v| v.parse().unwrap_or(u64::MAX));
        start <= 299 && end >= 100
    })
}

/// Whether the launcher's pivot marker of the record's pending journal exists.
pub fn pivoted(dir: &Path, chain: &Chain) -> bool {
    chain
        .journal
        .as_ref()
        .is_some_and(|j| dir.join(marker_name(&j.id)).exists())
}

/// The volume's record for an offline user: a pending journal is first resolved from the
/// files ([`Facts::Gone`]), refused while a QEMU still holds the record's images (its
/// launcher answers for it: the node agent resolves it through the launcher).
pub fn read_resolved(dir: &Path) -> Result<Chain, StorageError> {
    let chain = read_chain(dir)?;
    if chain.journal.is_none() {
        return Ok(chain);
    }
    let locks =
        std::fs::read_to_string("/proc/locks").map_err(|e| StorageError::io("/proc/locks", e))?;
    for l in &chain.layers {
        let path = dir.join(&l.file);
        let meta = std::fs::metadata(&path).map_err(|e| StorageError::io(&path, e))?;
        if qemu_holds(&locks, meta.dev(), meta.ino()) {
            return Err(StorageError::InUse(format!(
                "an online merge of the volume is unfinished and a QEMU still has its image {} \
                 open (its launcher answers for it)",
                l.file
            )));
        }
    }
    let facts = Facts::Gone {
        pivoted: pivoted(dir, &chain),
    };
    Ok(match resolve_on_disk(dir, &facts)? {
        Some(r) => r.chain,
        None => read_chain(dir)?,
    })
}

#[cfg(test)]
#[path = "journal_tests.rs"]
mod tests;
