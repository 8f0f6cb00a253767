//! The HyperConverged reconcile's decisions, pure: HCO's defaults, the four objects a
//! HyperConverged owns (KubeVirt, CDI, SSP, NetworkAddonsConfig) with HCO's names, labels and
//! owner references, each built from the HyperConverged spec the way HCO maps it, and what
//! differs between an owned object and its desired form ([`owned_drift`], [`decide_spec`]).

use serde_json::{Map, Value, json};

/// The platform namespace: where the HyperConverged (and the owned KubeVirt and SSP) live.
pub const PLATFORM_NAMESPACE: &str = "kubevirt-hyperconverged";
/// The one HyperConverged's name.
pub const HCO_NAME: &str = "kubevirt-hyperconverged";
/// `hco.kubevirt.io/v1beta1`.
pub const HCO_API_VERSION: &str = "hco.kubevirt.io/v1beta1";

/// The KubeVirt gates HCO always turns on (its hard-coded list).
pub const HARDCODED_KUBEVIRT_GATES: &[&str] = &[
    "DataVolumes",
    "SRIOV",
    "CPUManager",
    "CPUNodeDiscovery",
    "Snapshot",
    "HotplugVolumes",
    "ExpandDisks",
    "GPU",
    "HostDevices",
    "NUMA",
    "VMExport",
    "DisableCustomSELinuxPolicy",
    "KubevirtSeccompProfile",
    "HotplugNICs",
    "VMPersistentState",
    "NetworkBindingPlugins",
    "CommonInstancetypesDeploymentGate",
];

/// HCO feature gates (camelCase, in `spec.featureGates`) that become KubeVirt gates.
pub const HCO_TO_KUBEVIRT_GATES: &[(&str, &str)] = &[
    ("downwardMetrics", "DownwardMetrics"),
    ("withHostPassthroughCPU", "WithHostPassthroughCPU"),
    ("disableMDevConfiguration", "DisableMDEVConfiguration"),
    ("persistentReservation", "PersistentReservation"),
    ("autoResourceLimits", "AutoResourceLimitsGate"),
    ("alignCPUs", "AlignCPUs"),
    ("decentralizedLiveMigration", "DecentralizedLiveMigration"),
];

/// KubeVirt gates ferrovirt accepts by their KubeVirt name in the HyperConverged's
/// `spec.featureGates` (a ferrovirt extension: HCO's API has no such entries) and carries out.
pub const EXTENSION_KUBEVIRT_GATES: &[&str] = &["HostDisk"];

/// CPU models HCO always lists as obsolete (the same list as KubeVirt's default).
pub const HARDCODED_OBSOLETE_CPU_MODELS: &[&str] =
    crate::kubevirt::cpu_model::DEFAULT_OBSOLETE_CPU_MODELS;

/// HCO's published defaults of the HyperConverged spec (what its CRD fills in).
pub fn defaults() -> Value {
    json!({
        "certConfig": {
            "ca": {"duration": "48h0m0s", "renewBefore": "24h0m0s"},
            "server": {"duration": "24h0m0s", "renewBefore": "12h0m0s"}
        },
        "featureGates": {
            "deployKubeSecondaryDNS": false,
            "disableMDevConfiguration": false,
            "downwardMetrics": false,
            "enableCommonBootImageImport": true,
            "persistentReservation": false,
            "alignCPUs": false,
            "enableApplicationAwareQuota": false,
            "decentralizedLiveMigration": false
        },
        "liveMigrationConfig": {
            "allowAutoConverge": false,
            "allowPostCopy": false,
            "completionTimeoutPerGiB": 150,
            "parallelMigrationsPerCluster": 5,
            "parallelOutboundMigrationsPerNode": 2,
            "progressTimeout": 150
        },
        "resourceRequirements": {"vmiCPUAllocationRatio": 10},
        "higherWorkloadDensity": {"memoryOvercommitPercentage": 100},
        "uninstallStrategy": "BlockUninstallIfWorkloadsExist",
        "workloadUpdateStrategy": {
            "batchEvictionInterval": "1m0s",
            "batchEvictionSize": 10,
            "workloadUpdateMethods": ["LiveMigrate"]
        },
        "virtualMachineOptions": {"disableFreePageReporting": false, "disableSerialConsoleLog": true}
    })
}

/// Fill every absent field of `target` (recursively into objects) from `from`.
fn fill_absent(target: &mut Map<String, Value>, from: &Map<String, Value>) {
    for (k, v) in from {
        match (target.get_mut(k), v) {
            (None, _) => {
                target.insert(k.clone(), v.clone());
            }
            (Some(Value::Object(t)), Value::Object(f)) => fill_absent(t, f),
            _ => {}
        }
    }
}

/// The HyperConverged object (as JSON) with HCO's defaults filled into `spec`.
pub fn fill_defaults(hco: &mut Value) {
    let Some(root) = hco.as_object_mut() else {
        return;
    };
    let spec = root
        .entry("spec")
        .or_insert_with(|| Value::Object(Map::new()));
    if !spec.is_object() {
        return;
    }
    if let (Some(s), Value::Object(d)) = (spec.as_object_mut(), defaults()) {
        fill_absent(s, &d);
    }
}

/// The kinds a HyperConverged owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OwnedKind {
    KubeVirt,
    Cdi,
    Ssp,
    NetworkAddonsConfig,
}

impl OwnedKind {
    /// Every owned kind, in HCO's order.
    pub const ALL: [OwnedKind; 4] = [
        OwnedKind::KubeVirt,
        OwnedKind::Cdi,
        OwnedKind::NetworkAddonsConfig,
        OwnedKind::Ssp,
    ];
    pub fn group(self) -> &'static str {
        match self {
            OwnedKind::KubeVirt => "kubevirt.io",
            OwnedKind::Cdi => "cdi.kubevirt.io",
            OwnedKind::Ssp => "ssp.kubevirt.io",
            OwnedKind::NetworkAddonsConfig => "networkaddonsoperator.network.kubevirt.io",
        }
    }
    pub fn version(self) -> &'static str {
        match self {
            OwnedKind::KubeVirt | OwnedKind::NetworkAddonsConfig => "v1",
            OwnedKind::Cdi => "v1beta1",
            OwnedKind::Ssp => "v1beta2",
        }
    }
    pub fn api_version(self) -> String {
        format!("{}/{}", self.group(), self.version())
    }
    pub fn kind(self) -> &'static str {
        match self {
            OwnedKind::KubeVirt => "KubeVirt",
            OwnedKind::Cdi => "CDI",
            OwnedKind::Ssp => "SSP",
            OwnedKind::NetworkAddonsConfig => "NetworkAddonsConfig",
        }
    }
    pub fn plural(self) -> &'static str {
        match self {
            OwnedKind::KubeVirt => "kubevirts",
            OwnedKind::Cdi => "cdis",
            OwnedKind::Ssp => "ssps",
            OwnedKind::NetworkAddonsConfig => "networkaddonsconfigs",
        }
    }
    /// HCO's name of the owned object.
    pub fn name(self) -> &'static str {
        match self {
            OwnedKind::KubeVirt => "kubevirt-kubevirt-hyperconverged",
            OwnedKind::Cdi => "cdi-kubevirt-hyperconverged",
            OwnedKind::Ssp => "ssp-kubevirt-hyperconverged",
            OwnedKind::NetworkAddonsConfig => "cluster",
        }
    }
    /// KubeVirt and SSP live in the HyperConverged's namespace; CDI and NetworkAddonsConfig
    /// are cluster-scoped.
    pub fn namespaced(self) -> bool {
        matches!(self, OwnedKind::KubeVirt | OwnedKind::Ssp)
    }
    /// HCO sets a controller owner reference on the namespaced ones only (a cluster-scoped
    /// object cannot be owned by a namespaced one).
    pub fn owner_referenced(self) -> bool {
        self.namespaced()
    }
    /// The `app.kubernetes.io/component` label.
    pub fn component(self) -> &'static str {
        match self {
            OwnedKind::KubeVirt => "compute",
            OwnedKind::Cdi => "storage",
            OwnedKind::Ssp => "schedule",
            OwnedKind::NetworkAddonsConfig => "network",
        }
    }
}

/// Orders the cluster's KubeVirt CRs (whole objects) the way every component reads them: the
/// HyperConverged's own (`kubevirt-kubevirt-hyperconverged`) first, then the others oldest first.
pub fn order_kubevirts(crs: &mut [&Value]) {
    let owned = OwnedKind::KubeVirt.name();
    crs.sort_by_key(|o| {
        let name = o.pointer("/metadata/name").and_then(Value::as_str);
        let created = o
            .pointer("/metadata/creationTimestamp")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        (name != Some(owned), created)
    });
}

/// HCO's labels on an owned object.
pub fn labels(hco_name: &str, kind: OwnedKind) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("app".into(), json!(hco_name));
    m.insert("app.kubernetes.io/managed-by".into(), json!("hco-operator"));
    m.insert(
        "app.kubernetes.io/part-of".into(),
        json!("hyperconverged-cluster"),
    );
    m.insert(
        "app.kubernetes.io/version".into(),
        json!(env!("CARGO_PKG_VERSION")),
    );
    m.insert(
        "app.kubernetes.io/component".into(),
        json!(kind.component()),
    );
    m
}

fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    v.pointer(path).filter(|v| !v.is_null())
}

fn put(m: &mut Map<String, Value>, key: &str, v: Option<&Value>) {
    if let Some(v) = v {
        m.insert(key.into(), v.clone());
    }
}

/// The KubeVirt gates a (defaulted) HyperConverged spec turns on, in a stable order.
pub fn kubevirt_gates(spec: &Value) -> Vec<String> {
    let mut out: Vec<String> = HARDCODED_KUBEVIRT_GATES
        .iter()
        .map(|g| g.to_string())
        .collect();
    let on = |name: &str| at(spec, &format!("/featureGates/{name}")) == Some(&json!(true));
    for (hco, kv) in HCO_TO_KUBEVIRT_GATES {
        if on(hco) {
            out.push(kv.to_string());
        }
    }
    for g in EXTENSION_KUBEVIRT_GATES {
        if on(g) && !out.iter().any(|o| o == g) {
            out.push(g.to_string());
        }
    }
    out
}

/// The `spec` of the owned KubeVirt for a (defaulted) HyperConverged spec.
pub fn kubevirt_spec(spec: &Value, namespace: &str) -> Value {
    let mut dev = Map::new();
    dev.insert("featureGates".into(), json!(kubevirt_gates(spec)));
    put(
        &mut dev,
        "cpuAllocationRatio",
        at(spec, "/resourceRequirements/vmiCPUAllocationRatio"),
    );
    put(
        &mut dev,
        "memoryOvercommit",
        at(spec, "/higherWorkloadDensity/memoryOvercommitPercentage"),
    );
    let mut config = Map::new();
    config.insert("developerConfiguration".into(), Value::Object(dev));
    put(&mut config, "migrations", at(spec, "/liveMigrationConfig"));
    put(
        &mut config,
        "evictionStrategy",
        at(spec, "/evictionStrategy"),
    );
    put(
        &mut config,
        "commonInstancetypesDeployment",
        at(spec, "/commonInstancetypesDeployment"),
    );
    put(&mut config, "cpuModel", at(spec, "/defaultCPUModel"));
    put(
        &mut config,
        "defaultRuntimeClass",
        at(spec, "/defaultRuntimeClass"),
    );
    put(
        &mut config,
        "vmStateStorageClass",
        at(spec, "/vmStateStorageClass"),
    );
    // HCO's names → KubeVirt's, disabled entries dropped.
    if let Some(p) =
        crate::kubevirt::host_devices::hco_to_kubevirt(at(spec, "/permittedHostDevices"))
    {
        config.insert("permittedHostDevices".into(), p);
    }
    put(
        &mut config,
        "mediatedDevicesConfiguration",
        at(spec, "/mediatedDevicesConfiguration"),
    );
    put(
        &mut config,
        "ksmConfiguration",
        at(spec, "/ksmConfiguration"),
    );
    let mut obsolete = Map::new();
    for m in HARDCODED_OBSOLETE_CPU_MODELS
        .iter()
        .map(|m| m.to_string())
        .chain(
            at(spec, "/obsoleteCPUs/cpuModels")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|m| m.as_str().map(String::from)),
        )
    {
        obsolete.insert(m, json!(true));
    }
    config.insert("obsoleteCPUModels".into(), Value::Object(obsolete));
    put(
        &mut config,
        "minCPUModel",
        at(spec, "/obsoleteCPUs/minCPUModel"),
    );

    let mut kv = Map::new();
    let uninstall = match at(spec, "/uninstallStrategy").and_then(Value::as_str) {
        Some("RemoveWorkloads") => "RemoveWorkloads",
        _ => "BlockUninstallIfWorkloadsExist",
    };
    kv.insert("uninstallStrategy".into(), json!(uninstall));
    for (from, to) in [("/infra", "infra"), ("/workloads", "workloads")] {
        if let Some(p) = at(spec, &format!("{from}/nodePlacement")) {
            kv.insert(to.into(), json!({"nodePlacement": p}));
        }
    }
    if let Some(c) = at(spec, "/certConfig") {
        kv.insert(
            "certificateRotateStrategy".into(),
            json!({"selfSigned": c.clone()}),
        );
    }
    put(
        &mut kv,
        "workloadUpdateStrategy",
        at(spec, "/workloadUpdateStrategy"),
    );
    kv.insert("configuration".into(), Value::Object(config));
    kv.insert("productName".into(), json!("hyperconverged-cluster"));
    kv.insert("productVersion".into(), json!(env!("CARGO_PKG_VERSION")));
    kv.insert("productComponent".into(), json!("compute"));
    kv.insert("serviceMonitorNamespace".into(), json!(namespace));
    Value::Object(kv)
}

/// The `spec` of the owned CDI for a (defaulted) HyperConverged spec.
pub fn cdi_spec(spec: &Value) -> Value {
    let mut config = Map::new();
    config.insert(
        "featureGates".into(),
        json!([
            "HonorWaitForFirstConsumer",
            "DataVolumeClaimAdoption",
            "WebhookPvcRendering"
        ]),
    );
    put(
        &mut config,
        "insecureRegistries",
        at(spec, "/storageImport/insecureRegistries"),
    );
    // ferrovirt's transfer bounds (same names on the CDI config: `hco::transfer_timeouts`).
    for f in ["transferStallTimeoutSeconds", "transferTimeoutSeconds"] {
        put(&mut config, f, at(spec, &format!("/storageImport/{f}")));
    }
    put(
        &mut config,
        "scratchSpaceStorageClass",
        at(spec, "/scratchSpaceStorageClass"),
    );
    put(
        &mut config,
        "podResourceRequirements",
        at(spec, "/resourceRequirements/storageWorkloads"),
    );
    put(
        &mut config,
        "filesystemOverhead",
        at(spec, "/filesystemOverhead"),
    );
    let mut cdi = Map::new();
    let uninstall = match at(spec, "/uninstallStrategy").and_then(Value::as_str) {
        Some("RemoveWorkloads") => "RemoveWorkloads",
        _ => "BlockUninstallIfWorkloadsExist",
    };
    cdi.insert("uninstallStrategy".into(), json!(uninstall));
    put(&mut cdi, "infra", at(spec, "/infra/nodePlacement"));
    put(&mut cdi, "workload", at(spec, "/workloads/nodePlacement"));
    if let Some(c) = at(spec, "/certConfig") {
        cdi.insert("certConfig".into(), c.clone());
    }
    cdi.insert("config".into(), Value::Object(config));
    Value::Object(cdi)
}

/// The `spec` of the owned SSP for a (defaulted) HyperConverged spec.
pub fn ssp_spec(spec: &Value) -> Value {
    let namespace = at(spec, "/commonTemplatesNamespace")
        .cloned()
        .unwrap_or_else(|| json!("openshift"));
    let mut templates = Map::new();
    templates.insert("namespace".into(), namespace);
    put(
        &mut templates,
        "dataImportCronTemplates",
        at(spec, "/dataImportCronTemplates"),
    );
    let mut validator = Map::new();
    validator.insert("replicas".into(), json!(2));
    put(
        &mut validator,
        "placement",
        at(spec, "/infra/nodePlacement"),
    );
    json!({"commonTemplates": templates, "templateValidator": validator})
}

/// The `spec` of the owned NetworkAddonsConfig for a (defaulted) HyperConverged spec.
pub fn network_addons_spec(spec: &Value) -> Value {
    let mut s = Map::new();
    s.insert("multus".into(), json!({}));
    s.insert("linuxBridge".into(), json!({}));
    s.insert("kubeMacPool".into(), json!({}));
    if at(spec, "/featureGates/deployKubeSecondaryDNS") == Some(&json!(true)) {
        s.insert("kubeSecondaryDNS".into(), json!({}));
    }
    let mut placement = Map::new();
    put(&mut placement, "infra", at(spec, "/infra/nodePlacement"));
    put(
        &mut placement,
        "workloads",
        at(spec, "/workloads/nodePlacement"),
    );
    if !placement.is_empty() {
        s.insert("placementConfiguration".into(), Value::Object(placement));
    }
    if let Some(c) = at(spec, "/certConfig") {
        s.insert(
            "selfSignConfiguration".into(),
            json!({
                "caRotateInterval": at(c, "/ca/duration"),
                "caOverlapInterval": at(c, "/ca/renewBefore"),
                "certRotateInterval": at(c, "/server/duration"),
                "certOverlapInterval": at(c, "/server/renewBefore"),
            }),
        );
    }
    Value::Object(s)
}

/// The spec an owned object of `kind` should have for the (defaulted) HyperConverged spec.
pub fn desired_spec(kind: OwnedKind, spec: &Value, namespace: &str) -> Value {
    match kind {
        OwnedKind::KubeVirt => kubevirt_spec(spec, namespace),
        OwnedKind::Cdi => cdi_spec(spec),
        OwnedKind::Ssp => ssp_spec(spec),
        OwnedKind::NetworkAddonsConfig => network_addons_spec(spec),
    }
}

/// The full object of `kind` a HyperConverged (as JSON, defaults filled here) owns: name,
/// namespace, HCO's labels, the controller owner reference where HCO sets one, and the spec.
pub fn desired_object(kind: OwnedKind, hco: &Value) -> Value {
    let mut hco = hco.clone();
    fill_defaults(&mut hco);
    let name = at(&hco, "/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or(HCO_NAME);
    let namespace = at(&hco, "/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or(PLATFORM_NAMESPACE);
    let spec = hco.get("spec").cloned().unwrap_or_else(|| json!({}));
    let mut meta = Map::new();
    meta.insert("name".into(), json!(kind.name()));
    if kind.namespaced() {
        meta.insert("namespace".into(), json!(namespace));
    }
    meta.insert("labels".into(), Value::Object(labels(name, kind)));
    if kind.owner_referenced()
        && let Some(uid) = at(&hco, "/metadata/uid")
    {
        meta.insert(
            "ownerReferences".into(),
            json!([{
                "apiVersion": HCO_API_VERSION,
                "kind": "HyperConverged",
                "name": name,
                "uid": uid,
                "controller": true,
                "blockOwnerDeletion": true,
            }]),
        );
    }
    json!({
        "apiVersion": kind.api_version(),
        "kind": kind.kind(),
        "metadata": meta,
        "spec": desired_spec(kind, &spec, namespace),
    })
}

/// The paths (`spec.configuration.migrations.parallelMigrationsPerCluster`, `metadata.labels.app`)
/// where `actual` differs from `desired`: the whole `spec`, the labels `desired` sets and its
/// owner references. `None` when they agree.
pub fn owned_drift(desired: &Value, actual: &Value) -> Option<Vec<String>> {
    let mut out = Vec::new();
    diff(
        "spec",
        desired.get("spec").unwrap_or(&Value::Null),
        actual.get("spec").unwrap_or(&Value::Null),
        &mut out,
    );
    if let Some(want) = desired
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
    {
        for (k, v) in want {
            if actual.pointer("/metadata/labels").and_then(|l| l.get(k)) != Some(v) {
                out.push(format!("metadata.labels.{k}"));
            }
        }
    }
    if let Some(want) = desired
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
    {
        let have = actual
            .pointer("/metadata/ownerReferences")
            .and_then(Value::as_array);
        for r in want {
            let found = have
                .into_iter()
                .flatten()
                .any(|h| h.get("uid") == r.get("uid") && h.get("controller") == Some(&json!(true)));
            if !found {
                out.push("metadata.ownerReferences".into());
            }
        }
    }
    (!out.is_empty()).then_some(out)
}

fn diff(path: &str, want: &Value, have: &Value, out: &mut Vec<String>) {
    match (want, have) {
        (Value::Object(w), Value::Object(h)) => {
            let mut keys: Vec<&String> = w.keys().chain(h.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                diff(
                    &format!("{path}.{k}"),
                    w.get(k).unwrap_or(&Value::Null),
                    h.get(k).unwrap_or(&Value::Null),
                    out,
                );
            }
        }
        _ if want != have => out.push(path.to_string()),
        _ => {}
    }
}

/// What the reconcile last wrote into an owned object's spec: the spec it sent and the spec
/// the server stored in answer (they differ only when the server normalised something).
#[derive(Debug, Clone, PartialEq)]
pub struct Written {
    pub sent: Value,
    pub stored: Value,
}

/// What to do with an existing owned object.
#[derive(Debug, Clone, PartialEq)]
pub enum SpecAction {
    /// It is as desired.
    Keep,
    /// The HyperConverged changed (or the reconcile does not know what it wrote before): write
    /// the desired object; HCO's Event reason `Updated`.
    Update(Vec<String>),
    /// Someone else edited it since the reconcile wrote it: write the desired object back;
    /// HCO's Event reason `Overwritten`.
    Overwrite(Vec<String>),
}

/// Decide about an existing owned object from its desired form, its actual state and what the
/// reconcile last wrote into it (`last`, for this same desired spec or an older one).
pub fn decide_spec(desired: &Value, actual: &Value, last: Option<&Written>) -> SpecAction {
    let want_spec = desired.get("spec").unwrap_or(&Value::Null);
    let have_spec = actual.get("spec").unwrap_or(&Value::Null);
    if let Some(w) = last
        && &w.sent == want_spec
    {
        // The desired spec is what was written: the stored answer is the reference (so a
        // server normalisation never loops), anything else is someone's edit.
        let mut reference = desired.clone();
        reference["spec"] = w.stored.clone();
        return match owned_drift(&reference, actual) {
            None => SpecAction::Keep,
            Some(d) if &w.stored != have_spec => SpecAction::Overwrite(d),
            Some(d) => SpecAction::Update(d),
        };
    }
    match owned_drift(desired, actual) {
        None => SpecAction::Keep,
        Some(d) => SpecAction::Update(d),
    }
}

#[cfg(test)]
#[path = "desired_tests.rs"]
mod tests;
