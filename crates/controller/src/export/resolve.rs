//! Reads an export's source from the API into what [`super::plan`] and the download routes
//! need: the exported volumes (claim, PV, snapshot layer) or why they cannot be served now.
//! A VM export whose own online snapshot ([`super::plan::snapshot_name`], owned by the
//! export) exists is read from that snapshot, as an export of the snapshot would be; a
//! running VM without one asks for it ([`SourceState::NeedsSnapshot`]).
//! Everything is looked up in the export's own namespace: a source names no namespace, so
//! no export can reach another namespace's objects.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::Api;

use ferrovirt_api::kubevirt::export::VirtualMachineExport;
use ferrovirt_api::kubevirt::vmi::VmiPhase;

use super::plan::SourceState;
use crate::error::ControllerError;
use crate::runtime::resources::{Vm, Vmi};
use crate::snapshot::resources::{VmSnapshot, VmSnapshotContent, VolSnap, VolSnapContent};
use crate::storage::pvc_loop::claims_of;

/// One exported volume.
#[derive(Debug, Clone)]
pub struct Volume {
    /// The export's name for it: the claim's name.
    pub name: String,
    pub claim: PersistentVolumeClaim,
    pub pv: PersistentVolume,
    /// The snapshot layer to read (a VirtualMachineSnapshot source), else the live volume.
    pub handle: Option<String>,
}

/// What the source looks like.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub state: SourceState,
    /// The volumes (complete only when `state` is `Ready`).
    pub volumes: Vec<Volume>,
    /// The VM to recreate (a VirtualMachine source, or the one a snapshot captured), as JSON.
    pub vm: Option<serde_json::Value>,
}

impl Resolved {
    fn not(state: SourceState) -> Self {
        Resolved {
            state,
            volumes: Vec::new(),
            vm: None,
        }
    }
}

/// Reads the source of export `export` (in its namespace).
pub async fn resolve(
    client: &kube::Client,
    export: &VirtualMachineExport,
) -> Result<Resolved, ControllerError> {
    let ns = export.metadata.namespace.as_deref().unwrap_or("");
    let spec = export.spec.clone().unwrap_or_default();
    let name = spec.source.name.as_str();
    match spec.source.kind.as_str() {
        "PersistentVolumeClaim" => {
            if let Some(vmi) = active_user(client, ns, name).await? {
                return Ok(Resolved::not(SourceState::InUse(format!(
                    "PersistentVolumeClaim {name} is in use by the running VirtualMachineInstance {vmi}"
                ))));
            }
            let mut out = Resolved::not(SourceState::Ready {
                vm_name: None,
                volumes: vec![name.to_string()],
                via_snapshot: None,
            });
            match claim_volume(client, ns, name, None).await? {
                Ok(v) => out.volumes.push(v),
                Err(state) => return Ok(Resolved::not(state)),
            }
            Ok(out)
        }
        "VirtualMachine" => {
            let own = super::plan::snapshot_name(export.metadata.name.as_deref().unwrap_or(""));
            let snap = Api::<VmSnapshot>::namespaced(client.clone(), ns)
                .get_opt(&own)
                .await?
                .filter(|s| {
                    super::plan::owned_by(&s.0.metadata, export)
                        && s.0.spec.as_ref().is_some_and(|sp| sp.source.name == name)
                });
            if let Some(snap) = snap {
                return export_snapshot_source(client, ns, &snap).await;
            }
            let Some(vm) = Api::<Vm>::namespaced(client.clone(), ns)
                .get_opt(name)
                .await?
            else {
                return Ok(Resolved::not(SourceState::NotFound(format!(
                    "VirtualMachine {name} not found"
                ))));
            };
            let claims: Vec<String> =
                vm.0.spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref())
                    .and_then(|s| s.volumes.as_ref())
                    .into_iter()
                    .flatten()
                    .filter_map(|v| {
                        v.persistent_volume_claim
                            .as_ref()
                            .map(|c| c.claim_name.clone())
                            .or_else(|| v.data_volume.as_ref().map(|d| d.name.clone()))
                    })
                    .collect();
            let vmi = Api::<Vmi>::namespaced(client.clone(), ns)
                .get_opt(name)
                .await?;
            if !claims.is_empty() && vmi.is_some_and(|v| is_active(&v)) {
                return Ok(Resolved::not(SourceState::NeedsSnapshot {
                    vm: name.to_string(),
                }));
            }
            let vm_json = serde_json::to_value(&vm.0)?;
            volumes_of(client, ns, claims, Some(name.to_string()), vm_json, |_| {
                None
            })
            .await
        }
        "VirtualMachineSnapshot" => snapshot_source(client, ns, name).await,
        other => Ok(Resolved::not(SourceState::NotFound(format!(
            "exporting a {other} is not supported"
        )))),
    }
}

/// The volumes of VirtualMachineSnapshot `name`: each volume backup of its content under the
/// captured claim's name, read from the snapshot's frozen layer; the VM as captured.
pub(crate) async fn snapshot_source(
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> Result<Resolved, ControllerError> {
    let Some(snap) = Api::<VmSnapshot>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await?
    else {
        return Ok(Resolved::not(SourceState::NotFound(format!(
            "VirtualMachineSnapshot {name} not found"
        ))));
    };
    let status = snap.0.status.clone().unwrap_or_default();
    if status.ready_to_use != Some(true) {
        return Ok(Resolved::not(SourceState::NotReady(format!(
            "VirtualMachineSnapshot {name} is not ready to use"
        ))));
    }
    let Some(content_name) = status.virtual_machine_snapshot_content_name else {
        return Ok(Resolved::not(SourceState::NotReady(format!(
            "VirtualMachineSnapshot {name} has no content"
        ))));
    };
    let Some(content) = Api::<VmSnapshotContent>::namespaced(client.clone(), ns)
        .get_opt(&content_name)
        .await?
    else {
        return Ok(Resolved::not(SourceState::NotFound(format!(
            "VirtualMachineSnapshotContent {content_name} not found"
        ))));
    };
    let spec = content.0.spec.clone().unwrap_or_default();
    let vm_json = serde_json::to_value(spec.source.virtual_machine.clone())?;
    let vm_name = spec
        .source
        .virtual_machine
        .as_ref()
        .and_then(|v| v.metadata.as_ref())
        .and_then(|m| m.name.clone());
    let mut out = Resolved::not(SourceState::Ready {
        vm_name: vm_name.clone(),
        volumes: Vec::new(),
        via_snapshot: None,
    });
    out.vm = Some(vm_json);
    let mut names = Vec::new();
    for b in spec.volume_backups.iter().flatten() {
        let claim_name = b
            .persistent_volume_claim
            .metadata
            .as_ref()
            .and_then(|m| m.name.clone())
            .unwrap_or_else(|| b.volume_name.clone());
        let Some(vs_name) = &b.volume_snapshot_name else {
            continue;
        };
        let handle = match snapshot_handle(client, ns, vs_name).await? {
            Ok(h) => h,
            Err(state) => return Ok(Resolved::not(state)),
        };
        let Some((pv_name, layer)) = handle.split_once('/') else {
            return Ok(Resolved::not(SourceState::NotFound(format!(
                "VolumeSnapshot {vs_name} has the foreign handle {handle:?}"
            ))));
        };
        let Some(pv) = Api::<PersistentVolume>::all(client.clone())
            .get_opt(pv_name)
            .await?
        else {
            return Ok(Resolved::not(SourceState::NotFound(format!(
                "the volume {pv_name} of VolumeSnapshot {vs_name} is gone"
            ))));
        };
        let claim = PersistentVolumeClaim {
            metadata: b
                .persistent_volume_claim
                .metadata
                .clone()
                .unwrap_or_default(),
            spec: b.persistent_volume_claim.spec.clone(),
            status: None,
        };
        names.push(claim_name.clone());
        out.volumes.push(Volume {
            name: claim_name,
            claim,
            pv,
            handle: Some(layer.to_string()),
        });
    }
    if names.is_empty() {
        return Ok(Resolved::not(SourceState::Nothing(format!(
            "VirtualMachineSnapshot {name} holds no volumes"
        ))));
    }
    out.state = SourceState::Ready {
        vm_name,
        volumes: names,
        via_snapshot: None,
    };
    Ok(out)
}

/// A VM export's own online snapshot: failed (the export fails with the reason), in progress,
/// or served as an export of the snapshot would be.
async fn export_snapshot_source(
    client: &kube::Client,
    ns: &str,
    snap: &VmSnapshot,
) -> Result<Resolved, ControllerError> {
    let snap_name = snap.0.metadata.name.clone().unwrap_or_default();
    let st = snap.0.status.clone().unwrap_or_default();
    if st.phase.as_deref() == Some("Failed") {
        let why = st
            .error
            .and_then(|e| e.message)
            .unwrap_or_else(|| "no reason given".into());
        return Ok(Resolved::not(SourceState::SnapshotFailed(format!(
            "the online VirtualMachineSnapshot {snap_name} of the running VM failed: {why}"
        ))));
    }
    if st.ready_to_use != Some(true) {
        return Ok(Resolved::not(SourceState::SnapshotInProgress(format!(
            "the online VirtualMachineSnapshot {snap_name} of the running VM is being taken \
             (phase {})",
            st.phase.as_deref().unwrap_or("unknown")
        ))));
    }
    let mut r = snapshot_source(client, ns, &snap_name).await?;
    if let SourceState::Ready { via_snapshot, .. } = &mut r.state {
        *via_snapshot = Some(snap_name);
    }
    Ok(r)
}

async fn volumes_of(
    client: &kube::Client,
    ns: &str,
    claims: Vec<String>,
    vm_name: Option<String>,
    vm: serde_json::Value,
    handle: impl Fn(&str) -> Option<String>,
) -> Result<Resolved, ControllerError> {
    if claims.is_empty() {
        return Ok(Resolved::not(SourceState::Nothing(
            "the VirtualMachine has no persistentVolumeClaim or dataVolume volumes".into(),
        )));
    }
    let mut out = Resolved::not(SourceState::Ready {
        vm_name,
        volumes: claims.clone(),
        via_snapshot: None,
    });
    out.vm = Some(vm);
    for c in &claims {
        match claim_volume(client, ns, c, handle(c)).await? {
            Ok(v) => out.volumes.push(v),
            Err(state) => {
                return Ok(Resolved {
                    state,
                    volumes: Vec::new(),
                    vm: out.vm,
                });
            }
        }
    }
    Ok(out)
}

/// A bound claim and its PV, or the state saying why not.
async fn claim_volume(
    client: &kube::Client,
    ns: &str,
    name: &str,
    handle: Option<String>,
) -> Result<Result<Volume, SourceState>, ControllerError> {
    let Some(claim) = Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await?
    else {
        return Ok(Err(SourceState::NotFound(format!(
            "PersistentVolumeClaim {name} not found"
        ))));
    };
    let pv_name = claim.spec.as_ref().and_then(|s| s.volume_name.clone());
    let bound = claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    let Some(pv_name) = pv_name.filter(|_| bound) else {
        return Ok(Err(SourceState::NotReady(format!(
            "PersistentVolumeClaim {name} is not bound yet"
        ))));
    };
    let Some(pv) = Api::<PersistentVolume>::all(client.clone())
        .get_opt(&pv_name)
        .await?
    else {
        return Ok(Err(SourceState::NotFound(format!(
            "PersistentVolume {pv_name} of claim {name} not found"
        ))));
    };
    Ok(Ok(Volume {
        name: name.to_string(),
        claim,
        pv,
        handle,
    }))
}

/// The `<pv>/<layer>` handle of a ready VolumeSnapshot.
async fn snapshot_handle(
    client: &kube::Client,
    ns: &str,
    vs_name: &str,
) -> Result<Result<String, SourceState>, ControllerError> {
    let Some(vs) = Api::<VolSnap>::namespaced(client.clone(), ns)
        .get_opt(vs_name)
        .await?
    else {
        return Ok(Err(SourceState::NotFound(format!(
            "VolumeSnapshot {vs_name} not found"
        ))));
    };
    let bound =
        vs.0.status
            .as_ref()
            .and_then(|s| s.bound_volume_snapshot_content_name.clone());
    let Some(content) = bound else {
        return Ok(Err(SourceState::NotReady(format!(
            "VolumeSnapshot {vs_name} is not bound yet"
        ))));
    };
    let c = Api::<VolSnapContent>::all(client.clone())
        .get_opt(&content)
        .await?;
    match c
        .and_then(|c| c.0.status)
        .filter(|s| s.ready_to_use == Some(true))
        .and_then(|s| s.snapshot_handle)
    {
        Some(h) => Ok(Ok(h)),
        None => Ok(Err(SourceState::NotReady(format!(
            "VolumeSnapshotContent {content} is not ready"
        )))),
    }
}

fn is_active(vmi: &Vmi) -> bool {
    !matches!(
        vmi.0.status.as_ref().and_then(|s| s.phase),
        Some(VmiPhase::Succeeded | VmiPhase::Failed)
    )
}

/// An active VMI in `ns` using claim `claim`, if any.
async fn active_user(
    client: &kube::Client,
    ns: &str,
    claim: &str,
) -> Result<Option<String>, ControllerError> {
    let vmis = Api::<Vmi>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await?;
    Ok(vmis
        .items
        .into_iter()
        .filter(is_active)
        .find(|v| claims_of(&v.0).iter().any(|c| c == claim))
        .and_then(|v| v.0.metadata.name))
}
