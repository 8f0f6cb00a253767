//! Unit tests of the QEMU argv builder (`cmdline`): every flag and device from a `LaunchSpec`.

use super::*;
use crate::spec::*;

fn spec() -> LaunchSpec {
    let mut s = LaunchSpec::new(
        "vm1",
        "12345678-9abc-def0-1234-56789abcdef0",
        256,
        "/run/vm1/qmp.sock".into(),
    );
    s.smbios.serial = Some("SER-1".into());
    s
}

fn disk(id: &str) -> Disk {
    Disk {
        id: id.into(),
        path: format!("/img/{id}.img").into(),
        format: DiskFormat::Raw,
        bus: DiskBus::Virtio,
        readonly: false,
        cdrom: false,
        empty: false,
        boot_order: None,
        serial: None,
        cache: None,
        source: DiskSource::File,
        backing: Vec::new(),
    }
}

/// Value following the first occurrence of `flag`.
fn value_of<'a>(argv: &'a [String], flag: &str) -> Option<&'a str> {
    argv.iter()
        .position(|a| a == flag)
        .map(|i| argv[i + 1].as_str())
}

/// Values following every occurrence of `flag`.
fn values_of<'a>(argv: &'a [String], flag: &str) -> Vec<&'a str> {
    argv.windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].as_str())
        .collect()
}

fn blockdevs(argv: &[String]) -> Vec<Value> {
    values_of(argv, "-blockdev")
        .into_iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect()
}

#[test]
fn baseline_machine_and_defaults() {
    let argv = qemu_command(&spec());
    assert_eq!(value_of(&argv, "-machine"), Some("q35"));
    assert!(argv.contains(&"-nodefaults".to_string()));
    assert!(argv.contains(&"-no-user-config".to_string()));
    assert_eq!(value_of(&argv, "-display"), Some("none"));
    assert_eq!(
        value_of(&argv, "-uuid"),
        Some("12345678-9abc-def0-1234-56789abcdef0")
    );
    assert_eq!(value_of(&argv, "-m"), Some("256M"));
    assert_eq!(
        value_of(&argv, "-smp"),
        Some("1,sockets=1,cores=1,threads=1")
    );
    assert_eq!(value_of(&argv, "-name"), Some("guest=vm1,debug-threads=on"));
    assert!(!argv.contains(&"-S".to_string()));
    assert!(!argv.contains(&"-sandbox".to_string()));
    assert!(!argv.contains(&"-vnc".to_string()));
}

#[test]
fn smbios_carries_manufacturer_uuid_and_serial() {
    let argv = qemu_command(&spec());
    assert_eq!(
        value_of(&argv, "-smbios"),
        Some(
            "type=1,manufacturer=ferrovirt,serial=SER-1,uuid=12345678-9abc-def0-1234-56789abcdef0"
        )
    );
    let mut s = spec();
    s.smbios.manufacturer = "Acme, Inc".into();
    s.smbios.product = Some("VM".into());
    s.smbios.family = Some("f".into());
    let argv = qemu_command(&s);
    let smbios = value_of(&argv, "-smbios").unwrap();
    assert!(smbios.starts_with("type=1,manufacturer=Acme,, Inc,product=VM,serial=SER-1,"));
    assert!(smbios.ends_with(",family=f"));
}

#[test]
fn qmp_and_serial_are_listening_unix_sockets() {
    let mut s = spec();
    s.sockets.serial = Some("/run/vm1/serial.sock".into());
    let argv = qemu_command(&s);
    let chardevs = values_of(&argv, "-chardev");
    assert!(chardevs.contains(&"socket,id=qmp,path=/run/vm1/qmp.sock,server=on,wait=off"));
    assert!(chardevs.contains(&"socket,id=serial0,path=/run/vm1/serial.sock,server=on,wait=off"));
    assert_eq!(value_of(&argv, "-mon"), Some("chardev=qmp,mode=control"));
    assert!(values_of(&argv, "-device").contains(&"isa-serial,chardev=serial0"));
}

#[test]
fn serial_log_is_attached_to_the_console_or_stands_alone() {
    let mut s = spec();
    s.sockets.serial = Some("/s.sock".into());
    s.sockets.serial_log = Some("/log/console.log".into());
    let argv = qemu_command(&s);
    assert!(values_of(&argv, "-chardev").contains(
        &"socket,id=serial0,path=/s.sock,server=on,wait=off,logfile=/log/console.log.fifo,logappend=on"
    ));
    s.sockets.serial = None;
    let argv = qemu_command(&s);
    assert!(values_of(&argv, "-chardev").contains(&"file,id=serial0,path=/log/console.log.fifo"));
    assert!(values_of(&argv, "-device").contains(&"isa-serial,chardev=serial0"));
}

#[test]
fn paths_with_commas_are_escaped() {
    let mut s = spec();
    s.sockets.qmp = "/run/a,b/qmp.sock".into();
    let argv = qemu_command(&s);
    assert!(
        values_of(&argv, "-chardev")
            .contains(&"socket,id=qmp,path=/run/a,,b/qmp.sock,server=on,wait=off")
    );
}

#[test]
fn vnc_socket_adds_display_device() {
    let mut s = spec();
    s.sockets.vnc = Some("/run/vm1/vnc.sock".into());
    let argv = qemu_command(&s);
    assert_eq!(value_of(&argv, "-vnc"), Some("unix:/run/vm1/vnc.sock"));
    assert!(values_of(&argv, "-device").contains(&"VGA,id=video0"));
    assert_eq!(value_of(&argv, "-display"), Some("none"));
    s.video = VideoModel::VirtioGpu;
    assert!(values_of(&qemu_command(&s), "-device").contains(&"virtio-gpu-pci,id=video0"));
}

#[test]
fn guest_agent_channel() {
    let mut s = spec();
    s.sockets.guest_agent = Some("/run/vm1/qga.sock".into());
    let argv = qemu_command(&s);
    let devices = values_of(&argv, "-device");
    assert!(devices.contains(&"virtio-serial-pci,id=virtio-serial0"));
    assert!(
        devices.contains(
            &"virtserialport,bus=virtio-serial0.0,chardev=qga0,name=org.qemu.guest_agent.0"
        )
    );
    assert!(
        values_of(&argv, "-chardev")
            .contains(&"socket,id=qga0,path=/run/vm1/qga.sock,server=on,wait=off")
    );
}

#[test]
fn tcg_uses_max_cpu_and_optional_tb_size() {
    let mut s = spec();
    s.cpu.model = CpuModel::Host;
    let argv = qemu_command(&s);
    assert_eq!(value_of(&argv, "-accel"), Some("tcg"));
    assert_eq!(value_of(&argv, "-cpu"), Some("max"));
    s.tcg_tb_size_mib = Some(64);
    assert_eq!(
        value_of(&qemu_command(&s), "-accel"),
        Some("tcg,tb-size=64")
    );
}

#[test]
fn kvm_uses_requested_model_and_ignores_tb_size() {
    let mut s = spec();
    s.accel = Accel::Kvm;
    s.tcg_tb_size_mib = Some(64);
    s.cpu.model = CpuModel::Host;
    let argv = qemu_command(&s);
    assert_eq!(value_of(&argv, "-accel"), Some("kvm"));
    assert_eq!(value_of(&argv, "-cpu"), Some("host"));
    s.cpu.model = CpuModel::Named("Skylake-Client".into());
    assert_eq!(value_of(&qemu_command(&s), "-cpu"), Some("Skylake-Client"));
}

#[test]
fn topology_is_spelled_out() {
    let mut s = spec();
    s.cpu.sockets = 2;
    s.cpu.cores = 2;
    s.cpu.threads = 2;
    assert_eq!(
        value_of(&qemu_command(&s), "-smp"),
        Some("8,sockets=2,cores=2,threads=2")
    );
}

#[test]
fn sandbox_and_start_paused() {
    let mut s = spec();
    s.sandbox = true;
    s.start_paused = true;
    let argv = qemu_command(&s);
    assert_eq!(
        value_of(&argv, "-sandbox"),
        Some("on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny")
    );
    assert!(argv.contains(&"-S".to_string()));
}

#[test]
fn kernel_boot() {
    let mut s = spec();
    s.kernel_boot = Some(KernelBoot {
        kernel: "/boot/vmlinuz".into(),
        initrd: Some("/boot/initrd.img".into()),
        cmdline: Some("console=ttyS0 quiet, x".into()),
    });
    let argv = qemu_command(&s);
    assert_eq!(value_of(&argv, "-kernel"), Some("/boot/vmlinuz"));
    assert_eq!(value_of(&argv, "-initrd"), Some("/boot/initrd.img"));
    // -append is not a key=value option: commas stay as they are.
    assert_eq!(value_of(&argv, "-append"), Some("console=ttyS0 quiet, x"));
}

#[test]
fn efi_with_secure_boot() {
    let mut s = spec();
    s.firmware = Firmware::Efi {
        secure_boot: true,
        code_path: "/usr/share/OVMF/OVMF_CODE.secboot.fd".into(),
        vars_path: "/var/vm1/VARS.fd".into(),
    };
    let argv = qemu_command(&s);
    assert_eq!(
        value_of(&argv, "-machine"),
        Some("q35,pflash0=fw-code,pflash1=fw-vars,smm=on")
    );
    let b = blockdevs(&argv);
    assert_eq!(b[0]["node-name"], "fw-code");
    assert_eq!(b[0]["read-only"], true);
    assert_eq!(b[1]["filename"], "/var/vm1/VARS.fd");
    assert_eq!(b[1]["read-only"], false);
    assert_eq!(
        value_of(&argv, "-global"),
        Some("driver=cfi.pflash01,property=secure,value=on")
    );
    s.firmware = Firmware::Efi {
        secure_boot: false,
        code_path: "/c".into(),
        vars_path: "/v".into(),
    };
    let argv = qemu_command(&s);
    assert_eq!(
        value_of(&argv, "-machine"),
        Some("q35,pflash0=fw-code,pflash1=fw-vars")
    );
    assert_eq!(value_of(&argv, "-global"), None);
}

#[test]
fn virtio_disk_is_two_blockdev_layers_and_a_device() {
    let mut s = spec();
    let mut d = disk("root");
    d.format = DiskFormat::Qcow2;
    d.boot_order = Some(1);
    d.serial = Some("abc,def".into());
    s.disks.push(d);
    let argv = qemu_command(&s);
    let b = blockdevs(&argv);
    assert_eq!(
        b[0],
        json!({"driver": "file", "filename": "/img/root.img",
               "node-name": "file-root", "read-only": false})
    );
    assert_eq!(
        b[1],
        json!({"driver": "qcow2", "file": "file-root", "backing": null,
               "node-name": "fmt-root", "read-only": false})
    );
    assert!(
        values_of(&argv, "-device")
            .contains(&"virtio-blk-pci,id=root,drive=fmt-root,serial=abc,,def,bootindex=1")
    );
}

#[test]
fn qcow2_overlays_name_their_recorded_backing_chain() {
    let mut s = spec();
    let mut d = disk("root");
    d.format = DiskFormat::Qcow2;
    d.path = "/vmi/overlay.qcow2".into();
    d.backing = vec![
        BackingImage {
            path: "/cache/base.qcow2".into(),
            format: DiskFormat::Qcow2,
            source: DiskSource::File,
        },
        BackingImage {
            path: "/dev/loop7".into(),
            format: DiskFormat::Raw,
            source: DiskSource::Block,
        },
    ];
    s.disks.push(d);
    let argv = qemu_command(&s);
    let b = blockdevs(&argv);
    let names: Vec<&str> = b.iter().map(|n| n["node-name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "file-root-b2",
            "fmt-root-b2",
            "file-root-b1",
            "fmt-root-b1",
            "file-root",
            "fmt-root"
        ]
    );
    assert_eq!(b[0]["driver"], "host_device");
    assert_eq!(b[1]["driver"], "raw");
    assert!(b[1].get("backing").is_none(), "raw has no backing option");
    assert_eq!(b[1]["read-only"], true);
    assert_eq!(b[3]["driver"], "qcow2");
    assert_eq!(b[3]["backing"], "fmt-root-b2");
    assert_eq!(b[3]["read-only"], true);
    assert_eq!(b[5]["backing"], "fmt-root-b1");
    assert_eq!(b[5]["read-only"], false);
    assert!(values_of(&argv, "-device").contains(&"virtio-blk-pci,id=root,drive=fmt-root"));
    // A raw disk never gets a backing key, whatever its bytes say.
    let mut s = spec();
    s.disks.push(disk("data"));
    let b = blockdevs(&qemu_command(&s));
    assert_eq!(b[1]["driver"], "raw");
    assert!(b[1].get("backing").is_none());
}

#[test]
fn block_source_readonly_and_cache_modes() {
    let mut s = spec();
    let mut d = disk("data");
    d.source = DiskSource::Block;
    d.path = "/dev/loop3".into();
    d.readonly = true;
    d.cache = Some(CacheMode::None);
    s.disks.push(d);
    let argv = qemu_command(&s);
    let b = blockdevs(&argv);
    assert_eq!(b[0]["driver"], "host_device");
    assert_eq!(b[0]["read-only"], true);
    assert_eq!(b[1]["read-only"], true);
    assert_eq!(b[0]["cache"], json!({"direct": true, "no-flush": false}));
    assert_eq!(b[1]["cache"], json!({"direct": true, "no-flush": false}));
    assert!(
        values_of(&argv, "-device")
            .contains(&"virtio-blk-pci,id=data,drive=fmt-data,write-cache=on")
    );
    assert_eq!(cache_flags(CacheMode::Writethrough), (false, false, false));
    assert_eq!(cache_flags(CacheMode::Unsafe), (false, true, true));
    assert_eq!(cache_flags(CacheMode::Directsync), (true, false, false));
}

#[test]
fn empty_cdroms_are_drives_without_a_medium() {
    let mut s = spec();
    s.disks.push(disk("root"));
    for (id, bus) in [("cd-sata", DiskBus::Sata), ("cd-scsi", DiskBus::Scsi)] {
        let mut cd = disk(id);
        cd.path = "".into();
        cd.cdrom = true;
        cd.empty = true;
        cd.bus = bus;
        s.disks.push(cd);
    }
    s.validate().unwrap();
    let argv = qemu_command(&s);
    let devices = values_of(&argv, "-device");
    assert!(
        devices.contains(&"ide-cd,bus=ide.0,id=cd-sata"),
        "{devices:?}"
    );
    assert!(
        devices.contains(&"scsi-cd,bus=scsi0.0,channel=0,scsi-id=0,lun=0,id=cd-scsi"),
        "{devices:?}"
    );
    assert!(devices.contains(&"virtio-scsi-pci,id=scsi0"));
    // No block nodes for them: only the root disk's file and format nodes.
    let names: Vec<String> = blockdevs(&argv)
        .iter()
        .map(|n| n["node-name"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(names, ["file-root", "fmt-root"]);
    assert!(
        !argv
            .iter()
            .any(|a| a.contains("cd-sata") && a.contains("filename"))
    );
}

#[test]
fn sata_scsi_and_usb_buses() {
    let mut s = spec();
    let mut a = disk("a");
    a.bus = DiskBus::Sata;
    let mut cd = disk("cd");
    cd.bus = DiskBus::Sata;
    cd.cdrom = true;
    cd.boot_order = Some(2);
    let mut sc = disk("sc");
    sc.bus = DiskBus::Scsi;
    let mut sc2 = disk("sc2");
    sc2.bus = DiskBus::Scsi;
    sc2.cdrom = true;
    let mut u = disk("u");
    u.bus = DiskBus::Usb;
    s.disks.extend([a, cd, sc, sc2, u]);
    let argv = qemu_command(&s);
    let devices = values_of(&argv, "-device");
    assert!(devices.contains(&"virtio-scsi-pci,id=scsi0"));
    assert!(devices.contains(&"qemu-xhci,id=usb"));
    assert!(devices.contains(&"ide-hd,bus=ide.0,id=a,drive=fmt-a"));
    assert!(devices.contains(&"ide-cd,bus=ide.1,id=cd,drive=fmt-cd,bootindex=2"));
    assert!(devices.contains(&"scsi-hd,bus=scsi0.0,channel=0,scsi-id=0,lun=0,id=sc,drive=fmt-sc"));
    assert!(
        devices.contains(&"scsi-cd,bus=scsi0.0,channel=0,scsi-id=1,lun=0,id=sc2,drive=fmt-sc2")
    );
    assert!(devices.contains(&"usb-storage,bus=usb.0,id=u,drive=fmt-u"));
    // the CD-ROM's nodes are read-only although the disk did not ask for it
    let b = blockdevs(&argv);
    let cd_fmt = b.iter().find(|n| n["node-name"] == "fmt-cd").unwrap();
    assert_eq!(cd_fmt["read-only"], true);
    // controllers come before the devices that sit on them
    let pos = |needle: &str| argv.iter().position(|x| x.starts_with(needle)).unwrap();
    assert!(pos("virtio-scsi-pci") < pos("scsi-hd"));
    assert!(pos("qemu-xhci") < pos("usb-storage"));
}

#[test]
fn no_controllers_without_such_disks() {
    let mut s = spec();
    s.disks.push(disk("a"));
    let argv = qemu_command(&s);
    let devices = values_of(&argv, "-device");
    assert!(!devices.iter().any(|d| d.starts_with("virtio-scsi-pci")));
    assert!(!devices.iter().any(|d| d.starts_with("qemu-xhci")));
}

#[test]
fn user_mode_nic_with_forwards() {
    let mut s = spec();
    s.nics.push(Nic {
        id: "net0".into(),
        mac: Some("52:54:00:12:34:56".into()),
        model: NicModel::VirtioNetPci,
        backend: NicBackend::User {
            forwards: vec![
                HostForward {
                    protocol: ForwardProtocol::Tcp,
                    host_addr: "127.0.0.1".into(),
                    host_port: 2222,
                    guest_port: 22,
                },
                HostForward {
                    protocol: ForwardProtocol::Udp,
                    host_addr: "127.0.0.1".into(),
                    host_port: 5353,
                    guest_port: 53,
                },
            ],
        },
        boot_order: Some(3),
    });
    let argv = qemu_command(&s);
    assert_eq!(
        value_of(&argv, "-netdev"),
        Some(
            "user,id=net-net0,restrict=on,hostfwd=tcp:127.0.0.1:2222-:22,hostfwd=udp:127.0.0.1:5353-:53"
        )
    );
    assert!(
        values_of(&argv, "-device")
            .contains(&"virtio-net-pci,id=net0,netdev=net-net0,mac=52:54:00:12:34:56,bootindex=3")
    );
}

#[test]
fn tap_and_unconnected_nics() {
    let mut s = spec();
    s.nics.push(Nic {
        id: "a".into(),
        mac: None,
        model: NicModel::E1000e,
        backend: NicBackend::Tap {
            ifname: "tap-vm1".into(),
            queues: 1,
        },
        boot_order: None,
    });
    s.nics.push(Nic {
        id: "b".into(),
        mac: None,
        model: NicModel::VirtioNetPci,
        backend: NicBackend::None,
        boot_order: None,
    });
    let argv = qemu_command(&s);
    assert_eq!(
        values_of(&argv, "-netdev"),
        vec!["tap,id=net-a,ifname=tap-vm1,script=no,downscript=no"]
    );
    let devices = values_of(&argv, "-device");
    assert!(devices.contains(&"e1000e,id=a,netdev=net-a,romfile="));
    assert!(devices.contains(&"virtio-net-pci,id=b,romfile="));
}

#[test]
fn rng_balloon_and_extra_args_last() {
    let mut s = spec();
    s.rng = true;
    s.balloon = true;
    s.extra_args = vec!["-d".into(), "guest_errors".into()];
    let argv = qemu_command(&s);
    assert_eq!(
        value_of(&argv, "-object"),
        Some("rng-random,id=rng0,filename=/dev/urandom")
    );
    let devices = values_of(&argv, "-device");
    assert!(devices.contains(&"virtio-rng-pci,rng=rng0"));
    assert!(devices.contains(&"virtio-balloon-pci,id=balloon0"));
    assert_eq!(&argv[argv.len() - 2..], ["-d", "guest_errors"]);
}

#[test]
fn argv_is_deterministic() {
    let mut s = spec();
    s.disks.push(disk("a"));
    assert_eq!(qemu_command(&s), qemu_command(&s));
}

#[test]
fn accel_choice() {
    let intel = "processor\t: 0\nflags\t\t: fpu vme vmx sse2\n";
    let amd = "flags\t: fpu svm lm\n";
    let none = "flags\t: fpu lm hypervisor\nvmx flags\t: vnmi\n";
    assert_eq!(choose_accel(true, intel), Accel::Kvm);
    assert_eq!(choose_accel(true, amd), Accel::Kvm);
    assert_eq!(choose_accel(false, intel), Accel::Tcg);
    assert_eq!(choose_accel(true, none), Accel::Tcg);
    assert_eq!(choose_accel(true, ""), Accel::Tcg);
    // substrings do not count
    assert_eq!(choose_accel(true, "flags\t: svmx vmxx\n"), Accel::Tcg);
}

#[test]
fn detect_accel_runs_on_this_host() {
    // Only checks that detection does not panic; the answer depends on the machine.
    let _ = detect_accel();
}

#[test]
fn migration_target_waits_for_the_incoming_stream() {
    let mut s = spec();
    assert!(!qemu_command(&s).iter().any(|a| a == "-incoming"));
    s.incoming = true;
    let argv = qemu_command(&s);
    let i = argv.iter().position(|a| a == "-incoming").unwrap();
    // The connection is handed over later (`migrate-incoming fd:`).
    assert_eq!(argv[i + 1], "defer");
    // The target never boots on its own: no -S needed, the guest runs when the stream ends.
    assert!(!argv.iter().any(|a| a == "-S"));
}

#[test]
fn multi_queue_tap_nic() {
    let mut s = spec();
    s.nics.push(Nic {
        id: "default".into(),
        mac: None,
        model: NicModel::VirtioNetPci,
        backend: NicBackend::Tap {
            ifname: "tap0".into(),
            queues: 2,
        },
        boot_order: None,
    });
    s.validate().unwrap();
    let argv = qemu_command(&s);
    assert_eq!(
        values_of(&argv, "-netdev"),
        vec!["tap,id=net-default,ifname=tap0,script=no,downscript=no,queues=2"]
    );
    assert!(
        values_of(&argv, "-device")
            .contains(&"virtio-net-pci,id=default,netdev=net-default,mq=on,vectors=6,romfile=")
    );
    // Multiple queues need virtio; 0 and more than KubeVirt's cap are refused.
    for (model, queues) in [
        (NicModel::E1000e, 2),
        (NicModel::VirtioNetPci, 0),
        (NicModel::VirtioNetPci, 257),
    ] {
        s.nics[0].model = model;
        s.nics[0].backend = NicBackend::Tap {
            ifname: "tap0".into(),
            queues,
        };
        assert!(s.validate().is_err(), "{model:?} {queues}");
    }
}

#[test]
fn host_devices_are_passed_through_and_usb_ones_get_a_controller() {
    use crate::hostdev::HostDevice;
    let mut s = spec();
    s.host_devices = vec![
        HostDevice::Pci {
            address: "0000:01:00.0".into(),
        },
        HostDevice::Usb { bus: 1, addr: 4 },
    ];
    let argv = qemu_command(&s);
    let devices = values_of(&argv, "-device");
    assert!(devices.contains(&"qemu-xhci,id=usb"));
    assert!(devices.contains(&"vfio-pci,host=0000:01:00.0,id=hostdev0"));
    assert!(devices.contains(&"usb-host,hostbus=1,hostaddr=4,id=hostdev1,bus=usb.0"));
    let pos = |needle: &str| argv.iter().position(|x| x.starts_with(needle)).unwrap();
    assert!(pos("qemu-xhci") < pos("usb-host"));
    // PCI alone needs no USB controller.
    s.host_devices.truncate(1);
    assert!(!values_of(&qemu_command(&s), "-device").contains(&"qemu-xhci,id=usb"));
}
