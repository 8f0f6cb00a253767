//! The guest platform beyond CPUs, memory, disks and NICs: what KubeVirt's `domain.features`,
//! `domain.clock`, `domain.rebootPolicy`, `domain.chassis`, `domain.cpu.features` and the
//! watchdog, panic and input devices ask, as QEMU options. Pure: [`machine_props`],
//! [`cpu_suffix`], [`rtc_opts`] and [`device_args`] are called by `cmdline::qemu_command`.

use serde::{Deserialize, Serialize};

use crate::spec::Accel;

/// Platform settings of one VM; the default is QEMU's defaults (what a VMI without these
/// fields gets).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Platform {
    /// A guest reboot ends QEMU instead of resetting the guest (`-no-reboot`): KubeVirt's
    /// `rebootPolicy: Terminate`.
    pub no_reboot: bool,
    /// `-machine acpi=` (None: QEMU's default, on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acpi: Option<bool>,
    /// `-machine smm=` (None: QEMU's default; EFI secure boot turns it on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smm: Option<bool>,
    /// `-machine hpet=` (None: QEMU's default, present).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hpet: Option<bool>,
    /// Where the guest's RTC starts (`-rtc base=YYYY-MM-DDTHH:MM:SS`), when not at UTC: the
    /// agent computes it when it maps the VMI, from `clock.utc.offsetSeconds` or
    /// `clock.timezone`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rtc_base: Option<String>,
    /// Catch up missed RTC ticks (`-rtc driftfix=slew`): the rtc timer's tickPolicy catchup.
    pub rtc_catchup: bool,
    /// The RTC follows the guest's own clock (`-rtc clock=vm`) instead of the host's: the rtc
    /// timer's `track: guest`.
    pub rtc_track_guest: bool,
    /// Hide the KVM signature from the guest (`kvm=off`; features.kvm.hidden). Under TCG there is
    /// none to hide.
    pub kvm_hidden: bool,
    /// Turn off the paravirtual spinlock hint (`kvm-pv-unhalt=off`; features.pvspinlock
    /// disabled). Only KVM offers it.
    pub pv_unhalt_off: bool,
    /// CPU feature flags appended to the model (`+avx2`, `-vmx`).
    pub cpu_flags: Vec<String>,
    /// Fail to start when a requested flag is not available (`enforce`): a `require` policy.
    pub cpu_enforce: bool,
    /// An i6300esb watchdog and what its expiry does (`-action watchdog=…`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watchdog: Option<WatchdogAction>,
    /// A pvpanic device: the guest reports a panic to QEMU (KubeVirt's `panicDevices`).
    pub pvpanic: bool,
    /// Tablets (absolute pointing devices) on these buses.
    pub tablets: Vec<TabletBus>,
    /// SMBIOS type 3 (chassis) strings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chassis: Option<Chassis>,
    /// An HD audio controller with a codec (`ich9` or `ac97`) whose audio goes nowhere.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sound: Option<SoundModel>,
}

/// What a watchdog's expiry does: KubeVirt's `poweroff`, `reset`, `shutdown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WatchdogAction {
    Poweroff,
    Reset,
    Shutdown,
}

/// The bus of a tablet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TabletBus {
    Usb,
    Virtio,
}

/// Sound models KubeVirt offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SoundModel {
    Ich9,
    Ac97,
}

/// SMBIOS chassis strings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Chassis {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manufacturer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub asset: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sku: Option<String>,
}

impl Platform {
    /// Whether any tablet needs the USB controller.
    pub fn needs_usb(&self) -> bool {
        self.tablets.contains(&TabletBus::Usb)
    }
}

fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

/// `-machine` properties (each with its leading comma); `smm_forced`: EFI secure boot needs
/// SMM, whatever the platform says (the agent refuses the contradiction before).
pub fn machine_props(p: &Platform, smm_forced: bool) -> String {
    let mut m = String::new();
    if let Some(acpi) = p.acpi {
        m.push_str(&format!(",acpi={}", on_off(acpi)));
    }
    match (smm_forced, p.smm) {
        (true, _) => m.push_str(",smm=on"),
        (false, Some(smm)) => m.push_str(&format!(",smm={}", on_off(smm))),
        (false, None) => {}
    }
    if let Some(hpet) = p.hpet {
        m.push_str(&format!(",hpet={}", on_off(hpet)));
    }
    m
}

/// What follows the CPU model on `-cpu` (each with its leading comma).
pub fn cpu_suffix(p: &Platform, accel: Accel) -> String {
    let mut s = String::new();
    for f in &p.cpu_flags {
        s.push(',');
        s.push_str(&crate::cmdline::esc(f));
    }
    if accel == Accel::Kvm {
        if p.kvm_hidden {
            s.push_str(",kvm=off");
        }
        if p.pv_unhalt_off {
            s.push_str(",kvm-pv-unhalt=off");
        }
    }
    if p.cpu_enforce {
        s.push_str(",enforce");
    }
    s
}

/// The `-rtc` value.
pub fn rtc_opts(p: &Platform) -> String {
    let mut o = format!(
        "base={}",
        crate::cmdline::esc(p.rtc_base.as_deref().unwrap_or("utc"))
    );
    if p.rtc_track_guest {
        o.push_str(",clock=vm");
    }
    if p.rtc_catchup {
        o.push_str(",driftfix=slew");
    }
    o
}

/// Devices and options after the disks and NICs: watchdog, pvpanic, tablets, sound, the
/// chassis SMBIOS table and `-no-reboot`. `usb_bus`: the id of the USB controller.
pub fn device_args(p: &Platform, usb_bus: &str) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut opt = |k: &str, v: String| {
        a.push(k.to_string());
        a.push(v);
    };
    if let Some(action) = p.watchdog {
        opt("-device", "i6300esb,id=watchdog0".into());
        let act = match action {
            WatchdogAction::Poweroff => "poweroff",
            WatchdogAction::Reset => "reset",
            WatchdogAction::Shutdown => "shutdown",
        };
        opt("-action", format!("watchdog={act}"));
    }
    if p.pvpanic {
        opt("-device", "pvpanic,id=panic0".into());
    }
    for (i, bus) in p.tablets.iter().enumerate() {
        let dev = match bus {
            TabletBus::Usb => format!("usb-tablet,id=tablet{i},bus={usb_bus}.0"),
            TabletBus::Virtio => format!("virtio-tablet-pci,id=tablet{i}"),
        };
        opt("-device", dev);
    }
    if let Some(model) = p.sound {
        opt("-audiodev", "none,id=snd0".into());
        match model {
            SoundModel::Ich9 => {
                opt("-device", "ich9-intel-hda,id=sound0".into());
                opt("-device", "hda-duplex,bus=sound0.0,audiodev=snd0".into());
            }
            SoundModel::Ac97 => opt("-device", "AC97,id=sound0,audiodev=snd0".into()),
        }
    }
    if let Some(c) = &p.chassis {
        let mut s = "type=3".to_string();
        for (k, v) in [
            ("manufacturer", &c.manufacturer),
            ("version", &c.version),
            ("serial", &c.serial),
            ("asset", &c.asset),
            ("sku", &c.sku),
        ] {
            if let Some(v) = v {
                s.push_str(&format!(",{k}={}", crate::cmdline::esc(v)));
            }
        }
        opt("-smbios", s);
    }
    if p.no_reboot {
        a.push("-no-reboot".into());
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_add_nothing() {
        let p = Platform::default();
        assert_eq!(machine_props(&p, false), "");
        assert_eq!(machine_props(&p, true), ",smm=on");
        assert_eq!(cpu_suffix(&p, Accel::Kvm), "");
        assert_eq!(rtc_opts(&p), "base=utc");
        assert!(device_args(&p, "usb").is_empty());
    }

    #[test]
    fn every_setting_has_its_option() {
        let p = Platform {
            no_reboot: true,
            acpi: Some(true),
            smm: Some(false),
            hpet: Some(false),
            rtc_base: Some("2001-09-09T02:46:40".into()),
            rtc_catchup: true,
            rtc_track_guest: true,
            kvm_hidden: true,
            pv_unhalt_off: true,
            cpu_flags: vec!["+avx2".into(), "-vmx".into()],
            cpu_enforce: true,
            watchdog: Some(WatchdogAction::Poweroff),
            pvpanic: true,
            tablets: vec![TabletBus::Usb, TabletBus::Virtio],
            chassis: Some(Chassis {
                manufacturer: Some("Acme, Inc".into()),
                asset: Some("A-1".into()),
                ..Chassis::default()
            }),
            sound: Some(SoundModel::Ich9),
        };
        assert_eq!(machine_props(&p, false), ",acpi=on,smm=off,hpet=off");
        assert_eq!(
            cpu_suffix(&p, Accel::Kvm),
            ",+avx2,-vmx,kvm=off,kvm-pv-unhalt=off,enforce"
        );
        // Under TCG there is no KVM signature or PV spinlock to switch off.
        assert_eq!(cpu_suffix(&p, Accel::Tcg), ",+avx2,-vmx,enforce");
        assert_eq!(
            rtc_opts(&p),
            "base=2001-09-09T02:46:40,clock=vm,driftfix=slew"
        );
        assert_eq!(
            device_args(&p, "usb"),
            [
                "-device",
                "i6300esb,id=watchdog0",
                "-action",
                "watchdog=poweroff",
                "-device",
                "pvpanic,id=panic0",
                "-device",
                "usb-tablet,id=tablet0,bus=usb.0",
                "-device",
                "virtio-tablet-pci,id=tablet1",
                "-audiodev",
                "none,id=snd0",
                "-device",
                "ich9-intel-hda,id=sound0",
                "-device",
                "hda-duplex,bus=sound0.0,audiodev=snd0",
                "-smbios",
                "type=3,manufacturer=Acme,, Inc,asset=A-1",
                "-no-reboot",
            ]
        );
        assert!(p.needs_usb());
    }
}
