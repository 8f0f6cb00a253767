//! Image format detection from the first bytes of an untrusted image (pure), so `qemu-img` is
//! always run with `-f` and never probes. [`detect`] names the format by its magic (anything
//! unrecognised is `raw`: its bytes are imported as they are) and refuses, before `qemu-img`
//! ever opens the file, every header that makes QEMU open other files: a VMDK text
//! descriptor (its extents are other files), a VMDK sparse header in descriptor mode, qcow/qcow2
//! backing files, qcow2 external data files and VHD differencing disks.

use crate::error::StorageError;

/// How many leading bytes [`detect`] needs (QEMU's own probe buffer size).
pub const HEAD_BYTES: usize = 2048;

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn be64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?))
}
fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn le64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn refuse(m: impl Into<String>) -> StorageError {
    StorageError::Refused(format!(
        "{}; only self-contained images are accepted",
        m.into()
    ))
}

/// Whether `head` is a VMDK text descriptor as QEMU recognises one: after `#` comment lines
/// and blank lines, a `version=1|2|3` line.
pub fn is_vmdk_descriptor(head: &[u8]) -> bool {
    let mut rest = head;
    loop {
        while let Some((&c, r)) = rest.split_first() {
            if c == b' ' || c == b'\t' || c == b'\r' || c == b'\n' {
                rest = r;
            } else {
                break;
            }
        }
        if rest.first() == Some(&b'#') {
            match rest.iter().position(|&c| c == b'\n') {
                Some(i) => rest = &rest[i + 1..],
                None => return false,
            }
            continue;
        }
        return [b"version=1", b"version=2", b"version=3"]
            .iter()
            .any(|v| rest.starts_with(*v))
            || rest.starts_with(b"createType")
            || rest.starts_with(b"CID=");
    }
}

/// The format of an image whose first bytes are `head` (at least [`HEAD_BYTES`] when the file
/// is that long), or why it is refused.
pub fn detect(head: &[u8]) -> Result<&'static str, StorageError> {
    if head.starts_with(b"QFI\xfb") {
        let version = be32(head, 4).unwrap_or(0);
        if !(1..=3).contains(&version) {
            return Err(StorageError::Refused(format!(
                "not a valid disk image: unsupported qcow2 version {version}"
            )));
        }
        let backing = be64(head, 8).unwrap_or(0);
        if backing != 0 {
            let len = be32(head, 16).unwrap_or(0) as usize;
            let name = usize::try_from(backing)
                .ok()
                .and_then(|at| head.get(at..at.checked_add(len.min(1024))?))
                .map(|n| format!(" ({})", String::from_utf8_lossy(n)))
                .unwrap_or_default();
            return Err(refuse(format!("the image has a backing file{name}")));
        }
        return match version {
            1 => Ok("qcow"),
            2 => Ok("qcow2"),
            _ => {
                // Version 3: incompatible feature bit 2 is an external data file.
                let incompatible = be64(head, 72).unwrap_or(0);
                if incompatible & (1 << 2) != 0 {
                    return Err(refuse("the qcow2 image has an external data file"));
                }
                Ok("qcow2")
            }
        };
    }
    if head.starts_with(b"KDMV") {
        let capacity = le64(head, 12).unwrap_or(0);
        let desc_offset = le64(head, 28).unwrap_or(0);
        if capacity == 0 && desc_offset != 0 {
            return Err(refuse(
                "the VMDK header defers to its embedded descriptor, which may name extent files",
            ));
        }
        return Ok("vmdk");
    }
    if head.starts_with(b"COWD") {
        return Err(refuse("VMDK3 (COWD) images may name parent files"));
    }
    if is_vmdk_descriptor(head) {
        return Err(refuse(
            "the image is a VMDK descriptor file, which names its data in other files (extents)",
        ));
    }
    if head.starts_with(b"vhdxfile") {
        return Ok("vhdx");
    }
    if head.starts_with(b"conectix") {
        // Disk type 4: differencing (has a parent disk).
        if be32(head, 60) == Some(4) {
            return Err(refuse("the VHD image is a differencing disk"));
        }
        return Ok("vpc");
    }
    if le32(head, 64) == Some(0xbeda_107f) {
        // Image type 4: differencing (parent UUID); 3: undo.
        if matches!(le32(head, 0x4c), Some(3) | Some(4)) {
            return Err(refuse("the VDI image is a differencing disk"));
        }
        return Ok("vdi");
    }
    Ok("raw")
}

/// Reads the head of `path` and [`detect`]s its format.
pub fn detect_file(path: &std::path::Path) -> Result<&'static str, StorageError> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| StorageError::io(path, e))?;
    let mut head = vec![0u8; HEAD_BYTES];
    let mut n = 0;
    while n < head.len() {
        let r = f
            .read(&mut head[n..])
            .map_err(|e| StorageError::io(path, e))?;
        if r == 0 {
            break;
        }
        n += r;
    }
    detect(&head[..n])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe seen in the wild: a 135-byte descriptor with a FLAT extent on a host file.
    pub const FLAT_DESCRIPTOR: &str = "# Disk DescriptorFile\nversion=1\nCID=fffffffe\n\
        parentCID=ffffffff\ncreateType=\"monolithicFlat\"\nRW 8 FLAT \"/etc/ferrovirt/token\" 0\n";

    #[test]
    fn descriptors_are_refused() {
        let e = detect(FLAT_DESCRIPTOR.as_bytes()).unwrap_err().to_string();
        assert!(
            e.contains("VMDK descriptor") && e.contains("self-contained"),
            "{e}"
        );
        assert!(is_vmdk_descriptor(b"\n\n# c\nversion=2\n"));
        assert!(!is_vmdk_descriptor(b"hello"));
        assert!(!is_vmdk_descriptor(b"# only a comment"));
    }

    #[test]
    fn magic_numbers() {
        let mut q = b"QFI\xfb\0\0\0\x03".to_vec();
        q.resize(104, 0);
        assert_eq!(detect(&q).unwrap(), "qcow2");
        let mut data_file = q.clone();
        data_file[79] = 4;
        assert!(
            detect(&data_file)
                .unwrap_err()
                .to_string()
                .contains("data file")
        );
        let mut backing = q.clone();
        backing[15] = 104;
        backing[19] = 11;
        backing.extend_from_slice(b"/etc/passwd");
        let e = detect(&backing).unwrap_err().to_string();
        assert!(e.contains("backing file (/etc/passwd)"), "{e}");
        let mut junk = q.clone();
        junk[5] = 7;
        let e = detect(&junk).unwrap_err().to_string();
        assert!(e.contains("not a valid disk image"), "{e}");
        let mut v1 = q.clone();
        v1[7] = 1;
        assert_eq!(detect(&v1).unwrap(), "qcow");
        let mut k = b"KDMV".to_vec();
        k.resize(512, 0);
        k[12] = 1;
        assert_eq!(detect(&k).unwrap(), "vmdk");
        k[12] = 0;
        k[28] = 1;
        assert!(detect(&k).is_err());
        assert_eq!(detect(b"vhdxfile....").unwrap(), "vhdx");
        let mut vpc = b"conectix".to_vec();
        vpc.resize(512, 0);
        assert_eq!(detect(&vpc).unwrap(), "vpc");
        vpc[63] = 4;
        assert!(detect(&vpc).is_err());
        let mut vdi = vec![0u8; 512];
        vdi[64..68].copy_from_slice(&0xbeda_107fu32.to_le_bytes());
        vdi[0x4c] = 1;
        assert_eq!(detect(&vdi).unwrap(), "vdi");
        vdi[0x4c] = 4;
        assert!(detect(&vdi).is_err());
        assert_eq!(detect(&[0u8; 512]).unwrap(), "raw");
        assert_eq!(detect(&[]).unwrap(), "raw");
    }
}
