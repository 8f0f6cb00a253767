//! backup.ferrovirt.io/v1alpha1: BackupTarget (cluster-scoped: an S3 bucket or a directory),
//! Backup (one run: VMs by name → the target), BackupRestore (a backup found on the target →
//! VMs here) and BackupPlan (a cron schedule in a time zone, VMs by name or label selector,
//! GFS retention; each run is a Backup owned by the plan). Types, printer columns, admission
//! (docs/backup.md).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use serde_json::Value;

use crate::admission::{FieldError, Operation, is_dns1123_label, is_dns1123_subdomain};
use crate::kubevirt::vmi::Condition;
use crate::registry::{ALL_VERBS, PrinterColumn, ResourceDef};

/// The API group.
pub const GROUP: &str = "backup.ferrovirt.io";
/// The served (and stored) version.
pub const VERSION: &str = "v1alpha1";
/// The key of the encryption key in its Secret.
pub const ENCRYPTION_KEY: &str = "key";
/// The keys of S3 credentials in their Secret.
pub const ACCESS_KEY_ID: &str = "accessKeyId";
pub const SECRET_ACCESS_KEY: &str = "secretAccessKey";
pub const SESSION_TOKEN: &str = "sessionToken";

/// Phases of a Backup and a BackupRestore.
pub mod phase {
    pub const PENDING: &str = "Pending";
    pub const RUNNING: &str = "Running";
    pub const SUCCEEDED: &str = "Succeeded";
    pub const FAILED: &str = "Failed";
}

resource! {
    /// Where backups are stored: an S3 bucket or a filesystem directory (e.g. an NFS mount).
    BackupTarget, BackupTargetSpec, BackupTargetStatus
}

kstruct! {
    /// Exactly one of `s3` and `filesystem`.
    pub struct BackupTargetSpec {
        pub s3: Option<S3Location>,
        pub filesystem: Option<FilesystemLocation>,
    }
}

kstruct! {
    /// An S3 bucket on AWS or any S3-protocol server.
    pub struct S3Location {
        /// `http://host:port` or `https://host:port`; empty for AWS.
        pub endpoint: Option<String>,
        pub bucket: String,
        /// Object-name prefix inside the bucket (`/`-separated segments).
        pub prefix: Option<String>,
        /// Default `us-east-1`.
        pub region: Option<String>,
        /// A Secret with keys `accessKeyId`, `secretAccessKey` (and optionally `sessionToken`).
        pub credentials_secret_ref: SecretReference,
        /// Path-style URLs (`endpoint/bucket/key`), as most non-AWS servers need.
        #[serde(default)]
        pub path_style: bool,
        /// PEM bundle of CAs trusted for an `https` endpoint, besides the system's.
        pub ca_bundle: Option<String>,
    }
}

kstruct! {
    /// A directory on the server's machine (an NFS mount for a real cluster).
    pub struct FilesystemLocation {
        /// An absolute path; it must exist.
        pub path: String,
        pub prefix: Option<String>,
    }
}

kstruct! {
    /// A Secret in a namespace.
    pub struct SecretReference {
        pub name: String,
        pub namespace: String,
    }
}

kstruct! {
    /// What the last check of the target found.
    pub struct BackupTargetStatus {
        pub reachable: Option<bool>,
        /// Bytes of every object below the prefix.
        pub bytes_stored: Option<i64>,
        /// Completed backups listed in the catalog (readable without a key: their names).
        pub last_check_time: Option<Time>,
        pub conditions: Option<Vec<Condition>>,
    }
}

resource! {
    /// One backup run of VMs of the Backup's namespace to a target.
    Backup, BackupSpec, BackupStatus
}

kstruct! {
    /// What to back up and where.
    pub struct BackupSpec {
        /// The BackupTarget's name.
        pub target: String,
        /// VirtualMachines of this namespace, by name.
        pub virtual_machines: Vec<String>,
        /// A Secret of this namespace whose key `key` (at least 16 bytes) encrypts the backup.
        pub encryption_key_secret_ref: String,
        /// The backup's name on the target; default `<namespace>-<name>`.
        pub backup_name: Option<String>,
        /// How the running VMs' disks are made consistent (default: each VM frozen for its
        /// own snapshot).
        pub consistency: Option<Consistency>,
    }
}

kstruct! {
    /// How a backup quiesces the running VMs it reads.
    pub struct Consistency {
        /// `PerVM` (default): each running VM's filesystems are frozen through its guest
        /// agent for its own online snapshot, one VM after the other. `Group`: every running
        /// VM of the backup is frozen first (all through their guest agents; one without an
        /// answering guest agent fails the backup), then all snapshots are taken, then all
        /// are thawed: one point in time across the VMs.
        pub freeze: Option<String>,
        /// The longest a `Group` freeze may hold the guests (Go duration, default `60s`):
        /// each guest is thawed then by its launcher, and a backup whose snapshots were not
        /// all taken by then fails.
        pub freeze_timeout: Option<String>,
        /// A command (path first, then its arguments; no shell unless you name one) run in
        /// every running VM of the backup through its guest agent before the first
        /// snapshot (and before a `Group` freeze). A non-zero exit or a timeout fails the
        /// backup, naming the VM.
        pub pre_freeze_command: Option<Vec<String>>,
        /// A command run in every running VM after the last snapshot (after a `Group`
        /// thaw), also when the backup failed after its `preFreezeCommand`s ran.
        pub post_thaw_command: Option<Vec<String>>,
        /// How long each command may run (Go duration, default `30s`, at most `2m`).
        pub command_timeout: Option<String>,
    }
}

/// The default [`Consistency::command_timeout`].
pub const DEFAULT_COMMAND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// [`Consistency::freeze`] values.
pub const FREEZE_PER_VM: &str = "PerVM";
pub const FREEZE_GROUP: &str = "Group";
/// The default [`Consistency::freeze_timeout`].
pub const DEFAULT_FREEZE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

impl Consistency {
    /// The hold of a `Group` freeze, or `None` for `PerVM` (pure; admission has refused
    /// other values).
    pub fn group_hold(c: Option<&Consistency>) -> Option<std::time::Duration> {
        let c = c?;
        if c.freeze.as_deref() != Some(FREEZE_GROUP) {
            return None;
        }
        Some(
            c.freeze_timeout
                .as_deref()
                .and_then(|t| crate::kubevirt::snapshot::parse_go_duration(t).ok())
                .unwrap_or(DEFAULT_FREEZE_TIMEOUT),
        )
    }
}

impl Consistency {
    /// How long each pre/post command may run (pure).
    pub fn command_timeout(c: Option<&Consistency>) -> std::time::Duration {
        c.and_then(|c| c.command_timeout.as_deref())
            .and_then(|t| crate::kubevirt::snapshot::parse_go_duration(t).ok())
            .unwrap_or(DEFAULT_COMMAND_TIMEOUT)
    }
}

/// Admission of a guest command at `field`.
fn validate_command(c: &Value, field: &str, e: &mut Vec<FieldError>) {
    let Some(items) = c.as_array() else {
        e.push(FieldError::type_invalid(
            field,
            "a list of strings (path first)",
        ));
        return;
    };
    match items.first().and_then(Value::as_str) {
        Some(p) if p.starts_with('/') => {}
        _ => e.push(FieldError::invalid(
            format!("{field}[0]"),
            "the command's absolute path (e.g. /bin/sh) is required first",
        )),
    }
    if items.len() > 64 {
        e.push(FieldError::invalid(field, "at most 64 elements"));
    }
    for (i, a) in items.iter().enumerate() {
        match a.as_str() {
            Some(s) if s.len() <= 4096 && !s.contains('\0') => {}
            _ => e.push(FieldError::invalid(
                format!("{field}[{i}]"),
                "a string of at most 4096 bytes without NUL",
            )),
        }
    }
}

/// Admission of a `consistency` block at `field` (a Backup's or a BackupPlan's spec).
fn validate_consistency(c: &Value, field: &str, e: &mut Vec<FieldError>) {
    if c.is_null() {
        return;
    }
    for k in ["preFreezeCommand", "postThawCommand"] {
        if let Some(cmd) = c.get(k).filter(|v| !v.is_null()) {
            validate_command(cmd, &format!("{field}.{k}"), e);
        }
    }
    if let Some(t) = c.get("commandTimeout").filter(|v| !v.is_null()) {
        let d = t
            .as_str()
            .ok_or_else(|| format!("{t} is not a duration"))
            .and_then(crate::kubevirt::snapshot::parse_go_duration);
        match d {
            Ok(d) if d.as_secs() >= 1 && d.as_secs() <= 120 => {}
            Ok(_) => e.push(FieldError::invalid(
                format!("{field}.commandTimeout"),
                format!("{t}: between 1s and 2m"),
            )),
            Err(m) => e.push(FieldError::invalid(format!("{field}.commandTimeout"), m)),
        }
    }
    if let Some(f) = c.get("freeze").filter(|v| !v.is_null()) {
        let ok = matches!(f.as_str(), Some(FREEZE_PER_VM | FREEZE_GROUP));
        if !ok {
            e.push(FieldError::not_supported(
                format!("{field}.freeze"),
                format!("{f}: supported values: \"{FREEZE_PER_VM}\", \"{FREEZE_GROUP}\""),
            ));
        }
    }
    if let Some(t) = c.get("freezeTimeout").filter(|v| !v.is_null()) {
        let d = t
            .as_str()
            .ok_or_else(|| format!("{t} is not a duration"))
            .and_then(crate::kubevirt::snapshot::parse_go_duration);
        match d {
            Ok(d) if d.as_secs() >= 1 && d.as_secs() <= 3600 => {}
            Ok(_) => e.push(FieldError::invalid(
                format!("{field}.freezeTimeout"),
                format!("{t}: between 1s and 1h"),
            )),
            Err(m) => e.push(FieldError::invalid(format!("{field}.freezeTimeout"), m)),
        }
    }
}

kstruct! {
    /// The run's state.
    pub struct BackupStatus {
        /// `Pending`, `Running`, `Succeeded` or `Failed`.
        pub phase: Option<String>,
        /// Percent of the bytes to read, e.g. `42%`.
        pub progress: Option<String>,
        /// The name on the target.
        pub backup_name: Option<String>,
        pub start_time: Option<Time>,
        pub completion_time: Option<Time>,
        pub duration_seconds: Option<f64>,
        /// The online snapshot taken of a running VM: deleted if the backup fails, kept as
        /// the VM's backup point (for the next, incremental backup) if it succeeds.
        pub snapshot_name: Option<String>,
        pub volumes: Option<Vec<BackupVolumeStatus>>,
        pub bytes_read: Option<i64>,
        pub bytes_new: Option<i64>,
        pub bytes_deduplicated: Option<i64>,
        /// A `Group` freeze: which VMs were frozen together and for how long.
        pub freeze: Option<BackupFreezeStatus>,
        pub conditions: Option<Vec<Condition>>,
    }
}

kstruct! {
    /// The window in which a `Group` freeze held every running VM of the backup.
    pub struct BackupFreezeStatus {
        /// The VMs frozen together (the running ones).
        pub virtual_machines: Vec<String>,
        /// When the first freeze was asked, and when the last thaw answered.
        pub start_time: Option<Time>,
        pub end_time: Option<Time>,
        /// How long the guests were held, in seconds (from the first freeze's answer to the
        /// first thaw's request).
        pub held_seconds: Option<f64>,
    }
}

kstruct! {
    /// One volume's figures.
    pub struct BackupVolumeStatus {
        pub virtual_machine: String,
        /// The claim's name (the disk's name on the target).
        pub name: String,
        pub size_bytes: i64,
        pub bytes_read: i64,
        pub bytes_new: i64,
        pub bytes_deduplicated: i64,
        pub bytes_zero: i64,
        /// Sealed (compressed, encrypted) bytes uploaded.
        pub bytes_uploaded: Option<i64>,
        /// Bytes of unchanged chunks taken from the previous backup's index, not read.
        pub bytes_reused: Option<i64>,
        /// Whether only the chunks changed since the previous backup were read.
        pub incremental: Option<bool>,
        /// The previous backup (its name on the target) an incremental read started from.
        pub base_backup: Option<String>,
        /// Why the volume was read whole.
        pub full_read_reason: Option<String>,
    }
}

resource! {
    /// Restores VMs from a backup found on a target.
    BackupRestore, BackupRestoreSpec, BackupRestoreStatus
}

kstruct! {
    /// Which backup, which VMs, where.
    pub struct BackupRestoreSpec {
        /// The BackupTarget the backup is on.
        pub target: String,
        /// The backup's name as the target lists it.
        pub backup_name: String,
        /// A Secret of this namespace with the backup's key (`key`).
        pub encryption_key_secret_ref: String,
        /// VMs to restore (default: all of the backup).
        pub virtual_machines: Option<Vec<RestoreVirtualMachine>>,
        /// Source namespace → namespace to restore into. A BackupRestore writes only into
        /// its own namespace: every value must be that namespace (the default for every
        /// source namespace).
        pub namespace_mapping: Option<BTreeMap<String, String>>,
        /// Give restored interfaces new MAC addresses (default false: the backup's).
        #[serde(default)]
        pub new_mac_addresses: bool,
        /// Give restored VMs a new firmware UUID (default false).
        #[serde(default, rename = "newFirmwareUUID")]
        pub new_firmware_uuid: bool,
        /// Start the VMs once restored.
        #[serde(default)]
        pub start: bool,
    }
}

kstruct! {
    /// One VM of the backup.
    pub struct RestoreVirtualMachine {
        /// `namespace/name` as the backup lists it.
        pub name: String,
        /// A new name here (its claims are renamed `<newName>-<claim>`).
        pub new_name: Option<String>,
        /// Only these of the VM's claims (their names in the backup), each into a DataVolume
        /// (named as the VM's claims would be); the VM itself, its Secrets and ConfigMaps are
        /// not restored. Absent: the whole VM with all its claims.
        pub volumes: Option<Vec<String>>,
    }
}

kstruct! {
    /// The restore's state.
    pub struct BackupRestoreStatus {
        pub phase: Option<String>,
        pub progress: Option<String>,
        pub start_time: Option<Time>,
        pub completion_time: Option<Time>,
        /// `namespace/name` of each VM created.
        pub restored_virtual_machines: Option<Vec<String>>,
        /// The DataVolumes created and filled.
        pub restored_volumes: Option<Vec<RestoredVolume>>,
        pub bytes_written: Option<i64>,
        pub conditions: Option<Vec<Condition>>,
    }
}

kstruct! {
    /// One restored disk.
    pub struct RestoredVolume {
        /// `namespace/name` of the VM it belongs to here.
        pub virtual_machine: String,
        /// The DataVolume (and claim) here.
        pub name: String,
        /// The disk's name in the backup (`<vm>.<claim>`).
        pub disk: String,
        pub size_bytes: i64,
    }
}

/// The label on every object a BackupRestore creates: the restore's UID (a restore run again
/// after a restart recognises its own objects; any other object of the same name is a
/// conflict).
pub const RESTORE_UID_LABEL: &str = "backup.ferrovirt.io/restore-uid";

resource! {
    /// Scheduled backups with retention: each run is a Backup owned by the plan.
    BackupPlan, BackupPlanSpec, BackupPlanStatus
}

kstruct! {
    /// A schedule, a selection, a retention policy.
    pub struct BackupPlanSpec {
        /// Cron schedule: 5 fields, or 6 with seconds first.
        pub schedule: String,
        /// IANA time zone of the schedule (default UTC).
        pub time_zone: Option<String>,
        /// The BackupTarget.
        pub target: String,
        /// VirtualMachines of this namespace, by name.
        pub virtual_machines: Option<Vec<String>>,
        /// VirtualMachines of this namespace by label (`{}`: every VM of the namespace); the
        /// union with `virtualMachines` is backed up.
        pub selector: Option<LabelSelector>,
        /// A Secret of this namespace whose key `key` encrypts the backups.
        pub encryption_key_secret_ref: String,
        /// How many backups to keep.
        pub retention: Option<Retention>,
        /// How the running VMs of each run are quiesced (see [`Consistency`]).
        pub consistency: Option<Consistency>,
        /// No runs while true.
        #[serde(default)]
        pub paused: bool,
    }
}

kstruct! {
    /// Grandfather-father-son retention.
    pub struct Retention {
        pub keep_last: Option<i32>,
        pub hourly: Option<i32>,
        pub daily: Option<i32>,
        pub weekly: Option<i32>,
        pub monthly: Option<i32>,
        pub yearly: Option<i32>,
    }
}

kstruct! {
    /// The plan's runs.
    pub struct BackupPlanStatus {
        /// The scheduled time of the last run.
        pub last_run_time: Option<Time>,
        pub next_run_time: Option<Time>,
        /// The last finished run's phase (`Succeeded`, `Failed`) or why a run did not start.
        pub last_result: Option<String>,
        /// The Backup of the last run.
        pub last_backup: Option<String>,
        /// Backups pruned by retention so far.
        pub pruned: Option<i64>,
        pub conditions: Option<Vec<Condition>>,
    }
}

fn col(name: &'static str, type_: &'static str, json_path: &'static str) -> PrinterColumn {
    PrinterColumn {
        name,
        type_,
        json_path,
        description: "",
        priority: 0,
    }
}

fn def(
    kind: &'static str,
    list_kind: &'static str,
    plural: &'static str,
    singular: &'static str,
    namespaced: bool,
    printer_columns: Vec<PrinterColumn>,
) -> ResourceDef {
    ResourceDef {
        group: GROUP,
        version: VERSION,
        kind,
        list_kind,
        plural,
        singular,
        namespaced,
        short_names: &[],
        categories: &[],
        has_status: true,
        verbs: ALL_VERBS,
        printer_columns,
    }
}

/// The group's entries of the resource table.
pub fn resources() -> Vec<ResourceDef> {
    vec![
        def(
            "BackupTarget",
            "BackupTargetList",
            "backuptargets",
            "backuptarget",
            false,
            vec![
                col("Bucket", "string", ".spec.s3.bucket"),
                col("Path", "string", ".spec.filesystem.path"),
                col("Reachable", "boolean", ".status.reachable"),
                col("Stored", "integer", ".status.bytesStored"),
            ],
        ),
        def(
            "Backup",
            "BackupList",
            "backups",
            "backup",
            true,
            vec![
                col("Target", "string", ".spec.target"),
                col("Phase", "string", ".status.phase"),
                col("Progress", "string", ".status.progress"),
                col("Read", "integer", ".status.bytesRead"),
                col("New", "integer", ".status.bytesNew"),
            ],
        ),
        def(
            "BackupRestore",
            "BackupRestoreList",
            "backuprestores",
            "backuprestore",
            true,
            vec![
                col("Backup", "string", ".spec.backupName"),
                col("Phase", "string", ".status.phase"),
                col("Progress", "string", ".status.progress"),
            ],
        ),
        def(
            "BackupPlan",
            "BackupPlanList",
            "backupplans",
            "backupplan",
            true,
            vec![
                col("Schedule", "string", ".spec.schedule"),
                col("LastRun", "date", ".status.lastRunTime"),
                col("NextRun", "date", ".status.nextRunTime"),
                col("LastResult", "string", ".status.lastResult"),
            ],
        ),
    ]
}

/// The OpenAPI schema of one of the group's kinds.
pub fn schema(kind: &str) -> Option<Value> {
    use crate::schema::schema_of;
    Some(match kind {
        "BackupTarget" => schema_of::<BackupTarget>(),
        "Backup" => schema_of::<Backup>(),
        "BackupRestore" => schema_of::<BackupRestore>(),
        "BackupPlan" => schema_of::<BackupPlan>(),
        _ => return None,
    })
}

/// What the backup repository names may be: a DNS-1123 subdomain.
pub fn is_backup_name(s: &str) -> bool {
    is_dns1123_subdomain(s)
}

/// An object-name prefix: `/`-separated segments of `[A-Za-z0-9._-]`, none `.` or `..`.
pub fn is_prefix(p: &str) -> bool {
    let p = p.trim_matches('/');
    p.is_empty()
        || p.split('/').all(|seg| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        })
}

fn req_name(spec: &Value, field: &str, what: &str, e: &mut Vec<FieldError>) {
    match spec[field].as_str() {
        None | Some("") => e.push(FieldError::required(
            format!("spec.{field}"),
            format!("{what} is required"),
        )),
        Some(s) if !is_dns1123_subdomain(s) => e.push(FieldError::invalid(
            format!("spec.{field}"),
            format!("{s:?} is not a valid {what}"),
        )),
        Some(_) => {}
    }
}

/// Admission of the group's kinds: typed parse (the first type error with its path), then the
/// checks below; specs of Backup and BackupRestore are immutable.
pub fn admit(kind: &str, op: Operation, obj: &mut Value, old: Option<&Value>) -> Vec<FieldError> {
    use crate::admission::parse_typed;
    let parsed = match kind {
        "BackupTarget" => parse_typed::<BackupTarget>(obj).map(drop),
        "Backup" => parse_typed::<Backup>(obj).map(drop),
        "BackupRestore" => parse_typed::<BackupRestore>(obj).map(drop),
        "BackupPlan" => parse_typed::<BackupPlan>(obj).map(drop),
        _ => Ok(()),
    };
    if let Err(e) = parsed {
        return vec![e];
    }
    let mut e = Vec::new();
    if obj.get("spec").is_none() {
        e.push(FieldError::required("spec", "spec is required"));
        return e;
    }
    if op == Operation::Update
        && matches!(kind, "Backup" | "BackupRestore")
        && let Some(old) = old
        && old.get("spec") != obj.get("spec")
    {
        e.push(FieldError::forbidden(
            "spec",
            "spec is immutable after creation",
        ));
    }
    let spec = &obj["spec"];
    match kind {
        "BackupTarget" => validate_target(spec, &mut e),
        "Backup" => {
            req_name(spec, "target", "BackupTarget name", &mut e);
            req_name(spec, "encryptionKeySecretRef", "Secret name", &mut e);
            let vms = spec["virtualMachines"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if vms.is_empty() {
                e.push(FieldError::required(
                    "spec.virtualMachines",
                    "at least one VirtualMachine name is required",
                ));
            }
            for (i, v) in vms.iter().enumerate() {
                let s = v.as_str().unwrap_or("");
                if !is_dns1123_subdomain(s) {
                    e.push(FieldError::invalid(
                        format!("spec.virtualMachines[{i}]"),
                        format!("{s:?} is not a VirtualMachine name"),
                    ));
                }
                if vms[..i].contains(v) {
                    e.push(FieldError::duplicate(
                        format!("spec.virtualMachines[{i}]"),
                        s,
                    ));
                }
            }
            validate_consistency(&spec["consistency"], "spec.consistency", &mut e);
            if let Some(n) = spec["backupName"].as_str()
                && !is_backup_name(n)
            {
                e.push(FieldError::invalid(
                    "spec.backupName",
                    format!("{n:?} is not a DNS-1123 subdomain"),
                ));
            }
        }
        "BackupRestore" => {
            let ns = obj["metadata"]["namespace"].as_str().unwrap_or("");
            validate_restore(spec, ns, &mut e);
        }
        "BackupPlan" => validate_plan(spec, &mut e),
        _ => {}
    }
    e
}

fn validate_plan(spec: &Value, e: &mut Vec<FieldError>) {
    let schedule = spec["schedule"].as_str().unwrap_or("");
    if let Err(err) = crate::backup_schedule::Schedule::parse(schedule, spec["timeZone"].as_str()) {
        e.push(FieldError::invalid(err.field, err.message));
    }
    req_name(spec, "target", "BackupTarget name", e);
    req_name(spec, "encryptionKeySecretRef", "Secret name", e);
    validate_consistency(&spec["consistency"], "spec.consistency", e);
    let vms = spec["virtualMachines"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if vms.is_empty() && spec.get("selector").is_none_or(Value::is_null) {
        e.push(FieldError::required(
            "spec.virtualMachines",
            "virtualMachines or selector is required (selector {} selects every VM of the \
             namespace)",
        ));
    }
    for (i, v) in vms.iter().enumerate() {
        let s = v.as_str().unwrap_or("");
        if !is_dns1123_subdomain(s) {
            e.push(FieldError::invalid(
                format!("spec.virtualMachines[{i}]"),
                format!("{s:?} is not a VirtualMachine name"),
            ));
        }
        if vms[..i].contains(v) {
            e.push(FieldError::duplicate(
                format!("spec.virtualMachines[{i}]"),
                s,
            ));
        }
    }
    for (i, r) in spec["selector"]["matchExpressions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let op = r["operator"].as_str().unwrap_or("");
        if !matches!(op, "In" | "NotIn" | "Exists" | "DoesNotExist") {
            e.push(FieldError::invalid(
                format!("spec.selector.matchExpressions[{i}].operator"),
                format!("{op:?}: In, NotIn, Exists or DoesNotExist"),
            ));
        }
    }
    for f in ["keepLast", "hourly", "daily", "weekly", "monthly", "yearly"] {
        if let Some(n) = spec["retention"][f].as_i64()
            && n < 0
        {
            e.push(FieldError::invalid(
                format!("spec.retention.{f}"),
                format!("{n}: a count of zero or more is required"),
            ));
        }
    }
}

fn validate_target(spec: &Value, e: &mut Vec<FieldError>) {
    let s3 = spec.get("s3").filter(|v| !v.is_null());
    let fs = spec.get("filesystem").filter(|v| !v.is_null());
    match (s3, fs) {
        (None, None) => e.push(FieldError::required(
            "spec",
            "one of spec.s3 and spec.filesystem is required",
        )),
        (Some(_), Some(_)) => e.push(FieldError::forbidden(
            "spec.filesystem",
            "only one of spec.s3 and spec.filesystem may be set",
        )),
        _ => {}
    }
    let prefix_ok = |p: &Value, field: &str, e: &mut Vec<FieldError>| {
        if let Some(p) = p["prefix"].as_str()
            && !is_prefix(p)
        {
            e.push(FieldError::invalid(
                field.to_string(),
                format!("{p:?}: segments of letters, digits, '.', '_', '-', none '.' or '..'"),
            ));
        }
    };
    if let Some(s3) = s3 {
        let bucket = s3["bucket"].as_str().unwrap_or("");
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !bucket_ok {
            e.push(FieldError::invalid(
                "spec.s3.bucket",
                format!("{bucket:?} is not an S3 bucket name"),
            ));
        }
        if let Some(ep) = s3["endpoint"].as_str()
            && !ep.is_empty()
            && !(ep.starts_with("http://") || ep.starts_with("https://"))
        {
            e.push(FieldError::invalid(
                "spec.s3.endpoint",
                format!("{ep:?}: an http:// or https:// URL is required"),
            ));
        }
        let sref = &s3["credentialsSecretRef"];
        for f in ["name", "namespace"] {
            let v = sref[f].as_str().unwrap_or("");
            if !is_dns1123_subdomain(v) {
                e.push(FieldError::required(
                    format!("spec.s3.credentialsSecretRef.{f}"),
                    format!("{v:?} is not a valid {f}"),
                ));
            }
        }
        if let Some(ca) = s3["caBundle"].as_str()
            && !ca.contains("-----BEGIN CERTIFICATE-----")
        {
            e.push(FieldError::invalid(
                "spec.s3.caBundle",
                "a PEM bundle of certificates is required",
            ));
        }
        prefix_ok(s3, "spec.s3.prefix", e);
    }
    if let Some(fs) = fs {
        let p = fs["path"].as_str().unwrap_or("");
        if !p.starts_with('/') || p.split('/').any(|s| s == "..") {
            e.push(FieldError::invalid(
                "spec.filesystem.path",
                format!("{p:?}: an absolute path without '..' is required"),
            ));
        }
        prefix_ok(fs, "spec.filesystem.prefix", e);
    }
}

fn validate_restore(spec: &Value, own_ns: &str, e: &mut Vec<FieldError>) {
    req_name(spec, "target", "BackupTarget name", e);
    req_name(spec, "encryptionKeySecretRef", "Secret name", e);
    match spec["backupName"].as_str() {
        Some(n) if is_backup_name(n) => {}
        n => e.push(FieldError::required(
            "spec.backupName",
            format!(
                "{:?}: the backup's name as the target lists it is required",
                n.unwrap_or("")
            ),
        )),
    }
    if let Some(map) = spec["namespaceMapping"].as_object() {
        for (from, to) in map {
            let to = to.as_str().unwrap_or("");
            if !is_dns1123_label(from) || !is_dns1123_label(to) {
                e.push(FieldError::invalid(
                    format!("spec.namespaceMapping.{from}"),
                    format!("{from:?} → {to:?}: namespaces are DNS-1123 labels"),
                ));
            } else if !own_ns.is_empty() && to != own_ns {
                e.push(FieldError::forbidden(
                    format!("spec.namespaceMapping.{from}"),
                    format!(
                        "{from:?} → {to:?}: a BackupRestore restores into its own namespace \
                         {own_ns:?} only (create it in {to:?} to restore there)"
                    ),
                ));
            }
        }
    }
    for (i, vm) in spec["virtualMachines"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let name = vm["name"].as_str().unwrap_or("");
        let ok = match name.split_once('/') {
            Some((ns, n)) => is_dns1123_label(ns) && is_dns1123_subdomain(n),
            None => false,
        };
        if !ok {
            e.push(FieldError::invalid(
                format!("spec.virtualMachines[{i}].name"),
                format!("{name:?}: namespace/name as the backup lists it"),
            ));
        }
        if let Some(n) = vm["newName"].as_str()
            && !is_dns1123_subdomain(n)
        {
            e.push(FieldError::invalid(
                format!("spec.virtualMachines[{i}].newName"),
                format!("{n:?} is not a VirtualMachine name"),
            ));
        }
        if let Some(vols) = vm.get("volumes").filter(|v| !v.is_null()) {
            let field = format!("spec.virtualMachines[{i}].volumes");
            match vols.as_array() {
                Some(list) if !list.is_empty() => {
                    for (j, v) in list.iter().enumerate() {
                        if !v.as_str().is_some_and(is_dns1123_subdomain) {
                            e.push(FieldError::invalid(
                                format!("{field}[{j}]"),
                                format!("{v}: a claim name of the VM in the backup"),
                            ));
                        } else if list[..j].contains(v) {
                            e.push(FieldError::duplicate(
                                format!("{field}[{j}]"),
                                v.to_string(),
                            ));
                        }
                    }
                    if spec["start"] == true {
                        e.push(FieldError::forbidden(
                            "spec.start",
                            format!(
                                "{field} restores volumes only: there is no VirtualMachine to \
                                 start"
                            ),
                        ));
                    }
                }
                _ => e.push(FieldError::invalid(
                    field,
                    "a non-empty list of claim names (absent: the whole VM)",
                )),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(kind: &str, mut v: Value) -> Vec<String> {
        admit(kind, Operation::Create, &mut v, None)
            .into_iter()
            .map(|e| e.field)
            .collect()
    }

    #[test]
    fn targets() {
        let s3 = json!({"spec": {"s3": {"endpoint": "http://127.0.0.1:9000", "bucket": "vms",
            "credentialsSecretRef": {"name": "s3", "namespace": "default"}, "pathStyle": true}}});
        assert!(fields("BackupTarget", s3).is_empty());
        let fs = json!({"spec": {"filesystem": {"path": "/mnt/nfs/backups", "prefix": "a/b"}}});
        assert!(fields("BackupTarget", fs).is_empty());
        assert_eq!(fields("BackupTarget", json!({"spec": {}})), ["spec"]);
        let both = json!({"spec": {"filesystem": {"path": "/x"}, "s3": {"bucket": "vms",
            "credentialsSecretRef": {"name": "s3", "namespace": "d"}}}});
        assert_eq!(fields("BackupTarget", both), ["spec.filesystem"]);
        let bad = json!({"spec": {"s3": {"endpoint": "ftp://x", "bucket": "A",
            "credentialsSecretRef": {"name": "s3", "namespace": ""}, "prefix": "../x",
            "caBundle": "nope"}}});
        assert_eq!(
            fields("BackupTarget", bad),
            [
                "spec.s3.bucket",
                "spec.s3.endpoint",
                "spec.s3.credentialsSecretRef.namespace",
                "spec.s3.caBundle",
                "spec.s3.prefix"
            ]
        );
        let rel = json!({"spec": {"filesystem": {"path": "backups/../etc"}}});
        assert_eq!(fields("BackupTarget", rel), ["spec.filesystem.path"]);
        let typo = json!({"spec": {"filesystem": {"path": 3}}});
        assert_eq!(fields("BackupTarget", typo), ["spec.filesystem.path"]);
    }

    #[test]
    fn backups_and_restores() {
        let ok = json!({"spec": {"target": "s3", "virtualMachines": ["vm1"],
            "encryptionKeySecretRef": "key"}});
        assert!(fields("Backup", ok.clone()).is_empty());
        let bad = json!({"spec": {"target": "", "virtualMachines": ["vm1", "vm1", "Bad"],
            "encryptionKeySecretRef": "key", "backupName": "../x"}});
        assert_eq!(
            fields("Backup", bad),
            [
                "spec.target",
                "spec.virtualMachines[1]",
                "spec.virtualMachines[2]",
                "spec.backupName"
            ]
        );
        let mut changed = ok.clone();
        changed["spec"]["target"] = json!("other");
        let errs = admit("Backup", Operation::Update, &mut changed, Some(&ok));
        assert_eq!(errs[0].field, "spec");

        let r = json!({"metadata": {"namespace": "restored"},
            "spec": {"target": "s3", "backupName": "default-b1",
            "encryptionKeySecretRef": "key", "start": true,
            "namespaceMapping": {"default": "restored"}, "newMacAddresses": true,
            "newFirmwareUUID": true,
            "virtualMachines": [{"name": "default/vm1", "newName": "vm2"}]}});
        assert!(fields("BackupRestore", r.clone()).is_empty());
        // Into another namespace than its own: refused naming the mapping.
        let mut other = r.clone();
        other["spec"]["namespaceMapping"] = json!({"default": "prod"});
        let mut v = other.clone();
        let errs = admit("BackupRestore", Operation::Create, &mut v, None);
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].field, "spec.namespaceMapping.default");
        assert!(errs[0].message.contains("own namespace"), "{errs:?}");
        let mut changed = r.clone();
        changed["spec"]["start"] = json!(false);
        let errs = admit("BackupRestore", Operation::Update, &mut changed, Some(&r));
        assert_eq!(errs[0].field, "spec");
        let missing = json!({"spec": {"target": "s3", "encryptionKeySecretRef": "key"}});
        let mut m = missing.clone();
        let errs = admit("BackupRestore", Operation::Create, &mut m, None);
        assert!(errs[0].message.contains("backupName"), "{errs:?}");
        let r = json!({"spec": {"target": "s3", "encryptionKeySecretRef": "key", "backupName": "",
            "namespaceMapping": {"default": "Bad_NS"},
            "virtualMachines": [{"name": "vm1"}]}});
        assert_eq!(
            fields("BackupRestore", r),
            [
                "spec.backupName",
                "spec.namespaceMapping.default",
                "spec.virtualMachines[0].name"
            ]
        );
    }

    #[test]
    fn plans_are_admitted_and_bad_fields_named() {
        let plan = json!({"spec": {"schedule": "0 * * * *", "timeZone": "Europe/Berlin",
            "target": "s3", "encryptionKeySecretRef": "key", "virtualMachines": ["vm1"],
            "retention": {"daily": 7, "keepLast": 2}}});
        assert!(fields("BackupPlan", plan).is_empty());
        let whole_ns = json!({"spec": {"schedule": "*/20 * * * * *", "target": "s3",
            "encryptionKeySecretRef": "key", "selector": {}}});
        assert!(fields("BackupPlan", whole_ns).is_empty());
        let bad = json!({"spec": {"schedule": "0 * *", "timeZone": "Nowhere/City",
            "target": "s3", "encryptionKeySecretRef": "key", "retention": {"daily": -1}}});
        assert_eq!(
            fields("BackupPlan", bad),
            [
                "spec.schedule",
                "spec.virtualMachines",
                "spec.retention.daily"
            ]
        );
        let bad_tz = json!({"spec": {"schedule": "0 * * * *", "timeZone": "Nowhere/City",
            "target": "s3", "encryptionKeySecretRef": "key", "virtualMachines": ["a", "a"],
            "selector": {"matchExpressions": [{"key": "k", "operator": "Near"}]}}});
        assert_eq!(
            fields("BackupPlan", bad_tz),
            [
                "spec.timeZone",
                "spec.virtualMachines[1]",
                "spec.selector.matchExpressions[0].operator"
            ]
        );
    }

    #[test]
    fn table_and_schemas() {
        let r = resources();
        assert_eq!(r.len(), 4);
        assert!(!r[0].namespaced && r[1].namespaced);
        for d in &r {
            assert!(schema(d.kind).is_some());
        }
    }

    #[test]
    fn consistency_is_per_vm_or_group_with_a_bounded_timeout() {
        let b = |c: Value| {
            json!({"spec": {"target": "s3", "virtualMachines": ["vm1", "vm2"],
                "encryptionKeySecretRef": "k", "consistency": c}})
        };
        assert!(
            fields(
                "Backup",
                b(json!({"freeze": "Group", "freezeTimeout": "30s"}))
            )
            .is_empty()
        );
        assert!(fields("Backup", b(json!({"freeze": "PerVM"}))).is_empty());
        assert_eq!(
            fields("Backup", b(json!({"freeze": "Crash"}))),
            ["spec.consistency.freeze"]
        );
        assert_eq!(
            fields(
                "Backup",
                b(json!({"freeze": "Group", "freezeTimeout": "2h"}))
            ),
            ["spec.consistency.freezeTimeout"]
        );
        assert_eq!(
            fields("Backup", b(json!({"freezeTimeout": "soon"}))),
            ["spec.consistency.freezeTimeout"]
        );
        let cmd = json!({"freeze": "Group", "preFreezeCommand": ["/bin/sh", "-c", "sync"],
            "postThawCommand": ["/bin/true"], "commandTimeout": "10s"});
        assert!(fields("Backup", b(cmd)).is_empty());
        assert_eq!(
            fields(
                "Backup",
                b(json!({"preFreezeCommand": ["sh", "-c", "sync"]}))
            ),
            ["spec.consistency.preFreezeCommand[0]"]
        );
        assert_eq!(
            fields("Backup", b(json!({"postThawCommand": "/bin/true"}))),
            ["spec.consistency.postThawCommand"]
        );
        assert_eq!(
            fields("Backup", b(json!({"preFreezeCommand": ["/bin/a", 3]}))),
            ["spec.consistency.preFreezeCommand[1]"]
        );
        assert_eq!(
            fields("Backup", b(json!({"commandTimeout": "10m"}))),
            ["spec.consistency.commandTimeout"]
        );
        let plan = json!({"spec": {"schedule": "*/5 * * * *", "target": "s3",
            "encryptionKeySecretRef": "k", "virtualMachines": ["a"],
            "consistency": {"freeze": "group"}}});
        assert_eq!(fields("BackupPlan", plan), ["spec.consistency.freeze"]);
        let c = |f: &str, t: Option<&str>| Consistency {
            freeze: Some(f.into()),
            freeze_timeout: t.map(String::from),
            ..Default::default()
        };
        assert_eq!(Consistency::group_hold(None), None);
        assert_eq!(Consistency::group_hold(Some(&c("PerVM", None))), None);
        assert_eq!(
            Consistency::group_hold(Some(&c("Group", None))),
            Some(DEFAULT_FREEZE_TIMEOUT)
        );
        assert_eq!(
            Consistency::group_hold(Some(&c("Group", Some("45s")))),
            Some(std::time::Duration::from_secs(45))
        );
    }

    #[test]
    fn restores_of_chosen_volumes() {
        let r = |vm: Value, start: bool| {
            json!({"metadata": {"namespace": "dr"}, "spec": {"target": "s3",
                "encryptionKeySecretRef": "k", "backupName": "prod-b1",
                "virtualMachines": [vm], "start": start}})
        };
        let ok = json!({"name": "prod/a", "volumes": ["a-data"]});
        assert!(fields("BackupRestore", r(ok.clone(), false)).is_empty());
        assert_eq!(fields("BackupRestore", r(ok, true)), ["spec.start"]);
        assert_eq!(
            fields(
                "BackupRestore",
                r(json!({"name": "prod/a", "volumes": []}), false)
            ),
            ["spec.virtualMachines[0].volumes"]
        );
        assert_eq!(
            fields(
                "BackupRestore",
                r(
                    json!({"name": "prod/a", "volumes": ["x", "x", "Bad_Name"]}),
                    false
                )
            ),
            [
                "spec.virtualMachines[0].volumes[1]",
                "spec.virtualMachines[0].volumes[2]"
            ]
        );
    }
}
