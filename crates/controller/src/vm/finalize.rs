//! The VirtualMachine finalizer, as KubeVirt keeps it: a VM carries
//! [`VM_FINALIZER`] while it lives, and once deleted keeps it until no VMI of it exists, so a
//! deletion (`kubectl delete vm X --wait`) ends only after the guest stopped. With
//! `propagationPolicy: Orphan` (the API server's `orphan` finalizer) the VMI is left running
//! and the finalizer goes at once.

use ferrovirt_api::kubevirt::vm::VirtualMachine;

/// The finalizer KubeVirt's VM controller keeps on VirtualMachines.
pub const VM_FINALIZER: &str = "kubevirt.io/virtualMachineControllerFinalize";

/// The finalizer the API server adds for `propagationPolicy: Orphan`.
pub const ORPHAN_FINALIZER: &str = "orphan";

/// What to do with the VM's finalizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalizerStep {
    /// Add [`VM_FINALIZER`].
    Add,
    /// Remove [`VM_FINALIZER`].
    Remove,
    /// Leave the finalizers as they are.
    Keep,
}

fn finalizers(vm: &VirtualMachine) -> &[String] {
    vm.metadata.finalizers.as_deref().unwrap_or_default()
}

/// Whether the VM is being deleted with `propagationPolicy: Orphan` (its VMI is to stay).
pub fn orphaning(vm: &VirtualMachine) -> bool {
    vm.metadata.deletion_timestamp.is_some() && finalizers(vm).iter().any(|f| f == ORPHAN_FINALIZER)
}

/// The finalizer step for `vm`; `vmi_exists`: a VMI controlled by this VM still exists.
pub fn finalizer_step(vm: &VirtualMachine, vmi_exists: bool) -> FinalizerStep {
    let has = finalizers(vm).iter().any(|f| f == VM_FINALIZER);
    match (vm.metadata.deletion_timestamp.is_some(), has) {
        (false, false) => FinalizerStep::Add,
        (true, true) if orphaning(vm) || !vmi_exists => FinalizerStep::Remove,
        _ => FinalizerStep::Keep,
    }
}

/// The VM's finalizer list after `step`.
pub fn apply_step(vm: &VirtualMachine, step: FinalizerStep) -> Vec<String> {
    let mut f = finalizers(vm).to_vec();
    match step {
        FinalizerStep::Add => f.push(VM_FINALIZER.into()),
        FinalizerStep::Remove => f.retain(|x| x != VM_FINALIZER),
        FinalizerStep::Keep => {}
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::testutil::vm;

    fn with(fins: &[&str], deleting: bool) -> VirtualMachine {
        let mut b = vm("a");
        if deleting {
            b = b.deleting();
        }
        let mut v = b.build();
        v.metadata.finalizers = Some(fins.iter().map(|s| s.to_string()).collect());
        v
    }

    #[test]
    fn a_live_vm_gets_the_finalizer_once() {
        let v = with(&[], false);
        assert_eq!(finalizer_step(&v, false), FinalizerStep::Add);
        assert_eq!(apply_step(&v, FinalizerStep::Add), vec![VM_FINALIZER]);
        assert_eq!(
            finalizer_step(&with(&[VM_FINALIZER], false), true),
            FinalizerStep::Keep
        );
    }

    #[test]
    fn a_deleted_vm_keeps_it_while_its_vmi_exists() {
        let v = with(&[VM_FINALIZER], true);
        assert_eq!(finalizer_step(&v, true), FinalizerStep::Keep);
        assert_eq!(finalizer_step(&v, false), FinalizerStep::Remove);
        assert!(apply_step(&v, FinalizerStep::Remove).is_empty());
    }

    #[test]
    fn orphan_removes_it_at_once_and_keeps_other_finalizers() {
        let v = with(&[ORPHAN_FINALIZER, VM_FINALIZER], true);
        assert!(orphaning(&v));
        assert_eq!(finalizer_step(&v, true), FinalizerStep::Remove);
        assert_eq!(
            apply_step(&v, FinalizerStep::Remove),
            vec![ORPHAN_FINALIZER]
        );
    }

    #[test]
    fn a_deleted_vm_without_it_is_not_given_it() {
        assert_eq!(finalizer_step(&with(&[], true), true), FinalizerStep::Keep);
    }
}
