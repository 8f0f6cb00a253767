//! ferrovirt's user verbs, kubectl's and virtctl's, speaking only the public API so they work
//! against any ferrovirt (or Kubernetes + KubeVirt) server.
//!
//! - [`target`]: which server and credentials (kubeconfig, `$KUBECONFIG`, or the local server's).
//! - [`session`]: a connected client with the server's resource types ([`resources`]).
//! - kubectl: [`get`], [`describe`], [`apply`] (apply/create/edit), [`wait`] (wait/delete),
//!   `api-resources` ([`resources::api_resources_table`]); output formats in [`printer`] and
//!   [`jsonpath`].
//! - virtctl: [`virt`] (start, stop, restart, pause, unpause, soft-reboot, guestosinfo, userlist,
//!   fslist), [`console`], [`vnc`] (proxy and screenshot), [`create_vm`], [`expand`],
//!   [`upload`] (image-upload), [`vmexport`] (vmexport create/download/delete).
//! - [`backup`]: `backup create|list|describe|verify|restore` (backup.ferrovirt.io).
//! - [`error`]: kubectl-style messages.

pub mod apply;
pub mod backup;
pub mod completion;
pub mod console;
pub mod create_vm;
pub mod describe;
pub mod error;
pub mod expand;
pub mod expose;
pub mod get;
pub mod migrate;
pub mod portforward;
pub mod printer;
pub mod progress;
pub mod resources;
pub mod session;
pub mod ssh;
pub mod target;
pub mod transport;
pub mod upload;
pub mod virt;
pub mod vmexport;
pub mod vnc;
pub mod wait;
pub mod wsio;

pub use error::CliError;
