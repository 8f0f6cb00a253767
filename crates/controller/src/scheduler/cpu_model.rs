//! Named CPU models (docs/hyperconverged.md "CPU models"), pure: a VMI whose
//! `spec.domain.cpu.model` names a model (anything but `host-model` and `host-passthrough`)
//! fits only a node labelled `cpu-model.node.kubevirt.io/<Model>=true` (the agent's node
//! labelling, as KubeVirt's node-labeller); a model the KubeVirt CR lists in
//! `obsoleteCPUModels` fits no node. Either way the reason names the field and the model.

use std::collections::BTreeSet;

use ferrovirt_api::kubevirt::cpu_model::{CPU_MODEL_LABEL, is_named, node_offers, vmi_model};
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use k8s_openapi::api::core::v1::Node;

/// Why `node` cannot run `vmi`'s CPU model (`None`: it can, or the VMI names none).
pub fn unmet(
    vmi: &VirtualMachineInstance,
    node: &Node,
    obsolete: &BTreeSet<String>,
) -> Option<String> {
    let model = vmi_model(vmi).filter(|m| is_named(m))?;
    if obsolete.contains(model) {
        return Some(format!(
            "node(s) cannot honour spec.domain.cpu.model: CPU model {model} is obsolete \
             (obsoleteCPUModels)"
        ));
    }
    (!node_offers(node.metadata.labels.as_ref(), model)).then(|| {
        format!(
            "node(s) cannot honour spec.domain.cpu.model: no CPU model {model} \
             (label {CPU_MODEL_LABEL}{model})"
        )
    })
}

#[cfg(test)]
mod tests {
    use ferrovirt_api::kubevirt::domain::Cpu;

    use super::super::testutil::{node, vmi};
    use super::super::{Decision, SchedulerOptions, Snapshot};
    use super::*;

    fn with_model(model: Option<&str>) -> VirtualMachineInstance {
        let mut v = vmi("v").build();
        v.spec.as_mut().unwrap().domain.cpu = Some(Cpu {
            model: model.map(str::to_string),
            ..Default::default()
        });
        v
    }

    fn obsolete(models: &[&str]) -> BTreeSet<String> {
        models.iter().map(|m| m.to_string()).collect()
    }

    #[test]
    fn a_named_model_needs_the_label() {
        let labelled = node("a")
            .label("cpu-model.node.kubevirt.io/Westmere", "true")
            .build();
        let bare = node("b").build();
        let none = obsolete(&[]);
        assert_eq!(unmet(&with_model(Some("Westmere")), &labelled, &none), None);
        let why = unmet(&with_model(Some("Westmere")), &bare, &none).unwrap();
        assert!(
            why.contains("spec.domain.cpu.model")
                && why.contains("cpu-model.node.kubevirt.io/Westmere"),
            "{why}"
        );
        // host-model, host-passthrough and no model need no label.
        for m in [None, Some("host-model"), Some("host-passthrough"), Some("")] {
            assert_eq!(unmet(&with_model(m), &bare, &none), None, "{m:?}");
        }
    }

    #[test]
    fn an_obsolete_model_fits_nowhere_and_says_so() {
        let n = node("a")
            .label("cpu-model.node.kubevirt.io/Nehalem", "true")
            .build();
        let why = unmet(&with_model(Some("Nehalem")), &n, &obsolete(&["Nehalem"])).unwrap();
        assert!(why.contains("CPU model Nehalem is obsolete"), "{why}");
        // Through the scheduler: the VMI stays unschedulable with the reason.
        let nodes = [n];
        let opts = SchedulerOptions {
            obsolete_cpu_models: obsolete(&["Nehalem"]),
            ..SchedulerOptions::default()
        };
        let snap = Snapshot::new(&nodes, [], &opts);
        match snap.schedule(&with_model(Some("Nehalem")), &[], &[]) {
            Decision::Unschedulable(e) => assert_eq!(
                e.to_string(),
                "0/1 nodes are available: 1 node(s) cannot honour spec.domain.cpu.model: \
                 CPU model Nehalem is obsolete (obsoleteCPUModels)."
            ),
            d => panic!("{d:?}"),
        }
        let opts = SchedulerOptions {
            obsolete_cpu_models: obsolete(&[]),
            ..SchedulerOptions::default()
        };
        assert_eq!(
            Snapshot::new(&nodes, [], &opts).schedule(&with_model(Some("Nehalem")), &[], &[]),
            Decision::Bind { node: "a".into() }
        );
    }
}
