//! The BackupPlan controller (I/O; decisions in [`super::runs`] and
//! `ferrovirt_api::backup_schedule`).
//!
//! Each reconcile: parse the schedule (a bad one: condition `Ready=False`, reason
//! `InvalidSchedule`); list the plan's Backups (label `backup.ferrovirt.io/plan`); when a
//! scheduled time has come and the plan is not paused, create the run's Backup (owned by the
//! plan, named by the scheduled time, so it is made once) for the VMs the plan selects — or
//! skip the run while the previous one is in progress; report the newest finished run as
//! `lastResult` with a condition and an Event; prune the runs retention drops (the backup on
//! the target first, then the Backup object) and then garbage-collect the target in the
//! background; requeue at the next scheduled time.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use serde_json::{Value, json};

use ferrovirt_api::backup::{BackupPlan, phase};
use ferrovirt_api::backup_schedule::{Schedule, due};
use ferrovirt_backup::repo::Create;
use ferrovirt_backup::{GcOptions, Repository};

use super::loops::{read_key, resolve_target};
use super::resources::{BackupRun, Plan};
use super::runs::{self, Run};
use crate::error::ControllerError;
use crate::runtime::events::{EventRecorder, object_ref};
use crate::runtime::resources::Vm;

/// The longest a plan waits between two looks (a clock jump or a missed watch event).
const MAX_WAIT: Duration = Duration::from_secs(30);

struct Ctx {
    client: kube::Client,
    events: EventRecorder,
}

/// Runs the BackupPlan controller (it also wakes on changes of the plans' Backups).
pub async fn run(client: kube::Client) -> Result<(), ControllerError> {
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        events: EventRecorder::new(client.clone(), "backupplan-controller"),
    });
    crate::runtime::drive(
        Controller::new(Api::<Plan>::all(client.clone()), watcher::Config::default())
            .owns(
                Api::<BackupRun>::all(client.clone()),
                watcher::Config::default(),
            )
            .run(
                crate::runtime::metrics::timed("BackupPlan", reconcile),
                error_policy,
                ctx,
            ),
        "backupplan-controller",
        "BackupPlan",
    )
    .await
}

fn error_policy(_o: Arc<Plan>, err: &ControllerError, _ctx: Arc<Ctx>) -> Action {
    tracing::debug!(error = %err, "backup plan reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

fn run_of(b: &BackupRun) -> Run {
    let b = &b.0;
    let at = b
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(runs::SCHEDULED_ANNOTATION))
        .and_then(|s| s.parse().ok())
        .or_else(|| b.metadata.creation_timestamp.as_ref().map(|t| t.0))
        .unwrap_or(Timestamp::UNIX_EPOCH);
    let st = b.status.clone().unwrap_or_default();
    Run {
        name: b.metadata.name.clone().unwrap_or_default(),
        backup_name: st.backup_name.clone().unwrap_or_default(),
        phase: st.phase.clone().unwrap_or_else(|| phase::PENDING.into()),
        at,
        message: st
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == "Ready")
            .and_then(|c| c.message.clone())
            .unwrap_or_default(),
    }
}

async fn reconcile(obj: Arc<Plan>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let plan: &BackupPlan = &obj.0;
    if plan.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns = plan.metadata.namespace.clone().unwrap_or_default();
    let name = plan.metadata.name.clone().unwrap_or_default();
    let spec = plan.spec.clone().unwrap_or_default();
    let status = plan.status.clone().unwrap_or_default();
    let oref = object_ref(
        &format!(
            "{}/{}",
            ferrovirt_api::backup::GROUP,
            ferrovirt_api::backup::VERSION
        ),
        "BackupPlan",
        &plan.metadata,
    );
    let now = Timestamp::now();
    let nows = now.to_string();
    let schedule = match Schedule::parse(&spec.schedule, spec.time_zone.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            patch(
                &ctx,
                &ns,
                &name,
                json!({"nextRunTime": null, "conditions": [super::plan::condition(
                    "Ready", false, "InvalidSchedule", &e.to_string(), &nows)]}),
            )
            .await?;
            return Ok(Action::await_change());
        }
    };
    let backups: Api<BackupRun> = Api::namespaced(ctx.client.clone(), &ns);
    let list = backups
        .list(&ListParams::default().labels(&format!("{}={name}", runs::PLAN_LABEL)))
        .await?;
    let all: Vec<Run> = list.items.iter().map(run_of).collect();
    let mut st = serde_json::Map::new();

    // 1. a run, if one is due
    let anchor = plan
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .unwrap_or(now);
    let last = status.last_run_time.as_ref().map(|t| t.0);
    let d = due(&schedule, last, anchor, now);
    if !spec.paused
        && let Some(at) = d.run
    {
        st.insert("lastRunTime".into(), json!(at.to_string()));
        if let Some(r) = runs::in_progress(&all) {
            let msg = format!("run at {at} skipped: {} is still in progress", r.name);
            ctx.events.record(&oref, true, "Skipped", &msg).await;
        } else {
            start_run(&ctx, plan, &ns, at, &oref).await?;
        }
    }
    st.insert(
        "nextRunTime".into(),
        match (spec.paused, d.next) {
            (false, Some(n)) => json!(n.to_string()),
            _ => Value::Null,
        },
    );

    // 2. the newest finished run is the last result
    let mut ready = super::plan::condition(
        "Ready",
        true,
        if spec.paused { "Paused" } else { "Scheduled" },
        &format!("schedule {:?} in {}", spec.schedule, tz_name(&spec)),
        &nows,
    );
    if let Some(r) = runs::last_finished(&all) {
        let changed = status.last_backup.as_deref() != Some(&r.name)
            || status.last_result.as_deref() != Some(&r.phase);
        st.insert("lastBackup".into(), json!(r.name));
        st.insert("lastResult".into(), json!(r.phase));
        if changed {
            let failed = r.phase == phase::FAILED;
            let msg = format!("run {} {}: {}", r.name, r.phase.to_lowercase(), r.message);
            ctx.events.record(&oref, failed, &r.phase, &msg).await;
        }
        if r.phase == phase::FAILED {
            ready = super::plan::condition("Ready", false, "LastRunFailed", &r.message, &nows);
        }
    }

    // 3. retention
    let prune = runs::to_prune(
        &all,
        &runs::keep_of(spec.retention.as_ref()),
        schedule.time_zone(),
    );
    if !prune.is_empty() {
        match prune_runs(&ctx, &ns, &spec, &prune).await {
            Ok(n) => {
                st.insert(
                    "pruned".into(),
                    json!(status.pruned.unwrap_or(0) + i64::from(n)),
                );
            }
            Err(msg) => {
                ctx.events.record(&oref, true, "PruneFailed", &msg).await;
                ready = super::plan::condition("Ready", false, "PruneFailed", &msg, &nows);
            }
        }
    }
    st.insert("conditions".into(), json!([ready]));
    patch(&ctx, &ns, &name, Value::Object(st)).await?;
    let wait = d
        .next
        .and_then(|n| n.duration_since(now).try_into().ok())
        .unwrap_or(MAX_WAIT)
        .min(MAX_WAIT);
    Ok(Action::requeue(wait.max(Duration::from_millis(200))))
}

fn tz_name(spec: &ferrovirt_api::backup::BackupPlanSpec) -> String {
    spec.time_zone.clone().unwrap_or_else(|| "UTC".into())
}

async fn patch(ctx: &Ctx, ns: &str, name: &str, status: Value) -> Result<(), ControllerError> {
    Api::<Plan>::namespaced(ctx.client.clone(), ns)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await?;
    Ok(())
}

/// Creates the run's Backup for the selected VMs (an Event either way).
async fn start_run(
    ctx: &Ctx,
    plan: &BackupPlan,
    ns: &str,
    at: Timestamp,
    oref: &k8s_openapi::api::core::v1::ObjectReference,
) -> Result<(), ControllerError> {
    let vms = Api::<Vm>::namespaced(ctx.client.clone(), ns)
        .list(&ListParams::default())
        .await?;
    let vms: Vec<(String, BTreeMap<String, String>)> = vms
        .items
        .iter()
        .map(|v| {
            (
                v.0.metadata.name.clone().unwrap_or_default(),
                v.0.metadata.labels.clone().unwrap_or_default(),
            )
        })
        .collect();
    let spec = plan.spec.clone().unwrap_or_default();
    let (selected, missing) = runs::select_vms(&spec, &vms);
    if !missing.is_empty() {
        let msg = format!(
            "spec.virtualMachines: {} not found in namespace {ns}; backing up the others",
            missing.join(", ")
        );
        ctx.events
            .record(oref, true, "VirtualMachineMissing", &msg)
            .await;
    }
    if selected.is_empty() {
        let msg = format!("run at {at}: no VirtualMachine of namespace {ns} is selected");
        ctx.events.record(oref, true, "NothingSelected", &msg).await;
        return Ok(());
    }
    let b = runs::run_backup(plan, at, selected);
    let bname = b.metadata.name.clone().unwrap_or_default();
    match Api::<BackupRun>::namespaced(ctx.client.clone(), ns)
        .create(&PostParams::default(), &BackupRun(b))
        .await
    {
        Ok(_) => {
            let msg = format!("run at {at}: Backup {bname} created");
            ctx.events.record(oref, false, "RunStarted", &msg).await;
            Ok(())
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Removes pruned runs: each succeeded one's backup from the target (catalog entry first),
/// then the Backup objects; then a garbage collection of the target in the background.
async fn prune_runs(
    ctx: &Ctx,
    ns: &str,
    spec: &ferrovirt_api::backup::BackupPlanSpec,
    prune: &[Run],
) -> Result<u32, String> {
    let mut repo = None;
    if prune.iter().any(|r| r.phase == phase::SUCCEEDED) {
        let target = resolve_target(&ctx.client, &spec.target).await?;
        let key = read_key(
            &ctx.client,
            ns,
            &spec.encryption_key_secret_ref,
            "spec.encryptionKeySecretRef",
        )
        .await?;
        repo = Some(
            Repository::open(&target, &key, Create::Never)
                .await
                .map_err(|e| format!("target {}: {e}", spec.target))?,
        );
    }
    let api: Api<BackupRun> = Api::namespaced(ctx.client.clone(), ns);
    let mut n = 0;
    for r in prune {
        if let Some(repo) = &repo
            && r.phase == phase::SUCCEEDED
            && !r.backup_name.is_empty()
        {
            repo.delete_backup(&r.backup_name)
                .await
                .map_err(|e| format!("pruning backup {} from the target: {e}", r.backup_name))?;
        }
        match api.delete(&r.name, &DeleteParams::default()).await {
            Ok(_) => n += 1,
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(format!("deleting Backup {ns}/{}: {e}", r.name)),
        }
    }
    if let Some(repo) = repo {
        let target = spec.target.clone();
        tokio::spawn(async move {
            match repo.gc(GcOptions::default()).await {
                Ok(r) => tracing::info!(target = %target, report = ?r, "backup gc"),
                Err(e) => tracing::warn!(target = %target, error = %e, "backup gc failed"),
            }
        });
    }
    Ok(n)
}
