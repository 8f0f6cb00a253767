//! Builders for Nodes and VMIs used by the scheduler's unit tests.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Node, NodeAffinity, NodeCondition, NodeSelector, NodeSelectorTerm, NodeSpec,
    NodeStatus, PodAffinity, PodAffinityTerm, PodAntiAffinity, PreferredSchedulingTerm, Taint,
    Toleration, WeightedPodAffinityTerm,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};

use ferrovirt_api::kubevirt::domain::{Cpu, Memory, ResourceRequirements};
use ferrovirt_api::kubevirt::vmi::{
    VirtualMachineInstance, VirtualMachineInstanceSpec, VirtualMachineInstanceStatus, VmiPhase,
};

pub const HOSTNAME: &str = "kubernetes.io/hostname";

pub struct NodeBuilder(Node);

/// A Ready node with 8 CPUs, 16Gi and its hostname label.
pub fn node(name: &str) -> NodeBuilder {
    let mut n = Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some([(HOSTNAME.to_string(), name.to_string())].into()),
            ..Default::default()
        },
        spec: Some(NodeSpec::default()),
        status: Some(NodeStatus {
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
    };
    set_alloc(&mut n, "8", "16Gi");
    NodeBuilder(n)
}

fn set_alloc(n: &mut Node, cpu: &str, mem: &str) {
    let m: BTreeMap<_, _> = [
        ("cpu".to_string(), Quantity(cpu.into())),
        ("memory".to_string(), Quantity(mem.into())),
    ]
    .into();
    n.status.as_mut().unwrap().allocatable = Some(m);
}

impl NodeBuilder {
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.0
            .metadata
            .labels
            .get_or_insert_default()
            .insert(k.into(), v.into());
        self
    }
    pub fn alloc(mut self, cpu: &str, mem: &str) -> Self {
        set_alloc(&mut self.0, cpu, mem);
        self
    }
    pub fn taint(mut self, key: &str, value: &str, effect: &str) -> Self {
        let spec = self.0.spec.get_or_insert_default();
        spec.taints.get_or_insert_default().push(Taint {
            key: key.into(),
            value: (!value.is_empty()).then(|| value.into()),
            effect: effect.into(),
            time_added: None,
        });
        self
    }
    pub fn unschedulable(mut self) -> Self {
        self.0.spec.get_or_insert_default().unschedulable = Some(true);
        self
    }
    pub fn ready(mut self, status: &str) -> Self {
        let conds = self.0.status.as_mut().unwrap().conditions.as_mut().unwrap();
        conds[0].status = status.into();
        self
    }
    pub fn build(self) -> Node {
        self.0
    }
}

pub struct VmiBuilder(VirtualMachineInstance);

/// A VMI in namespace `default` with no resources set.
pub fn vmi(name: &str) -> VmiBuilder {
    VmiBuilder(VirtualMachineInstance {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            ..Default::default()
        },
        spec: Some(VirtualMachineInstanceSpec::default()),
        ..Default::default()
    })
}

fn term(key: &str, value: &str, topology: &str) -> PodAffinityTerm {
    PodAffinityTerm {
        label_selector: Some(LabelSelector {
            match_labels: Some([(key.to_string(), value.to_string())].into()),
            match_expressions: None,
        }),
        topology_key: topology.into(),
        ..Default::default()
    }
}

impl VmiBuilder {
    fn spec(&mut self) -> &mut VirtualMachineInstanceSpec {
        self.0.spec.get_or_insert_default()
    }
    fn aff(&mut self) -> &mut Affinity {
        self.spec().affinity.get_or_insert_default()
    }
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.0
            .metadata
            .labels
            .get_or_insert_default()
            .insert(k.into(), v.into());
        self
    }
    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.0
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(k.into(), v.into());
        self
    }
    pub fn namespace(mut self, ns: &str) -> Self {
        self.0.metadata.namespace = Some(ns.into());
        self
    }
    pub fn requests(mut self, cpu: &str, mem: &str) -> Self {
        let r = self.spec().domain.resources.get_or_insert_default();
        let req = r.requests.get_or_insert_default();
        req.insert("cpu".into(), Quantity(cpu.into()));
        req.insert("memory".into(), Quantity(mem.into()));
        self
    }
    pub fn requests_extra(mut self, k: &str, v: &str) -> Self {
        let r: &mut ResourceRequirements = self.spec().domain.resources.get_or_insert_default();
        r.requests
            .get_or_insert_default()
            .insert(k.into(), Quantity(v.into()));
        self
    }
    pub fn guest(mut self, mem: &str) -> Self {
        self.spec().domain.memory = Some(Memory {
            guest: Some(Quantity(mem.into())),
            ..Default::default()
        });
        self
    }
    pub fn topology(mut self, cores: u32, sockets: u32, threads: u32) -> Self {
        self.spec().domain.cpu = Some(Cpu {
            cores: Some(cores),
            sockets: Some(sockets),
            threads: Some(threads),
            ..Default::default()
        });
        self
    }
    pub fn selector(mut self, k: &str, v: &str) -> Self {
        self.spec()
            .node_selector
            .get_or_insert_default()
            .insert(k.into(), v.into());
        self
    }
    pub fn toleration(mut self, t: Toleration) -> Self {
        self.spec().tolerations.get_or_insert_default().push(t);
        self
    }
    pub fn node_affinity(mut self, t: NodeSelectorTerm) -> Self {
        let na: &mut NodeAffinity = self.aff().node_affinity.get_or_insert_default();
        na.required_during_scheduling_ignored_during_execution
            .get_or_insert_with(|| NodeSelector {
                node_selector_terms: vec![],
            })
            .node_selector_terms
            .push(t);
        self
    }
    pub fn preferred_node_affinity(mut self, t: NodeSelectorTerm, weight: i32) -> Self {
        let na: &mut NodeAffinity = self.aff().node_affinity.get_or_insert_default();
        na.preferred_during_scheduling_ignored_during_execution
            .get_or_insert_default()
            .push(PreferredSchedulingTerm {
                preference: t,
                weight,
            });
        self
    }
    pub fn affinity(mut self, k: &str, v: &str, topo: &str) -> Self {
        let pa: &mut PodAffinity = self.aff().pod_affinity.get_or_insert_default();
        pa.required_during_scheduling_ignored_during_execution
            .get_or_insert_default()
            .push(term(k, v, topo));
        self
    }
    pub fn anti_affinity(mut self, k: &str, v: &str, topo: &str) -> Self {
        let pa: &mut PodAntiAffinity = self.aff().pod_anti_affinity.get_or_insert_default();
        pa.required_during_scheduling_ignored_during_execution
            .get_or_insert_default()
            .push(term(k, v, topo));
        self
    }
    pub fn preferred_affinity(mut self, k: &str, v: &str, topo: &str, weight: i32) -> Self {
        let pa: &mut PodAffinity = self.aff().pod_affinity.get_or_insert_default();
        pa.preferred_during_scheduling_ignored_during_execution
            .get_or_insert_default()
            .push(WeightedPodAffinityTerm {
                pod_affinity_term: term(k, v, topo),
                weight,
            });
        self
    }
    pub fn preferred_anti_affinity(mut self, k: &str, v: &str, topo: &str, weight: i32) -> Self {
        let pa: &mut PodAntiAffinity = self.aff().pod_anti_affinity.get_or_insert_default();
        pa.preferred_during_scheduling_ignored_during_execution
            .get_or_insert_default()
            .push(WeightedPodAffinityTerm {
                pod_affinity_term: term(k, v, topo),
                weight,
            });
        self
    }
    pub fn bound(mut self, node: &str, phase: VmiPhase) -> Self {
        let st: &mut VirtualMachineInstanceStatus = self.0.status.get_or_insert_default();
        st.node_name = Some(node.into());
        st.phase = Some(phase);
        self
    }
    pub fn build(self) -> VirtualMachineInstance {
        self.0
    }
}
