//! ferrovirt-storage: the I/O building blocks of ferrovirt's storage layer, free of API types.
//!
//! - [`provisioner`]: volume directories (`<root>/<pv>/disk.img`, thin raw sparse files) for
//!   the built-in `shared` and `local` classes, deletion, and copying for clones;
//! - [`header`]: format detection from image headers (refuses multi-file images);
//! - [`qemu_img`]: `qemu-img info --output=json`, `convert -p` with progress, `resize`;
//! - [`block`]: Block-mode volumes as loop devices over `disk.img` (attach, grow, detach);
//! - [`checksum`]: `sha256:<hex>`-style checksums;
//! - [`http`]: the HTTP(S) downloader (reqwest + rustls), shared with the registry client;
//! - [`netpolicy`]: the address policy of imports (no loopback, link-local, … unless
//!   allowed), with the filtering DNS resolver;
//! - [`tls`]: rustls client settings (system roots + `certConfigMap`, `insecureSkipVerify`);
//! - [`importer`]: download → checksum → decompress → validate → convert to raw;
//! - [`registry`]: disk images from OCI registries (containerDisk layout): the distribution
//!   API client, layer extraction, the DataVolume `registry` import and the node's image cache.
//! - [`export`]: a volume or snapshot read out as a raw (or gzip) stream, chains through
//!   qemu-nbd (VirtualMachineExport).
//! - [`snapshot`]: copy-on-write volume snapshots (a recorded qcow2 layer chain per volume).
//! - [`shared_mount`]: shared filesystems declared in StorageClasses (mount parameter, the
//!   marker every node must see, the Node condition and annotation they feed).
//!
//! The format choices are documented in `docs/storage.md`.

pub mod block;
pub mod checksum;
pub mod error;
pub mod export;
pub mod header;
pub mod http;
pub mod importer;
pub mod netpolicy;
pub mod provisioner;
pub mod qemu_img;
pub mod registry;
pub mod shared_mount;
pub mod snapshot;
pub mod tls;

pub use error::StorageError;
