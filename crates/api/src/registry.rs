//! The table of served resources: what discovery, OpenAPI, Table output and routing are built
//! from. One [`ResourceDef`] per kind and version the API server serves.

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
    /// Extra columns for Table output. For KubeVirt's kinds NAME and AGE are added by the
    /// server (see [`table_columns`] for KubeVirt's exact order); Kubernetes' built-in kinds
    /// list every column after NAME themselves, Age included, in Kubernetes' order (a `Name`
    /// column replaces the leading NAME, as for Events). Columns with the [`COMPUTED`] path
    /// are filled by the API server's built-in printers.
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
    v.extend(volume_snapshot_resources());
    v.extend(crate::backup::resources());
    v.extend(crate::udn::resources());
    v.extend(crate::nmstate::resources());
    let legacy = legacy_versions(&v);
    v.extend(legacy);
    v
}

/// Older versions KubeVirt still serves for every `kubevirt.io` kind, with the v1 schema.
/// Objects are stored once, in v1 ([`storage_version`]), and read back in the asked version.
pub const KUBEVIRT_LEGACY_VERSIONS: &[&str] = &["v1alpha3"];

/// A twin of every `kubevirt.io/v1` kind for each of [`KUBEVIRT_LEGACY_VERSIONS`], so kinds
/// added to the table get their legacy versions without listing them twice.
fn legacy_versions(defs: &[ResourceDef]) -> Vec<ResourceDef> {
    defs.iter()
        .filter(|d| d.group == "kubevirt.io" && d.version == "v1")
        .flat_map(|d| {
            KUBEVIRT_LEGACY_VERSIONS.iter().map(move |v| ResourceDef {
                version: v,
                ..d.clone()
            })
        })
        .collect()
}

/// The version objects of `def`'s resource are stored in: the first version the table lists
/// for its group and plural (the preferred one).
pub fn storage_version(def: &ResourceDef) -> &'static str {
    use std::collections::HashMap;
    use std::sync::OnceLock;
    static FIRST: OnceLock<HashMap<(&'static str, &'static str), &'static str>> = OnceLock::new();
    let first = FIRST.get_or_init(|| {
        let mut m = HashMap::new();
        for d in resources() {
            m.entry((d.group, d.plural)).or_insert(d.version);
        }
        m
    });
    first
        .get(&(def.group, def.plural))
        .copied()
        .unwrap_or(def.version)
}

/// The warning a client gets for using a deprecated version (KubeVirt's legacy versions).
pub fn deprecation_warning(def: &ResourceDef) -> Option<String> {
    (def.group == "kubevirt.io" && KUBEVIRT_LEGACY_VERSIONS.contains(&def.version)).then(|| {
        format!(
            "{}/{} is deprecated and will go away in a later release; use {}/v1",
            def.group, def.version, def.group
        )
    })
}

/// Whether a group is one of Kubernetes' built-in API groups (core, `apps`, `*.k8s.io`)
/// rather than one that a real cluster gets from CustomResourceDefinitions.
pub fn is_builtin_group(group: &str) -> bool {
    // The CSI snapshot kinds are CRDs (the external-snapshotter's) despite their group.
    group.is_empty()
        || group == "apps"
        || (group.ends_with(".k8s.io") && group != "snapshot.storage.k8s.io")
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
    // Built-in kinds list Age themselves (CRDs and Events have none).
    if is_builtin_group(def.group) {
        return def.printer_columns.clone();
    }
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

/// Columns whose cells the API server computes itself (as Kubernetes' built-in printers do:
/// counts, short access modes, roles from labels) carry this JSONPath.
pub const COMPUTED: &str = "";

fn computed(name: &'static str, type_: &'static str) -> PrinterColumn {
    col(name, type_, COMPUTED)
}

fn core_resources() -> Vec<ResourceDef> {
    let core = |kind, list, plural, singular| Def::new("", "v1", kind, list, plural, singular);
    let age = age_column;
    let event_cols = || {
        vec![
            computed("Last Seen", "string"),
            col("Type", "string", ".type"),
            col("Reason", "string", ".reason"),
            computed("Object", "string"),
            PrinterColumn {
                priority: 1,
                ..computed("Subobject", "string")
            },
            PrinterColumn {
                priority: 1,
                ..computed("Source", "string")
            },
            computed("Message", "string"),
            PrinterColumn {
                priority: 1,
                ..computed("First Seen", "string")
            },
            PrinterColumn {
                priority: 1,
                ..computed("Count", "integer")
            },
            wide("Name", "string", ".metadata.name"),
        ]
    };
    vec![
        core("Namespace", "NamespaceList", "namespaces", "namespace")
            .cluster()
            .short(&["ns"])
            .status()
            .cols(vec![col("Status", "string", PHASE), age()]),
        core("Node", "NodeList", "nodes", "node")
            .cluster()
            .short(&["no"])
            .status()
            .cols(vec![
                computed("Status", "string"),
                computed("Roles", "string"),
                age(),
                col("Version", "string", ".status.nodeInfo.kubeletVersion"),
                PrinterColumn {
                    priority: 1,
                    ..computed("Internal-IP", "string")
                },
                PrinterColumn {
                    priority: 1,
                    ..computed("External-IP", "string")
                },
                wide("OS-Image", "string", ".status.nodeInfo.osImage"),
                wide("Kernel-Version", "string", ".status.nodeInfo.kernelVersion"),
                wide(
                    "Container-Runtime",
                    "string",
                    ".status.nodeInfo.containerRuntimeVersion",
                ),
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
            computed("Access Modes", "string"),
            col(
                "Reclaim Policy",
                "string",
                ".spec.persistentVolumeReclaimPolicy",
            ),
            col("Status", "string", PHASE),
            computed("Claim", "string"),
            col("StorageClass", "string", ".spec.storageClassName"),
            computed("VolumeAttributesClass", "string"),
            col("Reason", "string", ".status.reason"),
            age(),
            PrinterColumn {
                priority: 1,
                ..computed("VolumeMode", "string")
            },
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
            computed("Access Modes", "string"),
            computed("StorageClass", "string"),
            computed("VolumeAttributesClass", "string"),
            age(),
            PrinterColumn {
                priority: 1,
                ..computed("VolumeMode", "string")
            },
        ]),
        core("Secret", "SecretList", "secrets", "secret").cols(vec![
            col("Type", "string", ".type"),
            computed("Data", "integer"),
            age(),
        ]),
        core("ConfigMap", "ConfigMapList", "configmaps", "configmap")
            .short(&["cm"])
            .cols(vec![computed("Data", "integer"), age()]),
        core("Event", "EventList", "events", "event")
            .short(&["ev"])
            .cols(event_cols()),
        core(
            "ResourceQuota",
            "ResourceQuotaList",
            "resourcequotas",
            "resourcequota",
        )
        .short(&["quota"])
        .status()
        .cols(vec![age()]),
        core(
            "ServiceAccount",
            "ServiceAccountList",
            "serviceaccounts",
            "serviceaccount",
        )
        .short(&["sa"])
        .cols(vec![computed("Secrets", "integer"), age()]),
        core("Pod", "PodList", "pods", "pod")
            .short(&["po"])
            .all()
            .status()
            .verbs(READ_ONLY_VERBS)
            .cols(vec![
                computed("Ready", "string"),
                computed("Status", "string"),
                computed("Restarts", "string"),
                age(),
                wide("IP", "string", ".status.podIP"),
                wide("Node", "string", ".spec.nodeName"),
                PrinterColumn {
                    priority: 1,
                    ..computed("Nominated Node", "string")
                },
                PrinterColumn {
                    priority: 1,
                    ..computed("Readiness Gates", "string")
                },
            ]),
        core("Service", "ServiceList", "services", "service")
            .short(&["svc"])
            .all()
            .status()
            .cols(vec![
                col("Type", "string", ".spec.type"),
                col("Cluster-IP", "string", ".spec.clusterIP"),
                computed("External-IP", "string"),
                computed("Port(s)", "string"),
                age(),
                PrinterColumn {
                    priority: 1,
                    ..computed("Selector", "string")
                },
            ]),
        core("Endpoints", "EndpointsList", "endpoints", "endpoints")
            .short(&["ep"])
            .cols(vec![computed("Endpoints", "string"), age()]),
        Def::new(
            "discovery.k8s.io",
            "v1",
            "EndpointSlice",
            "EndpointSliceList",
            "endpointslices",
            "endpointslice",
        )
        .cols(vec![
            col("AddressType", "string", ".addressType"),
            computed("Ports", "string"),
            computed("Endpoints", "string"),
            age(),
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
            computed("ReclaimPolicy", "string"),
            computed("VolumeBindingMode", "string"),
            computed("AllowVolumeExpansion", "string"),
            age(),
        ]),
        Def::new(
            "coordination.k8s.io",
            "v1",
            "Lease",
            "LeaseList",
            "leases",
            "lease",
        )
        .cols(vec![col("Holder", "string", ".spec.holderIdentity"), age()]),
        Def::new(
            "events.k8s.io",
            "v1",
            "Event",
            "EventList",
            "events",
            "event",
        )
        .cols(event_cols()),
        Def::new(
            "apps",
            "v1",
            "ControllerRevision",
            "ControllerRevisionList",
            "controllerrevisions",
            "controllerrevision",
        )
        .cols(vec![
            computed("Controller", "string"),
            col("Revision", "integer", ".revision"),
            age(),
        ]),
        Def::new(
            "apiextensions.k8s.io",
            "v1",
            "CustomResourceDefinition",
            "CustomResourceDefinitionList",
            "customresourcedefinitions",
            "customresourcedefinition",
        )
        .cluster()
        .short(&["crd", "crds"])
        .status()
        .verbs(READ_ONLY_VERBS)
        .cols(vec![col("Created At", "string", CREATED)]),
    ]
    .into_iter()
    .chain(access_resources())
    .map(|d| d.0)
    .collect()
}

/// Access control: RBAC kinds and the authentication/authorization review kinds (create-only;
/// answered by the API server's `auth` module, never stored).
fn access_resources() -> Vec<Def> {
    let rbac = |kind, list, plural, singular| {
        Def::new(
            "rbac.authorization.k8s.io",
            "v1",
            kind,
            list,
            plural,
            singular,
        )
    };
    let review = |group, kind, list, plural, singular| {
        Def::new(group, "v1", kind, list, plural, singular)
            .cluster()
            .verbs(CREATE_ONLY_VERBS)
    };
    let binding_cols = || {
        vec![
            computed("Role", "string"),
            age_column(),
            PrinterColumn {
                priority: 1,
                ..computed("Users", "string")
            },
            PrinterColumn {
                priority: 1,
                ..computed("Groups", "string")
            },
            PrinterColumn {
                priority: 1,
                ..computed("ServiceAccounts", "string")
            },
        ]
    };
    vec![
        rbac("Role", "RoleList", "roles", "role").cols(vec![col("Created At", "string", CREATED)]),
        rbac(
            "ClusterRole",
            "ClusterRoleList",
            "clusterroles",
            "clusterrole",
        )
        .cluster()
        .cols(vec![col("Created At", "string", CREATED)]),
        rbac(
            "RoleBinding",
            "RoleBindingList",
            "rolebindings",
            "rolebinding",
        )
        .cols(binding_cols()),
        rbac(
            "ClusterRoleBinding",
            "ClusterRoleBindingList",
            "clusterrolebindings",
            "clusterrolebinding",
        )
        .cluster()
        .cols(binding_cols()),
        review(
            "authentication.k8s.io",
            "SelfSubjectReview",
            "SelfSubjectReviewList",
            "selfsubjectreviews",
            "selfsubjectreview",
        ),
        review(
            "authentication.k8s.io",
            "TokenReview",
            "TokenReviewList",
            "tokenreviews",
            "tokenreview",
        ),
        review(
            "authorization.k8s.io",
            "SelfSubjectAccessReview",
            "SelfSubjectAccessReviewList",
            "selfsubjectaccessreviews",
            "selfsubjectaccessreview",
        ),
        review(
            "authorization.k8s.io",
            "SubjectAccessReview",
            "SubjectAccessReviewList",
            "subjectaccessreviews",
            "subjectaccessreview",
        ),
    ]
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
    let export = |version| {
        Def::new(
            "export.kubevirt.io",
            version,
            "VirtualMachineExport",
            "VirtualMachineExportList",
            "virtualmachineexports",
            "virtualmachineexport",
        )
        .short(&["vmexport", "vmexports"])
        .all()
        .status()
        .cols(vec![
            col("SourceKind", "string", ".spec.source.kind"),
            col("SourceName", "string", ".spec.source.name"),
            col("Phase", "string", PHASE),
        ])
    };
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
        // export.kubevirt.io: v1 (stored) and v1beta1, one object.
        export("v1"),
        export("v1beta1"),
        Def::new(
            "clone.kubevirt.io",
            "v1beta1",
            "VirtualMachineClone",
            "VirtualMachineCloneList",
            "virtualmachineclones",
            "virtualmachineclone",
        )
        .short(&["vmclone", "vmclones"])
        .all()
        .status()
        .cols(vec![
            col("Phase", "string", ".status.phase"),
            col("SourceVirtualMachine", "string", ".spec.source.name"),
            col("TargetVirtualMachine", "string", ".spec.target.name"),
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

/// snapshot.storage.k8s.io/v1 (`crate::volumesnapshot`), columns as the external-snapshotter's
/// CRDs print them.
fn volume_snapshot_resources() -> Vec<ResourceDef> {
    let vs = |kind, list, plural, singular| {
        Def::new(
            "snapshot.storage.k8s.io",
            "v1",
            kind,
            list,
            plural,
            singular,
        )
    };
    vec![
        vs(
            "VolumeSnapshot",
            "VolumeSnapshotList",
            "volumesnapshots",
            "volumesnapshot",
        )
        .short(&["vs"])
        .status()
        .cols(vec![
            col("ReadyToUse", "boolean", ".status.readyToUse"),
            col(
                "SourcePVC",
                "string",
                ".spec.source.persistentVolumeClaimName",
            ),
            col(
                "SourceSnapshotContent",
                "string",
                ".spec.source.volumeSnapshotContentName",
            ),
            col("RestoreSize", "string", ".status.restoreSize"),
            col("SnapshotClass", "string", ".spec.volumeSnapshotClassName"),
            col(
                "SnapshotContent",
                "string",
                ".status.boundVolumeSnapshotContentName",
            ),
            col("CreationTime", "date", ".status.creationTime"),
        ]),
        vs(
            "VolumeSnapshotContent",
            "VolumeSnapshotContentList",
            "volumesnapshotcontents",
            "volumesnapshotcontent",
        )
        .cluster()
        .short(&["vsc", "vscs"])
        .status()
        .cols(vec![
            col("ReadyToUse", "boolean", ".status.readyToUse"),
            col("RestoreSize", "integer", ".status.restoreSize"),
            col("DeletionPolicy", "string", ".spec.deletionPolicy"),
            col("Driver", "string", ".spec.driver"),
            col(
                "VolumeSnapshotClass",
                "string",
                ".spec.volumeSnapshotClassName",
            ),
            col("VolumeSnapshot", "string", ".spec.volumeSnapshotRef.name"),
            col(
                "VolumeSnapshotNamespace",
                "string",
                ".spec.volumeSnapshotRef.namespace",
            ),
        ]),
        vs(
            "VolumeSnapshotClass",
            "VolumeSnapshotClassList",
            "volumesnapshotclasses",
            "volumesnapshotclass",
        )
        .cluster()
        .short(&["vsclass", "vsclasses"])
        .cols(vec![
            col("Driver", "string", ".driver"),
            col("DeletionPolicy", "string", ".deletionPolicy"),
        ]),
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
            "k8s.cni.cncf.io",
            "v1alpha1",
            "IPAMClaim",
            "IPAMClaimList",
            "ipamclaims",
            "ipamclaim",
        )
        .status()
        .cols(vec![
            col("Network", "string", ".spec.network"),
            col("Interface", "string", ".spec.interface"),
            col("IPs", "string", ".status.ips"),
        ]),
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
        // The HyperConverged's operand kinds (`crate::hco::operands`).
        Def::new(
            "ssp.kubevirt.io",
            "v1beta2",
            "SSP",
            "SSPList",
            "ssps",
            "ssp",
        )
        .status(),
        Def::new(
            "networkaddonsoperator.network.kubevirt.io",
            "v1",
            "NetworkAddonsConfig",
            "NetworkAddonsConfigList",
            "networkaddonsconfigs",
            "networkaddonsconfig",
        )
        .cluster()
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
