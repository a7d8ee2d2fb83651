"""The Pod Security Standards' `restricted` profile (Kubernetes 1.33, every baseline check included), transcribed
from https://kubernetes.io/docs/concepts/security/pod-security-standards/ as the PodSecurity admission plugin
applies it to a Pod: `restricted_violations(pod)` lists what a namespace labelled
`pod-security.kubernetes.io/enforce: restricted` would refuse, one line per check, in the plugin's terms."""

from __future__ import annotations

from typing import Any

Raw = dict[str, Any]

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
    "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def _containers(spec: Raw) -> list[Raw]:
    return [c for key in ("initContainers", "containers", "ephemeralContainers") for c in spec.get(key) or []]


def restricted_violations(pod: Raw) -> list[str]:
    spec = pod["spec"]
    pod_sc = spec.get("securityContext") or {}
    containers = _containers(spec)
    found: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            found.append(what)

    # --- baseline ---
    check(not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), "host namespaces")
    for c in containers:
        sc = c.get("securityContext") or {}
        name = c["name"]
        check(not (sc.get("windowsOptions") or {}).get("hostProcess"), f"{name}: hostProcess")
        check(not sc.get("privileged"), f"{name}: privileged")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        check(added <= BASELINE_CAPABILITIES, f"{name}: capabilities added beyond baseline {added}")
        check(all(not p.get("hostPort") for p in c.get("ports") or []), f"{name}: hostPort")
        check((sc.get("procMount") or "Default") == "Default", f"{name}: procMount")
        check((sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") != "Unconfined", f"{name}: AppArmor")
        selinux = sc.get("seLinuxOptions") or {}
        check(
            selinux.get("type", "") in SELINUX_TYPES and not selinux.get("user") and not selinux.get("role"),
            f"{name}: seLinuxOptions",
        )
        # --- restricted ---
        check(sc.get("allowPrivilegeEscalation") is False, f"{name}: allowPrivilegeEscalation != false")
        check(sc.get("runAsNonRoot") is not False, f"{name}: runAsNonRoot=false")
        check(sc.get("runAsNonRoot") is True or pod_sc.get("runAsNonRoot") is True, f"{name}: runAsNonRoot not true")
        check(sc.get("runAsUser") != 0, f"{name}: runAsUser=0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        check(seccomp in ("RuntimeDefault", "Localhost"), f"{name}: seccompProfile {seccomp!r}")
        caps = sc.get("capabilities") or {}
        check("ALL" in (caps.get("drop") or []), f"{name}: capabilities do not drop ALL")
        check(
            set(caps.get("add") or []) <= {"NET_BIND_SERVICE"}, f"{name}: capabilities add more than NET_BIND_SERVICE"
        )
    check((pod_sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") != "Unconfined", "pod: AppArmor")
    check((pod_sc.get("seccompProfile") or {}).get("type") != "Unconfined", "pod: seccompProfile Unconfined")
    pod_selinux = pod_sc.get("seLinuxOptions") or {}
    check(pod_selinux.get("type", "") in SELINUX_TYPES and not pod_selinux.get("user"), "pod: seLinuxOptions")
    check(pod_sc.get("runAsUser") != 0, "pod: runAsUser=0")
    for sysctl in pod_sc.get("sysctls") or []:
        check(sysctl.get("name") in SAFE_SYSCTLS, f"pod: sysctl {sysctl.get('name')}")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        check(kinds <= RESTRICTED_VOLUMES, f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    return found
