"""`gpu-occupancy-exporter doctor`: every check both ways, on the simulated node and the
Kubernetes API stand-in; exit codes; the JSON shape; bounded time when a source hangs."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.cli import _pointed_at
from exporter.config import Config, parse_config
from exporter.doctor.check import Check, exit_status
from exporter.doctor.run import run_checks
from exporter.sim.environment import SimEnvironment
from exporter.sim.podresources_server import start_podresources_server
from tests.harness import scenario_from

FAKE_BINDINGS = str(Path(__file__).parent / "fake_dcgm")
SINGLE = yaml.safe_load(
    (Path(__file__).parents[1] / "exporter/sim/scenarios/single-gpu.yaml").read_text()
)
TIMEOUT_S = 2.0


def single(**changes: Any) -> dict[str, Any]:
    """single-gpu with root keys changed (``gpu0`` merges into its one GPU)."""
    scenario = copy.deepcopy(SINGLE)
    gpu = changes.pop("gpu0", None)
    if gpu:
        scenario["gpus"][0].update(gpu)
    scenario.update(changes)
    return scenario


@asynccontextmanager
async def node(
    source: str | dict[str, Any] = "single-gpu", *argv: str
) -> AsyncIterator[tuple[Config, SimEnvironment]]:
    """A simulated node, and the doctor's config pointed at it as --simulate does."""
    config = parse_config(["doctor", "--dcgm", "off", *argv])
    sim = SimEnvironment(scenario_from(source), kube_api=config.kube_api != "off")
    paths = await sim.start()
    try:
        yield _pointed_at(config, paths), sim
    finally:
        await sim.stop()


async def doctor(config: Config) -> dict[str, Check]:
    checks = await run_checks(config, TIMEOUT_S)
    assert len({c.name for c in checks}) == len(checks), "one entry per check"
    return {c.name: c for c in checks}


def verdict(checks: dict[str, Check], name: str) -> str:
    return checks[name].verdict


# -- the whole run -------------------------------------------------------------------


async def test_a_healthy_node_passes_every_check_it_can_prove() -> None:
    async with node() as (config, _):
        checks = await doctor(config)
    for name in (
        "nvml",
        "driver",
        "nvml.gpus",
        "podresources",
        "podresources.allocatable",
        "podresources.dra",
        "proc",
        "kmsg",
        "kube_api",
        "rbac.events",
        "rbac.lease",
        "rbac.node_status",
        "rbac.device_taint_rules",
        "web_config",
        "gpu0.gpm",
        "gpu0.mig",
        "gpu0.processes",
    ):
        assert verdict(checks, name) == "ok", checks[name]
    # what the defaults leave out is not ok: it is said, with the fix
    assert verdict(checks, "dcgm") == "degraded" and "--dcgm" in checks["dcgm"].fix
    assert verdict(checks, "gpu0.dcgm") == "degraded"
    assert verdict(checks, "cgroup") == "degraded"  # single-gpu has no cgroup tree
    assert exit_status(list(checks.values())) == 0
    for check in checks.values():
        assert check.verdict == "ok" or check.fix, check


# -- NVML and the driver ---------------------------------------------------------------


async def test_no_driver_is_nvml_missing_and_exit_1() -> None:
    async with node("no-gpu") as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "nvml") == "missing"
    assert "DriverNotLoaded" in checks["nvml"].detail
    assert "runtimeClassName" in checks["nvml"].fix
    assert not any(name.startswith("gpu") for name in checks)
    assert exit_status(list(checks.values())) == 1


async def test_nvml_seeing_no_gpu_is_missing() -> None:
    async with node(single(nvml_sees_no_gpu=True)) as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "nvml") == "ok"
    assert verdict(checks, "nvml.gpus") == "missing"
    assert "NVIDIA_VISIBLE_DEVICES" in checks["nvml.gpus"].fix


async def test_a_driver_before_r535_is_degraded() -> None:
    async with node(single(driver_version="525.105.17")) as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "driver") == "degraded"
    assert "R535" in checks["driver"].fix


async def test_a_gpu_without_gpm_is_degraded() -> None:
    async with node(single(gpu0={"gpm_supported": False})) as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "gpu0.gpm") == "degraded"
    assert "no GPM" in checks["gpu0.gpm"].detail
    assert exit_status(list(checks.values())) == 0


async def test_gpm_refused_by_permission_is_degraded() -> None:
    errors = [{"call": "nvmlGpmSampleGet", "error": "NO_PERMISSION", "gpu": 0}]
    async with node(single(call_errors=errors)) as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "gpu0.gpm") == "degraded"
    assert "NoPermission" in checks["gpu0.gpm"].detail


async def test_mig_on_is_reported_and_an_unreadable_mig_mode_is_degraded() -> None:
    mig = [{"profile": "3g.40gb", "gpu_instance_id": 1, "compute_instance_id": 0}]
    async with node(single(gpu0={"mig": mig})) as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "gpu0.mig") == "ok" and "MIG on: 1" in checks["gpu0.mig"].detail
    assert verdict(checks, "gpu0.gpm") == "ok"  # sampled per GPU instance
    errors = [{"call": "nvmlDeviceGetMigMode", "error": "NO_PERMISSION", "gpu": 0}]
    async with node(single(call_errors=errors)) as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "gpu0.mig") == "degraded"


async def test_process_listing_refused_is_missing() -> None:
    errors = [
        {"call": "nvmlDeviceGetComputeRunningProcesses_v3", "error": "NO_PERMISSION", "gpu": 0}
    ]
    async with node(single(call_errors=errors)) as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "gpu0.processes") == "missing"
    assert "NoPermission" in checks["gpu0.processes"].detail
    assert exit_status(list(checks.values())) == 1


async def test_a_hung_nvml_gives_missing_within_the_deadline() -> None:
    errors = [{"call": "nvmlDeviceGetUUID", "delay_s": 30, "gpu": 0}]
    async with node(single(call_errors=errors), "--kube-api", "off") as (config, _):
        started = time.monotonic()
        checks = await doctor(config)
        took = time.monotonic() - started
    assert verdict(checks, "nvml") == "missing"
    assert "no answer within" in checks["nvml"].detail
    assert took < TIMEOUT_S + 3


# -- DCGM ------------------------------------------------------------------------------


@pytest.fixture
def dcgm_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    uuid = scenario_from("single-gpu").gpus[0].uuid
    state = tmp_path / "dcgm.json"
    fields = {str(f): 0.25 for f in range(1001, 1009)}
    state.write_text(
        json.dumps(
            {
                "hostengines": ["127.0.0.1:5555"],
                "gpus": [{"id": 0, "uuid": f"GPU-{uuid.removeprefix('GPU-')}", "fields": fields}],
            }
        )
    )
    monkeypatch.setenv("FAKE_DCGM_STATE", str(state))
    yield state


def _dcgm(config: Config, mode: str) -> Config:
    dcgm = parse_config(["doctor", "--dcgm", mode]).dcgm
    return replace(config, dcgm=dcgm, dcgm_bindings_path=FAKE_BINDINGS)


async def test_dcgm_reachable_and_profiling_is_ok(dcgm_state: Path) -> None:
    async with node() as (config, _):
        checks = await doctor(_dcgm(config, "127.0.0.1:5555"))
    assert verdict(checks, "dcgm") == "ok", checks["dcgm"]
    assert verdict(checks, "gpu0.dcgm") == "ok", checks["gpu0.dcgm"]


async def test_dcgm_unreachable_is_degraded(dcgm_state: Path) -> None:
    async with node() as (config, _):
        checks = await doctor(_dcgm(config, "10.255.0.1:5555"))
    assert verdict(checks, "dcgm") == "degraded"
    assert "not reachable" in checks["dcgm"].detail
    assert verdict(checks, "gpu0.dcgm") == "degraded"


async def test_dcgm_without_profiling_for_a_gpu_is_degraded(dcgm_state: Path) -> None:
    state = json.loads(dcgm_state.read_text())
    state["errors"] = {"dcgmWatchFields": "PROFILING_NOT_SUPPORTED"}
    dcgm_state.write_text(json.dumps(state))
    async with node() as (config, _):
        checks = await doctor(_dcgm(config, "127.0.0.1:5555"))
    assert verdict(checks, "dcgm") == "ok"
    assert verdict(checks, "gpu0.dcgm") == "degraded"


# -- PodResources -----------------------------------------------------------------------


async def test_an_absent_pod_resources_socket_is_missing(tmp_path: Path) -> None:
    async with node() as (config, _):
        config = replace(config, pod_resources_socket=tmp_path / "kubelet.sock")
        checks = await doctor(config)
    assert verdict(checks, "podresources") == "missing"
    assert "does not exist" in checks["podresources"].detail
    assert "podResources.hostPath" in checks["podresources"].fix
    assert verdict(checks, "podresources.dra") == "degraded"  # cannot tell
    assert exit_status(list(checks.values())) == 1


async def test_a_silent_pod_resources_socket_is_missing_within_the_deadline(
    tmp_path: Path,
) -> None:
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX) as silent:
        silent.bind(str(path))
        silent.listen(1)  # accepted by the kernel, never answered
        async with node("single-gpu", "--kube-api", "off") as (config, _):
            started = time.monotonic()
            checks = await doctor(replace(config, pod_resources_socket=path))
            took = time.monotonic() - started
    assert verdict(checks, "podresources") == "missing"
    assert "DEADLINE_EXCEEDED" in checks["podresources"].detail
    assert took < 2 * TIMEOUT_S + 3


async def test_a_kubelet_without_get_allocatable_is_degraded(tmp_path: Path) -> None:
    path = tmp_path / "old-kubelet.sock"
    server = await start_podresources_server(path, lambda: ((), ()), allocatable_implemented=False)
    try:
        async with node() as (config, _):
            checks = await doctor(replace(config, pod_resources_socket=path))
    finally:
        await server.stop(None)
    assert verdict(checks, "podresources") == "ok"
    assert verdict(checks, "podresources.allocatable") == "degraded"
    assert "1.23" in checks["podresources.allocatable"].fix


async def test_dra_claims_reported_are_ok_and_unreported_are_degraded() -> None:
    async with node("dra") as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "podresources.dra") == "ok", checks["podresources.dra"]
    assert "all reported" in checks["podresources.dra"].detail
    dra = yaml.safe_load(
        (Path(__file__).parents[1] / "exporter/sim/scenarios/dra.yaml").read_text()
    )
    dra["kubelet_reports_claims"] = False
    async with node(dra) as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "podresources.dra") == "degraded"
    assert "KubeletPodResourcesDynamicResources" in checks["podresources.dra"].fix


# -- the host ----------------------------------------------------------------------------


async def test_a_proc_that_is_not_the_hosts_is_missing(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    async with node() as (config, _):
        checks = await doctor(replace(config, proc_root=tmp_path / "proc"))
    assert verdict(checks, "proc") == "missing"
    assert "hostPID" in checks["proc"].fix


async def test_cgroup_v2_with_psi_is_ok_v1_has_no_psi_and_off_is_degraded() -> None:
    async with node("why-idle") as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "cgroup") == "ok" and "v2" in checks["cgroup"].detail
    assert verdict(checks, "psi") == "ok", checks["psi"]
    why_idle = yaml.safe_load(
        (Path(__file__).parents[1] / "exporter/sim/scenarios/why-idle.yaml").read_text()
    )
    async with node({**why_idle, "cgroup_version": 1}) as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "cgroup") == "ok" and "v1" in checks["cgroup"].detail
    assert verdict(checks, "psi") == "degraded"
    async with node("why-idle") as (config, _):
        checks = await doctor(replace(config, cgroup_root=None))
    assert verdict(checks, "cgroup") == "degraded"
    assert "hostCgroup" in checks["cgroup"].fix


async def test_a_cgroup_tree_without_pressure_files_is_psi_degraded() -> None:
    why_idle = yaml.safe_load(
        (Path(__file__).parents[1] / "exporter/sim/scenarios/why-idle.yaml").read_text()
    )
    for pod in why_idle["pods"]:
        for container in pod["containers"]:
            if "cgroup" in container:
                container["cgroup"]["psi"] = False
    async with node(why_idle) as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "psi") == "degraded"
    assert "PSI" in checks["psi"].detail


async def test_an_unreadable_kernel_log_is_degraded(tmp_path: Path) -> None:
    async with node() as (config, _):
        checks = await doctor(replace(config, kmsg_path=tmp_path / "no-kmsg"))
    assert verdict(checks, "kmsg") == "degraded"
    assert "kmsg.enabled" in checks["kmsg"].fix
    assert exit_status(list(checks.values())) == 0


async def test_web_config_valid_is_ok_and_broken_is_missing(tmp_path: Path) -> None:
    good = tmp_path / "web.yml"
    good.write_text("http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    bad = tmp_path / "bad.yml"
    bad.write_text("tls_server_config:\n  cert_file: /nonexistent.crt\n")
    async with node("single-gpu", "--kube-api", "off") as (config, _):
        ok_checks = await doctor(replace(config, web_config_file=good))
        bad_checks = await doctor(replace(config, web_config_file=bad))
    assert verdict(ok_checks, "web_config") == "ok"
    assert verdict(bad_checks, "web_config") == "missing"
    assert exit_status(list(bad_checks.values())) == 1


# -- the Kubernetes API and RBAC -----------------------------------------------------------


async def test_kube_api_off_is_degraded_and_makes_no_write() -> None:
    async with node("single-gpu", "--kube-api", "off") as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "kube_api") == "degraded"
    assert "--kube-api auto" in checks["kube_api"].fix
    assert verdict(checks, "rbac.events") == "ok"  # no write is made
    assert exit_status(list(checks.values())) == 0


async def test_pods_forbidden_is_degraded() -> None:
    async with node() as (config, sim):
        assert sim.kube_api is not None
        sim.kube_api.set_error(403, "pods is forbidden", resource="pods")
        checks = await doctor(config)
    assert verdict(checks, "kube_api") == "degraded"
    assert "list, watch on pods" in checks["kube_api"].fix


def write_kubeconfig(path: Path, port: int) -> Path:
    """A kubeconfig for an API server on 127.0.0.1:``port`` over plain HTTP, a token user."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


async def test_a_silent_api_server_is_degraded_within_the_deadline(tmp_path: Path) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", silent.getsockname()[1])
        async with node() as (config, _):
            started = time.monotonic()
            checks = await doctor(replace(config, kubeconfig=str(kubeconfig)))
            took = time.monotonic() - started
    assert verdict(checks, "kube_api") == "degraded"
    assert "not reachable" in checks["kube_api"].detail
    assert verdict(checks, "rbac.events") == "degraded"  # the default write: cannot tell
    assert took < TIMEOUT_S + 4


@pytest.mark.parametrize(
    ("check", "flags", "only"),
    [
        ("rbac.events", (), "/events"),
        ("rbac.node_status", ("--node-condition",), "/status"),
        ("rbac.device_taint_rules", ("--dra-device-taints",), "devicetaintrules"),
    ],
)
async def test_rbac_denying_a_write_the_flags_make_is_missing(
    check: str, flags: tuple[str, ...], only: str
) -> None:
    async with node("single-gpu", *flags) as (config, sim):
        assert sim.kube_api is not None
        allowed = await doctor(config)
        sim.kube_api.writes.set_write_fault("forbidden", only=only)
        denied = await doctor(config)
        assert sim.kube_api.writes.write_log == []  # asked, never written
    assert verdict(allowed, check) == "ok" and "allowed" in allowed[check].detail
    assert verdict(denied, check) == "missing", denied[check]
    assert "grant the exporter's service account" in denied[check].fix
    assert exit_status(list(denied.values())) == 1
    others = {"rbac.events", "rbac.node_status", "rbac.device_taint_rules"} - {check}
    assert all(verdict(denied, name) == "ok" for name in others)


async def test_rbac_denying_a_write_the_flags_do_not_make_is_ok_with_a_note() -> None:
    async with node() as (config, sim):
        assert sim.kube_api is not None
        sim.kube_api.writes.set_write_fault("forbidden", only="/status")
        checks = await doctor(config)
    assert verdict(checks, "rbac.node_status") == "ok"
    assert "before turning it on" in checks["rbac.node_status"].detail


async def test_rbac_denying_the_writer_lease_is_missing() -> None:
    async with node() as (config, sim):
        assert sim.kube_api is not None
        sim.kube_api.writes.set_lease_fault("forbidden")
        checks = await doctor(config)
    assert verdict(checks, "rbac.lease") == "missing"
    assert "leases" in checks["rbac.lease"].fix


async def test_shadowed_writes_need_no_rbac() -> None:
    async with node("single-gpu", "--kube-writes", "shadow") as (config, sim):
        assert sim.kube_api is not None
        sim.kube_api.writes.set_write_fault("forbidden")
        checks = await doctor(config)
    assert verdict(checks, "rbac.events") == "ok"
    assert exit_status(list(checks.values())) == 0


# -- the command ---------------------------------------------------------------------------


def run_doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exporter", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_doctor_json_has_one_entry_per_check_and_exit_0() -> None:
    result = run_doctor("--simulate", "single-gpu", "--json", "--dcgm", "off")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is True
    names = [c["name"] for c in data["checks"]]
    assert len(names) == len(set(names))
    assert {"nvml", "podresources", "proc", "kube_api", "gpu0.gpm"} <= set(names)
    for entry in data["checks"]:
        assert set(entry) == {"name", "verdict", "detail", "fix"}
        assert entry["verdict"] in ("ok", "degraded", "missing")


def test_doctor_text_prints_one_line_per_check_and_exits_1_when_missing() -> None:
    result = run_doctor("--simulate", "no-gpu", "--kube-api", "off", "--dcgm", "off")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    nvml = next(line for line in lines if line.split()[1:2] == ["nvml"])
    assert nvml.startswith("MISSING") and "(fix: " in nvml
    assert "would NOT work" in lines[-1]


def test_doctor_with_a_bad_flag_exits_2_with_one_line() -> None:
    result = run_doctor("--no-such-flag")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_doctor_help_names_json_and_the_exporter_flags() -> None:
    result = run_doctor("--help")
    assert result.returncode == 0
    for flag in ("--json", "--timeout", "--web-config-file", "--node-condition", "--proc-root"):
        assert flag in result.stdout


# -- an adversarial review: what it broke, held -------------------------------------------


class _ApiServer:
    """A small HTTP API server: pods of the node listed at once, access reviews answered
    after ``delay_s`` with ``allowed`` (any JSON value)."""

    def __init__(self, *, delay_s: float, allowed: object, more_pods: bool = False) -> None:
        import http.server
        import threading

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                page: dict[str, Any] = {"kind": "PodList", "apiVersion": "v1", "items": []}
                if outer.more_pods:
                    page["items"] = [{"metadata": {"namespace": "a", "name": "p"}, "spec": {}}]
                    page["metadata"] = {"continue": "next-page-token"}
                self._send(200, page)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                time.sleep(outer.delay_s)
                status = {"allowed": outer.allowed, "reason": "test server"}
                self._send(201, {"kind": "SelfSubjectAccessReview", "status": status})

        self.delay_s = delay_s
        self.allowed = allowed
        self.more_pods = more_pods
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, path: Path) -> Path:
        return write_kubeconfig(path, self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow  # waits out the kube checks' budget by design
async def test_slow_denying_reviews_past_the_budget_still_fail_the_run(tmp_path: Path) -> None:
    """Reviews that take most of --timeout each: the kube checks overrun their budget.
    The denials already answered stand (the writes these flags make are asked first) and
    every RBAC check still appears, those not reached as "cannot tell"."""
    api = _ApiServer(delay_s=0.7 * TIMEOUT_S, allowed=False)
    try:
        async with node() as (config, _):
            checks = await doctor(replace(config, kubeconfig=str(api.kubeconfig(tmp_path / "k"))))
    finally:
        api.close()
    names = {"rbac.events", "rbac.node_status", "rbac.device_taint_rules", "rbac.lease"}
    assert names <= set(checks)
    assert verdict(checks, "rbac.events") == "missing"  # the default write, denied
    assert verdict(checks, "kube_api") == "ok"  # the pods were listed
    assert exit_status(list(checks.values())) == 1


async def test_a_review_whose_allowed_is_not_a_boolean_is_cannot_tell(tmp_path: Path) -> None:
    api = _ApiServer(delay_s=0.0, allowed="yes")
    try:
        async with node() as (config, _):
            checks = await doctor(replace(config, kubeconfig=str(api.kubeconfig(tmp_path / "k"))))
    finally:
        api.close()
    assert verdict(checks, "rbac.events") == "degraded"
    assert "cannot tell" in checks["rbac.events"].detail


def fake_proc(root: Path, pid2_stat: str, uptime: str | None = "100.0 50.0\n") -> Path:
    (root / "1").mkdir(parents=True)
    (root / "1" / "stat").write_text("1 (systemd) S 0 1 1 0 -1 4194560 0\n")
    (root / "2").mkdir()
    (root / "2" / "stat").write_text(pid2_stat)
    if uptime is not None:
        (root / "uptime").write_text(uptime)
    return root


@pytest.mark.parametrize("stat", ["garbage", "", "2 kthreadd S"])
async def test_proc_is_ok_only_when_pid_2_reads_as_kthreadd(tmp_path: Path, stat: str) -> None:
    proc = fake_proc(tmp_path / "proc", stat)
    async with node() as (config, _):
        checks = await doctor(replace(config, proc_root=proc))
    assert verdict(checks, "proc") == "degraded"
    assert "cannot tell" in checks["proc"].detail


async def test_a_kernel_log_that_gives_no_record_is_not_ok(tmp_path: Path) -> None:
    empty = tmp_path / "kmsg"
    empty.write_bytes(b"")
    async with node() as (config, _):
        checks = await doctor(replace(config, kmsg_path=empty))
    assert verdict(checks, "kmsg") == "degraded"
    assert "gave no record" in checks["kmsg"].detail


@pytest.mark.parametrize("uptime", ["nan inf\n", "1" * 10_000, None])
async def test_an_uptime_that_is_not_procs_is_not_evidence(
    tmp_path: Path, uptime: str | None
) -> None:
    """A NaN, an endless file (a symlink to /dev/zero, refused: O_NOFOLLOW), a huge one:
    no boot time, so the kernel log's backlog cannot be dated; read at most 64 bytes."""
    proc = tmp_path / "proc"
    async with node() as (config, _):
        real = config.proc_root
        fake = fake_proc(proc, (real / "2" / "stat").read_text(), uptime)
        if uptime is None:
            (fake / "uptime").symlink_to("/dev/zero")
        checks = await doctor(replace(config, proc_root=fake))
    assert verdict(checks, "kmsg") == "degraded"
    assert "uptime" in checks["kmsg"].detail


def _bindings(tmp_path: Path, source: str) -> Path:
    """DCGM bindings whose pydcgm runs ``source`` at import, the rest the stand-in's."""
    import shutil

    out = tmp_path / "bindings"
    shutil.copytree(FAKE_BINDINGS, out, ignore=shutil.ignore_patterns("__pycache__"))
    future = "from __future__ import annotations\n"
    head, _, rest = (out / "pydcgm.py").read_text().partition(future)
    (out / "pydcgm.py").write_text(head + future + source + "\n" + rest)
    return out


def doctor_with_bindings(bindings: Path) -> tuple[subprocess.CompletedProcess[str], Any]:
    """The doctor as a command on single-gpu with these bindings: its run, its report."""
    result = run_doctor(
        *("--simulate", "single-gpu", "--json", "--dcgm", "auto"),
        *("--dcgm-bindings-path", str(bindings)),
    )
    return result, json.loads(result.stdout)


def test_bindings_that_print_leave_the_json_report_intact(tmp_path: Path) -> None:
    result, report = doctor_with_bindings(_bindings(tmp_path, "print('DCGM banner: hello')"))
    assert {c["name"] for c in report["checks"]} >= {"dcgm", "nvml"}
    assert "DCGM banner: hello" in result.stderr


def test_bindings_that_exit_fail_their_check_not_the_report(tmp_path: Path) -> None:
    result, report = doctor_with_bindings(_bindings(tmp_path, "import sys\nsys.exit(0)"))
    dcgm = next(c for c in report["checks"] if c["name"] == "dcgm")
    assert dcgm["verdict"] == "degraded" and "SystemExit" in dcgm["detail"]
    assert result.returncode == 0  # nothing missing: DCGM is optional


def test_a_web_config_that_is_a_directory_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    from exporter.exposition.web_config import WebConfigError, read_bounded

    with pytest.raises(WebConfigError, match="not a regular file"):
        read_bounded(tmp_path, 1024, "a YAML file", "")
    result = subprocess.run(
        [
            *(sys.executable, "-m", "exporter", "--simulate", "single-gpu"),
            *("--web-config-file", str(tmp_path), "--listen", "127.0.0.1:0"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "not a regular file" in result.stderr


async def test_a_first_page_without_claims_cannot_clear_dra(tmp_path: Path) -> None:
    """More pods than one page: no claim among those read proves nothing (an adversarial review)."""
    api = _ApiServer(delay_s=0.0, allowed=True, more_pods=True)
    try:
        async with node() as (config, _):
            checks = await doctor(replace(config, kubeconfig=str(api.kubeconfig(tmp_path / "k"))))
    finally:
        api.close()
    assert "more exist" in checks["kube_api"].detail
    assert verdict(checks, "podresources.dra") == "degraded"
    assert "cannot tell" in checks["podresources.dra"].detail


async def test_process_listing_is_checked_through_the_entry_points_the_exporter_calls() -> None:
    """An early R535 driver has ``_v3`` listings that write a wider struct: the exporter
    calls ``_v2`` there (sources/nvml.py, process_listing_suffix), and so does doctor."""
    from tests.test_process_listings import R535_EARLY

    async with node(R535_EARLY) as (config, _):
        checks = await doctor(config)
    assert verdict(checks, "gpu0.processes") == "ok"
    assert checks["gpu0.processes"].detail == "process listings answer, _v2 (4 process(es) now)"
