//! Live migration on the node (docs/migration.md): the pure per-VMI decisions of the target
//! side ([`target_step`]: start a launcher that waits for the incoming stream, or abandon it)
//! and of the source side ([`source_step`]: send the VM once the target is ready), the
//! status patches they write and the node-namespace sockets. Neither the memory stream
//! ([`crate::migstream`]) nor a block migration's NBD connections ([`crate::nbdpeer`]) pass
//! through the agents: both are QEMU to QEMU.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use ferrovirt_api::kubevirt::vmi::{MigrationState, VirtualMachineInstance};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};

/// The target agent's unix socket in the VMI directory on which its launcher receives the
/// migration's data connection ([`crate::migstream::hand_over`]).
pub const INCOMING_SOCKET: &str = "migration-in.sock";
/// The same on the source.
pub const OUTGOING_SOCKET: &str = "migration-out.sock";

/// The target's hand-over socket in a VMI directory.
pub fn incoming_socket(dir: &Path) -> PathBuf {
    dir.join(INCOMING_SOCKET)
}

fn state(vmi: &VirtualMachineInstance) -> Option<&MigrationState> {
    vmi.status.as_ref()?.migration_state.as_ref()
}

fn bound_to(vmi: &VirtualMachineInstance) -> Option<&str> {
    vmi.status.as_ref()?.node_name.as_deref()
}

/// What the target node does about a VMI whose migration state names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetStep {
    /// Start a launcher waiting for the incoming stream, then report its address.
    Prepare,
    /// The migration failed (or moved elsewhere): stop the waiting launcher, remove it.
    Abandon,
    Nothing,
}

/// The target side's decision for `vmi` on `node`; `launcher`: this node has a launcher
/// directory for the VMI; `preparing`: a preparation is in flight.
pub fn target_step(
    vmi: &VirtualMachineInstance,
    node: &str,
    launcher: bool,
    preparing: bool,
) -> TargetStep {
    if bound_to(vmi) == Some(node) {
        // The VMI runs here (migrated in, or never left): the ordinary reconcile owns it.
        return TargetStep::Nothing;
    }
    let Some(st) = state(vmi) else {
        return if launcher {
            TargetStep::Abandon
        } else {
            TargetStep::Nothing
        };
    };
    let ours = st.target_node.as_deref() == Some(node);
    let failed = st.failed == Some(true);
    let completed = st.completed == Some(true);
    if !ours || failed || completed || vmi.metadata.deletion_timestamp.is_some() {
        return if launcher && !preparing {
            TargetStep::Abandon
        } else {
            TargetStep::Nothing
        };
    }
    if !launcher && !preparing && st.target_node_address.is_none() {
        TargetStep::Prepare
    } else {
        TargetStep::Nothing
    }
}

/// Where the source connects: `targetNodeAddress` and the port in
/// `targetDirectMigrationNodePorts`.
pub fn target_endpoint(st: &MigrationState) -> Option<SocketAddr> {
    let ip: IpAddr = st.target_node_address.as_deref()?.parse().ok()?;
    let port: u16 = st
        .target_direct_migration_node_ports
        .as_ref()?
        .iter()
        .filter(|(_, v)| **v == 0)
        .find_map(|(p, _)| p.parse().ok())?;
    Some(SocketAddr::new(ip, port))
}

/// The value marking a block-migration (NBD) port in `targetDirectMigrationNodePorts`
/// (KubeVirt's libvirt block-migration port; the migration stream's port maps to 0).
pub const NBD_PORT_MARK: i32 = 49153;

/// The value marking the port on which the target receives the frozen layers of the
/// node-local volumes' snapshot chains ([`crate::chaincopy`]) before its QEMU starts.
pub const CHAIN_PORT_MARK: i32 = ferrovirt_api::migration::CHAIN_PORT_MARK;

/// The target's port for the snapshot chains, when it waits for them.
pub fn chain_endpoint(st: &MigrationState) -> Option<SocketAddr> {
    let ip: IpAddr = st.target_node_address.as_deref()?.parse().ok()?;
    let port = st
        .target_direct_migration_node_ports
        .iter()
        .flatten()
        .find(|(_, v)| **v == CHAIN_PORT_MARK)
        .and_then(|(p, _)| p.parse().ok())?;
    Some(SocketAddr::new(ip, port))
}

/// Whether the source on `node` sends its volumes' chains for `vmi`'s migration now: bound
/// here, the migration not started nor finished, the target waiting for them (its stream
/// not ready yet); `sent`: the migration uid they were last sent for.
pub fn chain_step(
    vmi: &VirtualMachineInstance,
    node: &str,
    sent: Option<&str>,
) -> Option<SocketAddr> {
    let st = state(vmi)?;
    if bound_to(vmi) != Some(node)
        || st.source_node.as_deref() != Some(node)
        || ferrovirt_api::migration::finished(st)
        || st.start_timestamp.is_some()
        || target_endpoint(st).is_some()
        || vmi.metadata.deletion_timestamp.is_some()
        || sent.is_some_and(|s| Some(s) == st.migration_uid.as_deref())
    {
        return None;
    }
    chain_endpoint(st)
}

/// The target's report that it waits for the snapshot chains on `address`:`port`.
pub fn chain_ready_patch(address: IpAddr, port: u16) -> Value {
    json!({"migrationState": {
        "targetNodeAddress": address.to_string(),
        "targetDirectMigrationNodePorts": {port.to_string(): CHAIN_PORT_MARK},
    }})
}

/// The target's NBD ports (one for all the disks copied), in order.
pub fn block_ports(st: &MigrationState) -> Vec<u16> {
    let mut ports: Vec<u16> = st
        .target_direct_migration_node_ports
        .iter()
        .flatten()
        .filter(|(_, v)| **v == NBD_PORT_MARK)
        .filter_map(|(p, _)| p.parse().ok())
        .collect();
    ports.sort_unstable();
    ports
}

/// What the source node does about a VMI bound to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceStep {
    /// Send the VM to the target.
    Migrate {
        target: SocketAddr,
        target_node: String,
        migration_uid: String,
    },
    Nothing,
}

/// The source side's decision for `vmi` bound to `node`; `driving`: this agent already runs
/// the migration.
pub fn source_step(vmi: &VirtualMachineInstance, node: &str, driving: bool) -> SourceStep {
    let Some(st) = state(vmi) else {
        return SourceStep::Nothing;
    };
    if driving
        || bound_to(vmi) != Some(node)
        || st.source_node.as_deref() != Some(node)
        || ferrovirt_api::migration::finished(st)
        || st.start_timestamp.is_some()
        || vmi.metadata.deletion_timestamp.is_some()
    {
        return SourceStep::Nothing;
    }
    match (target_endpoint(st), st.target_node.clone()) {
        (Some(target), Some(target_node)) if target_node != node => SourceStep::Migrate {
            target,
            target_node,
            migration_uid: st.migration_uid.clone().unwrap_or_default(),
        },
        _ => SourceStep::Nothing,
    }
}

/// The target's report once its QEMU waits for the stream.
pub fn target_ready_patch(address: IpAddr, port: u16, nbd_ports: &[u16], now: &str) -> Value {
    let mut ports = serde_json::Map::new();
    ports.insert(port.to_string(), json!(0));
    for p in nbd_ports {
        ports.insert(p.to_string(), json!(NBD_PORT_MARK));
    }
    json!({"migrationState": {
        "targetNodeAddress": address.to_string(),
        "targetDirectMigrationNodePorts": ports,
        "targetNodeDomainDetected": true,
        "targetNodeDomainReadyTimestamp": now,
    }})
}

/// A failed migration (the source runs on).
pub fn failed_patch(reason: &str, now: &str) -> Value {
    json!({"migrationState": {"failed": true, "failureReason": reason, "endTimestamp": now}})
}

/// The wait before retry `tries` of the switch-over write: 250 ms doubling, at most 5 s (it
/// is retried until it is written: the target runs the guest).
pub fn switch_over_backoff(tries: u32) -> std::time::Duration {
    let ms = 250u64.saturating_mul(1 << tries.saturating_sub(1).min(5));
    std::time::Duration::from_millis(ms.min(5000))
}

/// The switch-over: the VMI moves to the target in one write (node, label, state).
pub fn switch_over_patch(uid: Option<&str>, target_node: &str, now: &str) -> Value {
    json!({
        "metadata": {"uid": uid, "labels": {"kubevirt.io/nodeName": target_node}},
        "status": {
            "nodeName": target_node,
            "migrationState": {"completed": true, "endTimestamp": now},
        },
    })
}

/// Whether the target accepts a channel connection from `peer`: only the source node's
/// address may set up a migration stream.
pub fn accept_peer(peer: IpAddr, source: IpAddr) -> bool {
    peer == source
}

/// Runs `f` on a blocking thread inside the named network namespace `netns` (the agent's
/// own when `None`): node-to-node sockets of a node played by a namespace (`--node-netns`)
/// are made where the node's addresses are.
pub(crate) async fn in_netns<T: Send + 'static>(
    netns: Option<String>,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    tokio::task::spawn_blocking(move || {
        ferrovirt_network::netns::run_in(netns.as_deref(), f)
            .map_err(|e| std::io::Error::other(e.to_string()))?
    })
    .await
    .map_err(std::io::Error::other)?
}

/// A TCP listener on `ip` (port chosen by the kernel) in the node's namespace.
pub async fn bind_in(netns: Option<String>, ip: std::net::IpAddr) -> std::io::Result<TcpListener> {
    let l = in_netns(netns, move || {
        let l = std::net::TcpListener::bind((ip, 0))?;
        l.set_nonblocking(true)?;
        Ok(l)
    })
    .await?;
    TcpListener::from_std(l)
}

/// A TCP connection to `target` made from the node's namespace.
pub async fn connect_in(netns: Option<String>, target: SocketAddr) -> std::io::Result<TcpStream> {
    if netns.is_none() {
        return TcpStream::connect(target).await;
    }
    let s = in_netns(netns, move || {
        let s = std::net::TcpStream::connect_timeout(&target, std::time::Duration::from_secs(10))?;
        s.set_nonblocking(true)?;
        Ok(s)
    })
    .await?;
    TcpStream::from_std(s)
}

/// Whether the settings allow switching to post-copy (`allowPostCopy`; [`crate::postcopy`]).
/// A block migration never switches: both QEMUs then run without `postcopy-ram`.
pub fn post_copy_allowed(
    c: &ferrovirt_api::kubevirt::misc::MigrationConfiguration,
    block: bool,
) -> bool {
    c.allow_post_copy == Some(true) && !block
}

/// Whether the migration's settings turn TLS off (KubeVirt's `disableTLS`).
pub fn tls_disabled(c: &ferrovirt_api::kubevirt::misc::MigrationConfiguration) -> bool {
    c.other.get("disableTLS").and_then(Value::as_bool) == Some(true)
}

/// The settings recorded on the VMI's migration state (defaults when none).
pub fn configuration(
    vmi: &VirtualMachineInstance,
) -> ferrovirt_api::kubevirt::misc::MigrationConfiguration {
    state(vmi)
        .and_then(|s| s.migration_configuration.clone())
        .unwrap_or_else(ferrovirt_api::migration_policy::defaults)
}

/// Progress of a running migration, from successive `query-migrate` answers: when the
/// remaining memory last shrank (to a new low).
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    lowest_remaining: Option<u64>,
    last_progress: std::time::Duration,
}

impl Progress {
    /// Takes one `query-migrate` answer seen `at` (since the start).
    pub fn observe(&mut self, query_migrate: &Value, at: std::time::Duration) {
        let Some(remaining) = query_migrate["ram"]["remaining"].as_u64() else {
            return;
        };
        if self.lowest_remaining.is_none_or(|l| remaining < l) {
            self.lowest_remaining = Some(remaining);
            self.last_progress = at;
        }
    }

    /// How long the remaining memory has not shrunk, `now` since the start.
    pub fn stalled_for(&self, now: std::time::Duration) -> std::time::Duration {
        now.saturating_sub(self.last_progress)
    }
}

/// The file in a VMI directory with the VMI's live-migratability, decided when its launcher
/// started (the claims' access modes are known then).
pub const MIGRATABLE_FILE: &str = "migratable.json";

/// Records the live-migratability of the VMI in its directory.
/// `volume_dirs`: the directory name (the PV's) of each node-local claim a block migration
/// would copy, so that [`read_migratable_now`] can see snapshots taken since.
pub fn write_migratable(
    dir: &Path,
    m: &Result<ferrovirt_api::migration::Method, ferrovirt_api::migration::NotMigratable>,
    volume_dirs: &std::collections::BTreeMap<String, String>,
) -> Result<(), crate::error::AgentError> {
    let v = match m {
        Ok(ferrovirt_api::migration::Method::Live) => json!({"migratable": true}),
        Ok(ferrovirt_api::migration::Method::Block(vols)) => {
            json!({"migratable": true, "block": vols, "volumeDirs": volume_dirs})
        }
        Err(e) => json!({"migratable": false, "reason": e.reason, "message": e.message}),
    };
    ferrovirt_launcher::control::write_json_atomic(&dir.join(MIGRATABLE_FILE), &v)?;
    Ok(())
}

/// The recorded live-migratability: `Err((reason, message))` when not; `None`: unknown.
pub fn read_migratable(dir: &Path) -> Option<Result<(), (String, String)>> {
    let v: Value = serde_json::from_slice(&std::fs::read(dir.join(MIGRATABLE_FILE)).ok()?).ok()?;
    if v["migratable"] == true {
        Some(Ok(()))
    } else {
        Some(Err((
            v["reason"].as_str().unwrap_or_default().to_string(),
            v["message"].as_str().unwrap_or_default().to_string(),
        )))
    }
}

/// [`read_migratable`], checked again against the node's volumes under `volume_root`: a
/// node-local claim whose snapshot chain is in a state that cannot be carried now (an online
/// merge unfinished, its journal pending, or a record that does not read) makes the VMI not
/// live-migratable, naming the state. Chains themselves are carried ([`crate::chaincopy`]).
pub fn read_migratable_now(dir: &Path, volume_root: &Path) -> Option<Result<(), (String, String)>> {
    let recorded = read_migratable(dir)?;
    if recorded.is_err() {
        return Some(recorded);
    }
    Some(
        match uncarriable_claim(&read_volume_dirs(dir), volume_root) {
            Some((claim, why)) => Err((
                ferrovirt_api::migration::reason::DISKS_NOT_LIVE_MIGRATABLE.to_string(),
                format!(
                    "cannot migrate VMI: PVC {claim} is not shared (ReadWriteMany) and its snapshot \
                 chain cannot be carried now: {why}"
                ),
            )),
            None => Ok(()),
        },
    )
}

/// The node-local claims a block migration copies, and their volume directory names
/// (recorded at the start, [`write_migratable`]).
pub fn read_volume_dirs(dir: &Path) -> std::collections::BTreeMap<String, String> {
    std::fs::read(dir.join(MIGRATABLE_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|v| serde_json::from_value(v["volumeDirs"].clone()).ok())
        .unwrap_or_default()
}

/// A volume directory name of [`read_volume_dirs`] as a path under `volume_root` (`None`:
/// a name that is a path is never followed).
pub fn volume_dir(volume_root: &Path, name: &str) -> Option<PathBuf> {
    (!name.is_empty() && !name.contains('/') && !name.starts_with('.'))
        .then(|| volume_root.join(name))
}

/// The first claim of `dirs` (claim → volume directory name) whose volume under
/// `volume_root` has a chain that cannot be carried now, and why.
fn uncarriable_claim(
    dirs: &std::collections::BTreeMap<String, String>,
    volume_root: &Path,
) -> Option<(String, String)> {
    dirs.iter().find_map(|(c, d)| {
        let dir = volume_dir(volume_root, d)?;
        if !dir.join(ferrovirt_storage::snapshot::CHAIN_FILE).exists() {
            return None;
        }
        let why = match ferrovirt_storage::snapshot::read_chain(&dir) {
            Ok(chain) => crate::chaincopy::plan(&chain).err()?,
            Err(e) => e.to_string(),
        };
        Some((c.clone(), why))
    })
}

/// The volumes a block migration of the VMI in `dir` copies (empty: a live migration).
pub fn read_block_volumes(dir: &Path) -> Vec<ferrovirt_api::migration::BlockVolume> {
    std::fs::read(dir.join(MIGRATABLE_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|v| serde_json::from_value(v["block"].clone()).ok())
        .unwrap_or_default()
}

/// The figures of a finished `query-migrate` answer: (total ms, downtime ms).
pub fn figures(query_migrate: &Value) -> (Option<u64>, Option<u64>) {
    (
        query_migrate["total-time"].as_u64(),
        query_migrate["downtime"].as_u64(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(node: &str, st: Value) -> VirtualMachineInstance {
        serde_json::from_value(json!({"metadata": {"name": "v", "uid": "u"},
            "status": {"phase": "Running", "nodeName": node, "migrationState": st}}))
        .unwrap()
    }

    #[test]
    fn the_target_prepares_once_and_abandons_a_failed_migration() {
        let v = vmi("n1", json!({"targetNode": "n2", "sourceNode": "n1"}));
        assert_eq!(target_step(&v, "n2", false, false), TargetStep::Prepare);
        assert_eq!(target_step(&v, "n2", false, true), TargetStep::Nothing);
        assert_eq!(target_step(&v, "n2", true, false), TargetStep::Nothing);
        assert_eq!(target_step(&v, "n3", false, false), TargetStep::Nothing);
        let failed = vmi("n1", json!({"targetNode": "n2", "failed": true}));
        assert_eq!(target_step(&failed, "n2", true, false), TargetStep::Abandon);
        assert_eq!(
            target_step(&failed, "n2", false, false),
            TargetStep::Nothing
        );
        // Switched over: the VMI is ours now, the ordinary reconcile takes it.
        let done = vmi("n2", json!({"targetNode": "n2", "completed": true}));
        assert_eq!(target_step(&done, "n2", true, false), TargetStep::Nothing);
    }

    #[test]
    fn the_source_migrates_once_the_target_reported_its_address() {
        let waiting = vmi("n1", json!({"targetNode": "n2", "sourceNode": "n1"}));
        assert_eq!(source_step(&waiting, "n1", false), SourceStep::Nothing);
        let ready = vmi(
            "n1",
            json!({"targetNode": "n2", "sourceNode": "n1", "migrationUid": "m",
                "targetNodeAddress": "10.1.2.3", "targetDirectMigrationNodePorts": {"4444": 0}}),
        );
        assert_eq!(
            source_step(&ready, "n1", false),
            SourceStep::Migrate {
                target: "10.1.2.3:4444".parse().unwrap(),
                target_node: "n2".into(),
                migration_uid: "m".into()
            }
        );
        assert_eq!(source_step(&ready, "n1", true), SourceStep::Nothing);
        assert_eq!(source_step(&ready, "n2", false), SourceStep::Nothing);
        let mut started = ready.clone();
        started
            .status
            .as_mut()
            .unwrap()
            .migration_state
            .as_mut()
            .unwrap()
            .start_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        assert_eq!(source_step(&started, "n1", false), SourceStep::Nothing);
    }

    #[test]
    fn post_copy_only_when_allowed_and_never_for_a_block_migration() {
        let mut c = ferrovirt_api::kubevirt::misc::MigrationConfiguration::default();
        assert!(!post_copy_allowed(&c, false));
        c.allow_post_copy = Some(false);
        assert!(!post_copy_allowed(&c, false));
        c.allow_post_copy = Some(true);
        assert!(post_copy_allowed(&c, false));
        assert!(!post_copy_allowed(&c, true));
    }

    #[test]
    fn the_switch_over_write_backs_off_to_five_seconds() {
        assert_eq!(switch_over_backoff(1).as_millis(), 250);
        assert_eq!(switch_over_backoff(2).as_millis(), 500);
        assert_eq!(switch_over_backoff(5).as_millis(), 4000);
        assert_eq!(switch_over_backoff(50).as_millis(), 5000);
    }

    #[test]
    fn the_target_patch_round_trips_to_the_endpoint() {
        let p = target_ready_patch("127.0.0.1".parse().unwrap(), 4321, &[5002, 5001], "t");
        let st: MigrationState = serde_json::from_value(p["migrationState"].clone())
            .unwrap_or_else(|_| {
                let mut v = p["migrationState"].clone();
                v["targetNodeDomainReadyTimestamp"] = json!("2026-01-01T00:00:00Z");
                serde_json::from_value(v).unwrap()
            });
        assert_eq!(
            target_endpoint(&st),
            Some("127.0.0.1:4321".parse().unwrap())
        );
        // The NBD ports are told apart from the stream's.
        assert_eq!(block_ports(&st), vec![5001, 5002]);
    }

    #[test]
    fn progress_is_a_new_low_of_remaining_memory() {
        use std::time::Duration;
        let mut p = Progress::default();
        let q = |r: u64| json!({"ram": {"remaining": r}});
        p.observe(&q(100), Duration::from_secs(1));
        p.observe(&q(50), Duration::from_secs(2));
        p.observe(&q(80), Duration::from_secs(5));
        assert_eq!(
            p.stalled_for(Duration::from_secs(6)),
            Duration::from_secs(4)
        );
        p.observe(&q(10), Duration::from_secs(7));
        assert_eq!(p.stalled_for(Duration::from_secs(7)), Duration::ZERO);
    }

    /// The target's channel serving `target`'s certificate and pinned to `source`'s, opened
    /// by a client presenting `client` and pinning `expected`: whether the hello arrives.
    async fn channel_carries(
        target: &crate::tls::AgentCert,
        source: &crate::tls::AgentCert,
        client: &crate::tls::AgentCert,
        expected: crate::tls::Fingerprint,
    ) -> bool {
        use std::time::Duration;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = crate::tls::migration_server_config(target, source.fingerprint()).unwrap();
        let accepted = tokio::spawn(async move {
            let from = "127.0.0.1".parse().unwrap();
            let mut ch = crate::migstream::accept_channel(&listener, from, Some(server))
                .await
                .ok()?;
            crate::migstream::recv::<String>(&mut ch).await.ok()
        });
        let cfg = crate::tls::migration_client_config(client, expected).unwrap();
        let conn = crate::migstream::connect_channel(None, addr, Some(cfg));
        if let Ok(Ok((mut ch, _))) = tokio::time::timeout(Duration::from_millis(1500), conn).await {
            let _ = crate::migstream::send(&mut ch, &"QEVM".to_string()).await;
        }
        let abort = accepted.abort_handle();
        let got = tokio::time::timeout(Duration::from_millis(1500), accepted).await;
        abort.abort();
        matches!(got, Ok(Ok(Some(s))) if s == "QEVM")
    }

    #[tokio::test]
    async fn the_stream_between_nodes_is_mutual_tls_pinned_to_both_nodes() {
        let target = crate::tls::AgentCert::generate(&["127.0.0.1".into()]).unwrap();
        let source = crate::tls::AgentCert::generate(&["127.0.0.1".into()]).unwrap();
        let attacker = crate::tls::AgentCert::generate(&["127.0.0.1".into()]).unwrap();
        let pin = target.fingerprint();
        assert!(channel_carries(&target, &source, &source, pin).await);
        assert!(
            !channel_carries(&target, &source, &attacker, pin).await,
            "a client without the source node's certificate reaches nothing"
        );
        assert!(
            !channel_carries(&attacker, &source, &source, pin).await,
            "the source sends nothing to a target without the target node's certificate"
        );
    }

    #[test]
    fn disable_tls_is_read_from_the_settings() {
        let on: ferrovirt_api::kubevirt::misc::MigrationConfiguration =
            serde_json::from_value(json!({"disableTLS": true})).unwrap();
        assert!(tls_disabled(&on));
        assert!(!tls_disabled(&ferrovirt_api::migration_policy::defaults()));
    }

    #[test]
    fn switch_over_moves_node_label_and_state_in_one_patch() {
        let p = switch_over_patch(Some("u"), "n2", "t");
        assert_eq!(p["status"]["nodeName"], "n2");
        assert_eq!(p["metadata"]["labels"]["kubevirt.io/nodeName"], "n2");
        assert_eq!(p["status"]["migrationState"]["completed"], true);
        assert_eq!(p["metadata"]["uid"], "u");
    }

    #[test]
    fn a_chain_is_carried_but_a_pending_merge_makes_the_vmi_not_migratable() {
        use ferrovirt_api::migration::{BlockVolume, Method};
        use ferrovirt_storage::snapshot::{CHAIN_FILE, Chain, Journal, plan_snapshot};
        let vmi_dir = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        let vol = root.path().join("pv-data");
        std::fs::create_dir(&vol).unwrap();
        let block = Ok(Method::Block(vec![BlockVolume {
            volume: "data".into(),
            claim: Some("data".into()),
        }]));
        let dirs = [("data".to_string(), "pv-data".to_string())].into();
        write_migratable(vmi_dir.path(), &block, &dirs).unwrap();
        assert_eq!(
            read_migratable_now(vmi_dir.path(), root.path()),
            Some(Ok(()))
        );
        // Snapshots taken since the start: the chain is carried, still migratable.
        let mut chain = plan_snapshot(&plan_snapshot(&Chain::default()).chain).chain;
        std::fs::write(vol.join(CHAIN_FILE), serde_json::to_vec(&chain).unwrap()).unwrap();
        assert_eq!(
            read_migratable_now(vmi_dir.path(), root.path()),
            Some(Ok(()))
        );
        assert_eq!(read_volume_dirs(vmi_dir.path()), dirs);
        // An online merge unfinished: refused, naming it.
        chain.journal = Some(Journal {
            id: "m-1".into(),
            commit: false,
            layers: chain.layers.clone(),
            detached: Vec::new(),
            delete: Vec::new(),
        });
        std::fs::write(vol.join(CHAIN_FILE), serde_json::to_vec(&chain).unwrap()).unwrap();
        let (reason, message) = read_migratable_now(vmi_dir.path(), root.path())
            .unwrap()
            .unwrap_err();
        assert_eq!(reason, "DisksNotLiveMigratable");
        assert!(
            message.contains("PVC data") && message.contains("online merge"),
            "{message}"
        );
        // A directory name that is a path is never followed.
        let odd = [("data".to_string(), "../x".to_string())].into();
        write_migratable(vmi_dir.path(), &block, &odd).unwrap();
        assert_eq!(
            read_migratable_now(vmi_dir.path(), root.path()),
            Some(Ok(()))
        );
    }

    #[test]
    fn the_source_sends_the_chains_once_the_target_waits_for_them() {
        let waiting = vmi(
            "n1",
            json!({"targetNode": "n2", "sourceNode": "n1", "migrationUid": "m",
            "targetNodeAddress": "10.1.2.3", "targetDirectMigrationNodePorts": {"5555": CHAIN_PORT_MARK}}),
        );
        let at: SocketAddr = "10.1.2.3:5555".parse().unwrap();
        assert_eq!(chain_step(&waiting, "n1", None), Some(at));
        assert_eq!(chain_step(&waiting, "n1", Some("m")), None, "sent once");
        assert_eq!(chain_step(&waiting, "n1", Some("older")), Some(at));
        assert_eq!(chain_step(&waiting, "n2", None), None);
        // Not yet a stream endpoint: the source does not migrate before the chains.
        assert_eq!(source_step(&waiting, "n1", false), SourceStep::Nothing);
        let st = waiting
            .status
            .as_ref()
            .unwrap()
            .migration_state
            .as_ref()
            .unwrap();
        assert_eq!(target_endpoint(st), None);
        assert!(block_ports(st).is_empty());
        // The target ready: the chain port stays in the map, the stream is its own.
        let ready = vmi(
            "n1",
            json!({"targetNode": "n2", "sourceNode": "n1", "migrationUid": "m",
            "targetNodeAddress": "10.1.2.3",
            "targetDirectMigrationNodePorts": {"5555": CHAIN_PORT_MARK, "4444": 0, "4445": NBD_PORT_MARK}}),
        );
        assert_eq!(chain_step(&ready, "n1", None), None);
        let st = ready
            .status
            .as_ref()
            .unwrap()
            .migration_state
            .as_ref()
            .unwrap();
        assert_eq!(target_endpoint(st), Some("10.1.2.3:4444".parse().unwrap()));
        assert_eq!(block_ports(st), vec![4445]);
        let p = chain_ready_patch("10.1.2.3".parse().unwrap(), 5555);
        assert_eq!(
            p["migrationState"]["targetDirectMigrationNodePorts"]["5555"],
            CHAIN_PORT_MARK
        );
        assert!(
            p["migrationState"]
                .get("targetNodeDomainReadyTimestamp")
                .is_none()
        );
    }
}
