#!/usr/bin/env python3
"""Writes crates/api/assets/common-instancetypes.yaml: the matrix of KubeVirt's
common cluster instancetypes (series x size) as its README describes them (facts: series,
vCPU/memory ratios and the attributes each series sets); the manifests are our own."""
import pathlib

SIZES = {"nano": (1, "512Mi"), "micro": (1, "1Gi"), "small": (1, "2Gi"), "medium": (1, "4Gi"),
         "large": (2, "8Gi"), "xlarge": (4, "16Gi"), "2xlarge": (8, "32Gi"), "4xlarge": (16, "64Gi"),
         "8xlarge": (32, "128Gi")}
# series: (sizes, memory per vCPU in GiB or None for the u/o table, extra cpu, extra memory)
SERIES = {
    "u1": (list(SIZES), None, {}, {}),
    "o1": (list(SIZES), None, {}, {"overcommitPercent": 50}),
    "cx1": (["medium", "large", "xlarge", "2xlarge", "4xlarge", "8xlarge"], 2,
            {"dedicatedCPUPlacement": True, "isolateEmulatorThread": True,
             "numa": {"guestMappingPassthrough": {}}}, {"hugepages": {"pageSize": "2Mi"}}),
    "m1": (["large", "xlarge", "2xlarge", "4xlarge", "8xlarge"], 8, {},
           {"hugepages": {"pageSize": "2Mi"}}),
    "n1": (["medium", "large", "xlarge", "2xlarge", "4xlarge", "8xlarge"], 4,
           {"dedicatedCPUPlacement": True, "isolateEmulatorThread": True},
           {"hugepages": {"pageSize": "1Gi"}}),
}

def y(v, ind):
    pad = "  " * ind
    if isinstance(v, dict):
        if not v:
            return " {}"
        return "".join(f"\n{pad}{k}:{y(x, ind + 1)}" for k, x in v.items())
    if isinstance(v, bool):
        return " true" if v else " false"
    return f" {v}" if isinstance(v, int) else f' "{v}"'

out = ["# source: kubevirt/common-instancetypes README (series and sizes table), deployed by virt-operator"]
for series, (sizes, per_cpu, cpu_extra, mem_extra) in SERIES.items():
    for size in sizes:
        cpus, mem = SIZES[size]
        if per_cpu:
            cpus = {"medium": 1, "large": 2, "xlarge": 4, "2xlarge": 8, "4xlarge": 16, "8xlarge": 32}[size]
            mem = f"{cpus * per_cpu}Gi"
        name = f"{series}.{size}"
        doc = {"apiVersion": "instancetype.kubevirt.io/v1beta1",
               "kind": "VirtualMachineClusterInstancetype",
               "metadata": {"name": name, "labels": {
                   "instancetype.kubevirt.io/vendor": "kubevirt.io",
                   "instancetype.kubevirt.io/class": series[:-1],
                   "instancetype.kubevirt.io/cpu": str(cpus),
                   "instancetype.kubevirt.io/memory": mem,
                   "instancetype.kubevirt.io/common-instancetypes-version": "v1.2.0"},
                   "annotations": {"instancetype.kubevirt.io/description": f"The {series} series, size {size}.",
                                   "instancetype.kubevirt.io/displayName": name}},
               "spec": {"cpu": {"guest": cpus, **cpu_extra}, "memory": {"guest": mem, **mem_extra}}}
        out.append(y(doc, 0).lstrip("\n"))
p = pathlib.Path(__file__).resolve().parent.parent / "crates/api/assets/common-instancetypes.yaml"
p.write_text("\n---\n".join(out[1:]).join([out[0] + "\n", "\n"]))

# Preferences: KubeVirt's common cluster preferences (names, architecture requirement, and the
# device/firmware/feature preferences the README lists per OS family).
LINUX = {"devices": {"preferredDiskBus": "virtio", "preferredInterfaceModel": "virtio",
                     "preferredRng": {}, "preferredNetworkInterfaceMultiQueue": True}}
WIN = {"clock": {"preferredClockOffset": {"utc": {}},
                 "preferredTimer": {"hpet": {"present": False}, "hyperv": {},
                                    "pit": {"tickPolicy": "delay"}, "rtc": {"tickPolicy": "catchup"}}},
       "cpu": {"preferredCPUTopology": "sockets"},
       "devices": {"preferredDiskBus": "sata", "preferredInterfaceModel": "e1000e",
                   "preferredInputBus": "usb", "preferredInputType": "tablet",
                   "preferredCdromBus": "sata", "preferredTPM": {"persistent": True},
                   "preferredAutoattachInputDevice": True},
       "features": {"preferredAcpi": {}, "preferredApic": {},
                    "preferredHyperv": {"relaxed": {}, "spinlocks": {"spinlocks": 8191},
                                        "vapic": {}, "vpindex": {}, "synic": {}, "synictimer": {"direct": {}},
                                        "frequencies": {}, "reenlightenment": {}, "tlbflush": {}, "ipi": {},
                                        "runtime": {}, "reset": {}},
                    "preferredSmm": {}},
       "firmware": {"preferredEfi": {"secureBoot": True, "persistent": True}}}
PREFS = [
    ("alpine", LINUX, "1", "512Mi"), ("centos.stream9", LINUX, "1", "1.5Gi"),
    ("centos.stream10", LINUX, "1", "1.5Gi"), ("cirros", LINUX, "1", "256Mi"),
    ("fedora", LINUX, "1", "2Gi"), ("opensuse.tumbleweed", LINUX, "1", "1Gi"),
    ("opensuse.leap", LINUX, "1", "2Gi"), ("rhel.8", LINUX, "1", "1.5Gi"),
    ("rhel.9", LINUX, "1", "1.5Gi"), ("rhel.10", LINUX, "1", "1.5Gi"),
    ("sles", LINUX, "1", "2Gi"), ("ubuntu", LINUX, "1", "2Gi"), ("debian", LINUX, "1", "1Gi"),
    ("oraclelinux", LINUX, "1", "1.5Gi"),
    ("windows.10", WIN, "1", "2Gi"), ("windows.11", WIN, "2", "4Gi"),
    ("windows.2k16", WIN, "1", "2Gi"), ("windows.2k19", WIN, "1", "2Gi"),
    ("windows.2k22", WIN, "1", "2Gi"), ("windows.2k25", WIN, "2", "4Gi"),
]
pout = ["# source: kubevirt/common-instancetypes README (preferences list: names, requirements, per-OS device and firmware preferences)"]
for name, base, cpu, mem in PREFS:
    for arch in (["amd64", "arm64"] if base is LINUX and name in ("fedora", "ubuntu", "centos.stream9", "rhel.9") else ["amd64"]):
        n = name if arch == "amd64" else f"{name}.arm64"
        spec = {k: dict(v) for k, v in base.items()}
        spec["requirements"] = {"architecture": arch, "cpu": {"guest": int(cpu)}, "memory": {"guest": mem}}
        spec["preferredArchitecture"] = arch
        spec["devices"] = dict(spec["devices"], preferredVideoType="virtio" if arch == "arm64" or base is LINUX else "vga")
        doc = {"apiVersion": "instancetype.kubevirt.io/v1beta1", "kind": "VirtualMachineClusterPreference",
               "metadata": {"name": n, "annotations": {"openshift.io/display-name": n,
                            "iconClass": f"icon-{name.split('.')[0]}"},
                            "labels": {"instancetype.kubevirt.io/os-type": "windows" if base is WIN else "linux",
                                       "instancetype.kubevirt.io/arch": arch}},
               "spec": spec}
        pout.append(y(doc, 0).lstrip("\n"))
    if base is WIN:
        spec = {k: dict(v) for k, v in base.items()}
        spec["devices"] = dict(spec["devices"], preferredDiskBus="virtio", preferredInterfaceModel="virtio")
        spec["requirements"] = {"architecture": "amd64", "cpu": {"guest": int(cpu)}, "memory": {"guest": mem}}
        pout.append(y({"apiVersion": "instancetype.kubevirt.io/v1beta1", "kind": "VirtualMachineClusterPreference",
                       "metadata": {"name": f"{name}.virtio"}, "spec": spec}, 0).lstrip("\n"))
p = pathlib.Path(__file__).resolve().parent.parent / "crates/api/assets/common-preferences.yaml"
p.write_text("\n---\n".join(pout[1:]).join([pout[0] + "\n", "\n"]))
