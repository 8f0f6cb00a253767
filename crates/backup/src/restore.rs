//! What a restore makes of a backed-up VM (pure, shared by the CLI's `ferrovirt backup
//! restore` and the in-cluster BackupRestore controller): the VM renamed and moved, its claims
//! pointing at restored DataVolumes, and optionally new MAC addresses and a new firmware UUID.

use serde_json::{Value, json};

/// The DataVolume a claim `claim` of VM `old` is restored into: the claim's own name, or
/// `<new>-<claim>` when the VM gets a new name.
pub fn restored_claim_name(claim: &str, new_name: Option<&str>) -> String {
    match new_name {
        Some(n) => format!("{n}-{claim}"),
        None => claim.to_string(),
    }
}

/// The VM to create from a backed-up one, and its claims as (disk in the backup, new
/// DataVolume name): the name and namespace changed, `dataVolume`/`persistentVolumeClaim`
/// volumes pointing at the restored DataVolumes, `dataVolumeTemplates` dropped (their
/// volumes are restored), the run strategy from `start`.
pub fn restored_vm(
    vm: &Value,
    namespace: &str,
    new_name: Option<&str>,
    start: bool,
) -> (Value, Vec<(String, String)>) {
    let old = vm["metadata"]["name"].as_str().unwrap_or("").to_string();
    let name = new_name.unwrap_or(&old).to_string();
    let mut v = vm.clone();
    v["metadata"]["name"] = json!(name);
    v["metadata"]["namespace"] = json!(namespace);
    if let Some(s) = v["spec"].as_object_mut() {
        s.remove("dataVolumeTemplates");
        s.remove("running");
        s.insert(
            "runStrategy".into(),
            json!(if start { "Always" } else { "Halted" }),
        );
    }
    let mut claims = Vec::new();
    if let Some(vols) = v["spec"]["template"]["spec"]["volumes"].as_array_mut() {
        for vol in vols {
            let claim = vol["persistentVolumeClaim"]["claimName"]
                .as_str()
                .or_else(|| vol["dataVolume"]["name"].as_str())
                .map(str::to_string);
            if let Some(claim) = claim {
                let dv = restored_claim_name(&claim, new_name);
                if let Some(o) = vol.as_object_mut() {
                    o.remove("persistentVolumeClaim");
                    o.insert("dataVolume".into(), json!({"name": dv}));
                }
                let disk = format!("{old}.{claim}");
                if !claims.iter().any(|(d, _)| d == &disk) {
                    claims.push((disk, dv));
                }
            }
        }
    }
    (v, claims)
}

/// A locally administered unicast MAC address (`x2:…`) from 6 random bytes.
pub fn mac_from(random: [u8; 6]) -> String {
    let mut b = random;
    b[0] = (b[0] & 0xfc) | 0x02;
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A version 4 UUID from 16 random bytes.
pub fn uuid_from(random: [u8; 16]) -> String {
    let mut b = random;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Gives every interface of the VM's template a new MAC address when `macs` yields them,
/// and the VM a new firmware UUID when `uuid` is given. Interfaces without a `macAddress` get
/// one too, so the restored VM never shows the backed-up one.
pub fn rewrite_identity(
    vm: &mut Value,
    macs: Option<&mut dyn FnMut() -> String>,
    uuid: Option<String>,
) {
    let domain = &mut vm["spec"]["template"]["spec"]["domain"];
    if let Some(macs) = macs
        && let Some(ifaces) = domain["devices"]["interfaces"].as_array_mut()
    {
        for i in ifaces {
            if let Some(o) = i.as_object_mut() {
                o.insert("macAddress".into(), json!(macs()));
            }
        }
    }
    if let Some(u) = uuid {
        if !domain["firmware"].is_object() {
            domain["firmware"] = json!({});
        }
        domain["firmware"]["uuid"] = json!(u);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restored_vms_point_at_new_datavolumes() {
        let vm = json!({
            "metadata": {"name": "vm1", "namespace": "prod"},
            "spec": {"runStrategy": "Always", "dataVolumeTemplates": [{"metadata": {"name": "vm1-root"}}],
              "template": {"spec": {"volumes": [
                {"name": "root", "dataVolume": {"name": "vm1-root"}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                {"name": "ci", "cloudInitNoCloud": {"secretRef": {"name": "ud"}}}
              ]}}}
        });
        let (v, claims) = restored_vm(&vm, "dr", None, false);
        assert_eq!(v["metadata"]["namespace"], "dr");
        assert_eq!(v["spec"]["runStrategy"], "Halted");
        assert!(v["spec"].get("dataVolumeTemplates").is_none());
        assert_eq!(
            claims,
            [
                ("vm1.vm1-root".to_string(), "vm1-root".to_string()),
                ("vm1.data".to_string(), "data".to_string())
            ]
        );
        let vols = &v["spec"]["template"]["spec"]["volumes"];
        assert_eq!(vols[1]["dataVolume"]["name"], "data");
        assert!(vols[1].get("persistentVolumeClaim").is_none());
        let (v, claims) = restored_vm(&vm, "dr", Some("copy"), true);
        assert_eq!(v["metadata"]["name"], "copy");
        assert_eq!(v["spec"]["runStrategy"], "Always");
        assert_eq!(claims[0].1, "copy-vm1-root");
    }

    #[test]
    fn macs_and_uuids_are_well_formed() {
        assert_eq!(mac_from([0xff; 6]), "fe:ff:ff:ff:ff:ff");
        assert_eq!(mac_from([0x01, 0, 0, 0, 0, 0]), "02:00:00:00:00:00");
        let u = uuid_from([0xff; 16]);
        assert_eq!(u, "ffffffff-ffff-4fff-bfff-ffffffffffff");
        assert_eq!(uuid_from([0; 16]), "00000000-0000-4000-8000-000000000000");
    }

    #[test]
    fn identity_rewritten_only_when_asked() {
        let vm = json!({"spec": {"template": {"spec": {"domain": {"devices": {"interfaces": [
            {"name": "default", "masquerade": {}, "macAddress": "02:00:00:00:00:01"},
            {"name": "b", "bridge": {}}
        ]}}}}}});
        let mut n = 0u8;
        let mut macs = || {
            n += 1;
            mac_from([0, 0, 0, 0, 0, n])
        };
        let mut kept = vm.clone();
        rewrite_identity(&mut kept, None, None);
        assert_eq!(kept, vm);
        let mut same = vm.clone();
        rewrite_identity(&mut same, Some(&mut macs), None);
        // Asked for nothing but MACs: no firmware section appears.
        assert!(same["spec"]["template"]["spec"]["domain"]["firmware"].is_null());
        let ifs = &same["spec"]["template"]["spec"]["domain"]["devices"]["interfaces"];
        assert_eq!(ifs[0]["macAddress"], "02:00:00:00:00:01");
        assert_eq!(ifs[1]["macAddress"], "02:00:00:00:00:02");
        let mut v = vm.clone();
        rewrite_identity(&mut v, None, Some("u-1".into()));
        assert_eq!(
            v["spec"]["template"]["spec"]["domain"]["firmware"]["uuid"],
            "u-1"
        );
        let ifs = &v["spec"]["template"]["spec"]["domain"]["devices"]["interfaces"];
        assert_eq!(ifs[0]["macAddress"], "02:00:00:00:00:01");
        assert!(ifs[1].get("macAddress").is_none());
    }
}
