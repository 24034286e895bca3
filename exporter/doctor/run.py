"""Run every check with a deadline each, so a silent socket, API or driver gives a
``missing`` (or ``degraded``) line saying it timed out, never a hang.

Blocking checks run in daemon threads, not the default executor: a thread stuck in a
call that never returns (a hung NVML) must not keep the process from exiting, and
``asyncio.run`` would wait for the executor's threads at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

from exporter.config import Config
from exporter.doctor import dcgm_checks, host_checks, kube_checks, nvml_checks
from exporter.doctor.check import Check, Verdict, degraded, missing
from exporter.model import PodResourcesSnapshot

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 10.0


class TimedOut(Exception):
    pass


class Aborted(Exception):
    """A check raised SystemExit, KeyboardInterrupt or another BaseException (code it
    ran in-process, e.g. DCGM's bindings, called sys.exit): that check failed, the rest
    and the report stand."""


async def in_thread(fn: Callable[[], T], timeout_s: float, name: str) -> T:
    """``fn()`` in a daemon thread; ``TimedOut`` after ``timeout_s`` (the thread is left
    to finish or not: it holds no lock the rest needs)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def hand_over(result: T | None, error: BaseException | None) -> None:
        # the run may have ended (this check had timed out): then nobody waits for it
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, error)

    def work() -> None:
        try:
            result = fn()
        except Exception as exc:  # handed to the awaiting task, never lost
            hand_over(None, exc)
        except BaseException as exc:
            hand_over(None, Aborted(f"{type(exc).__name__} raised inside the check ({exc!r})"))
        else:
            hand_over(result, None)

    threading.Thread(target=work, name=f"doctor-{name}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except TimeoutError:
        raise TimedOut(f"no answer within {timeout_s:g} s") from None


def _failed(name: str, verdict: Verdict, exc: BaseException, fix: str) -> Check:
    why = str(exc) if isinstance(exc, TimedOut) else f"{type(exc).__name__}: {exc}"
    return (missing if verdict == "missing" else degraded)(name, f"check failed: {why}", fix)


async def run_checks(config: Config, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Check]:
    """Every check, in a stable order: node-wide first, then each GPU's."""
    nvml_task = in_thread(lambda: nvml_checks.check_nvml(config.slow_interval_s), timeout_s, "nvml")
    dcgm_task = in_thread(
        lambda: dcgm_checks.check_dcgm(
            config.dcgm, config.dcgm_bindings_path, config.dcgm_library_path
        ),
        # auto tries several host engines, each up to its connect timeout
        timeout_s + 5.0,
        "dcgm",
    )
    pods_task = asyncio.wait_for(
        host_checks.read_pod_resources(
            config.pod_resources_socket, config.resource_names, config.dra_drivers, timeout_s
        ),
        timeout_s * 2 + 1.0,  # two calls, each with timeout_s
    )
    kube_done: list[Check] = []  # filled as the kube check goes: kept if it overruns
    kube_task = in_thread(
        lambda: kube_checks.check_kube(config, timeout_s, kube_done),
        timeout_s * kube_checks.BUDGET_TIMEOUTS,
        "kube",
    )
    proc_task = in_thread(lambda: host_checks.check_proc(config.proc_root), timeout_s, "proc")
    cgroup_task = in_thread(
        lambda: host_checks.check_cgroups(config.cgroup_root, config.proc_root), timeout_s, "cgroup"
    )
    kmsg_task = in_thread(
        lambda: host_checks.check_kmsg(config.kmsg_path, config.proc_root, config.kmsg),
        timeout_s,
        "kmsg",
    )
    web_task = in_thread(
        lambda: host_checks.check_web_config(config.web_config_file), timeout_s, "web"
    )
    sources = asyncio.gather(nvml_task, dcgm_task, pods_task, kube_task, return_exceptions=True)
    host = asyncio.gather(proc_task, cgroup_task, kmsg_task, web_task, return_exceptions=True)
    (nvml, dcgm, pods, kube), (proc, cgroup, kmsg, web) = await asyncio.gather(sources, host)

    checks: list[Check] = []
    gpu_checks: list[Check] = []
    gpus: list[tuple[int, str]] = []
    if isinstance(nvml, BaseException):
        checks.append(_failed("nvml", "missing", nvml, nvml_checks.RUNTIME_FIX))
    else:
        gpus = nvml.gpus
        checks.extend(c for c in nvml.checks if not c.name.startswith("gpu"))
        gpu_checks.extend(c for c in nvml.checks if c.name.startswith("gpu"))
    if isinstance(dcgm, BaseException):
        checks.append(_failed("dcgm", "degraded", dcgm, dcgm_checks.DCGM_FIX))
        gpu_checks.extend(
            dcgm_checks.gpu_checks(dcgm_checks.DcgmFindings(checks[-1], None, ""), gpus)
        )
    else:
        checks.append(dcgm.reach)
        gpu_checks.extend(dcgm_checks.gpu_checks(dcgm, gpus))
    answer: PodResourcesSnapshot | None = None
    if isinstance(pods, BaseException):
        if isinstance(pods, TimeoutError):
            pods = TimedOut(f"no answer within {timeout_s * 2 + 1.0:g} s")
        checks.append(_failed("podresources", "missing", pods, host_checks.SOCKET_FIX))
    else:
        answer = pods
        checks.extend(host_checks.pod_resources_checks(pods))
    pod_list = None
    complete = True
    kube_rest: list[Check] = []
    if isinstance(kube, BaseException):
        # what finished stands; every check not reached says it cannot tell, none is lost
        done = list(kube_done)
        names = {c.name for c in done}
        if "kube_api" not in names:
            kube_rest.append(_failed("kube_api", "degraded", kube, kube_checks.API_FIX))
        why = f"the Kubernetes checks did not finish: {kube}"
        kube_rest += done + [
            kube_checks.unknown(write, sent, why)
            for write, sent in kube_checks.writes(config)
            if write.name not in names
        ]
    else:
        pod_list = kube.pods
        complete = kube.complete
        kube_rest = kube.checks
    checks.append(kube_checks.dra_check(pod_list, answer, config.dra_drivers, complete))
    checks.append(
        proc if isinstance(proc, Check) else _failed("proc", "missing", proc, host_checks.PROC_FIX)
    )
    if isinstance(cgroup, BaseException):
        checks.append(_failed("cgroup", "degraded", cgroup, "see docs/doctor.md"))
    else:
        checks.extend(cgroup)
    checks.append(
        kmsg if isinstance(kmsg, Check) else _failed("kmsg", "degraded", kmsg, host_checks.KMSG_FIX)
    )
    checks.extend(kube_rest)
    checks.append(
        web
        if isinstance(web, Check)
        else _failed("web_config", "missing", web, "fix --web-config-file")
    )
    return checks + sorted(gpu_checks, key=_gpu_order)


def _gpu_order(check: Check) -> tuple[int, str]:
    head, _, part = check.name.partition(".")
    return int(head.removeprefix("gpu")), part
