//! The agent's start path (issue #15: API create → QEMU exec): what a VMI references is read
//! by name ([`Agent::resolve_refs`]), then its volumes, its network and the API writes run
//! concurrently — the finalizer patch alongside the claim lookups; then, each on its own
//! branch, the fencing announcement (after the finalizer: the finalizer patch carries a
//! resourceVersion, the announcement does not, so they never conflict), the volumes
//! (containerDisks, `qemu-img` overlays, cloud-init images) and the pod network attachment.
//! The launcher is started first and joins the VM's cgroups meanwhile
//! ([`crate::early_launcher`]); it runs only after all of them are done, so QEMU never
//! starts before the finalizer and the announcement are written. Every step is timed on
//! CLOCK_BOOTTIME ([`ferrovirt_launcher::timing`]; docs/scale.md "Start path").

use std::path::PathBuf;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::control::LaunchMeta;
use ferrovirt_launcher::timing::{Timeline, boottime_us};
use kube::api::{Patch, PatchParams};
use serde_json::json;

use super::{Agent, kube_err, ns_name};
use crate::decide;
use crate::error::AgentError;
use crate::mapping::{self, MappingContext};
use crate::volumes;

impl Agent {
    /// ferrovirt's own directories no foreign host path may reach: the configured ones and the
    /// agent's data dir.
    fn protected_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = self.opts.isolation.protected_dirs.clone();
        dirs.push(self.opts.data_dir.clone());
        dirs
    }

    /// Starts `vmi`: adds the finalizer, prepares its volumes and network and spawns its
    /// launcher. Independent steps run concurrently (see the module doc); each goes into
    /// `timing`, which is logged and written into the VMI directory once the launcher is
    /// spawned.
    pub(super) async fn start(
        &self,
        vmi: &VirtualMachineInstance,
        timing: &mut Timeline,
    ) -> Result<(), AgentError> {
        self.start_with(vmi, timing, false, &Default::default())
            .await
    }

    /// [`Agent::start`]; with `incoming`, the launcher of a live-migration target whose QEMU
    /// waits for the stream (`-incoming defer`). A target's VMI already carries the source's
    /// finalizer and fencing announcement: neither is written again. `claim_paths`: claims
    /// whose volume is the block-migration target's fresh copy here, not the PV's path.
    pub(super) async fn start_with(
        &self,
        vmi: &VirtualMachineInstance,
        timing: &mut Timeline,
        incoming: bool,
        claim_paths: &std::collections::BTreeMap<String, PathBuf>,
    ) -> Result<(), AgentError> {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let dir = self.cfg.vmi_dir(&uid);
        let steps = Steps(std::sync::Mutex::new(std::mem::take(timing)));
        let finalizer = async {
            if incoming {
                return;
            }
            let t = boottime_us();
            if let Err(e) = self.set_finalizer(vmi, true).await {
                tracing::warn!("adding finalizer: {e}");
            }
            steps.span("finalizer", t);
        };
        let refs = async {
            let t = boottime_us();
            let refs = self.resolve_refs(vmi).await;
            steps.span("refs", t);
            refs
        };
        let ((), refs) = tokio::join!(finalizer, refs);
        let mut refs = refs?;
        for (claim, path) in claim_paths {
            if let Some(c) = refs.claims.get_mut(claim) {
                c.path = path.clone();
            }
        }
        let (kubevirts, cdi) = self.caches.kubevirt_and_cdi().await;
        let policy = crate::hostpath::HostPathPolicy {
            host_disk_gate: ferrovirt_api::hco::feature_gate_on(&kubevirts, "HostDisk"),
            allowed_roots: self.opts.isolation.host_disk_roots.clone(),
            protected: self.protected_dirs(),
        };
        // Refused host paths leave nothing behind, not even the VMI directory.
        crate::hostpath::verify(vmi, &refs, &policy)?;
        std::fs::create_dir_all(&dir).map_err(|e| AgentError::io(&dir, e))?;
        // A migration target has a cgroup of its own: on one host (tests) the source's
        // holds the source QEMU until the switch-over.
        let cgroup_name = if incoming {
            format!("{uid}.in")
        } else {
            uid.clone()
        };
        // The launcher joins its cgroups while the volumes and the network are prepared, and
        // runs once they are (`early_launcher`); dropped on an error below, it exits.
        let t = boottime_us();
        let early = self.early_launcher(&uid, &cgroup_name);
        steps.span("launcher_early", t);
        // The finalizer is on (its patch came back): the announcement may follow (a patch
        // without a resourceVersion, so the two never conflict). Meanwhile the volumes and
        // the network are prepared.
        let announce = async {
            let t = boottime_us();
            let fence = self.fence_spec(vmi, &refs).await?;
            steps.span("fence_spec", t);
            if incoming {
                // A migration target's VMI keeps the source's announcement until it moves.
                return Ok::<_, AgentError>(fence);
            }
            let t = boottime_us();
            // Announced before the launcher exists: the node controller replaces a VMI of a
            // dead node only when its launcher fences itself (or none was started).
            let announce = json!({"metadata": {"uid": vmi.metadata.uid, "annotations": {
                ferrovirt_api::fencing::FENCING_ANNOTATION: crate::fencing::announcement(fence.as_ref())
            }}});
            let (ns, name) = ns_name(vmi);
            self.vmi_api(&ns)
                .patch(&name, &PatchParams::default(), &Patch::Merge(&announce))
                .await
                .map_err(kube_err)?;
            steps.span("announce", t);
            Ok::<_, AgentError>(fence)
        };
        let insecure = ferrovirt_api::hco::insecure_registries(&cdi);
        let volumes = async {
            let t = boottime_us();
            let container_disks = self
                .container_disks
                .prepare(&self.client, vmi, &insecure)
                .await?;
            let mut refs = refs.clone();
            refs.container_disks = container_disks;
            let actions = volumes::plan(vmi, &refs, &dir)?;
            let prepared = tokio::task::spawn_blocking(move || volumes::execute(&actions))
                .await
                .map_err(|e| AgentError::Reference(format!("volume preparation task: {e}")))??;
            let mut run_as = None;
            if self.qemu_user.is_some() {
                // Root agent: this VM's QEMU gets a uid of its own, and its images are its.
                let range = self.opts.isolation.qemu_uids;
                let qemu_uid =
                    crate::isolation::allocate_uid(&self.opts.data_dir, &dir, &uid, range)
                        .map_err(|e| AgentError::io(&dir, e))?;
                crate::isolation::own_volumes(prepared.values().map(|v| &v.path), qemu_uid)
                    .map_err(|e| AgentError::io(&dir, e))?;
                run_as = Some(crate::isolation::run_as(qemu_uid));
            }
            steps.span("volumes", t);
            Ok::<_, AgentError>((prepared, run_as))
        };
        let network = async {
            if crate::network::has_explicit_macs(vmi) {
                let others = self.caches.all_vmis().await?;
                crate::network::check_duplicate_macs(vmi, &others)?;
            }
            let t = boottime_us();
            let mut net_opts = crate::network::AttachOptions {
                incoming,
                ..Default::default()
            };
            if self.net.enabled() {
                let all = self.caches.all_vmis().await?;
                net_opts.reserved = crate::pod_routes::reserved_addresses(&all, &uid);
            }
            let attachment = self
                .net
                .attach(&self.client, vmi, &uid, &dir, &net_opts)
                .await?;
            steps.span("network", t);
            Ok::<_, AgentError>(attachment)
        };
        // Each branch runs to its end (none is cancelled half-way); a network attached for
        // a start that failed elsewhere is detached again.
        let (fence, prepared, attachment) = tokio::join!(announce, volumes, network);
        let (fence, prepared, attachment) = match (fence, prepared, attachment) {
            (Ok(f), Ok(p), Ok(a)) => (f, p, a),
            (f, p, a) => {
                if a.is_ok() {
                    self.net.detach(&uid).await;
                }
                return Err(f
                    .err()
                    .or(p.err())
                    .or(a.err())
                    .unwrap_or_else(|| AgentError::Reference("start step failed".into())));
            }
        };
        let (prepared, run_as) = prepared;
        let mut ctx = MappingContext::new(&dir, self.accel);
        ctx.run_as = run_as;
        ctx.volumes = prepared;
        ctx.tcg_tb_size_mib = self.opts.tcg_tb_size_mib;
        ctx.cpu_models = self.cpu_models.clone();
        ctx.sandbox = true;
        ctx.cgroup_name = vmi.metadata.uid.as_ref().map(|_| cgroup_name.clone());
        ctx.pids_max = Some(self.opts.isolation.pids_max);
        ctx.serial_log_max_bytes = Some(self.opts.isolation.serial_log_max_bytes);
        ctx.pod_taps = attachment.taps;
        let exec_prefix = attachment.exec_prefix;
        let netns = attachment.netns;
        let mut spec = mapping::launch_spec(vmi, &ctx)?;
        spec.incoming = incoming;
        if !incoming {
            // A VMI with host devices never migrates (`ferrovirt_api::migration`).
            spec.host_devices = self.assign_host_devices(vmi, &dir).await?;
        }
        spec.validate()?;
        // LiveMigratable, decided now that the claims' access modes are known; the running
        // status reports it (`decide::Report::migratable`).
        let root = crate::nodestore::volume_root(&self.opts.data_dir);
        // A Primary UDN interface moves with its guest (same address and MAC on a network
        // that spans the nodes): judged as a masquerade interface would be.
        let judged = match attachment.primary_udn {
            Some(_) => crate::udn::migratable_view(vmi),
            None => vmi.clone(),
        };
        let migratable = match &attachment.layer3_udn {
            Some(net) => Err(crate::udn::layer3_not_migratable(net)),
            None => ferrovirt_api::migration::live_migratable(
                &judged,
                |c| refs.claim_access_modes.get(c).cloned(),
                |c| crate::blockmig::claim_block_ok(refs.claims.get(c), &root),
            ),
        };
        let volume_dirs = match &migratable {
            Ok(ferrovirt_api::migration::Method::Block(vols)) => vols
                .iter()
                .filter_map(|v| v.claim.as_ref())
                .filter_map(|c| {
                    let name = refs.claims.get(c)?.path.file_name()?.to_str()?.to_string();
                    Some((c.clone(), name))
                })
                .collect(),
            _ => Default::default(),
        };
        crate::migration::write_migratable(&dir, &migratable, &volume_dirs)?;
        let (ns, name) = ns_name(vmi);
        let meta = LaunchMeta {
            vmi_uid: uid,
            namespace: ns,
            name,
            grace_seconds: decide::grace_seconds(vmi),
            qemu_binary: self.opts.qemu_binary.clone(),
            fence,
            interfaces: vmi
                .spec
                .iter()
                .flat_map(|s| s.domain.devices.interfaces.iter().flatten())
                .map(|i| i.name.clone())
                .collect(),
            info_labels: crate::metrics::info_labels(
                vmi.metadata
                    .annotations
                    .as_ref()
                    .unwrap_or(&Default::default()),
            ),
        };
        let t = boottime_us();
        let mut launchers = self.launchers.lock().await;
        match early {
            Some(early) => launchers.start_early(
                &self.cfg,
                &spec,
                &meta,
                early,
                netns.as_deref(),
                &exec_prefix,
            )?,
            None => launchers.start_in(&self.cfg, &spec, &meta, &exec_prefix)?,
        }
        drop(launchers);
        steps.span("launcher_spawn", t);
        *timing = steps.0.into_inner().unwrap_or_else(|p| p.into_inner());
        tracing::info!(vmi = %meta.name, "start timing: {}", timing.summary());
        let _ = timing.write(&dir.join(ferrovirt_launcher::timing::AGENT_FILE));
        Ok(())
    }
}

impl Agent {
    /// Starts the launcher of `uid` early ([`crate::early_launcher`]), to join the cgroups
    /// named `cgroup_name` while the start's other steps run. `None` where it could not be
    /// started: the launcher is then spawned once everything is ready.
    fn early_launcher(
        &self,
        uid: &str,
        cgroup_name: &str,
    ) -> Option<crate::early_launcher::EarlyLauncher> {
        match crate::early_launcher::EarlyLauncher::start(&self.cfg, uid, cgroup_name) {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::warn!("no early launcher: {e}");
                None
            }
        }
    }
}

/// The start's [`Timeline`], shared by its concurrent branches.
struct Steps(std::sync::Mutex<Timeline>);

impl Steps {
    fn span(&self, name: &str, start_us: u64) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .span(name, start_us);
    }
}
