//! Reclaiming a volume's layers once the snapshots that held them are deleted.
//!
//! A snapshot's handle is the layer it froze. When a snapshot is deleted its layer is still in
//! the chain: every layer above reads through it. The deletion is recorded first ([`release`]:
//! the handle joins the chain's `released` set, whether or not a VM runs on the volume); a
//! layer never released is never dropped, so a snapshot being taken while a reclaim runs is
//! safe. [`plan_reclaim`] (pure) is told which layers are still held (every frozen layer not
//! released) and decides how to drop the others:
//!
//! - a detached layer (left above a revert point) that nothing holds and nothing is backed by
//!   is deleted outright;
//! - when no frozen layer is held any more, every qcow2 layer is committed into the raw bottom
//!   (`qemu-img commit`, cost ∝ the data written since the first snapshot) and the volume is a
//!   plain raw image again (so it can grow);
//! - otherwise each run of unheld frozen layers is streamed into the layer above it
//!   (`qemu-img rebase` onto the nearest held layer below, cost ∝ the dropped layers' data). The
//!   layer above keeps reading the same bytes, so a snapshot that layer holds is unchanged.
//!
//! [`reclaim`] carries the plan out on an unused volume (no running VM writes it; the caller
//! checks): every step leaves the recorded chain reading the same bytes if it is cut short,
//! `chain.json` is rewritten after the steps and the dropped files are deleted last. Every
//! image is opened through a `json:` description naming its backing; the only header write is
//! the backing name a rebase records (relative, as [`super::take`] writes it).

use std::collections::BTreeSet;
use std::path::Path;

use super::{Chain, Layer, LayerFormat, blockdev_json, qemu_img, read_chain, write_chain};
use crate::error::StorageError;

/// One I/O step of a reclaim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Copy into `image` what the layers between it and `onto` hold, then back it by `onto`.
    /// `old` is the chain under and including `image` before (bottom first); `onto` the new
    /// backing chain (bottom first).
    Rebase {
        image: Layer,
        old: Vec<Layer>,
        onto: Vec<Layer>,
    },
    /// Commit every layer of `layers` (bottom first, the bottom raw) into the bottom.
    CommitAll { layers: Vec<Layer> },
}

/// What a reclaim does to a volume.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReclaimPlan {
    pub steps: Vec<Step>,
    /// The chain to record after the steps.
    pub chain: Chain,
    /// Layer files to delete once the chain is recorded.
    pub delete: Vec<String>,
}

impl ReclaimPlan {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty() && self.delete.is_empty()
    }
}

/// Plan dropping the frozen layers of `chain` that no handle in `held` names.
pub fn plan_reclaim(chain: &Chain, held: &BTreeSet<String>) -> ReclaimPlan {
    let mut next = chain.clone();
    let mut delete = Vec::new();
    // Detached leaves nothing holds, repeatedly (a dropped leaf may uncover another).
    loop {
        let leaf = next.detached.iter().position(|d| {
            !held.contains(&d.file) && !next.detached.iter().any(|o| o.backing == d.file)
        });
        match leaf {
            Some(i) => delete.push(next.detached.remove(i).file),
            None => break,
        }
    }
    let pinned: BTreeSet<&str> = held
        .iter()
        .map(String::as_str)
        .chain(next.detached.iter().map(|d| d.backing.as_str()))
        .collect();
    let n = next.layers.len();
    let frozen = &next.layers[..n - 1];
    let mut steps = Vec::new();
    if n > 1
        && next.detached.is_empty()
        && next.layers[0].format == LayerFormat::Raw
        && !frozen.iter().any(|l| pinned.contains(l.file.as_str()))
    {
        steps.push(Step::CommitAll {
            layers: next.layers.clone(),
        });
        delete.extend(next.layers[1..].iter().map(|l| l.file.clone()));
        next.layers.truncate(1);
        next.released.clear();
        return ReclaimPlan {
            steps,
            chain: next,
            delete,
        };
    }
    // Runs of unpinned frozen layers above the bottom, each streamed into the layer above.
    let mut i = 1;
    while i + 1 < next.layers.len() {
        if pinned.contains(next.layers[i].file.as_str()) {
            i += 1;
            continue;
        }
        let mut end = i; // last unpinned of the run
        while end + 2 < next.layers.len() && !pinned.contains(next.layers[end + 1].file.as_str()) {
            end += 1;
        }
        steps.push(Step::Rebase {
            image: next.layers[end + 1].clone(),
            old: next.layers[..=end + 1].to_vec(),
            onto: next.layers[..i].to_vec(),
        });
        delete.extend(next.layers.drain(i..=end).map(|l| l.file));
        i += 1;
    }
    let released = std::mem::take(&mut next.released);
    next.released = released
        .into_iter()
        .filter(|r| delete.iter().all(|d| d != r) && is_frozen(&next, r))
        .collect();
    ReclaimPlan {
        steps,
        chain: next,
        delete,
    }
}

/// Whether `name` is a frozen layer of `chain`: live below the top, or detached.
fn is_frozen(chain: &Chain, name: &str) -> bool {
    chain.layers[..chain.layers.len() - 1]
        .iter()
        .any(|l| l.file == name)
        || chain.detached.iter().any(|d| d.file == name)
}

/// The layers still held by a snapshot: every frozen layer that was not released.
pub fn held_layers(chain: &Chain) -> BTreeSet<String> {
    chain.layers[..chain.layers.len() - 1]
        .iter()
        .map(|l| l.file.clone())
        .chain(chain.detached.iter().map(|d| d.file.clone()))
        .filter(|f| !chain.released.contains(f))
        .collect()
}

/// Record that the snapshots holding `handles` were deleted. Names that are not frozen
/// layers of the volume (already reclaimed, or never one of its snapshots) are ignored.
/// Returns whether anything was recorded.
pub fn release(dir: &Path, handles: &[String]) -> Result<bool, StorageError> {
    let mut chain = read_chain(dir)?;
    let mut changed = false;
    for h in handles {
        if is_frozen(&chain, h) {
            changed |= chain.released.insert(h.clone());
        }
    }
    if changed {
        write_chain(dir, &chain)?;
    }
    Ok(changed)
}

/// What [`reclaim`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct ReclaimReport {
    /// Layers merged away or deleted.
    pub dropped: Vec<String>,
    /// Whether the volume is a single raw image again.
    pub plain: bool,
}

/// Drop the released layers of the unused volume in `dir` (see the module doc). Also deletes
/// stray layer files a crash left outside the record.
pub fn reclaim(dir: &Path) -> Result<ReclaimReport, StorageError> {
    let chain = super::read_resolved(dir)?;
    let plan = plan_reclaim(&chain, &held_layers(&chain));
    for step in &plan.steps {
        run_step(dir, step)?;
    }
    if !plan.is_empty() {
        write_chain(dir, &plan.chain)?;
    }
    let mut dropped = plan.delete.clone();
    for f in &plan.delete {
        let _ = std::fs::remove_file(dir.join(f));
    }
    for stray in strays(dir, &plan.chain) {
        let _ = std::fs::remove_file(dir.join(&stray));
        dropped.push(stray);
    }
    Ok(ReclaimReport {
        dropped,
        plain: plan.chain.is_plain(),
    })
}

/// Records an online reclaim of the volume in `dir` once QEMU has carried out `plan`'s steps
/// under the running VM (`planned` is the chain the plan was made from), then deletes the
/// dropped layer files QEMU no longer has open (`open`, file names; one still open is kept:
/// a later reclaim's stray sweep takes it once the VM stopped). Order (docs/snapshots.md):
/// QEMU's job first, then `chain.json` replaced atomically, files deleted last; layers
/// released meanwhile (a concurrent release) stay released. A chain that changed otherwise
/// since the plan is refused and left as it is.
pub fn finish_online(
    dir: &Path,
    planned: &Chain,
    plan: &ReclaimPlan,
    open: &[String],
) -> Result<OnlineReport, StorageError> {
    let now = read_chain(dir)?;
    if now.layers != planned.layers || now.detached != planned.detached || now.next != planned.next
    {
        return Err(StorageError::invalid(
            "chain.json",
            "the volume's chain changed while its layers were merged online".to_string(),
        ));
    }
    let mut chain = plan.chain.clone();
    chain.journal = None;
    for r in now.released.difference(&planned.released) {
        if is_frozen(&chain, r) {
            chain.released.insert(r.clone());
        }
    }
    if !plan.is_empty() || now.journal.is_some() {
        write_chain(dir, &chain)?;
    }
    if let Some(j) = &now.journal {
        let _ = std::fs::remove_file(dir.join(super::journal::marker_name(&j.id)));
    }
    let mut report = OnlineReport {
        plain: chain.is_plain(),
        ..OnlineReport::default()
    };
    for f in &plan.delete {
        if open.contains(f) {
            report.kept_open.push(f.clone());
            continue;
        }
        let _ = std::fs::remove_file(dir.join(f));
        report.dropped.push(f.clone());
    }
    Ok(report)
}

/// What [`finish_online`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OnlineReport {
    /// Layer files merged away and deleted.
    pub dropped: Vec<String>,
    /// Layer files merged away that QEMU still had open: not deleted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kept_open: Vec<String>,
    /// Whether the volume is a single raw image again.
    pub plain: bool,
}

/// Layer files below the chain's next number that the record does not name: left by a crash
/// between a step and the record's rewrite (or by a revert before detached layers were
/// recorded; no snapshot could read those). Files numbered from `next` on may be an online
/// snapshot's prepared layer and are left alone.
fn strays(dir: &Path, chain: &Chain) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(n) = name
            .strip_prefix("layer-")
            .and_then(|r| r.strip_suffix(".qcow2"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let recorded = chain.layers.iter().any(|l| l.file == name)
            || chain.detached.iter().any(|d| d.file == name);
        if n < chain.next && !recorded {
            out.push(name);
        }
    }
    out.sort();
    out
}

fn run_step(dir: &Path, step: &Step) -> Result<(), StorageError> {
    match step {
        Step::Rebase { image, old, onto } => {
            let image_spec = format!("json:{}", blockdev_json(dir, old));
            let onto_top = onto.last().expect("a rebase has a backing");
            let onto_spec = format!("json:{}", blockdev_json(dir, onto));
            let fmt = onto_top.format.as_str();
            // Copy what the dropped layers hold into `image` (its visible bytes unchanged)...
            qemu_img(&["rebase", "-q", "-F", fmt, "-b", &onto_spec, &image_spec])?;
            // ...then record the new backing by its plain name, as every layer does.
            let path = dir.join(&image.file).display().to_string();
            qemu_img(&[
                "rebase",
                "-q",
                "-u",
                "-f",
                "qcow2",
                "-F",
                fmt,
                "-b",
                &onto_top.file,
                &path,
            ])
        }
        Step::CommitAll { layers } => {
            let spec = format!("json:{}", blockdev_json(dir, layers));
            let base = dir.join(&layers[0].file).display().to_string();
            qemu_img(&["commit", "-q", "-b", &base, &spec])
        }
    }
}

#[cfg(test)]
#[path = "reclaim_tests.rs"]
mod tests;
