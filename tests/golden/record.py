"""Record the golden copy of what the exporter serves for every shipped scenario.

Each scenario runs the real exporter in-process (``tests.harness.simulated_exporter``),
on a fixed schedule of the manual clock, and its ``/metrics`` text is stored normalised as
``tests/golden/<scenario>.json``::

    {family: {"type": ..., "samples": [[sample_name, {labels}, value], ...]}}

Values that depend on timing or on the machine are left out or made relative (see
``TIMING_FAMILIES``, ``EXCLUDED_LABELS`` and ``TIMESTAMP_SUFFIX``).
``tests/test_golden_output.py`` compares a fresh run with these files.

Re-record after an intended change of the output::

    .venv/bin/python tests/golden/record.py [scenario ...] [--out DIR] [--accept]

Without ``--accept`` nothing is written: each scenario whose served output differs from
its file shows a short unified diff, and the exit status is 1 if any differs (0 if none).
With ``--accept`` the differing files are written (each atomically, so runs side by side
never leave a torn file). Review the diff before accepting it.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make ``tests`` and ``exporter`` importable
    sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

GOLDEN_DIR = Path(__file__).resolve().parent
# A diff longer than this many changed lines per scenario is cut, with a count of the rest.
DIFF_LINES = 40
REQUIRED = ("single-gpu", "node-8gpu", "no-gpu", "orphans", "gke-timesharing", "dra")

# The schedule: the harness's first cycle, then CYCLES cycles STEP_S seconds apart, to
# 160 s: past the end of every shipped timeline (node-8gpu's last event, a lost GPU, is
# at 151 s), with time left for orphan hysteresis and for a holder scan whose result
# arrives a cycle after the one that asked for it.
CYCLES = 32
STEP_S = 5.0
# The NVML slow tier (exporter/sources/nvml_cadence.py) is read at the first cycle (0 s)
# and then, GPU i of N, at i/N of every --slow-interval (the reads are staggered). It
# also holds counters that move every cycle (energy, time under each clock-event reason:
# milliseconds a read on an H200), which a GPU whose last read was earlier serves as of
# that read. The golden compares the values at the slow tier's boundary of every GPU,
# i.e. what every cycle read before the tiers existed; with staggered reads the one
# schedule on which every GPU is at its boundary at the last cycle is a read every cycle:
# --slow-interval = STEP_S (each cycle then reaches every GPU's next grid point). Values
# carried between reads are held by tests/test_nvml_cadence.py and
# tests/test_nvml_cost_tiers.py (docs/metrics.md, "Cadence").
SLOW_INTERVAL_S = STEP_S
assert (CYCLES * STEP_S) % SLOW_INTERVAL_S == 0, "the last cycle is every GPU's slow-tier read"

# Families whose values depend on how fast this machine ran the cycle, or on when a
# background thread last woke (a source's last success; the Kubernetes writer's counts,
# and its lease: taken by the writer's thread on the wall clock, after the capture on a
# loaded machine, where no-gpu read leader 0 and lease "unknown" in one run of five):
# their series (names and labels) are kept, their values are stored as null and not
# compared. The Events themselves are compared by tests/test_kube_events.py.
TIMING_FAMILIES = frozenset(
    {
        "gpu_exporter_sample_duration_seconds",
        "gpu_exporter_source_read_seconds",
        "gpu_exporter_source_last_success_timestamp_seconds",
        "gpu_exporter_events",
        "gpu_exporter_kube_writes",
        "gpu_exporter_kube_writer_leader",
        "gpu_exporter_kube_writer_lease_state",
    }
)
# Series of other families whose values follow a background thread's wall-clock retries:
# the XID listener's failures on a node without NVML (no-gpu) are counted per retry, so
# 1 or 2 by the last cycle depending on the machine's load (a loaded CI run saw 2).
TIMING_SERIES = frozenset({("gpu_exporter_errors", "source", "xid")})
# Labels that name the machine rather than the node being simulated.
EXCLUDED_LABELS = {"gpu_exporter_build_info": frozenset({"python_version"})}
# Wall-clock timestamps: the simulated node's wall clock starts at the real time, so every
# ``*_timestamp_seconds`` value is stored relative to the last sample's (seconds before it,
# rounded to a millisecond); the last sample's own timestamp becomes 0.
TIMESTAMP_SUFFIX = "_timestamp_seconds"
REFERENCE_TIMESTAMP = "gpu_exporter_last_sample_timestamp_seconds"

Value = float | str | None
Golden = dict[str, dict[str, Any]]


def _value(value: float) -> Value:
    """JSON has no NaN/Inf: those are stored as Prometheus spells them."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return value


def normalise(text: str) -> Golden:
    """The text exposition as sorted, comparable JSON data, with the excluded parts gone."""
    families = list(text_string_to_metric_families(text))
    reference = next(
        (f.samples[0].value for f in families if f.name == REFERENCE_TIMESTAMP and f.samples),
        0.0,
    )
    golden: Golden = {}
    for family in families:
        timed_by = {(label, value) for name, label, value in TIMING_SERIES if name == family.name}
        dropped = EXCLUDED_LABELS.get(family.name, frozenset())
        relative = family.name.endswith(TIMESTAMP_SUFFIX)
        rows: list[tuple[str, dict[str, str], Value]] = [
            (
                sample.name,
                {k: v for k, v in sorted(sample.labels.items()) if k not in dropped},
                None
                if family.name in TIMING_FAMILIES or set(sample.labels.items()) & timed_by
                else _value(round(reference - sample.value, 3) if relative else sample.value),
            )
            for sample in family.samples
        ]
        rows.sort(key=lambda s: (s[0], sorted(s[1].items())))
        samples = [list(row) for row in rows]
        golden[family.name] = {"type": family.type, "samples": samples}
    return dict(sorted(golden.items()))


def _pod_watch(agent: Any) -> Any:
    """The agent's pod watcher: ``agent.pod_meta`` before the source registry, else its
    ``kube`` source (this script also records from older commits)."""
    watch = getattr(agent, "pod_meta", None)
    if watch is None and hasattr(agent, "source"):
        watch = agent.source("kube")
    return watch


def _api_pods(h: Any) -> set[tuple[str, bool]]:
    api = h.env.kube_api
    return {
        (p["metadata"]["uid"], p["metadata"].get("deletionTimestamp") is not None)
        for p in (api.pods() if api is not None else ())
    }


def _watched_pods(watch: Any) -> set[tuple[str, bool]]:
    return {(p.uid, p.deletion_timestamp is not None) for p in watch.snapshot().pods}


async def _settle(h: Any, timeout_s: float = 10.0) -> None:
    """Apply the simulator's timeline, then wait until the pod watch has seen it.

    The watch runs in its own thread; without this wait, whether a cycle sees a pod
    deletion made at the same simulated instant is a race (it showed as an idle counter
    that was 10 in one run and 15 in the next).
    """
    await asyncio.to_thread(h.env.sync)
    watch = _pod_watch(h.agent)
    if watch is None or h.env.kube_api is None:
        return
    deadline = time.monotonic() + timeout_s
    while _watched_pods(watch) != _api_pods(h):
        if time.monotonic() > deadline:
            raise AssertionError("pod watch did not catch up with the simulated API")
        await asyncio.sleep(0.01)


async def on_schedule(h: Any) -> AsyncIterator[None]:
    """The fixed schedule on a harness: CYCLES cycles STEP_S apart, each run once the
    timeline is applied and the pod watch has caught up; yields after every cycle."""
    for cycle in range(CYCLES):
        await h.advance(STEP_S, cycle=False)
        await _settle(h)
        if cycle == 1:
            # the refresh the agent asks for when the first cycle finds GPU processes: a
            # leak is judged only on an answer begun after its process was first seen
            # (docs/attribution.md, "Isolation leaks")
            await h.refresh_pod_resources()
        await h.cycle()
        yield


async def served_text(scenario: str) -> str:
    """The /metrics text after the fixed schedule."""
    from tests.harness import simulated_exporter

    async with simulated_exporter(scenario, argv=["--slow-interval", f"{SLOW_INTERVAL_S:g}"]) as h:
        async for _ in on_schedule(h):
            pass
        async with h.session.get(h.url + "/metrics") as response:
            assert response.status == 200, await response.text()
            return await response.text()


def served(scenario: str) -> Golden:
    """Run ``scenario`` on the fixed schedule and return its normalised /metrics."""
    return normalise(asyncio.run(served_text(scenario)))


def path_for(scenario: str, directory: Path = GOLDEN_DIR) -> Path:
    return directory / f"{scenario}.json"


def dump(golden: Golden) -> str:
    """JSON with one sample a line, so that a re-recording diffs readably in git."""
    families = []
    for name, family in golden.items():
        lines = [f"      {json.dumps(s, sort_keys=True)}" for s in family["samples"]]
        samples = "[\n" + ",\n".join(lines) + "\n    ]" if lines else "[]"
        families.append(
            f"  {json.dumps(name)}: {{\n"
            f'    "type": {json.dumps(family["type"])},\n'
            f'    "samples": {samples}\n'
            "  }"
        )
    return "{\n" + ",\n".join(families) + "\n}\n"


def load(path: Path) -> Golden:
    golden: Golden = json.loads(path.read_text(encoding="utf-8"))
    return golden


def diff(old: str | None, new: str, name: str, limit: int = DIFF_LINES) -> list[str]:
    """A unified diff of the recorded text ``old`` (None: no file yet) and the served
    ``new``, cut at ``limit`` changed lines, then a count; empty when they are the same.

    No context and no hunk headers: each sample line names its family, labels and value.
    """
    if old == new:
        return []
    lines = list(
        difflib.unified_diff(
            old.splitlines() if old is not None else [],
            new.splitlines(),
            f"{name} (recorded)" if old is not None else f"{name} (no file yet)",
            f"{name} (served now)",
            n=0,
            lineterm="",
        )
    )
    headers, changed = lines[:2], [line for line in lines[2:] if not line.startswith("@@")]
    removed = sum(1 for line in changed if line.startswith("-"))
    summary = f"{name}: {removed} line(s) removed, {len(changed) - removed} added"
    if len(changed) > limit:
        summary += f"; {len(changed) - limit} more not shown"
    return [*headers, *changed[:limit], summary]


def write_atomic(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` whole or not at all."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    from exporter.sim.scenario import SHIPPED, ScenarioError, load_scenario

    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Exit status: 0 nothing differs (or --accept wrote it), 1 something differs "
        "and was not written, 2 bad arguments.",
    )
    parser.add_argument("scenarios", nargs="*", help=f"default: all of {', '.join(SHIPPED)}")
    parser.add_argument("--out", type=Path, default=GOLDEN_DIR, help="default: %(default)s")
    parser.add_argument(
        "--accept", action="store_true", help="write the files that differ (default: only show)"
    )
    args = parser.parse_args(argv)
    scenarios = args.scenarios or list(SHIPPED)
    for scenario in scenarios:
        try:
            load_scenario(scenario)
        except ScenarioError as exc:
            parser.error(str(exc))
    if not args.out.is_dir():
        parser.error(f"--out {args.out}: not a directory; create it or name another")
    import exporter

    print(f"recording from {Path(exporter.__file__).parent}", file=sys.stderr)
    differing = []
    for scenario in scenarios:
        target = path_for(Path(scenario).stem, args.out)
        new = dump(served(scenario))
        old = target.read_text(encoding="utf-8") if target.is_file() else None
        lines = diff(old, new, str(target))
        if not lines:
            print(f"unchanged {target}", file=sys.stderr)
            continue
        print("\n".join(lines))
        differing.append(target)
        if args.accept:
            write_atomic(target, new)
            print(f"wrote {target}", file=sys.stderr)
    if differing and not args.accept:
        print(
            f"{len(differing)} golden file(s) differ and were not written; if the change "
            "is intended, run again with --accept",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
