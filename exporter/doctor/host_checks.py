"""What the exporter reads from the host: the kubelet's PodResources socket, /proc, the
cgroup tree and its pressure files, the kernel log, and its own web config."""

from __future__ import annotations

import os
from pathlib import Path

from exporter.doctor.check import Check, degraded, missing, ok
from exporter.exposition.web_config import (
    WebConfigError,
    load_web_config,
    mixed_cost_warning,
    ssl_context,
)
from exporter.model import PodResourcesSnapshot
from exporter.sources.cgroups import Layout, find_layout
from exporter.sources.kmsg import boot_epoch, parse_kmsg_record
from exporter.sources.podresources.client import PodResourcesClient
from exporter.sources.procfs import host_view_problem, shows_host_kthreadd

SOCKET_FIX = (
    "mount the kubelet's pod-resources directory (chart podResources.hostPath; "
    "/var/lib/kubelet/pod-resources by default, elsewhere on k0s and MicroK8s) and point "
    "--pod-resources-socket at its kubelet.sock"
)
PROC_FIX = (
    "run with hostPID: true and mount the host's /proc (chart hostProc), then point "
    "--proc-root at it"
)
KMSG_FIX = (
    "chart kmsg.enabled=true: mounts /dev/kmsg read-only and adds CAP_SYSLOG (a "
    "privileged container where the runtime does not grant /dev/kmsg); or --kmsg-path"
)
# Directories of a cgroup tree searched for one container's pressure file at most.
PSI_SEARCH_LIMIT = 2000


async def read_pod_resources(
    socket: Path,
    resource_names: tuple[str, ...],
    dra_drivers: tuple[str, ...],
    timeout_s: float,
) -> PodResourcesSnapshot:
    """One ``List`` + ``GetAllocatableResources`` round through the exporter's client."""
    client = PodResourcesClient(
        socket, resource_names=resource_names, dra_drivers=dra_drivers, timeout_s=timeout_s
    )
    try:
        return await client.fetch()
    finally:
        await client.close()


def pod_resources_checks(answer: PodResourcesSnapshot) -> list[Check]:
    if not answer.ok:
        return [
            missing(
                "podresources",
                f"{answer.error}: no pod owns any GPU in the exporter's output",
                SOCKET_FIX,
            )
        ]
    gpus = sum(len(c.device_ids) for c in answer.containers)
    checks = [
        ok(
            "podresources",
            f"v1 List answers: {len(answer.listed)} container(s), {gpus} GPU device(s) allocated",
        )
    ]
    if answer.allocatable_ok:
        advertised = sum(len(a.device_ids) for a in answer.allocatable)
        checks.append(
            ok("podresources.allocatable", f"GetAllocatableResources: {advertised} GPU device(s)")
        )
    else:
        checks.append(
            degraded(
                "podresources.allocatable",
                answer.error
                or "the kubelet does not offer GetAllocatableResources (before 1.21, or its "
                "KubeletPodResourcesGetAllocatable gate off): node GPU capacity is unknown",
                "upgrade the kubelet to 1.23+ (the call is GA there) or turn the "
                "KubeletPodResourcesGetAllocatable feature gate on",
            )
        )
    return checks


def check_proc(proc_root: Path) -> Check:
    problem = host_view_problem(proc_root)
    if problem is not None:
        return missing("proc", problem, PROC_FIX)
    if not shows_host_kthreadd(proc_root):
        return degraded(
            "proc",
            f"cannot tell whether {proc_root} is the host's /proc: pid 2's stat could not "
            "be read or parsed as kthreadd's",
            PROC_FIX,
        )
    return ok("proc", f"{proc_root} is the host's /proc (pid 1, pid 2 is kthreadd)")


def check_cgroups(cgroup_root: Path | None, proc_root: Path) -> list[Check]:
    """``cgroup`` (the tree and its version) and ``psi`` (pressure stall files)."""
    if cgroup_root is None:
        off = degraded(
            "cgroup",
            "off (--cgroup-root off): CPU throttling of GPU containers is not read, so "
            "an idle GPU's cause stays unknown (docs/why-idle.md)",
            "mount the host's /sys/fs/cgroup read-only (chart hostCgroup.enabled=true) "
            "and point --cgroup-root at it",
        )
        return [off, degraded("psi", "not read: --cgroup-root off", "see cgroup")]
    layout = find_layout(cgroup_root)
    if isinstance(layout, str):
        fix = "mount the host's /sys/fs/cgroup read-only (chart hostCgroup) or --cgroup-root off"
        return [degraded("cgroup", layout, fix), degraded("psi", "not read: see cgroup", fix)]
    checks = [ok("cgroup", f"cgroup v{layout.version} at {layout.base}")]
    checks.append(_psi(layout, proc_root))
    return checks


def _psi(layout: Layout, proc_root: Path) -> Check:
    fix = (
        "a kernel with PSI (CONFIG_PSI=y, 4.20+; boot with psi=1 where it is built "
        "off by default) on cgroup v2 (systemd.unified_cgroup_hierarchy=1)"
    )
    if layout.version == 1:
        return degraded(
            "psi",
            "cgroup v1 has no pressure files: CPU/IO/memory pressure of GPU containers "
            "is not read (throttling still is)",
            fix,
        )
    container = _a_container_cgroup(layout.base)
    if container is not None:
        if (container / "cpu.pressure").is_file():
            return ok("psi", f"pressure files present ({container / 'cpu.pressure'})")
        return degraded("psi", f"no cpu.pressure beside {container / 'cpu.stat'}: PSI is off", fix)
    if (proc_root / "pressure" / "cpu").is_file():
        return ok("psi", f"the kernel has PSI ({proc_root / 'pressure' / 'cpu'})")
    return degraded(
        "psi",
        "cannot tell: no container cgroup with cpu.stat found, and no "
        f"{proc_root / 'pressure' / 'cpu'}",
        fix,
    )


def _a_container_cgroup(base: Path) -> Path | None:
    """A directory under the kubepods tree holding ``cpu.stat``, searched a bounded way."""
    seen = 0
    for top in ("kubepods.slice", "kubepods"):
        start = base / top
        if not start.is_dir():
            continue
        for directory, _dirs, files in os.walk(start):
            seen += 1
            if seen > PSI_SEARCH_LIMIT:
                return None
            if "cpu.stat" in files and Path(directory) != start:
                return Path(directory)
    return None


def check_kmsg(path: Path, proc_root: Path, enabled: bool) -> Check:
    """Open the kernel log as the reader does and read one record."""
    flag = "" if enabled else " (--kmsg is off: add --kmsg, chart kmsg.enabled, to use it)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return degraded(
            "kmsg",
            f"{path} cannot be opened ({exc.strerror}): XIDs raised while the exporter "
            f"was down are not counted{flag}",
            KMSG_FIX,
        )
    try:
        try:
            head = os.read(fd, 8192)
        except BlockingIOError:
            head = b""
        except OSError as exc:
            return degraded("kmsg", f"{path} cannot be read ({exc.strerror}){flag}", KMSG_FIX)
    finally:
        os.close(fd)
    first = head.split(b"\n", 1)[0].decode("utf-8", "replace")
    if not head:  # a fresh open of /dev/kmsg reads its oldest record: nothing is no evidence
        return degraded(
            "kmsg",
            f"{path} gave no record: cannot tell it is the kernel log{flag}",
            "point --kmsg-path at /dev/kmsg (chart kmsg.enabled)",
        )
    if parse_kmsg_record(first) is None:
        return degraded(
            "kmsg", f"{path} is not in /dev/kmsg's record format", "point --kmsg-path at /dev/kmsg"
        )
    if boot_epoch(proc_root, 0.0) is None:
        return degraded(
            "kmsg",
            f"{path} readable, but {proc_root}/uptime is not: backlog XIDs are stamped "
            f"when read{flag}",
            PROC_FIX,
        )
    return ok("kmsg", f"{path} readable{flag}")


def check_web_config(path: Path | None) -> Check:
    if path is None:
        return ok(
            "web_config",
            "none (--web-config-file not given): /metrics over plain HTTP, no auth",
        )
    try:
        config = load_web_config(path)
        if config.tls is not None:
            ssl_context(config.tls)
    except WebConfigError as exc:
        return missing(
            "web_config",
            f"the exporter would not start: {exc}",
            "fix the file (exporter-toolkit web config format, docs/security.md) or the "
            "chart's webConfig values",
        )
    warning = mixed_cost_warning(config.basic_auth_users)
    if warning:
        return degraded("web_config", warning, "hash every password at the same bcrypt cost")
    parts = ["TLS" if config.tls else "no TLS"]
    parts.append(f"{len(config.basic_auth_users)} basic-auth user(s)")
    return ok("web_config", f"{path}: {', '.join(parts)}")
