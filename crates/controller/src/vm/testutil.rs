//! Builders for VirtualMachines and their VMIs used by the VM controller's unit tests.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;

use ferrovirt_api::kubevirt::vm::{
    RunStrategy, StartFailure, StateChangeRequest, VirtualMachine, VirtualMachineSpec,
    VirtualMachineStatus,
};
use ferrovirt_api::kubevirt::vmi::{
    Condition, MigrationState, PhaseTransition, VirtualMachineInstance,
    VirtualMachineInstanceStatus, VmiPhase,
};

use super::template::build_vmi;

/// Seconds since the epoch as a Time.
pub fn at(secs: i64) -> Time {
    Time(Timestamp::from_second(secs).unwrap())
}

pub struct VmBuilder(VirtualMachine);

/// A VM `default/<name>` with uid `uid-<name>`, generation 1 and an empty template.
pub fn vm(name: &str) -> VmBuilder {
    VmBuilder(VirtualMachine {
        api_version: Some("kubevirt.io/v1".into()),
        kind: Some("VirtualMachine".into()),
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            uid: Some(format!("uid-{name}")),
            generation: Some(1),
            ..Default::default()
        },
        spec: Some(VirtualMachineSpec::default()),
        status: None,
    })
}

impl VmBuilder {
    fn status(&mut self) -> &mut VirtualMachineStatus {
        self.0.status.get_or_insert_default()
    }
    pub fn strategy(mut self, s: RunStrategy) -> Self {
        self.0.spec.as_mut().unwrap().run_strategy = Some(s);
        self
    }
    pub fn running(mut self, r: bool) -> Self {
        self.0.spec.as_mut().unwrap().running = Some(r);
        self
    }
    pub fn template_label(mut self, k: &str, v: &str) -> Self {
        let t = &mut self.0.spec.as_mut().unwrap().template;
        t.metadata
            .get_or_insert_default()
            .labels
            .get_or_insert_default()
            .insert(k.into(), v.into());
        self
    }
    pub fn template_annotation(mut self, k: &str, v: &str) -> Self {
        let t = &mut self.0.spec.as_mut().unwrap().template;
        t.metadata
            .get_or_insert_default()
            .annotations
            .get_or_insert_default()
            .insert(k.into(), v.into());
        self
    }
    pub fn generation(mut self, g: i64) -> Self {
        self.0.metadata.generation = Some(g);
        self
    }
    pub fn request(mut self, action: &str, uid: Option<&str>) -> Self {
        self.status()
            .state_change_requests
            .get_or_insert_default()
            .push(StateChangeRequest {
                action: action.into(),
                data: None,
                uid: uid.map(Into::into),
            });
        self
    }
    /// Pretend a previous reconcile already recorded this run strategy.
    pub fn observed_strategy(mut self, s: RunStrategy) -> Self {
        self.status().run_strategy = Some(s);
        self
    }
    pub fn start_failure(mut self, count: i32, retry_after: i64, last_uid: &str) -> Self {
        self.status().start_failure = Some(StartFailure {
            retry_after_timestamp: Some(at(retry_after)),
            consecutive_fail_count: Some(count),
            last_failed_vmi_uid: Some(last_uid.into()),
        });
        self
    }
    pub fn deleting(mut self) -> Self {
        self.0.metadata.deletion_timestamp = Some(at(1));
        self
    }
    pub fn build(self) -> VirtualMachine {
        self.0
    }
}

pub struct VmiBuilder(VirtualMachineInstance);

/// The VMI `vm` would create, with the given uid and phase.
pub fn vmi_of(vm: &VirtualMachine, uid: &str, phase: VmiPhase) -> VmiBuilder {
    let mut v = build_vmi(vm, Default::default());
    v.metadata.uid = Some(uid.into());
    v.status = Some(VirtualMachineInstanceStatus {
        phase: Some(phase),
        ..Default::default()
    });
    VmiBuilder(v)
}

impl VmiBuilder {
    fn status(&mut self) -> &mut VirtualMachineInstanceStatus {
        self.0.status.get_or_insert_default()
    }
    pub fn condition(mut self, type_: &str, status: &str, reason: &str) -> Self {
        self.status()
            .conditions
            .get_or_insert_default()
            .push(Condition {
                type_: type_.into(),
                status: status.into(),
                reason: (!reason.is_empty()).then(|| reason.into()),
                ..Default::default()
            });
        self
    }
    pub fn deleting(mut self) -> Self {
        self.0.metadata.deletion_timestamp = Some(at(1));
        self
    }
    pub fn reason(mut self, r: &str) -> Self {
        self.status().reason = Some(r.into());
        self
    }
    pub fn transition(mut self, phase: VmiPhase, secs: i64) -> Self {
        self.status()
            .phase_transition_timestamps
            .get_or_insert_default()
            .push(PhaseTransition {
                phase: Some(phase),
                phase_transition_timestamp: Some(at(secs)),
            });
        self
    }
    pub fn migrating(mut self) -> Self {
        self.status().migration_state = Some(MigrationState {
            start_timestamp: Some(at(1)),
            ..Default::default()
        });
        self
    }
    pub fn build(self) -> VirtualMachineInstance {
        self.0
    }
}
