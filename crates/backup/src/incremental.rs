//! Incremental disk writes (docs/backup.md "Incremental reads"), the pure part: given the
//! previous backup's index of a disk and the chunks that changed since (from the volume's
//! layer chain), which chunks are read and which are taken over from that index unread. The
//! new backup still gets a full index (a restore needs no other backup).

use crate::format::{CHUNK_SIZE, ChunkRef, Index};

/// One chunk of the new index.
#[derive(Debug, Clone, PartialEq)]
pub enum Slot {
    /// Read `len` bytes from the stream of changed chunks.
    Read { len: u32 },
    /// Unchanged: the base index's entry, not read.
    Reuse(ChunkRef),
}

/// The chunks of a `size`-byte disk whose changed chunks (indices, ascending) are `changed`,
/// the others taken from `base`. Refused, with the reason, when `base` does not describe a
/// disk of this size in this chunk size or `changed` is not a list of its chunks.
pub fn plan_chunks(base: &Index, size: u64, changed: &[u64]) -> Result<Vec<Slot>, String> {
    if base.chunk_size != CHUNK_SIZE {
        return Err(format!(
            "the previous backup's index has chunk size {}, not {CHUNK_SIZE}",
            base.chunk_size
        ));
    }
    if base.size != size {
        return Err(format!(
            "the disk's size changed from {} to {size} bytes since the previous backup",
            base.size
        ));
    }
    let count = size.div_ceil(CHUNK_SIZE as u64);
    if base.chunks.len() as u64 != count {
        return Err(format!(
            "the previous backup's index has {} chunks for {size} bytes",
            base.chunks.len()
        ));
    }
    if changed.windows(2).any(|w| w[0] >= w[1]) || changed.last().is_some_and(|&l| l >= count) {
        return Err("the changed chunks are not a list of the disk's chunks".into());
    }
    let mut next = changed.iter().peekable();
    Ok(base
        .chunks
        .iter()
        .enumerate()
        .map(|(i, c)| {
            if next.peek() == Some(&&(i as u64)) {
                next.next();
                Slot::Read { len: c.len }
            } else {
                Slot::Reuse(c.clone())
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(size: u64) -> Index {
        let mut chunks = Vec::new();
        let mut left = size;
        let mut i = 0;
        while left > 0 {
            let len = left.min(CHUNK_SIZE as u64) as u32;
            let id = (i % 2 == 0).then(|| format!("{i:064}"));
            chunks.push(ChunkRef { id, len });
            left -= len as u64;
            i += 1;
        }
        Index {
            disk: "d".into(),
            size,
            chunk_size: CHUNK_SIZE,
            chunks,
        }
    }

    #[test]
    fn changed_chunks_are_read_and_the_others_reused_with_their_ids() {
        let size = 3 * CHUNK_SIZE as u64 + 100;
        let base = index(size);
        let plan = plan_chunks(&base, size, &[1, 3]).unwrap();
        assert_eq!(plan.len(), 4);
        assert_eq!(plan[0], Slot::Reuse(base.chunks[0].clone()));
        assert_eq!(
            plan[1],
            Slot::Read {
                len: CHUNK_SIZE as u32
            }
        );
        assert_eq!(plan[2], Slot::Reuse(base.chunks[2].clone()));
        assert_eq!(plan[3], Slot::Read { len: 100 });
        // Nothing changed: everything reused, nothing read.
        assert!(
            plan_chunks(&base, size, &[])
                .unwrap()
                .iter()
                .all(|s| matches!(s, Slot::Reuse(_)))
        );
    }

    #[test]
    fn a_base_that_does_not_fit_the_disk_is_refused_with_the_reason() {
        let size = 2 * CHUNK_SIZE as u64;
        let base = index(size);
        let grown = plan_chunks(&base, size + 1, &[]).unwrap_err();
        assert!(grown.contains("size changed"), "{grown}");
        assert!(plan_chunks(&base, size, &[2]).is_err());
        assert!(plan_chunks(&base, size, &[1, 0]).is_err());
        assert!(plan_chunks(&base, size, &[1, 1]).is_err());
        let mut odd = base.clone();
        odd.chunk_size = 4096;
        assert!(
            plan_chunks(&odd, size, &[])
                .unwrap_err()
                .contains("chunk size")
        );
        let mut short = base;
        short.chunks.pop();
        assert!(plan_chunks(&short, size, &[]).is_err());
    }
}
