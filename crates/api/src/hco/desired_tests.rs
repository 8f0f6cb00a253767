//! Unit tests of the HyperConverged mapping (`super`).

use serde_json::json;

use super::*;

fn hco(spec: Value) -> Value {
    json!({
        "apiVersion": HCO_API_VERSION, "kind": "HyperConverged",
        "metadata": {"name": HCO_NAME, "namespace": PLATFORM_NAMESPACE, "uid": "u-1"},
        "spec": spec,
    })
}

#[test]
fn defaults_fill_only_absent_fields() {
    let mut h = hco(json!({"liveMigrationConfig": {"parallelMigrationsPerCluster": 9}}));
    fill_defaults(&mut h);
    assert_eq!(
        h.pointer("/spec/liveMigrationConfig/parallelMigrationsPerCluster"),
        Some(&json!(9))
    );
    assert_eq!(
        h.pointer("/spec/liveMigrationConfig/parallelOutboundMigrationsPerNode"),
        Some(&json!(2))
    );
    assert_eq!(
        h.pointer("/spec/resourceRequirements/vmiCPUAllocationRatio"),
        Some(&json!(10))
    );
    // Idempotent.
    let once = h.clone();
    fill_defaults(&mut h);
    assert_eq!(h, once);
}

#[test]
fn kubevirt_gets_migrations_gates_and_eviction() {
    let h = hco(json!({
        "liveMigrationConfig": {"bandwidthPerMigration": "64Mi", "parallelMigrationsPerCluster": 3},
        "featureGates": {"HostDisk": true, "downwardMetrics": true},
        "evictionStrategy": "LiveMigrate",
        "obsoleteCPUs": {"cpuModels": ["Penryn"]},
    }));
    let kv = desired_object(OwnedKind::KubeVirt, &h);
    assert_eq!(kv["metadata"]["name"], "kubevirt-kubevirt-hyperconverged");
    assert_eq!(kv["metadata"]["namespace"], PLATFORM_NAMESPACE);
    assert_eq!(
        kv["metadata"]["labels"]["app.kubernetes.io/component"],
        "compute"
    );
    assert_eq!(kv["metadata"]["ownerReferences"][0]["uid"], "u-1");
    let c = &kv["spec"]["configuration"];
    assert_eq!(c["migrations"]["bandwidthPerMigration"], "64Mi");
    assert_eq!(c["migrations"]["parallelMigrationsPerCluster"], 3);
    assert_eq!(c["migrations"]["completionTimeoutPerGiB"], 150);
    assert_eq!(c["evictionStrategy"], "LiveMigrate");
    assert_eq!(c["developerConfiguration"]["cpuAllocationRatio"], 10);
    assert_eq!(c["developerConfiguration"]["memoryOvercommit"], 100);
    let gates: Vec<&str> = c["developerConfiguration"]["featureGates"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for g in ["Snapshot", "HostDisk", "DownwardMetrics", "VMExport"] {
        assert!(gates.contains(&g), "{g} missing from {gates:?}");
    }
    assert_eq!(c["obsoleteCPUModels"]["Penryn"], true);
    assert_eq!(c["obsoleteCPUModels"]["486"], true);
    assert_eq!(
        kv["spec"]["uninstallStrategy"],
        "BlockUninstallIfWorkloadsExist"
    );
    // The typed KubeVirt reads it back.
    let typed: crate::kubevirt::misc::KubeVirt = serde_json::from_value(kv).unwrap();
    let m = typed
        .spec
        .unwrap()
        .configuration
        .unwrap()
        .migrations
        .unwrap();
    assert_eq!(m.parallel_migrations_per_cluster, Some(3));
}

#[test]
fn cdi_ssp_and_network_addons() {
    let h = hco(json!({
        "storageImport": {"insecureRegistries": ["reg:5000"], "transferStallTimeoutSeconds": 7},
        "commonTemplatesNamespace": "templates",
    }));
    let cdi = desired_object(OwnedKind::Cdi, &h);
    assert_eq!(cdi["metadata"]["name"], "cdi-kubevirt-hyperconverged");
    assert!(cdi["metadata"].get("namespace").is_none());
    assert!(cdi["metadata"].get("ownerReferences").is_none());
    assert_eq!(
        cdi["spec"]["config"]["insecureRegistries"],
        json!(["reg:5000"])
    );
    assert_eq!(cdi["spec"]["config"]["transferStallTimeoutSeconds"], 7);
    let typed: crate::cdi::Cdi = serde_json::from_value(cdi).unwrap();
    assert_eq!(
        typed.spec.unwrap().config.unwrap().insecure_registries,
        Some(vec!["reg:5000".to_string()])
    );
    let ssp = desired_object(OwnedKind::Ssp, &h);
    assert_eq!(ssp["metadata"]["name"], "ssp-kubevirt-hyperconverged");
    assert_eq!(ssp["spec"]["commonTemplates"]["namespace"], "templates");
    assert_eq!(
        ssp["metadata"]["labels"]["app.kubernetes.io/component"],
        "schedule"
    );
    let nac = desired_object(OwnedKind::NetworkAddonsConfig, &h);
    assert_eq!(nac["metadata"]["name"], "cluster");
    assert!(nac["spec"].get("kubeSecondaryDNS").is_none());
    assert_eq!(
        nac["spec"]["selfSignConfiguration"]["caRotateInterval"],
        "48h0m0s"
    );
    let typed: crate::hco::operands::NetworkAddonsConfig = serde_json::from_value(nac).unwrap();
    assert!(typed.spec.unwrap().linux_bridge.is_some());
}

#[test]
fn drift_names_the_changed_fields() {
    let h = hco(json!({}));
    let want = desired_object(OwnedKind::KubeVirt, &h);
    assert_eq!(owned_drift(&want, &want), None);
    let mut edited = want.clone();
    edited["spec"]["configuration"]["migrations"]["parallelMigrationsPerCluster"] = json!(1);
    edited["spec"]["configuration"]["machineType"] = json!("pc");
    edited["metadata"]["labels"]["app"] = json!("other");
    assert_eq!(
        owned_drift(&want, &edited).unwrap(),
        vec![
            "spec.configuration.machineType",
            "spec.configuration.migrations.parallelMigrationsPerCluster",
            "metadata.labels.app",
        ]
    );
    // An extra label of someone else's is not drift; a lost owner reference is.
    let mut extra = want.clone();
    extra["metadata"]["labels"]["mine"] = json!("x");
    assert_eq!(owned_drift(&want, &extra), None);
    let mut orphan = want.clone();
    orphan["metadata"]["ownerReferences"] = json!([]);
    assert_eq!(
        owned_drift(&want, &orphan).unwrap(),
        vec!["metadata.ownerReferences"]
    );
}

#[test]
fn decide_tells_hco_changes_from_foreign_edits() {
    let old = desired_object(OwnedKind::KubeVirt, &hco(json!({})));
    let new = desired_object(
        OwnedKind::KubeVirt,
        &hco(json!({"liveMigrationConfig": {"parallelMigrationsPerCluster": 8}})),
    );
    let wrote_old = Written {
        sent: old["spec"].clone(),
        stored: old["spec"].clone(),
    };
    // Nothing changed.
    assert_eq!(decide_spec(&old, &old, Some(&wrote_old)), SpecAction::Keep);
    // The HyperConverged changed: an update.
    assert!(matches!(
        decide_spec(&new, &old, Some(&wrote_old)),
        SpecAction::Update(_)
    ));
    // Someone edited the object the reconcile wrote: overwritten.
    let mut edited = old.clone();
    edited["spec"]["configuration"]["evictionStrategy"] = json!("External");
    assert_eq!(
        decide_spec(&old, &edited, Some(&wrote_old)),
        SpecAction::Overwrite(vec!["spec.configuration.evictionStrategy".into()])
    );
    // Unknown history: an update.
    assert!(matches!(
        decide_spec(&old, &edited, None),
        SpecAction::Update(_)
    ));
    // The server normalised what was sent: its stored form is kept, no loop.
    let mut stored = old["spec"].clone();
    stored["configuration"]["extra"] = json!(true);
    let normalised = Written {
        sent: old["spec"].clone(),
        stored: stored.clone(),
    };
    let mut actual = old.clone();
    actual["spec"] = stored;
    assert_eq!(
        decide_spec(&old, &actual, Some(&normalised)),
        SpecAction::Keep
    );
}

#[test]
fn permitted_host_devices_reach_the_kubevirt_cr_in_kubevirts_names() {
    let h = hco(json!({"permittedHostDevices": {
        "pciHostDevices": [
            {"pciDeviceSelector": "1AF4:1000", "resourceName": "example.org/virtio-net"},
            {"pciDeviceSelector": "10DE:1EB8", "resourceName": "nvidia.com/T4", "disabled": true}
        ],
        "usbHostDevices": [{"resourceName": "example.org/key",
                            "selectors": [{"vendor": "1050", "product": "0407"}]}]
    }}));
    let kv = desired_object(OwnedKind::KubeVirt, &h);
    assert_eq!(
        kv.pointer("/spec/configuration/permittedHostDevices"),
        Some(&json!({
            "pciHostDevices": [{"pciVendorSelector": "1AF4:1000",
                                "resourceName": "example.org/virtio-net"}],
            "usb": [{"resourceName": "example.org/key",
                     "selectors": [{"vendor": "1050", "product": "0407"}]}]
        }))
    );
    let kv = desired_object(OwnedKind::KubeVirt, &hco(json!({})));
    assert_eq!(kv.pointer("/spec/configuration/permittedHostDevices"), None);
}
