//! The table of served resources: what discovery, OpenAPI, Table output and routing are built
//! from. One [`ResourceDef`] per kind the API server serves.

/// A `kubectl get` column: evaluated by the API server against each object (like a CRD's
/// `additionalPrinterColumns`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrinterColumn {
    pub name: &'static str,
    /// OpenAPI type: "string", "integer", "number", "boolean" or "date".
    pub type_: &'static str,
    /// Simple JSONPath such as `.status.phase` or `.metadata.creationTimestamp`.
    pub json_path: &'static str,
    pub description: &'static str,
    /// 0 = always shown; 1 = shown with `-o wide`.
    pub priority: i32,
}

/// One served resource kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceDef {
    /// API group; "" for core/v1.
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
    pub list_kind: &'static str,
    /// Lower-case plural used in URLs, e.g. "virtualmachines".
    pub plural: &'static str,
    pub singular: &'static str,
    pub namespaced: bool,
    pub short_names: &'static [&'static str],
    pub categories: &'static [&'static str],
    /// Whether a `/status` subresource exists (status ignored on main-resource writes).
    pub has_status: bool,
    /// Verbs for discovery; normally [`ALL_VERBS`].
    pub verbs: &'static [&'static str],
    /// Extra columns for Table output (NAME and AGE are always added by the server, so an
    /// `Age` column is never listed here; see [`table_columns`] for KubeVirt's exact order).
    pub printer_columns: Vec<PrinterColumn>,
}

/// The standard verb set.
pub const ALL_VERBS: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

impl ResourceDef {
    /// `group/version`, or just `version` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

/// Verbs for resources that are read-only views (e.g. Pods mirroring launchers).
pub const READ_ONLY_VERBS: &[&str] = &["get", "list", "watch"];

/// Verbs for request-like resources that are only ever created (UploadTokenRequest).
pub const CREATE_ONLY_VERBS: &[&str] = &["create"];

const CREATED: &str = ".metadata.creationTimestamp";
const PHASE: &str = ".status.phase";
const READY_COND: &str = ".status.conditions[?(@.type=='Ready')].status";

fn col(name: &'static str, type_: &'static str, json_path: &'static str) -> PrinterColumn {
    PrinterColumn {
        name,
        type_,
        json_path,
        description: "",
        priority: 0,
    }
}

fn wide(name: &'static str, type_: &'static str, json_path: &'static str) -> PrinterColumn {
    PrinterColumn {
        priority: 1,
        ..col(name, type_, json_path)
    }
}

fn described(mut c: PrinterColumn, description: &'static str) -> PrinterColumn {
    c.description = description;
    c
}

/// The `Age` column as CRDs spell it.
pub fn age_column() -> PrinterColumn {
    col("Age", "date", CREATED)
}

/// Builder for the table below: everything but the identity defaults to a namespaced kind with
/// all verbs, no short names, no categories, no status subresource and no columns.
struct Def(ResourceDef);

impl Def {
    fn new(
        group: &'static str,
        version: &'static str,
        kind: &'static str,
        list_kind: &'static str,
        plural: &'static str,
        singular: &'static str,
    ) -> Self {
        Def(ResourceDef {
            group,
            version,
            kind,
            list_kind,
            plural,
            singular,
            namespaced: true,
            short_names: &[],
            categories: &[],
            has_status: false,
            verbs: ALL_VERBS,
            printer_columns: Vec::new(),
        })
    }
    fn cluster(mut self) -> Self {
        self.0.namespaced = false;
        self
    }
    fn short(mut self, names: &'static [&'static str]) -> Self {
        self.0.short_names = names;
        self
    }
    fn all(mut self) -> Self {
        self.0.categories = &["all"];
        self
    }
    fn status(mut self) -> Self {
        self.0.has_status = true;
        self
    }
    fn verbs(mut self, verbs: &'static [&'static str]) -> Self {
        self.0.verbs = verbs;
        self
    }
    fn cols(mut self, cols: Vec<PrinterColumn>) -> Self {
        self.0.printer_columns = cols;
        self
    }
}

/// Every resource the API server serves.
pub fn resources() -> Vec<ResourceDef> {
    let mut v = core_resources();
    v.extend(kubevirt_resources());
    v.extend(cdi_and_other_resources());
    v
}

/// Look a served resource up by group and plural (e.g. `("kubevirt.io", "virtualmachines")`).
pub fn find(group: &str, plural: &str) -> Option<ResourceDef> {
    resources()
        .into_iter()
        .find(|d| d.group == group && d.plural == plural)
}

/// Look a served resource up by apiVersion and kind (e.g. `("kubevirt.io/v1", "VirtualMachine")`).
pub fn find_kind(api_version: &str, kind: &str) -> Option<ResourceDef> {
    resources()
        .into_iter()
        .find(|d| d.api_version() == api_version && d.kind == kind)
}

/// KubeVirt's full column list for `kubectl get` after NAME (and NAMESPACE): the kind's printer
/// columns with `Age` placed where the published CRD places it (second for VMs, VMIs, KubeVirt
/// and CDI; last otherwise).
pub fn table_columns(def: &ResourceDef) -> Vec<PrinterColumn> {
    let age_first = matches!(
        (def.group, def.kind),
        ("kubevirt.io", "VirtualMachine")
            | ("kubevirt.io", "VirtualMachineInstance")
            | ("kubevirt.io", "KubeVirt")
            | ("cdi.kubevirt.io", "CDI")
    );
    let mut cols = def.printer_columns.clone();
    if age_first {
        cols.insert(0, age_column());
    } else {
        cols.push(age_column());
    }
    cols
}

fn core_resources() -> Vec<ResourceDef> {
    let core = |kind, list, plural, singular| Def::new("", "v1", kind, list, plural, singular);
    vec![
        core("Namespace", "NamespaceList", "namespaces", "namespace")
            .cluster()
            .short(&["ns"])
            .status()
            .cols(vec![col("Status", "string", PHASE)]),
        core("Node", "NodeList", "nodes", "node")
            .cluster()
            .short(&["no"])
            .status()
            .cols(vec![
                col("Ready", "string", READY_COND),
                col("Version", "string", ".status.nodeInfo.kubeletVersion"),
                wide(
                    "Internal-IP",
                    "string",
                    ".status.addresses[?(@.type=='InternalIP')].address",
                ),
                wide("OS-Image", "string", ".status.nodeInfo.osImage"),
                wide("Kernel-Version", "string", ".status.nodeInfo.kernelVersion"),
            ]),
        core(
            "PersistentVolume",
            "PersistentVolumeList",
            "persistentvolumes",
            "persistentvolume",
        )
        .cluster()
        .short(&["pv"])
        .status()
        .cols(vec![
            col("Capacity", "string", ".spec.capacity.storage"),
            col("Access Modes", "string", ".spec.accessModes"),
            col(
                "Reclaim Policy",
                "string",
                ".spec.persistentVolumeReclaimPolicy",
            ),
            col("Status", "string", PHASE),
            col("Claim", "string", ".spec.claimRef.name"),
            col("StorageClass", "string", ".spec.storageClassName"),
            wide("VolumeMode", "string", ".spec.volumeMode"),
        ]),
        core(
            "PersistentVolumeClaim",
            "PersistentVolumeClaimList",
            "persistentvolumeclaims",
            "persistentvolumeclaim",
        )
        .short(&["pvc"])
        .status()
        .cols(vec![
            col("Status", "string", PHASE),
            col("Volume", "string", ".spec.volumeName"),
            col("Capacity", "string", ".status.capacity.storage"),
            col("Access Modes", "string", ".status.accessModes"),
            col("StorageClass", "string", ".spec.storageClassName"),
            wide("VolumeMode", "string", ".spec.volumeMode"),
        ]),
        core("Secret", "SecretList", "secrets", "secret")
            .cols(vec![col("Type", "string", ".type")]),
        core("ConfigMap", "ConfigMapList", "configmaps", "configmap").short(&["cm"]),
        core("Event", "EventList", "events", "event")
            .short(&["ev"])
            .cols(vec![
                col("Last Seen", "date", ".lastTimestamp"),
                col("Type", "string", ".type"),
                col("Reason", "string", ".reason"),
                col("Object", "string", ".involvedObject.name"),
                col("Message", "string", ".message"),
            ]),
        core(
            "ServiceAccount",
            "ServiceAccountList",
            "serviceaccounts",
            "serviceaccount",
        )
        .short(&["sa"]),
        core("Pod", "PodList", "pods", "pod")
            .short(&["po"])
            .all()
            .status()
            .verbs(READ_ONLY_VERBS)
            .cols(vec![
                col("Status", "string", PHASE),
                col(
                    "Restarts",
                    "integer",
                    ".status.containerStatuses[0].restartCount",
                ),
                wide("IP", "string", ".status.podIP"),
                wide("Node", "string", ".spec.nodeName"),
            ]),
        Def::new(
            "storage.k8s.io",
            "v1",
            "StorageClass",
            "StorageClassList",
            "storageclasses",
            "storageclass",
        )
        .cluster()
        .short(&["sc"])
        .cols(vec![
            col("Provisioner", "string", ".provisioner"),
            col("ReclaimPolicy", "string", ".reclaimPolicy"),
            col("VolumeBindingMode", "string", ".volumeBindingMode"),
            col("AllowVolumeExpansion", "boolean", ".allowVolumeExpansion"),
        ]),
        Def::new(
            "coordination.k8s.io",
            "v1",
            "Lease",
            "LeaseList",
            "leases",
            "lease",
        )
        .cols(vec![col("Holder", "string", ".spec.holderIdentity")]),
        Def::new(
            "events.k8s.io",
            "v1",
            "Event",
            "EventList",
            "events",
            "event",
        )
        .cols(vec![
            col("Type", "string", ".type"),
            col("Reason", "string", ".reason"),
            col("Regarding", "string", ".regarding.name"),
            col("Note", "string", ".note"),
        ]),
        Def::new(
            "apps",
            "v1",
            "ControllerRevision",
            "ControllerRevisionList",
            "controllerrevisions",
            "controllerrevision",
        )
        .cols(vec![
            col("Controller", "string", ".metadata.ownerReferences[0].name"),
            col("Revision", "integer", ".revision"),
        ]),
    ]
    .into_iter()
    .map(|d| d.0)
    .collect()
}

fn kubevirt_resources() -> Vec<ResourceDef> {
    let kv =
        |kind, list, plural, singular| Def::new("kubevirt.io", "v1", kind, list, plural, singular);
    let it = |kind, list, plural, singular| {
        Def::new(
            "instancetype.kubevirt.io",
            "v1beta1",
            kind,
            list,
            plural,
            singular,
        )
    };
    let snap = |kind, list, plural, singular| {
        Def::new(
            "snapshot.kubevirt.io",
            "v1beta1",
            kind,
            list,
            plural,
            singular,
        )
    };
    let error_col = || col("Error", "string", ".status.error.message");
    vec![
        kv(
            "VirtualMachine",
            "VirtualMachineList",
            "virtualmachines",
            "virtualmachine",
        )
        .short(&["vm", "vms"])
        .all()
        .status()
        .cols(vec![
            described(
                col("Status", "string", ".status.printableStatus"),
                "Human Readable Status",
            ),
            col("Ready", "string", READY_COND),
        ]),
        // KubeVirt's VMI CRD has no status subresource: its status is written on the object.
        kv(
            "VirtualMachineInstance",
            "VirtualMachineInstanceList",
            "virtualmachineinstances",
            "virtualmachineinstance",
        )
        .short(&["vmi", "vmis"])
        .all()
        .cols(vec![
            col("Phase", "string", PHASE),
            col("IP", "string", ".status.interfaces[0].ipAddress"),
            col("NodeName", "string", ".status.nodeName"),
            col("Ready", "string", READY_COND),
            wide(
                "Live-Migratable",
                "string",
                ".status.conditions[?(@.type=='LiveMigratable')].status",
            ),
            wide(
                "Paused",
                "string",
                ".status.conditions[?(@.type=='Paused')].status",
            ),
        ]),
        kv(
            "VirtualMachineInstanceMigration",
            "VirtualMachineInstanceMigrationList",
            "virtualmachineinstancemigrations",
            "virtualmachineinstancemigration",
        )
        .short(&["vmim", "vmims"])
        .all()
        .status()
        .cols(vec![
            described(
                col("Phase", "string", PHASE),
                "The current phase of VM instance migration",
            ),
            described(
                col("VMI", "string", ".spec.vmiName"),
                "The name of the VMI to perform the migration on",
            ),
        ]),
        kv(
            "VirtualMachineInstanceReplicaSet",
            "VirtualMachineInstanceReplicaSetList",
            "virtualmachineinstancereplicasets",
            "virtualmachineinstancereplicaset",
        )
        .short(&["vmirs", "vmirss"])
        .all()
        .status()
        .cols(vec![
            described(
                col("Desired", "integer", ".spec.replicas"),
                "Number of desired VirtualMachineInstances",
            ),
            described(
                col("Current", "integer", ".status.replicas"),
                "Number of managed and not final or deleted VirtualMachineInstances",
            ),
            described(
                col("Ready", "integer", ".status.readyReplicas"),
                "Number of managed VirtualMachineInstances which are ready to receive traffic",
            ),
        ]),
        kv(
            "VirtualMachineInstancePreset",
            "VirtualMachineInstancePresetList",
            "virtualmachineinstancepresets",
            "virtualmachineinstancepreset",
        )
        .short(&["vmipreset", "vmipresets"])
        .all(),
        Def::new(
            "pool.kubevirt.io",
            "v1beta1",
            "VirtualMachinePool",
            "VirtualMachinePoolList",
            "virtualmachinepools",
            "virtualmachinepool",
        )
        .short(&["vmpool", "vmpools"])
        .all()
        .status()
        .cols(vec![
            described(
                col("Desired", "integer", ".spec.replicas"),
                "Number of desired VirtualMachines",
            ),
            described(
                col("Current", "integer", ".status.replicas"),
                "Number of managed and not final or deleted VirtualMachines",
            ),
            described(
                col("Ready", "integer", ".status.readyReplicas"),
                "Number of managed VirtualMachines which are ready to receive traffic",
            ),
        ]),
        kv("KubeVirt", "KubeVirtList", "kubevirts", "kubevirt")
            .short(&["kv", "kvs"])
            .all()
            .status()
            .cols(vec![col("Phase", "string", PHASE)]),
        it(
            "VirtualMachineInstancetype",
            "VirtualMachineInstancetypeList",
            "virtualmachineinstancetypes",
            "virtualmachineinstancetype",
        )
        .short(&["vminstancetype", "vminstancetypes", "vmf", "vmfs"])
        .all(),
        it(
            "VirtualMachineClusterInstancetype",
            "VirtualMachineClusterInstancetypeList",
            "virtualmachineclusterinstancetypes",
            "virtualmachineclusterinstancetype",
        )
        .cluster()
        .short(&[
            "vmclusterinstancetype",
            "vmclusterinstancetypes",
            "vmcf",
            "vmcfs",
        ]),
        it(
            "VirtualMachinePreference",
            "VirtualMachinePreferenceList",
            "virtualmachinepreferences",
            "virtualmachinepreference",
        )
        .short(&["vmpref", "vmprefs", "vmp", "vmps"])
        .all(),
        it(
            "VirtualMachineClusterPreference",
            "VirtualMachineClusterPreferenceList",
            "virtualmachineclusterpreferences",
            "virtualmachineclusterpreference",
        )
        .cluster()
        .short(&["vmcp", "vmcps"]),
        snap(
            "VirtualMachineSnapshot",
            "VirtualMachineSnapshotList",
            "virtualmachinesnapshots",
            "virtualmachinesnapshot",
        )
        .short(&["vmsnapshot", "vmsnapshots"])
        .all()
        .status()
        .cols(vec![
            col("SourceKind", "string", ".spec.source.kind"),
            col("SourceName", "string", ".spec.source.name"),
            col("Phase", "string", PHASE),
            col("ReadyToUse", "boolean", ".status.readyToUse"),
            col("CreationTime", "date", ".status.creationTime"),
            error_col(),
        ]),
        snap(
            "VirtualMachineSnapshotContent",
            "VirtualMachineSnapshotContentList",
            "virtualmachinesnapshotcontents",
            "virtualmachinesnapshotcontent",
        )
        .short(&["vmsnapshotcontent", "vmsnapshotcontents"])
        .all()
        .status()
        .cols(vec![
            col("ReadyToUse", "boolean", ".status.readyToUse"),
            col("CreationTime", "date", ".status.creationTime"),
            error_col(),
        ]),
        snap(
            "VirtualMachineRestore",
            "VirtualMachineRestoreList",
            "virtualmachinerestores",
            "virtualmachinerestore",
        )
        .short(&["vmrestore", "vmrestores"])
        .all()
        .status()
        .cols(vec![
            col("TargetKind", "string", ".spec.target.kind"),
            col("TargetName", "string", ".spec.target.name"),
            col("Complete", "boolean", ".status.complete"),
            col("RestoreTime", "date", ".status.restoreTime"),
            error_col(),
        ]),
        Def::new(
            "migrations.kubevirt.io",
            "v1alpha1",
            "MigrationPolicy",
            "MigrationPolicyList",
            "migrationpolicies",
            "migrationpolicy",
        )
        .cluster()
        .status(),
    ]
    .into_iter()
    .map(|d| d.0)
    .collect()
}

fn cdi_and_other_resources() -> Vec<ResourceDef> {
    let cdi = |kind, list, plural, singular| {
        Def::new("cdi.kubevirt.io", "v1beta1", kind, list, plural, singular)
    };
    vec![
        cdi("DataVolume", "DataVolumeList", "datavolumes", "datavolume")
            .short(&["dv", "dvs"])
            .all()
            .status()
            .cols(vec![
                described(
                    col("Phase", "string", PHASE),
                    "The phase the data volume is in",
                ),
                described(
                    col("Progress", "string", ".status.progress"),
                    "Transfer progress in percentage if known, N/A otherwise",
                ),
                described(
                    col("Restarts", "integer", ".status.restartCount"),
                    "The number of times the transfer has been restarted.",
                ),
            ]),
        cdi("DataSource", "DataSourceList", "datasources", "datasource")
            .short(&["das"])
            .all()
            .status(),
        cdi(
            "StorageProfile",
            "StorageProfileList",
            "storageprofiles",
            "storageprofile",
        )
        .cluster()
        .all()
        .status(),
        cdi("CDI", "CDIList", "cdis", "cdi")
            .cluster()
            .short(&["cdi", "cdis"])
            .all()
            .status()
            .cols(vec![col("Phase", "string", PHASE)]),
        // Create-only: answered by the upload API's route with `status.token`.
        Def::new(
            "upload.cdi.kubevirt.io",
            "v1beta1",
            "UploadTokenRequest",
            "UploadTokenRequestList",
            "uploadtokenrequests",
            "uploadtokenrequest",
        )
        .verbs(CREATE_ONLY_VERBS),
        Def::new(
            "k8s.cni.cncf.io",
            "v1",
            "NetworkAttachmentDefinition",
            "NetworkAttachmentDefinitionList",
            "network-attachment-definitions",
            "network-attachment-definition",
        )
        .short(&["net-attach-def", "nad"]),
        Def::new(
            "hco.kubevirt.io",
            "v1beta1",
            "HyperConverged",
            "HyperConvergedList",
            "hyperconvergeds",
            "hyperconverged",
        )
        .short(&["hco", "hcos"])
        .all()
        .status(),
    ]
    .into_iter()
    .map(|d| d.0)
    .collect()
}

/// The OpenAPI v3 structural schema of a served kind, generated from its Rust type.
pub fn openapi_schema(def: &ResourceDef) -> serde_json::Value {
    crate::schema::openapi_schema(def)
}

/// Field paths (e.g. `.spec.template.spec.domain.foo`) present in `obj` but not in the kind's
/// schema, for `fieldValidation=Strict`/`Warn`. Free-form places are not descended.
pub fn unknown_fields(def: &ResourceDef, obj: &serde_json::Value) -> Vec<String> {
    crate::schema::unknown_fields(def, obj)
}

/// Remove unknown fields (see [`unknown_fields`]) from `obj`, returning their paths.
pub fn prune_unknown_fields(def: &ResourceDef, obj: &mut serde_json::Value) -> Vec<String> {
    crate::schema::prune_unknown_fields(def, obj)
}

/// Paths of a `/scale` subresource (as a CRD's `subresources.scale` declares them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScaleSubresource {
    pub spec_replicas_path: &'static str,
    pub status_replicas_path: &'static str,
    pub label_selector_path: &'static str,
}

/// The `/scale` subresource of a kind, if it has one (VirtualMachineInstanceReplicaSet,
/// VirtualMachinePool).
pub fn scale_subresource(def: &ResourceDef) -> Option<ScaleSubresource> {
    matches!(
        (def.group, def.kind),
        ("kubevirt.io", "VirtualMachineInstanceReplicaSet")
            | ("pool.kubevirt.io", "VirtualMachinePool")
    )
    .then_some(ScaleSubresource {
        spec_replicas_path: ".spec.replicas",
        status_replicas_path: ".status.replicas",
        label_selector_path: ".status.labelSelector",
    })
}
