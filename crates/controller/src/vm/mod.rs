//! The VirtualMachine controller's pure parts: the reconcile decision ([`decide`]), the VMI
//! built from a VM ([`template`]) and crash-loop back-off ([`backoff`]).

pub mod backoff;
pub mod decide;
pub mod finalize;
pub mod template;
#[cfg(test)]
pub(crate) mod testutil;
