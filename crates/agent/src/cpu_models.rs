//! Named CPU models on this node (KubeVirt's node-labeller; docs/hyperconverged.md "CPU
//! models"): which models this node's QEMU can run with the accelerator the agent uses (a
//! short-lived `qemu-system-x86_64 -machine none -accel <accel>` asked QMP
//! `query-cpu-definitions`: [`probe`]; the reply parsed and the usable models selected by the
//! pure [`parse_definitions`] and [`usable_models`]), and what a VMI's `spec.domain.cpu.model`
//! becomes on the QEMU command line ([`launch_model`], pure: a named model runs as itself, with
//! QEMU's `enforce`, or the VMI is refused naming the field). The Node labels themselves are
//! `ferrovirt_api::kubevirt::cpu_model::node_labels`.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use ferrovirt_api::kubevirt::cpu_model::{HOST_MODEL, HOST_PASSTHROUGH};
use ferrovirt_launcher::spec::{Accel, CpuModel};
use serde_json::Value;

use crate::error::AgentError;

/// One entry of QMP `query-cpu-definitions`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuDefinition {
    pub name: String,
    /// Features the accelerator cannot give this model (empty: it runs as defined).
    pub unavailable_features: Vec<String>,
    /// The versioned model this name stands for (`Westmere` → `Westmere-v1`).
    pub alias_of: Option<String>,
    /// Whether QEMU can migrate it (false for `max` and `host`).
    pub migration_safe: bool,
}

/// The `return` of a QMP `query-cpu-definitions` reply (the whole reply object or its
/// `return` array).
pub fn parse_definitions(reply: &Value) -> Result<Vec<CpuDefinition>, AgentError> {
    let list = reply.get("return").unwrap_or(reply);
    let bad = |m: &str| AgentError::Tool {
        tool: "qemu query-cpu-definitions".into(),
        message: m.to_string(),
    };
    let items = list
        .as_array()
        .ok_or_else(|| bad(&format!("not a list of CPU definitions: {reply}")))?;
    items
        .iter()
        .map(|d| {
            let name = d
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(&format!("a CPU definition without a name: {d}")))?;
            Ok(CpuDefinition {
                name: name.to_string(),
                unavailable_features: d
                    .get("unavailable-features")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|f| f.as_str().map(str::to_string))
                    .collect(),
                alias_of: d
                    .get("alias-of")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                migration_safe: d.get("migration-safe").and_then(Value::as_bool) == Some(true),
            })
        })
        .collect()
}

/// Whether `name` is one of QEMU's versioned model names (`Westmere-v1`): libvirt, and so
/// KubeVirt, offers the plain names only.
fn versioned(name: &str) -> bool {
    name.rsplit_once("-v").is_some_and(|(base, v)| {
        !base.is_empty() && !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit())
    })
}

/// The named models this node offers: the definitions with no unavailable feature, migration
/// safe (not `max` or `host`), not QEMU's `base` (no features at all) and not a versioned name.
pub fn usable_models(defs: &[CpuDefinition]) -> BTreeSet<String> {
    defs.iter()
        .filter(|d| d.unavailable_features.is_empty() && d.migration_safe)
        .filter(|d| d.name != "base" && !versioned(&d.name))
        .filter(|d| ferrovirt_api::kubevirt::cpu_model::valid_name(&d.name))
        .map(|d| d.name.clone())
        .collect()
}

/// The QEMU CPU model for a VMI's `spec.domain.cpu.model` under `accel`: none, `host-model` or
/// `host-passthrough` → everything the accelerator offers (`max` under TCG, `host` under KVM);
/// a named model → itself, when this node's QEMU runs it (`usable`), else a refusal naming
/// the field. Returns whether QEMU must `enforce` the model (named models: a feature QEMU
/// cannot give fails the start instead of being dropped).
pub fn launch_model(
    accel: Accel,
    model: Option<&str>,
    usable: &BTreeSet<String>,
) -> Result<(CpuModel, bool), AgentError> {
    match model.filter(|m| !m.is_empty()) {
        None | Some(HOST_MODEL) | Some(HOST_PASSTHROUGH) => Ok((
            match accel {
                Accel::Tcg => CpuModel::Max,
                Accel::Kvm => CpuModel::Host,
            },
            false,
        )),
        Some(m) if usable.contains(m) => Ok((CpuModel::Named(m.to_string()), true)),
        Some(m) => Err(AgentError::unsupported(
            "spec.domain.cpu.model",
            format!(
                "CPU model {m} is not usable by this node's QEMU under {accel} (usable: {})",
                if usable.is_empty() {
                    "none found".to_string()
                } else {
                    usable.iter().cloned().collect::<Vec<_>>().join(", ")
                }
            ),
        )),
    }
}

/// How long the probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// Asks `qemu` (no guest: `-machine none`) for its CPU definitions under `accel`.
pub async fn probe(qemu: &Path, accel: Accel) -> Result<Vec<CpuDefinition>, AgentError> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let tool = |m: String| AgentError::Tool {
        tool: qemu.display().to_string(),
        message: m,
    };
    let mut child = tokio::process::Command::new(qemu)
        .args(["-machine", "none", "-accel", &accel.to_string()])
        .args(["-nodefaults", "-display", "none", "-qmp", "stdio"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| tool(format!("starting it: {e}")))?;
    let mut stdin = child.stdin.take().ok_or_else(|| tool("no stdin".into()))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| tool("no stdout".into()))?;
    let ask = async {
        stdin
            .write_all(
                b"{\"execute\":\"qmp_capabilities\"}\n\
                  {\"execute\":\"query-cpu-definitions\",\"id\":\"defs\"}\n",
            )
            .await
            .map_err(|e| tool(format!("writing QMP: {e}")))?;
        let mut lines = BufReader::new(stdout).lines();
        while let Some(line) = lines
            .next_line()
            .await
            .map_err(|e| tool(format!("reading QMP: {e}")))?
        {
            let Ok(v) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if v["id"] == "defs" {
                if let Some(err) = v.get("error") {
                    return Err(tool(format!("query-cpu-definitions: {err}")));
                }
                return parse_definitions(&v);
            }
        }
        Err(tool("QEMU exited before answering".into()))
    };
    let result = tokio::time::timeout(PROBE_TIMEOUT, ask)
        .await
        .unwrap_or_else(|_| Err(tool(format!("no answer within {PROBE_TIMEOUT:?}"))));
    let _ = stdin.write_all(b"{\"execute\":\"quit\"}\n").await;
    drop(stdin);
    if tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// QEMU 7.2's reply under TCG on a test machine (captured with `-machine none -accel tcg`).
    const TCG_REPLY: &str = include_str!("../testdata/query-cpu-definitions-qemu-7.2-tcg.json");

    fn defs() -> Vec<CpuDefinition> {
        parse_definitions(&serde_json::from_str(TCG_REPLY).unwrap()).unwrap()
    }

    #[test]
    fn parses_the_captured_reply() {
        let d = defs();
        assert!(d.len() > 100, "{}", d.len());
        let westmere = d.iter().find(|d| d.name == "Westmere").unwrap();
        assert!(westmere.unavailable_features.is_empty());
        assert_eq!(westmere.alias_of.as_deref(), Some("Westmere-v1"));
        assert!(westmere.migration_safe);
        let haswell = d.iter().find(|d| d.name == "Haswell").unwrap();
        assert!(haswell.unavailable_features.contains(&"rtm".to_string()));
        let host = d.iter().find(|d| d.name == "host").unwrap();
        assert_eq!(host.unavailable_features, ["kvm"]);
        assert!(parse_definitions(&serde_json::json!({"return": {}})).is_err());
    }

    #[test]
    fn selects_the_models_tcg_runs() {
        let usable = usable_models(&defs());
        let want: BTreeSet<String> = [
            "486",
            "Conroe",
            "Nehalem",
            "Opteron_G1",
            "Opteron_G2",
            "Penryn",
            "Westmere",
            "athlon",
            "core2duo",
            "coreduo",
            "kvm32",
            "kvm64",
            "n270",
            "pentium",
            "pentium2",
            "pentium3",
            "qemu32",
            "qemu64",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(usable, want);
        assert!(versioned("Westmere-v1") && versioned("Skylake-Server-v5"));
        assert!(!versioned("Westmere") && !versioned("Skylake-Server-noTSX-IBRS"));
    }

    #[test]
    fn vmi_models_map_to_qemu() {
        let usable = usable_models(&defs());
        for m in [None, Some(""), Some("host-model"), Some("host-passthrough")] {
            assert_eq!(
                launch_model(Accel::Tcg, m, &usable).unwrap(),
                (CpuModel::Max, false)
            );
            assert_eq!(
                launch_model(Accel::Kvm, m, &usable).unwrap(),
                (CpuModel::Host, false)
            );
        }
        assert_eq!(
            launch_model(Accel::Tcg, Some("Westmere"), &usable).unwrap(),
            (CpuModel::Named("Westmere".into()), true)
        );
        let e = launch_model(Accel::Tcg, Some("Haswell"), &usable)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("spec.domain.cpu.model: CPU model Haswell is not usable"),
            "{e}"
        );
        let e = launch_model(Accel::Kvm, Some("EPYC"), &BTreeSet::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("none found"), "{e}");
    }
}
