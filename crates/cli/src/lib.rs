//! ferrovirt's user verbs (virtctl's and, later, kubectl's), speaking only the public API so they
//! work against any ferrovirt server.
//!
//! - [`target`]: which server and credentials (kubeconfig, `$KUBECONFIG`, or the local server's).
//! - [`virt`]: VM verbs on KubeVirt's subresources (start, stop, restart, pause, unpause,
//!   soft-reboot, guestosinfo, userlist, fslist) with kubectl-style errors.
//! - [`console`]: the interactive serial console over the console websocket.

pub mod console;
pub mod error;
pub mod target;
pub mod virt;

pub use error::CliError;
