"""PNG plots of an e2e run, drawn from Prometheus' range API (matplotlib, Agg backend).

The e2e test calls ``render_all`` after its scenario has played out; docs/img/ holds the
images of one such run (E2E_WRITE_IMAGES=1, docs/e2e.md). Against any Prometheus that
scraped the exporter on a simulated node it also runs alone:

    python -m tests.e2e.render_plots --prometheus http://127.0.0.1:9090 --out /tmp/img
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes

from exporter.sim.scenario import load_scenario
from tests.e2e.stack import PromApi

GIB = 2**30
STEP_S = 1.0
KIND_COLOURS = {
    "dead_process": "tab:red",
    "stuck_process": "tab:purple",
    "deleted_pod": "tab:orange",
    "unattributed": "tab:brown",
}
FILES = {
    "util": "e2e-gpu-util-vs-sm-active.png",
    "orphans": "e2e-orphaned-memory.png",
    "shared": "e2e-time-sliced-gpu.png",
    "hog": "e2e-shared-gpu-hog.png",
}


@dataclass(frozen=True)
class Event:
    """A timeline event of the scenario: seconds after the simulation started."""

    at: float
    action: str
    label: str
    gpus: tuple[str, ...]


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    t: np.ndarray  # seconds since t0
    v: np.ndarray


class Window:
    """Range queries over one time window, on a common grid of ``STEP_S`` seconds."""

    def __init__(self, api: PromApi, start: float, end: float, t0: float) -> None:
        self.api, self.start, self.end, self.t0 = api, start, end, t0
        self.grid = np.arange(start, end + STEP_S / 2, STEP_S) - t0

    def fetch(self, expr: str) -> list[Series]:
        data = self.api.query_range(expr, self.start, self.end, STEP_S)
        if data.get("status") != "success":
            raise AssertionError(f"range query {expr!r} failed: {data.get('error')}")
        out = []
        for item in data["data"]["result"]:
            values = np.array([[float(t), float(v)] for t, v in item["values"]])
            out.append(Series(item["metric"], values[:, 0] - self.t0, values[:, 1]))
        return out

    def on_grid(self, series: Series) -> np.ndarray:
        """The series' values on the grid, NaN where it had no sample."""
        out = np.full(self.grid.shape, np.nan)
        index = np.rint((series.t - self.grid[0]) / STEP_S).astype(int)
        keep = (index >= 0) & (index < len(out))
        out[index[keep]] = series.v[keep]
        return out

    def first_time(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """When each series of ``expr`` first had a sample, keyed by its sorted labels."""
        return {
            tuple(sorted(s.labels.items())): float(s.t[0]) for s in self.fetch(expr) if len(s.t)
        }


def load_events(path: Path) -> list[Event]:
    """The scenario's timeline, each event with the GPUs it touches."""
    scenario = load_scenario(str(path))
    gpu_of_pid = {p.pid: str(p.gpu) for p in scenario.processes}
    gpus_of_pod: dict[str, set[str]] = defaultdict(set)
    for p in scenario.processes:
        if p.pod:
            gpus_of_pod[p.pod].add(str(p.gpu))
    events = []
    for e in scenario.timeline:
        value = e.args.get("value")
        pid = e.args.get("pid", value)
        pod = str(e.args.get("pod", value))
        gpus: tuple[str, ...]
        if e.action in {"kill", "exit", "orphan", "set_process", "fork_orphan"}:
            gpus = (gpu_of_pid.get(int(pid), "?"),) if pid is not None else ()
        elif e.action in {"delete_pod", "set_pod_phase", "terminate_pod"}:
            gpus = tuple(sorted(gpus_of_pod.get(pod, ())))
        elif e.action == "lose":
            gpus = (str(value),)
        else:
            gpus = (str(e.args["gpu"]),) if "gpu" in e.args else ()
        label = {
            "kill": f"kill -9 pid {pid}",
            "exit": f"pid {pid} exits",
            "orphan": f"pid {pid} vanishes",
            "set_process": f"pid {pid}: "
            + ", ".join(f"{k} {v}" for k, v in e.args.items() if k != "pid"),
            "fork_orphan": f"pid {pid} forks {e.args.get('child_pid', '')}, dies",
            "delete_pod": f"pod {pod} deleted",
            "terminate_pod": f"pod {pod} terminating",
            "xid": f"XID {e.args.get('code')}",
            "lose": "GPU lost",
        }.get(e.action, e.action)
        events.append(Event(e.at, e.action, label, gpus))
    return events


def _mark_events(ax: Axes, events: list[Event], *, with_gpu: bool = False) -> None:
    """A dotted line per event, its label in a staggered row along the top."""
    for i, e in enumerate(sorted(events, key=lambda e: e.at)):
        ax.axvline(e.at, color="0.45", linestyle=":", linewidth=1.2)
        where = f" (GPU {', '.join(e.gpus)})" if with_gpu and e.gpus else ""
        ax.annotate(
            f"{e.label}{where}",
            xy=(e.at, 0.97 - 0.07 * (i % 4)),
            xycoords=ax.get_xaxis_transform(),
            xytext=(3, 0),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color="0.2",
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85},
        )
        if e.action == "lose":
            ax.axvspan(e.at, ax.get_xlim()[1], color="0.5", alpha=0.12, linewidth=0)
            ax.text(
                0.97,
                0.45,
                "GPU lost:\nno samples",
                transform=ax.transAxes,
                ha="right",
                fontsize=8,
                color="0.3",
            )


def _pods_by_gpu(window: Window) -> dict[str, list[str]]:
    pods: dict[str, set[str]] = defaultdict(set)
    for s in window.fetch("max by (gpu, namespace, pod) (gpu_container_allocated)"):
        pods[s.labels["gpu"]].add(f"{s.labels['namespace']}/{s.labels['pod']}")
    return {gpu: sorted(names) for gpu, names in pods.items()}


def plot_util_vs_sm_active(window: Window, events: list[Event], path: Path) -> Path:
    """Per GPU: NVML GPU-Util next to the share of SMs that were active."""
    util = {s.labels["gpu"]: s for s in window.fetch("gpu_utilization_ratio")}
    sm = {s.labels["gpu"]: s for s in window.fetch('gpu_sm_active_ratio{gpu_instance=""}')}
    mig: dict[str, list[Series]] = defaultdict(list)
    for s in window.fetch('gpu_sm_active_ratio{gpu_instance!=""}'):
        mig[s.labels["gpu"]].append(s)
    gpus = sorted({*util, *sm, *mig}, key=int)
    pods = _pods_by_gpu(window)
    cols = 4
    rows = (len(gpus) + cols - 1) // cols
    fig, axes = plt.subplots(
        rows, cols, figsize=(16, 3.6 * rows + 1.3), sharex=True, sharey=True, squeeze=False
    )
    for ax in axes.flat[len(gpus) :]:
        ax.set_visible(False)
    for ax, gpu in zip(axes.flat, gpus, strict=False):
        ax.set_xlim(window.grid[0], window.grid[-1])
        ax.set_ylim(-4, 135)  # a line at 0 % stays visible
        ax.set_yticks(range(0, 101, 25))
        u = window.on_grid(util[gpu]) * 100 if gpu in util else None
        a = window.on_grid(sm[gpu]) * 100 if gpu in sm else None
        if u is not None and a is not None:
            ax.fill_between(
                window.grid,
                a,
                u,
                where=u > a,
                color="tab:red",
                alpha=0.18,
                interpolate=True,
                label="GPU-Util overstates SM activity",
            )
        if u is not None:
            ax.plot(window.grid, u, color="tab:blue", linewidth=2, label="GPU-Util (NVML)")
        if a is not None:
            ax.plot(window.grid, a, color="tab:green", linewidth=2, label="SM active (GPM)")
        for s in sorted(mig.get(gpu, []), key=lambda s: s.labels.get("mig_profile", "")):
            ax.plot(
                window.grid,
                window.on_grid(s) * 100,
                linewidth=2,
                linestyle="--",
                label=f"SM active, MIG {s.labels.get('mig_profile')}",
            )
        if mig.get(gpu):
            ax.legend(fontsize=7, loc="center right")
            if u is None:
                ax.text(0.03, 0.72, "MIG mode: no GPU-Util", transform=ax.transAxes, fontsize=8)
        _mark_events(ax, [e for e in events if gpu in e.gpus])
        names = pods.get(gpu, [])
        who = ", ".join(n.split("/")[1] for n in names[:3]) + (" …" if len(names) > 3 else "")
        ax.set_title(f"GPU {gpu}: {who or 'no pod'}", fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("percent")
    for ax in axes[-1, :]:
        ax.set_xlabel("seconds since the simulation started")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(
        "GPU-Util is not occupancy: NVML GPU-Util (share of time any kernel ran) vs GPM SM "
        "active (share of SMs busy)\nper GPU of the simulated node in the e2e run; "
        "GPU 4 runs tiny kernels: 100 % GPU-Util while 2 % of its SMs work",
        x=0.01,
        ha="left",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_orphaned_memory(window: Window, events: list[Event], path: Path) -> Path:
    """Orphaned memory per GPU and kind, and when GPUOrphanedMemory fired."""
    series = window.fetch("sum by (gpu, kind) (gpu_orphaned_memory_bytes)")
    fired = window.first_time(
        'max by (gpu, kind) (ALERTS{alertname="GPUOrphanedMemory", alertstate="firing"})'
    )
    fig, ax = plt.subplots(figsize=(13, 6))
    ax.set_xlim(window.grid[0], window.grid[-1])
    ax.set_ylim(0, max([float(np.nanmax(s.v)) / GIB for s in series] + [1]) * 1.6)
    for s in sorted(series, key=lambda s: (int(s.labels["gpu"]), s.labels["kind"])):
        gpu, kind = s.labels["gpu"], s.labels["kind"]
        values = window.on_grid(s) / GIB
        colour = KIND_COLOURS.get(kind, "0.3")
        ax.plot(
            window.grid,
            np.nan_to_num(values),
            drawstyle="steps-post",
            linewidth=2.2,
            color=colour,
            label=f"{kind}, GPU {gpu}",
        )
        at = fired.get((("gpu", gpu), ("kind", kind)))
        if at is not None:
            level = float(np.nanmax(values))
            ax.plot([at], [level], marker="v", markersize=10, color=colour, linestyle="none")
            ax.annotate(
                "alert fires",
                (at, level),
                xytext=(6, 5),
                textcoords="offset points",
                fontsize=8,
                color=colour,
            )
    _mark_events(ax, [e for e in events if e.action != "xid" and e.action != "lose"], with_gpu=True)
    ax.set_xlabel("seconds since the simulation started (the scenario's `at:`)")
    ax.set_ylabel("orphaned GPU memory (GiB)")
    ax.set_title(
        "Zombie GPU memory by kind (gpu_orphaned_memory_bytes), e2e run on the simulated node\n"
        "▼ GPUOrphanedMemory fires: first seen + 10 s age + `for: 5s` "
        "(production: 10 min + 5 min)",
        loc="left",
        fontsize=11,
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9, title="kind, GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _shared_gpu(window: Window) -> str | None:
    """The GPU with the most time-sliced replicas allocated."""
    counts = window.fetch(
        'count by (gpu) (max_over_time(gpu_container_allocated{device_id=~".+::.+"}[1h]))'
    )
    if not counts:
        return None
    return max(counts, key=lambda s: float(np.nanmax(s.v))).labels["gpu"]


def plot_time_sliced_gpu(window: Window, events: list[Event], path: Path) -> Path | None:
    """Memory and SM share per pod on the time-sliced GPU."""
    gpu = _shared_gpu(window)
    if gpu is None:
        return None
    selector = f'gpu="{gpu}"'
    memory = window.fetch(f"sum by (pod) (gpu_container_memory_used_bytes{{{selector}}})")
    no_pod = window.fetch(
        f"sum by (owner, reason) (gpu_unattributed_memory_used_bytes{{{selector}}})"
    )
    orphaned = window.fetch(f"sum by (kind) (gpu_orphaned_memory_bytes{{{selector}}})")
    total = window.fetch(f'gpu_memory_used_bytes{{{selector}, gpu_instance=""}}')
    share = window.fetch(f"sum by (pod) (gpu_container_sm_utilization_ratio{{{selector}}})")
    active = window.fetch(f'gpu_sm_active_ratio{{{selector}, gpu_instance=""}}')
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8), sharex=True)
    pods = sorted(memory, key=lambda s: s.labels["pod"])
    layers = [(f"pod {s.labels['pod']}", np.nan_to_num(window.on_grid(s) / GIB)) for s in pods]
    layers += [
        (
            f"no pod: {s.labels['owner']}"
            + (f" ({s.labels['reason']})" if s.labels.get("reason") else ""),
            np.nan_to_num(window.on_grid(s) / GIB),
        )
        for s in no_pod
    ]
    top.stackplot(
        window.grid,
        *[values for _, values in layers],
        labels=[name for name, _ in layers],
        alpha=0.8,
        step="post",
    )
    attributed = sum((values for _, values in layers[: len(pods)]), np.zeros(window.grid.shape))
    for s in orphaned:
        values = np.nan_to_num(window.on_grid(s) / GIB)
        top.fill_between(
            window.grid,
            attributed,
            attributed + values,
            where=values > 0,
            step="post",
            facecolor="none",
            edgecolor="black",
            hatch="//",
            linewidth=0,
            label=f"of which orphaned ({s.labels['kind']})",
        )
    for s in total:
        top.plot(
            window.grid,
            window.on_grid(s) / GIB,
            color="black",
            linewidth=1.5,
            drawstyle="steps-post",
            label="GPU memory used (NVML)",
        )
    top.set_xlim(window.grid[0], window.grid[-1])
    top.set_ylim(0, top.get_ylim()[1] * 1.35)
    top.set_ylabel("GPU memory (GiB)")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    top.grid(alpha=0.3)
    top.set_title(
        f"A time-sliced GPU (GPU {gpu}) shared by {len(pods)} pods: memory and SM share per "
        "pod, e2e run on the simulated node",
        loc="left",
        fontsize=11,
    )
    for s in sorted(share, key=lambda s: s.labels["pod"]):
        bottom.plot(
            window.grid,
            window.on_grid(s) * 100,
            linewidth=2,
            drawstyle="steps-post",
            label=f"pod {s.labels['pod']}: its SM share",
        )
    for s in active:
        bottom.plot(
            window.grid,
            window.on_grid(s) * 100,
            color="black",
            linewidth=1.5,
            linestyle="--",
            label="whole GPU: SM active (GPM)",
        )
    bottom.set_ylim(0, 100)
    bottom.set_ylabel("SM share / SM active (%)")
    bottom.set_xlabel("seconds since the simulation started (the scenario's `at:`)")
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    bottom.grid(alpha=0.3)
    _mark_events(top, [e for e in events if gpu in e.gpus])
    for e in events:
        if gpu in e.gpus:
            bottom.axvline(e.at, color="0.45", linestyle=":", linewidth=1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _hog_gpu(window: Window) -> str | None:
    """The GPU GPUTimeSliceHog fired on, else the shared GPU on which one container took
    the largest share of the SM time."""
    fired = window.fetch('max by (gpu) (ALERTS{alertname="GPUTimeSliceHog", alertstate="firing"})')
    if fired:
        return min(s.labels["gpu"] for s in fired)
    top = window.fetch("max by (gpu) (gpu_container_sm_time_share_ratio)")
    if not top:
        return None
    return max(top, key=lambda s: float(np.nanmax(s.v))).labels["gpu"]


def _fired_at(window: Window, alert: str, gpu: str) -> float | None:
    fired = window.first_time(
        f'max by (gpu) (ALERTS{{alertname="{alert}", alertstate="firing", gpu="{gpu}"}})'
    )
    return min(fired.values(), default=None)


def plot_shared_gpu_hog(window: Window, events: list[Event], path: Path) -> Path | None:
    """On the hogged shared GPU: each container's share of the SM time, and the memory
    headroom against the largest recent growth, with when the two alerts fired."""
    gpu = _hog_gpu(window)
    if gpu is None:
        return None
    selector = f'gpu="{gpu}"'
    share = window.fetch(f"sum by (pod) (gpu_container_sm_time_share_ratio{{{selector}}})")
    active = window.fetch(f"gpu_shared_active_containers{{{selector}}}")
    headroom = window.fetch(f"gpu_shared_memory_headroom_bytes{{{selector}}}")
    growth = window.fetch(f"sum by (pod) (gpu_container_memory_growth_bytes{{{selector}}})")
    used = window.fetch(
        f"sum by (pod) (gpu_container_memory_used_bytes{{{selector}}} and on "
        f"(instance, namespace, pod, container, uuid) gpu_container_memory_limit_bytes)"
    )
    limit = window.fetch(f"sum by (pod) (gpu_container_memory_limit_bytes{{{selector}}})")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8), sharex=True)
    pods = sorted(share, key=lambda s: s.labels["pod"])
    top.stackplot(
        window.grid,
        *[np.nan_to_num(window.on_grid(s) * 100) for s in pods],
        labels=[f"pod {s.labels['pod']}" for s in pods],
        alpha=0.8,
        step="post",
    )
    for s in active:
        n = window.on_grid(s)
        top.plot(
            window.grid,
            100 / n,
            color="black",
            linewidth=1.5,
            linestyle="--",
            drawstyle="steps-post",
            label="an equal share (100 % / containers with work)",
        )
    top.set_xlim(window.grid[0], window.grid[-1])
    top.set_ylim(0, 100)
    top.set_ylabel("share of the SM time used (%)")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    top.grid(alpha=0.3)
    top.set_title(
        f"A hog on shared GPU {gpu}: each pod's share of the turns (gpu_container_sm_time_"
        "share_ratio) and the memory left, e2e run on the simulated node",
        loc="left",
        fontsize=11,
    )
    for s in headroom:
        bottom.plot(
            window.grid,
            window.on_grid(s) / GIB,
            color="black",
            linewidth=2,
            drawstyle="steps-post",
            label="headroom: total - used - reserved",
        )
    for s in sorted(growth, key=lambda s: s.labels["pod"]):
        values = window.on_grid(s) / GIB
        if np.nanmax(values) > 0:
            bottom.plot(
                window.grid,
                values,
                linewidth=1.5,
                linestyle="--",
                drawstyle="steps-post",
                label=f"pod {s.labels['pod']}: growth in the last 5 min",
            )
    for s in used:
        bottom.plot(
            window.grid,
            window.on_grid(s) / GIB,
            linewidth=1.5,
            drawstyle="steps-post",
            label=f"pod {s.labels['pod']}: memory used",
        )
    for s in limit:
        bottom.plot(
            window.grid,
            window.on_grid(s) / GIB,
            linewidth=1.5,
            linestyle=":",
            drawstyle="steps-post",
            label=f"pod {s.labels['pod']}: HAMi limit (promised)",
        )
    bottom.set_ylim(0, bottom.get_ylim()[1] * 1.15)
    bottom.set_ylabel("GiB")
    bottom.set_xlabel("seconds since the simulation started (the scenario's `at:`)")
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    bottom.grid(alpha=0.3)
    for ax, alert in ((top, "GPUTimeSliceHog"), (bottom, "GPUSharedMemoryNearFull")):
        at = _fired_at(window, alert, gpu)
        if at is not None:
            ax.axvline(at, color="tab:red", linewidth=1.5)
            ax.annotate(
                f"{alert} fires",
                xy=(at, 0.5),
                xycoords=ax.get_xaxis_transform(),
                xytext=(4, 0),
                textcoords="offset points",
                fontsize=8,
                color="tab:red",
            )
    _mark_events(bottom, [e for e in events if gpu in e.gpus])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render_all(
    api: PromApi, *, start: float, end: float, t0: float, events: list[Event], out_dir: Path
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    window = Window(api, start, end, t0)
    paths = [
        plot_util_vs_sm_active(window, events, out_dir / FILES["util"]),
        plot_orphaned_memory(window, events, out_dir / FILES["orphans"]),
        plot_time_sliced_gpu(window, events, out_dir / FILES["shared"]),
        plot_shared_gpu_hog(window, events, out_dir / FILES["hog"]),
    ]
    return [p for p in paths if p is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--out", type=Path, required=True, help="directory for the PNGs")
    parser.add_argument("--minutes", type=float, default=5, help="how far back (default 5)")
    parser.add_argument("--scenario", type=Path, help="scenario YAML, for event markers")
    parser.add_argument(
        "--t0",
        type=float,
        help="Unix time at which the simulation started (default: --minutes ago)",
    )
    args = parser.parse_args(argv)
    end = time.time()
    start = end - args.minutes * 60
    t0 = start if args.t0 is None else args.t0
    start = max(start, t0)
    api = PromApi(0)
    api.base = args.prometheus.rstrip("/")
    events = load_events(args.scenario) if args.scenario else []
    for path in render_all(api, start=start, end=end, t0=t0, events=events, out_dir=args.out):
        print(path)


if __name__ == "__main__":
    main()
