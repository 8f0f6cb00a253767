//! Host devices a cluster permits (KubeVirt's `configuration.permittedHostDevices`, HCO's
//! `spec.permittedHostDevices`), pure: the parsed list ([`PermittedHostDevices`]) every
//! component reads from the KubeVirt CRs, HCO's mapping into the KubeVirt CR ([`hco_to_kubevirt`]:
//! `pciDeviceSelector` → `pciVendorSelector`, `usbHostDevices` → `usb`, `disabled` entries
//! dropped), the shape checks of the HyperConverged field ([`validate_hco`]), KubeVirt's
//! render-time rule for a VMI's `gpus`/`hostDevices` ([`not_permitted`]) and what a VMI asks of
//! each resource ([`requested`]). docs/hyperconverged.md "Host devices".

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value, json};

use crate::admission::FieldError;
use crate::admission::meta::is_dns1123_subdomain;
use crate::kubevirt::vmi::VirtualMachineInstanceSpec;

/// A permitted PCI device type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciHostDevice {
    /// `vendor:device`, lower-case hex (KubeVirt lower-cases the selector).
    pub selector: String,
    pub resource_name: String,
    /// Advertised by an external device plugin: the agent neither counts nor assigns it.
    pub external: bool,
}

/// A permitted mediated device type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediatedHostDevice {
    /// The mdev type name with spaces as `_`, trimmed ([`mdev_type_name`]).
    pub selector: String,
    pub resource_name: String,
    pub external: bool,
}

/// One USB device of a permitted USB resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct UsbSelector {
    pub vendor: u16,
    pub product: u16,
}

/// A permitted USB resource: one unit is one device per selector, taken together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsbHostDevice {
    pub resource_name: String,
    pub selectors: Vec<UsbSelector>,
    pub external: bool,
}

/// The cluster's `permittedHostDevices`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PermittedHostDevices {
    pub pci: Vec<PciHostDevice>,
    pub mediated: Vec<MediatedHostDevice>,
    pub usb: Vec<UsbHostDevice>,
}

fn s<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn flag(v: &Value, key: &str) -> bool {
    v.get(key).and_then(Value::as_bool).unwrap_or(false)
}

fn items<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    v.get(key).and_then(Value::as_array).into_iter().flatten()
}

/// KubeVirt's normal form of an mdev type name: spaces become `_` (the surrounding white
/// space, such as sysfs' newline, trimmed first).
pub fn mdev_type_name(raw: &str) -> String {
    raw.trim().replace(' ', "_")
}

/// A `vendor:device` PCI selector: two groups of 4 hex digits.
pub fn valid_pci_selector(sel: &str) -> bool {
    sel.split_once(':').is_some_and(|(v, d)| hex4(v) && hex4(d))
}

fn hex4(s: &str) -> bool {
    s.len() == 4 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A USB id (`vendor` or `product`): 1 to 4 hex digits, as KubeVirt parses it.
pub fn parse_usb_id(s: &str) -> Option<u16> {
    (!s.is_empty() && s.len() <= 4)
        .then(|| u16::from_str_radix(s, 16).ok())
        .flatten()
}

/// Kubernetes' extended resource name: `<domain>/<name>` with a DNS-1123 subdomain outside
/// `kubernetes.io`, and a name of at most 63 alphanumerics, `-`, `_`, `.`, starting and
/// ending alphanumeric.
pub fn valid_resource_name(r: &str) -> bool {
    let Some((domain, name)) = r.split_once('/') else {
        return false;
    };
    let native = domain == "kubernetes.io" || domain.ends_with(".kubernetes.io");
    let b = name.as_bytes();
    let name_ok = !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric();
    is_dns1123_subdomain(domain) && !native && name_ok
}

impl PermittedHostDevices {
    /// The list a KubeVirt CR's `spec` sets; `None` when it sets none (then every device
    /// name is allowed, as in KubeVirt). Entries without a resource name are skipped; a USB
    /// entry with a selector that is not hex never matches a device.
    pub fn from_kubevirt_spec(spec: Option<&Value>) -> Option<Self> {
        let p = spec?
            .pointer("/configuration/permittedHostDevices")
            .filter(|v| !v.is_null())?;
        let mut out = PermittedHostDevices::default();
        for d in items(p, "pciHostDevices") {
            if let (Some(sel), Some(r)) = (s(d, "pciVendorSelector"), s(d, "resourceName")) {
                out.pci.push(PciHostDevice {
                    selector: sel.trim().to_ascii_lowercase(),
                    resource_name: r.to_string(),
                    external: flag(d, "externalResourceProvider"),
                });
            }
        }
        for d in items(p, "mediatedDevices") {
            if let (Some(sel), Some(r)) = (s(d, "mdevNameSelector"), s(d, "resourceName")) {
                out.mediated.push(MediatedHostDevice {
                    selector: mdev_type_name(sel),
                    resource_name: r.to_string(),
                    external: flag(d, "externalResourceProvider"),
                });
            }
        }
        for d in items(p, "usb") {
            let Some(r) = s(d, "resourceName") else {
                continue;
            };
            let parsed: Option<Vec<UsbSelector>> = items(d, "selectors")
                .map(|x| {
                    Some(UsbSelector {
                        vendor: parse_usb_id(s(x, "vendor")?)?,
                        product: parse_usb_id(s(x, "product")?)?,
                    })
                })
                .collect();
            out.usb.push(UsbHostDevice {
                resource_name: r.to_string(),
                // A bad selector: a unit that no set of devices completes.
                selectors: parsed.filter(|v| !v.is_empty()).unwrap_or_default(),
                external: flag(d, "externalResourceProvider"),
            });
        }
        Some(out)
    }

    /// The list of the cluster's KubeVirt CRs (whole objects, in the order
    /// `hco::desired::order_kubevirts` gives): the first that sets one.
    pub fn from_kubevirts<'a>(ordered: impl IntoIterator<Item = &'a Value>) -> Option<Self> {
        ordered
            .into_iter()
            .find_map(|cr| Self::from_kubevirt_spec(cr.get("spec")))
    }

    /// Every resource name the list permits.
    pub fn resource_names(&self) -> BTreeSet<String> {
        self.pci
            .iter()
            .map(|d| d.resource_name.clone())
            .chain(self.mediated.iter().map(|d| d.resource_name.clone()))
            .chain(self.usb.iter().map(|d| d.resource_name.clone()))
            .collect()
    }

    /// The resource names a node's agent advertises itself (not external).
    pub fn node_resources(&self) -> BTreeSet<String> {
        self.pci
            .iter()
            .filter(|d| !d.external)
            .map(|d| d.resource_name.clone())
            .chain(
                self.mediated
                    .iter()
                    .filter(|d| !d.external)
                    .map(|d| d.resource_name.clone()),
            )
            .chain(
                self.usb
                    .iter()
                    .filter(|d| !d.external)
                    .map(|d| d.resource_name.clone()),
            )
            .collect()
    }
}

/// The device-plugin resources `spec` asks for, with the field of each request
/// (`spec.domain.devices.gpus[0].deviceName`), in spec order.
pub fn requested(spec: &VirtualMachineInstanceSpec) -> Vec<(String, String)> {
    let d = &spec.domain.devices;
    let gpus = d.gpus.iter().flatten().enumerate().filter_map(|(i, g)| {
        let r = g.device_name.as_deref().filter(|n| !n.is_empty())?;
        Some((
            format!("spec.domain.devices.gpus[{i}].deviceName"),
            r.to_string(),
        ))
    });
    let hds = d
        .host_devices
        .iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, h)| {
            let r = h.device_name.as_deref().filter(|n| !n.is_empty())?;
            Some((
                format!("spec.domain.devices.hostDevices[{i}].deviceName"),
                r.to_string(),
            ))
        });
    gpus.chain(hds).collect()
}

/// How many devices of each resource `spec` asks for.
pub fn request_counts(spec: &VirtualMachineInstanceSpec) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (_, r) in requested(spec) {
        *out.entry(r).or_insert(0) += 1;
    }
    out
}

/// KubeVirt's rule when it renders a VMI's launcher: with a `permittedHostDevices` list set,
/// every `gpus[i].deviceName` and `hostDevices[i].deviceName` must be one of its resource
/// names; without a list, anything goes. One message per refused request, naming its field
/// and saying what KubeVirt says (`HostDevice x is not permitted in permittedHostDevices
/// configuration`).
pub fn not_permitted(
    spec: &VirtualMachineInstanceSpec,
    permitted: Option<&PermittedHostDevices>,
) -> Vec<String> {
    let Some(p) = permitted else {
        return Vec::new();
    };
    let names = p.resource_names();
    requested(spec)
        .into_iter()
        .filter(|(_, r)| !names.contains(r))
        .map(|(field, r)| {
            let what = if field.contains(".gpus[") {
                "GPU"
            } else {
                "HostDevice"
            };
            format!("{field}: {what} {r} is not permitted in permittedHostDevices configuration")
        })
        .collect()
}

/// VMI fields about host devices ferrovirt does not carry out, refused naming the field
/// (`dp`: the path of the domain spec): a vGPU display (`virtualGPUOptions.display` not
/// disabled) and device tags.
pub fn refused(
    spec_domain_devices: &crate::kubevirt::devices::Devices,
    dp: &str,
) -> Vec<FieldError> {
    let mut e = Vec::new();
    for (i, g) in spec_domain_devices.gpus.iter().flatten().enumerate() {
        let display = g
            .virtual_gpu_options
            .as_ref()
            .and_then(|o| o.display.as_ref());
        if display.is_some_and(|d| d.enabled != Some(false)) {
            e.push(FieldError::not_supported(
                format!("{dp}.devices.gpus[{i}].virtualGPUOptions.display"),
                "a vGPU display is not carried out by ferrovirt; set enabled: false or leave it out",
            ));
        }
        if g.tag.is_some() {
            e.push(FieldError::not_supported(
                format!("{dp}.devices.gpus[{i}].tag"),
                "device role tags are not carried out by ferrovirt",
            ));
        }
    }
    for (i, h) in spec_domain_devices
        .host_devices
        .iter()
        .flatten()
        .enumerate()
    {
        if h.tag.is_some() {
            e.push(FieldError::not_supported(
                format!("{dp}.devices.hostDevices[{i}].tag"),
                "device role tags are not carried out by ferrovirt",
            ));
        }
    }
    e
}

/// HCO's mapping of its `spec.permittedHostDevices` into the KubeVirt CR's
/// `configuration.permittedHostDevices`: `None` when the HyperConverged sets none; disabled
/// entries are dropped and an empty list left out (so every entry disabled is `{}`: the
/// list is set and permits nothing).
pub fn hco_to_kubevirt(hco: Option<&Value>) -> Option<Value> {
    let p = hco.filter(|v| !v.is_null())?;
    let mut out = Map::new();
    let enabled = |key: &'static str| items(p, key).filter(|d| !flag(d, "disabled"));
    let external = |d: &Value, m: &mut Map<String, Value>| {
        if flag(d, "externalResourceProvider") {
            m.insert("externalResourceProvider".into(), json!(true));
        }
    };
    let pci: Vec<Value> = enabled("pciHostDevices")
        .map(|d| {
            let mut m = Map::new();
            m.insert("pciVendorSelector".into(), json!(s(d, "pciDeviceSelector")));
            m.insert("resourceName".into(), json!(s(d, "resourceName")));
            external(d, &mut m);
            Value::Object(m)
        })
        .collect();
    let mdev: Vec<Value> = enabled("mediatedDevices")
        .map(|d| {
            let mut m = Map::new();
            m.insert("mdevNameSelector".into(), json!(s(d, "mdevNameSelector")));
            m.insert("resourceName".into(), json!(s(d, "resourceName")));
            external(d, &mut m);
            Value::Object(m)
        })
        .collect();
    let usb: Vec<Value> = enabled("usbHostDevices")
        .map(|d| {
            let mut m = Map::new();
            m.insert("resourceName".into(), json!(s(d, "resourceName")));
            if let Some(sel) = d.get("selectors").filter(|v| !v.is_null()) {
                m.insert("selectors".into(), sel.clone());
            }
            external(d, &mut m);
            Value::Object(m)
        })
        .collect();
    for (k, v) in [
        ("pciHostDevices", pci),
        ("mediatedDevices", mdev),
        ("usb", usb),
    ] {
        if !v.is_empty() {
            out.insert(k.into(), Value::Array(v));
        }
    }
    Some(Value::Object(out))
}

/// The shape of HCO's `spec.permittedHostDevices` (`field` is its path): known keys only, a
/// `vendor:device` hex PCI selector, a non-empty mdev selector, hex USB ids, valid extended
/// resource names, booleans where HCO has them.
pub fn validate_hco(v: &Value, field: &str, e: &mut Vec<FieldError>) {
    let Some(m) = v.as_object() else {
        e.push(FieldError::type_invalid(field, "must be an object"));
        return;
    };
    for (key, list) in m {
        let f = format!("{field}.{key}");
        let (required, optional): (&[&str], &[&str]) = match key.as_str() {
            "pciHostDevices" => (&["pciDeviceSelector", "resourceName"], &[]),
            "mediatedDevices" => (&["mdevNameSelector", "resourceName"], &[]),
            "usbHostDevices" => (&["resourceName"], &["selectors"]),
            _ => {
                e.push(FieldError::not_supported(
                    f,
                    "supported values: pciHostDevices, mediatedDevices, usbHostDevices",
                ));
                continue;
            }
        };
        if list.is_null() {
            continue;
        }
        let Some(entries) = list.as_array() else {
            e.push(FieldError::type_invalid(f, "must be a list"));
            continue;
        };
        for (i, d) in entries.iter().enumerate() {
            let f = format!("{f}[{i}]");
            let Some(dm) = d.as_object() else {
                e.push(FieldError::type_invalid(f, "must be an object"));
                continue;
            };
            for k in dm.keys() {
                let known = required.contains(&k.as_str())
                    || optional.contains(&k.as_str())
                    || k == "externalResourceProvider"
                    || k == "disabled";
                if !known {
                    e.push(FieldError::not_supported(
                        format!("{f}.{k}"),
                        "not a field of this host device",
                    ));
                }
            }
            for k in required {
                if dm.get(*k).and_then(Value::as_str).is_none_or(str::is_empty) {
                    e.push(FieldError::required(format!("{f}.{k}"), "must be set"));
                }
            }
            for k in ["externalResourceProvider", "disabled"] {
                if dm.get(k).is_some_and(|x| !x.is_boolean() && !x.is_null()) {
                    e.push(FieldError::type_invalid(
                        format!("{f}.{k}"),
                        "must be a boolean",
                    ));
                }
            }
            if let Some(r) = s(d, "resourceName").filter(|r| !r.is_empty())
                && !valid_resource_name(r)
            {
                e.push(FieldError::invalid(
                    format!("{f}.resourceName"),
                    format!(
                        "Invalid value: \"{r}\": must be an extended resource name: \
                         <domain>/<name>, the domain a DNS subdomain outside kubernetes.io"
                    ),
                ));
            }
            if let Some(sel) = s(d, "pciDeviceSelector").filter(|x| !x.is_empty())
                && !valid_pci_selector(sel)
            {
                e.push(FieldError::invalid(
                    format!("{f}.pciDeviceSelector"),
                    format!("Invalid value: \"{sel}\": must be vendor:device, 4 hex digits each"),
                ));
            }
            if key == "usbHostDevices" {
                check_usb_selectors(d.get("selectors"), &format!("{f}.selectors"), e);
            }
        }
    }
}

fn check_usb_selectors(v: Option<&Value>, f: &str, e: &mut Vec<FieldError>) {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        e.push(FieldError::required(
            f,
            "at least one vendor/product selector",
        ));
        return;
    };
    let Some(list) = v.as_array().filter(|l| !l.is_empty()) else {
        e.push(FieldError::required(
            f,
            "at least one vendor/product selector",
        ));
        return;
    };
    for (j, sel) in list.iter().enumerate() {
        for k in ["vendor", "product"] {
            let ok = s(sel, k).and_then(parse_usb_id).is_some();
            if !ok {
                e.push(FieldError::invalid(
                    format!("{f}[{j}].{k}"),
                    "must be a USB id of 1 to 4 hex digits",
                ));
            }
        }
    }
}

#[cfg(test)]
#[path = "host_devices_tests.rs"]
mod tests;
