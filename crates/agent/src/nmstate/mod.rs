//! Host network configuration from NodeNetworkConfigurationPolicies (nmstate.io), carried out
//! by the node's agent when started with `--nmstate` (opt-in: it changes the node's own
//! network). Each pass ([`run`], every `interval`):
//!
//! - reads the node's links and routes ([`current`]) and writes its NodeNetworkState when it
//!   changed (or every 30 s);
//! - for each policy whose `nodeSelector` matches the Node and whose generation this node has
//!   not finished, takes a slot of the policy's `maxUnavailable` (a compare-and-swap on the
//!   policy's `status.unavailableNodeCount`: two agents cannot both take the last one), or
//!   marks its enactment Pending/MaxUnavailableLimitReached and tries again next pass;
//! - plans the change ([`plan::plan`], pure), keeps the state before it as the checkpoint,
//!   runs the steps, and probes the API server (a real GET of its Node, retried until
//!   `probe_timeout`); when a step fails or the probe does not succeed it runs the plan of
//!   [`plan::restore_state`] (the rollback) and the enactment is Failing/FailedToConfigure
//!   saying why; else Available/SuccessfullyConfigured;
//! - deletes its enactments of policies that no longer select the node;
//! - gives the slot back and rewrites the policy's conditions from its enactments
//!   ([`status::aggregate`], pure), in the same compare-and-swap.
//!
//! `ipv4.dhcp: true` runs a DHCP client for the interface ([`dhcp`]): started (or adopted)
//! after the steps, the enactment waits for its first lease within the probe window and
//! fails naming the interface when none comes; `dhcp: false`, `enabled: false` or `absent`
//! stop it (releasing the lease) before the steps run, while the interface still exists.
//! `dns-resolver.config` writes the node's resolver file ([`resolver`]). Both are undone with
//! the rest on rollback: clients this apply started are stopped before the interfaces are
//! restored, those it stopped are started again after, the resolver file gets its previous
//! content.
//!
//! OVN bridge mappings of applied policies are kept in `DATA_DIR/nmstate-bridge-mappings.json`
//! and reported in the NodeNetworkState (`ovn.bridge-mappings`).

pub mod current;
pub mod dhcp;
pub mod plan;
pub mod resolver;
pub mod status;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferrovirt_api::nmstate::state::{DesiredState, MappingState};
use ferrovirt_api::nmstate::{
    self as api, ENACTMENT_NODE_LABEL, ENACTMENT_POLICY_LABEL, NmstateCondition,
};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams};
use serde_json::{Value, json};

use self::current::Current;
use crate::error::AgentError;

/// The agent's nmstate settings.
#[derive(Debug, Clone)]
pub struct NmstateOptions {
    /// The node's network namespace (`--node-netns`; `None`: the agent's own).
    pub netns: Option<String>,
    /// How long the node may take to reach the API server after a change before it is rolled
    /// back.
    pub probe_timeout: Duration,
    /// How often policies are checked and the state read.
    pub interval: Duration,
    /// The resolver file of a node without `netns` (`--nmstate-resolv-conf`).
    pub resolv_conf: PathBuf,
}

impl Default for NmstateOptions {
    fn default() -> Self {
        NmstateOptions {
            netns: None,
            probe_timeout: Duration::from_secs(30),
            interval: Duration::from_secs(2),
            resolv_conf: PathBuf::from("/etc/resolv.conf"),
        }
    }
}

fn ar(version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(api::GROUP, version, kind), plural)
}

fn policies(c: &Client) -> Api<DynamicObject> {
    let r = ar(
        api::POLICY_VERSION,
        "NodeNetworkConfigurationPolicy",
        "nodenetworkconfigurationpolicies",
    );
    Api::all_with(c.clone(), &r)
}

fn enactments(c: &Client) -> Api<DynamicObject> {
    let r = ar(
        api::STATE_VERSION,
        "NodeNetworkConfigurationEnactment",
        "nodenetworkconfigurationenactments",
    );
    Api::all_with(c.clone(), &r)
}

fn states(c: &Client) -> Api<DynamicObject> {
    let r = ar(api::STATE_VERSION, "NodeNetworkState", "nodenetworkstates");
    Api::all_with(c.clone(), &r)
}

fn kube_err(what: &str, e: kube::Error) -> AgentError {
    AgentError::Reference(format!("{what}: {e}"))
}

fn now() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// Reads the node's links and routes.
pub async fn read(netns: &Option<String>) -> Result<Current, AgentError> {
    let q = |args: &'static [&'static str]| async move {
        ferrovirt_network::apply::query("ip", netns, args)
            .await
            .map_err(|e| AgentError::Tool {
                tool: "ip".into(),
                message: e.to_string(),
            })
    };
    let links = q(&["-j", "-d", "addr", "show"]).await?;
    let routes = q(&["-j", "-4", "route", "show", "table", "main"]).await?;
    let parse = |e: String| AgentError::Tool {
        tool: "ip".into(),
        message: e,
    };
    Ok(Current {
        links: current::parse_links(&links).map_err(parse)?,
        routes: current::parse_routes(&routes).map_err(parse)?,
    })
}

async fn run_steps(netns: &Option<String>, steps: &[plan::Step]) -> Result<(), String> {
    for s in steps {
        let args: Vec<&str> = s.args.iter().map(String::as_str).collect();
        ferrovirt_network::apply::query(s.tool, netns, &args)
            .await
            .map_err(|e| format!("{}: {e}", s.line()))?;
    }
    Ok(())
}

/// A real request to the API server, retried until it succeeds or `timeout` passes.
async fn probe(client: &Client, node: &str, timeout: Duration) -> Result<(), String> {
    let nodes: Api<Node> = Api::all(client.clone());
    let deadline = Instant::now() + timeout;
    let mut last = String::from("no answer");
    while Instant::now() < deadline {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left.min(Duration::from_secs(5)), nodes.get(node)).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "request timed out".into(),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(last)
}

/// Whether a policy's `nodeSelector` matches the node's labels.
pub fn selects(selector: Option<&Value>, labels: &BTreeMap<String, String>) -> bool {
    selector.and_then(Value::as_object).is_none_or(|m| {
        m.iter()
            .all(|(k, v)| labels.get(k).map(String::as_str) == v.as_str())
    })
}

struct Nmstate {
    client: Client,
    node: String,
    data_dir: PathBuf,
    opts: NmstateOptions,
    dhcp: dhcp::Dhcp,
    last_report: Option<(Value, Instant)>,
}

/// What an apply changed besides the steps, undone on rollback.
#[derive(Default)]
struct Undo {
    resolver: Option<resolver::Checkpoint>,
    started: Vec<String>,
    stopped: Vec<(String, plan::DhcpOpts)>,
}

/// The loop (never returns; errors of one pass are logged and the next pass tries again).
pub async fn run(client: Client, node: String, data_dir: PathBuf, opts: NmstateOptions) {
    tracing::info!(
        ?opts,
        "nmstate: applying NodeNetworkConfigurationPolicies on this node"
    );
    let mut n = Nmstate {
        client,
        node,
        dhcp: dhcp::Dhcp::new(&data_dir, opts.netns.clone()),
        data_dir,
        opts,
        last_report: None,
    };
    loop {
        if let Err(e) = n.pass().await {
            tracing::warn!(error = %e, "nmstate pass");
        }
        tokio::time::sleep(n.opts.interval).await;
    }
}

/// The node's OVN bridge mappings (`localnet` → bridge) applied by policies, kept in
/// `DATA_DIR/nmstate-bridge-mappings.json` (empty when none were applied).
pub fn read_bridge_mappings(data_dir: &Path) -> BTreeMap<String, String> {
    std::fs::read(mappings_path(data_dir))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn mappings_path(data_dir: &Path) -> PathBuf {
    data_dir.join("nmstate-bridge-mappings.json")
}

impl Nmstate {
    fn mappings_path(&self) -> PathBuf {
        mappings_path(&self.data_dir)
    }

    fn mappings(&self) -> BTreeMap<String, String> {
        read_bridge_mappings(&self.data_dir)
    }

    fn save_mappings(&self, desired: &DesiredState) -> Result<(), AgentError> {
        let Some(ovn) = &desired.ovn else {
            return Ok(());
        };
        let mut m = self.mappings();
        for b in &ovn.bridge_mappings {
            match (b.state, &b.bridge) {
                (Some(MappingState::Absent), _) => {
                    m.remove(&b.localnet);
                }
                (_, Some(br)) => {
                    m.insert(b.localnet.clone(), br.clone());
                }
                _ => {}
            }
        }
        let p = self.mappings_path();
        let bytes = serde_json::to_vec_pretty(&m).unwrap_or_default();
        std::fs::write(&p, bytes).map_err(|e| AgentError::io(&p, e))
    }

    async fn report(&mut self, force: bool) -> Result<(), AgentError> {
        let cur = read(&self.opts.netns).await?;
        let mut state = cur.to_nmstate();
        state["ovn"] = json!({"bridge-mappings": self.mappings().iter()
            .map(|(l, b)| json!({"localnet": l, "bridge": b})).collect::<Vec<_>>()});
        let wanted = self.dhcp.wanted();
        dhcp::annotate(&mut state, &wanted);
        let dhcp_dns: Vec<String> = wanted
            .keys()
            .filter_map(|i| self.dhcp.lease(i))
            .flat_map(|l| l.dns)
            .collect();
        let file = std::fs::read_to_string(self.resolv_path()).unwrap_or_default();
        state["dns-resolver"] = resolver::report(&resolver::parse(&file), &dhcp_dns);
        if !force
            && let Some((last, at)) = &self.last_report
            && *last == state
            && at.elapsed() < Duration::from_secs(30)
        {
            return Ok(());
        }
        let api = states(&self.client);
        let existing = api
            .get_opt(&self.node)
            .await
            .map_err(|e| kube_err("reading the NodeNetworkState", e))?;
        let mut obj = match existing {
            Some(o) => o,
            None => {
                let node: Node = Api::all(self.client.clone())
                    .get(&self.node)
                    .await
                    .map_err(|e| kube_err("reading the Node", e))?;
                let body: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": "nmstate.io/v1beta1", "kind": "NodeNetworkState",
                    "metadata": {"name": self.node, "ownerReferences": [{
                        "apiVersion": "v1", "kind": "Node", "name": self.node,
                        "uid": node.metadata.uid.unwrap_or_default()}]}}))
                .map_err(|e| AgentError::Reference(e.to_string()))?;
                api.create(&PostParams::default(), &body)
                    .await
                    .map_err(|e| kube_err("creating the NodeNetworkState", e))?
            }
        };
        let t = now();
        obj.data["status"] = json!({
            "currentState": state,
            "lastSuccessfulUpdateTime": t,
            "conditions": [
                {"type": "Available", "status": "True", "reason": "SuccessfullyConfigured",
                 "lastHeartbeatTime": t, "lastTransitionTime": t},
                {"type": "Failing", "status": "False", "lastHeartbeatTime": t,
                 "lastTransitionTime": t}]});
        api.replace_status(&self.node, &PostParams::default(), &obj)
            .await
            .map_err(|e| kube_err("writing the NodeNetworkState", e))?;
        self.last_report = Some((state, Instant::now()));
        Ok(())
    }

    fn resolv_path(&self) -> PathBuf {
        resolver::path(&self.opts.netns, &self.opts.resolv_conf)
    }

    async fn pass(&mut self) -> Result<(), AgentError> {
        self.dhcp.ensure_all().await;
        self.report(false).await?;
        let node: Node = Api::all(self.client.clone())
            .get(&self.node)
            .await
            .map_err(|e| kube_err("reading the Node", e))?;
        let labels = node.metadata.labels.clone().unwrap_or_default();
        let list = policies(&self.client)
            .list(&ListParams::default())
            .await
            .map_err(|e| kube_err("listing NodeNetworkConfigurationPolicies", e))?;
        let mut selecting = std::collections::BTreeSet::new();
        for p in list.items {
            if p.metadata.deletion_timestamp.is_some()
                || !selects(p.data.pointer("/spec/nodeSelector"), &labels)
            {
                continue;
            }
            selecting.insert(p.metadata.name.clone().unwrap_or_default());
            if let Err(e) = self.enact(&p).await {
                tracing::warn!(policy = ?p.metadata.name, error = %e, "nmstate policy");
            }
        }
        // Enactments of policies that no longer select this node go (those of deleted
        // policies go with them: owner references).
        let eapi = enactments(&self.client);
        let mine = eapi
            .list(&ListParams::default().labels(&format!("{ENACTMENT_NODE_LABEL}={}", self.node)))
            .await
            .map_err(|e| kube_err("listing this node's enactments", e))?;
        for e in mine.items {
            let policy = e
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(ENACTMENT_POLICY_LABEL))
                .cloned()
                .unwrap_or_default();
            if !selecting.contains(&policy) {
                let name = e.metadata.name.clone().unwrap_or_default();
                tracing::info!(enactment = %name, "nmstate: the policy no longer selects this node");
                if let Err(err) = eapi.delete(&name, &Default::default()).await {
                    tracing::warn!(enactment = %name, error = %err, "deleting an enactment");
                }
            }
        }
        Ok(())
    }

    async fn enact(&mut self, p: &DynamicObject) -> Result<(), AgentError> {
        let pname = p.metadata.name.clone().unwrap_or_default();
        let generation = p.metadata.generation.unwrap_or(0);
        let name = api::enactment_name(&self.node, &pname);
        let eapi = enactments(&self.client);
        let mut e = match eapi
            .get_opt(&name)
            .await
            .map_err(|e| kube_err("reading the enactment", e))?
        {
            Some(e) => e,
            None => {
                let body: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": "nmstate.io/v1beta1", "kind": "NodeNetworkConfigurationEnactment",
                    "metadata": {"name": name,
                        "labels": {ENACTMENT_NODE_LABEL: self.node, ENACTMENT_POLICY_LABEL: pname},
                        "ownerReferences": [{"apiVersion": "nmstate.io/v1",
                            "kind": "NodeNetworkConfigurationPolicy", "name": pname,
                            "uid": p.metadata.uid.clone().unwrap_or_default()}]}}))
                .map_err(|e| AgentError::Reference(e.to_string()))?;
                eapi.create(&PostParams::default(), &body)
                    .await
                    .map_err(|e| kube_err("creating the enactment", e))?
            }
        };
        let done = e
            .data
            .pointer("/status/policyGeneration")
            .and_then(Value::as_i64)
            == Some(generation)
            && status::true_type(e.data.pointer("/status/conditions"))
                .is_some_and(|t| t == api::condition::AVAILABLE || t == api::condition::FAILING);
        if done {
            return Ok(());
        }
        let desired_v = p
            .data
            .pointer("/spec/desiredState")
            .cloned()
            .unwrap_or(json!({}));
        // A slot untouched for this long belongs to an agent that died mid-apply.
        let grace = self.opts.probe_timeout * 2 + Duration::from_secs(60);
        if !status::take_slot(&self.client, &pname, &self.node, grace).await? {
            if status::true_type(e.data.pointer("/status/conditions")).as_deref()
                == Some(api::condition::PENDING)
                && e.data
                    .pointer("/status/policyGeneration")
                    .and_then(Value::as_i64)
                    == Some(generation)
            {
                return Ok(());
            }
            self.write_enactment(
                &mut e,
                generation,
                &desired_v,
                api::condition::PENDING,
                api::reason::MAX_UNAVAILABLE_LIMIT_REACHED,
                "maxUnavailable nodes are already applying this policy",
            )
            .await?;
            return Ok(());
        }
        self.write_enactment(
            &mut e,
            generation,
            &desired_v,
            api::condition::PROGRESSING,
            api::reason::CONFIGURATION_PROGRESSING,
            "Applying desired state",
        )
        .await?;
        let started = Instant::now();
        let outcome = self.apply(&desired_v).await;
        let (ty, reason, msg) = match &outcome {
            Ok(()) => (
                api::condition::AVAILABLE,
                api::reason::SUCCESSFULLY_CONFIGURED,
                format!(
                    "successfully reconciled in {} ms",
                    started.elapsed().as_millis()
                ),
            ),
            Err(m) => (
                api::condition::FAILING,
                api::reason::FAILED_TO_CONFIGURE,
                m.clone(),
            ),
        };
        tracing::info!(policy = %pname, condition = ty, message = %msg, "nmstate enactment");
        // The state after the change (or the rollback) is reported before the enactment.
        if let Err(err) = self.report(true).await {
            tracing::warn!(error = %err, "reporting the NodeNetworkState");
        }
        let written = self
            .write_enactment(&mut e, generation, &desired_v, ty, reason, &msg)
            .await;
        status::release_slot(&self.client, &pname).await?;
        written
    }

    /// Applies one desired state with its checkpoint; the error says what happened,
    /// including the rollback.
    async fn apply(&self, desired_v: &Value) -> Result<(), String> {
        let desired = api::validate::parse_desired(desired_v)
            .map_err(|e| format!("{}: {}", e.field, e.message))?;
        let netns = &self.opts.netns;
        let mut undo = Undo::default();
        // Clients to stop go first, while their interfaces still exist (an `absent` one is
        // deleted by the steps): the lease is released on the wire, and the checkpoint and
        // the plan are read without it.
        self.stop_dhcp(&desired, &mut undo).await;
        let planned = match read(netns).await {
            Err(e) => Err(e.to_string()),
            Ok(checkpoint) => plan::plan(&checkpoint, &desired).map(|s| (checkpoint, s)),
        };
        let (checkpoint, steps) = match planned {
            Ok(p) => p,
            Err(e) => {
                self.undo_started(&undo).await;
                if let Err(u) = self.undo_rest(undo).await {
                    tracing::warn!(error = %u, "nmstate: restarting the stopped DHCP clients");
                }
                return Err(e);
            }
        };
        tracing::info!(steps = ?steps.iter().map(|s| s.line()).collect::<Vec<_>>(), "nmstate apply");
        let failure = match run_steps(netns, &steps).await {
            Err(e) => format!("applying failed at {e}"),
            Ok(()) => match self.carry_out(&desired, &mut undo).await {
                Err(e) => e,
                Ok(()) => match probe(&self.client, &self.node, self.opts.probe_timeout).await {
                    Ok(()) => {
                        self.save_mappings(&desired).map_err(|e| e.to_string())?;
                        return Ok(());
                    }
                    Err(e) => format!(
                        "the node could not reach the API server within {} s after applying ({e})",
                        self.opts.probe_timeout.as_secs()
                    ),
                },
            },
        };
        // The clients this policy started stop before the interfaces go back; those it
        // stopped start again once they are back.
        self.undo_started(&undo).await;
        let back = plan::restore_state(&checkpoint, &desired);
        let rolled = match read(netns).await {
            Err(e) => Err(e.to_string()),
            Ok(now) => match plan::plan(&now, &back) {
                Err(e) => Err(e),
                Ok(steps) => {
                    tracing::warn!(steps = ?steps.iter().map(|s| s.line()).collect::<Vec<_>>(),
                        "nmstate rollback");
                    run_steps(netns, &steps).await
                }
            },
        };
        let undone = self.undo_rest(undo).await;
        let rolled = rolled.and(undone);
        match rolled {
            Ok(()) => {
                let back_in = probe(&self.client, &self.node, self.opts.probe_timeout).await;
                Err(format!(
                    "{failure}; rolled back to the previous state{}",
                    if back_in.is_ok() {
                        ""
                    } else {
                        " (the API server is still unreachable)"
                    }
                ))
            }
            Err(e) => Err(format!("{failure}; the rollback failed too: {e}")),
        }
    }

    /// The resolver and the DHCP clients a desired state starts, recorded in `undo`; waits
    /// for each started client's first lease within the probe window.
    async fn carry_out(&self, desired: &DesiredState, undo: &mut Undo) -> Result<(), String> {
        if let Some(d) = &desired.dns_resolver {
            let p = self.resolv_path();
            undo.resolver = Some(resolver::write(&p, &d.config).map_err(|e| {
                format!("spec.desiredState.dns-resolver: writing the resolver file {e}")
            })?);
        }
        let deadline = Instant::now() + self.opts.probe_timeout;
        let changes = plan::dhcp_changes(desired);
        for (iface, want) in &changes {
            if let Some(o) = want
                && self
                    .dhcp
                    .start(iface, *o)
                    .await
                    .map_err(|e| format!("DHCP on {iface}: {e}"))?
            {
                undo.started.push(iface.clone());
            }
        }
        for (idx, (iface, want)) in changes.iter().enumerate() {
            if want.is_some() && self.dhcp.wait_lease(iface, deadline).await.is_none() {
                let at = desired
                    .interfaces
                    .iter()
                    .position(|i| i.name == *iface)
                    .unwrap_or(idx);
                return Err(format!(
                    "spec.desiredState.interfaces[{at}].ipv4.dhcp: no DHCP lease on {iface} \
                     within {} s",
                    self.opts.probe_timeout.as_secs()
                ));
            }
        }
        Ok(())
    }

    /// Stops the DHCP clients the desired state turns off (`dhcp: false`, an interface
    /// `absent` or `down`), recorded in `undo` to be started again on a rollback.
    async fn stop_dhcp(&self, desired: &DesiredState, undo: &mut Undo) {
        for (iface, want) in plan::dhcp_changes(desired) {
            if want.is_none() {
                let was = self.dhcp.running(&iface).is_some();
                if let Some(o) = self.dhcp.stop(&iface).await
                    && was
                {
                    undo.stopped.push((iface, o));
                }
            }
        }
    }

    /// Stops the DHCP clients [`carry_out`](Self::carry_out) started (first part of a
    /// rollback, before the interfaces are restored).
    async fn undo_started(&self, undo: &Undo) {
        for iface in &undo.started {
            self.dhcp.stop(iface).await;
        }
    }

    /// Starts again the DHCP clients [`stop_dhcp`](Self::stop_dhcp) stopped and restores the
    /// resolver file (last part of a rollback, once the interfaces are back).
    async fn undo_rest(&self, undo: Undo) -> Result<(), String> {
        for (iface, o) in &undo.stopped {
            if let Err(e) = self.dhcp.start(iface, *o).await {
                tracing::warn!(iface, error = %e, "nmstate rollback: restarting a DHCP client");
            }
        }
        match &undo.resolver {
            Some(cp) => cp
                .restore()
                .map_err(|e| format!("restoring the resolver file: {e}")),
            None => Ok(()),
        }
    }

    async fn write_enactment(
        &self,
        e: &mut DynamicObject,
        generation: i64,
        desired: &Value,
        ty: &str,
        reason: &str,
        message: &str,
    ) -> Result<(), AgentError> {
        let prev: Vec<NmstateCondition> = e
            .data
            .pointer("/status/conditions")
            .and_then(|c| serde_json::from_value(c.clone()).ok())
            .unwrap_or_default();
        let conds = status::enactment_conditions(&prev, ty, reason, message, &now());
        e.data["status"] = json!({"desiredState": desired, "policyGeneration": generation,
                                  "conditions": conds});
        let name = e.metadata.name.clone().unwrap_or_default();
        let api = enactments(&self.client);
        let updated = match api.replace_status(&name, &PostParams::default(), &*e).await {
            Ok(u) => u,
            Err(_) => {
                // Someone else wrote it: take theirs and write ours on top.
                let mut fresh = api
                    .get(&name)
                    .await
                    .map_err(|x| kube_err("reading the enactment", x))?;
                fresh.data["status"] = e.data["status"].clone();
                api.replace_status(&name, &PostParams::default(), &fresh)
                    .await
                    .map_err(|x| kube_err("writing the enactment", x))?
            }
        };
        *e = updated;
        Ok(())
    }
}
