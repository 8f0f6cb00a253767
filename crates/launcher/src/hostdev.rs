//! Host devices passed through to the guest (the VMI's `gpus[].deviceName` and
//! `hostDevices[].deviceName`, assigned by the agent): their description in the launch spec
//! ([`HostDevice`]), its validation and QEMU's devices for them, pure: a PCI function through
//! VFIO (`vfio-pci,host=<BDF>`), a mediated device through VFIO (`vfio-pci,sysfsdev=<path>`),
//! a USB device through `usb-host,hostbus=,hostaddr=` on the VM's USB controller.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::cmdline::esc;

/// One host device assigned to the VM.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum HostDevice {
    /// A PCI function bound to `vfio-pci`, by its address (`0000:65:00.0`).
    #[serde(rename_all = "camelCase")]
    Pci { address: String },
    /// A mediated device, by its sysfs directory (`/sys/bus/mdev/devices/<uuid>`).
    #[serde(rename_all = "camelCase")]
    Mdev { sysfs_path: PathBuf },
    /// A USB device, by bus number and device address.
    #[serde(rename_all = "camelCase")]
    Usb { bus: u32, addr: u32 },
}

/// Whether `a` is a full PCI address: `dddd:bb:ss.f` in lower-case hex, function 0–7.
pub fn is_pci_address(a: &str) -> bool {
    let b = a.as_bytes();
    let hex = |r: std::ops::Range<usize>| {
        b[r].iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && (b'0'..=b'7').contains(&b[11])
}

/// Checks the devices a spec assigns: PCI addresses well-formed and not repeated, mdev paths
/// absolute, USB bus and address in USB's ranges (1–127).
pub fn validate(devs: &[HostDevice]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for d in devs {
        match d {
            HostDevice::Pci { address } if !is_pci_address(address) => {
                return Err(format!(
                    "host device PCI address {address:?} is not dddd:bb:ss.f"
                ));
            }
            HostDevice::Mdev { sysfs_path } if !sysfs_path.is_absolute() => {
                return Err(format!(
                    "mediated device path {} is not absolute",
                    sysfs_path.display()
                ));
            }
            HostDevice::Usb { bus, addr } if !(1..=127).contains(addr) || *bus == 0 => {
                return Err(format!("USB device {bus}:{addr} is out of range"));
            }
            _ => {}
        }
        if !seen.insert(d) {
            return Err(format!("host device {d:?} is assigned twice"));
        }
    }
    Ok(())
}

/// Whether the devices need a USB controller.
pub fn needs_usb(devs: &[HostDevice]) -> bool {
    devs.iter().any(|d| matches!(d, HostDevice::Usb { .. }))
}

/// The locked-memory limit QEMU needs with VFIO devices (it pins all guest memory for DMA):
/// guest memory plus 1 GiB, as KubeVirt gives; `None` without host devices (or USB only).
pub fn memlock_bytes(devs: &[HostDevice], memory_mib: u64) -> Option<u64> {
    devs.iter()
        .any(|d| !matches!(d, HostDevice::Usb { .. }))
        .then(|| memory_mib.saturating_add(1024).saturating_mul(1 << 20))
}

/// QEMU's `-device` arguments for the devices (ids `hostdev0`, `hostdev1`, …); `usb_bus`: the
/// id of the USB controller.
pub fn device_args(devs: &[HostDevice], usb_bus: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, d) in devs.iter().enumerate() {
        let dev = match d {
            HostDevice::Pci { address } => {
                format!("vfio-pci,host={},id=hostdev{i}", esc(address))
            }
            HostDevice::Mdev { sysfs_path } => format!(
                "vfio-pci,sysfsdev={},display=off,id=hostdev{i}",
                esc(&sysfs_path.display().to_string())
            ),
            HostDevice::Usb { bus, addr } => {
                format!("usb-host,hostbus={bus},hostaddr={addr},id=hostdev{i},bus={usb_bus}.0")
            }
        };
        out.push("-device".to_string());
        out.push(dev);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_becomes_its_qemu_device() {
        let devs = [
            HostDevice::Pci {
                address: "0000:65:00.0".into(),
            },
            HostDevice::Mdev {
                sysfs_path: "/sys/bus/mdev/devices/4b20d080-1b54-4048-85b3-a6a62d165c01".into(),
            },
            HostDevice::Usb { bus: 3, addr: 12 },
        ];
        assert_eq!(
            device_args(&devs, "usb"),
            [
                "-device",
                "vfio-pci,host=0000:65:00.0,id=hostdev0",
                "-device",
                "vfio-pci,sysfsdev=/sys/bus/mdev/devices/4b20d080-1b54-4048-85b3-a6a62d165c01,\
                 display=off,id=hostdev1",
                "-device",
                "usb-host,hostbus=3,hostaddr=12,id=hostdev2,bus=usb.0",
            ]
        );
        assert!(needs_usb(&devs));
        assert_eq!(memlock_bytes(&devs, 1024), Some(2 << 30));
        assert_eq!(memlock_bytes(&devs[2..], 1024), None);
        assert!(!needs_usb(&devs[..2]));
        assert_eq!(validate(&devs), Ok(()));
    }

    #[test]
    fn malformed_or_repeated_devices_are_refused() {
        for bad in ["65:00.0", "0000:65:00.8", "0000:65:00.0,x", "0000:6G:00.0"] {
            let d = [HostDevice::Pci {
                address: bad.into(),
            }];
            assert!(validate(&d).is_err(), "{bad}");
        }
        let twice = [
            HostDevice::Usb { bus: 1, addr: 2 },
            HostDevice::Usb { bus: 1, addr: 2 },
        ];
        assert!(validate(&twice).unwrap_err().contains("twice"));
        assert!(validate(&[HostDevice::Usb { bus: 1, addr: 0 }]).is_err());
        assert!(
            validate(&[HostDevice::Mdev {
                sysfs_path: "rel".into()
            }])
            .is_err()
        );
        // The serialised form the agent writes into spec.json.
        let v = serde_json::to_value(devs_one()).unwrap();
        assert_eq!(v, serde_json::json!([{"kind": "usb", "bus": 1, "addr": 2}]));
    }

    fn devs_one() -> Vec<HostDevice> {
        vec![HostDevice::Usb { bus: 1, addr: 2 }]
    }
}
