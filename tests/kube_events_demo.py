"""Print what `kubectl` would show of the exporter's Kubernetes writes on a simulated node.

Runs the real exporter in-process on a shipped scenario (``tests.harness``: the real
``kubernetes`` client against the API stand-in), plays its timeline, then reads the
Events and the Node back from the stand-in and prints them the way ``kubectl describe
pod``, ``kubectl get events --field-selector reason=...`` and ``kubectl get node -o yaml``
lay them out. docs/kubernetes-events.md quotes this output; tests/test_kube_events_doc.py
checks that the quoted lines are still produced.

    .venv/bin/python tests/kube_events_demo.py [--scenario node-8gpu] [--until 175]
    .venv/bin/python tests/kube_events_demo.py --dra-taints

``--dra-taints`` plays the shipped ``dra`` scenario with one fault added (a fatal XID 79
on GPU 0 at 10 s) and ``--dra-device-taints``, and prints the DeviceTaintRule written.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import Harness, simulated_exporter

STEP_S = 5.0
SETTLE_S = 10.0  # wall time for the writer thread to send what the last cycles found


def _age(stamp: str | None, now: float) -> str:
    if not stamp:
        return "<unknown>"
    seconds = now - datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    seconds = max(0, round(seconds))  # float error must not cost a second
    return f"{seconds // 60}m{seconds % 60}s" if seconds >= 60 else f"{seconds}s"


def _when(event: dict[str, Any], now: float) -> str:
    age = _age(event.get("eventTime"), now)
    series = event.get("series")
    if series:
        return f"{_age(series.get('lastObservedTime'), now)} (x{series['count']} over {age})"
    return age


def describe_events(events: Sequence[dict[str, Any]], now: float) -> str:
    lines = [
        "Events:",
        "  Type     Reason            Age    From                    Message",
        "  ----     ------            ----   ----                    -------",
    ]
    for e in sorted(events, key=lambda e: e["eventTime"]):
        lines.append(
            f"  {e['type']:<8} {e['reason']:<17} {_when(e, now):<6} "
            f"{e['reportingController']:<23} {e['note']}"
        )
    return "\n".join(lines)


def get_events(events: Sequence[dict[str, Any]], now: float) -> str:
    lines = ["LAST SEEN   TYPE      REASON            OBJECT                 MESSAGE"]
    for e in sorted(events, key=lambda e: e["eventTime"]):
        series = e.get("series") or {}
        seen = _age(series.get("lastObservedTime") or e["eventTime"], now)
        obj = f"{e['regarding']['kind'].lower()}/{e['regarding']['name']}"
        lines.append(f"{seen:<11} {e['type']:<9} {e['reason']:<17} {obj:<22} {e['note']}")
    return "\n".join(lines)


def node_conditions(node: dict[str, Any]) -> str:
    ours = [c for c in node["status"]["conditions"] if c["type"] == "GPUUnhealthy"]
    return yaml.safe_dump({"status": {"conditions": ours}}, sort_keys=False, width=200)


def dra_with_a_fatal_xid() -> dict[str, Any]:
    """The shipped dra scenario, and GPU 0 throwing XID 79 at 10 s."""
    path = Path(__file__).resolve().parents[1] / "exporter" / "sim" / "scenarios" / "dra.yaml"
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data.setdefault("timeline", []).append({"at": 10, "xid": {"gpu": 0, "code": 79}})
    return dict(data)


async def play(
    scenario: str | dict[str, Any], until_s: float, argv: Sequence[str]
) -> dict[str, str]:
    async with simulated_exporter(scenario, argv=argv) as h:
        while h.clock() < until_s:
            await h.advance(STEP_S)
        await _settle(h)
        return report(h)


async def _settle(h: Harness) -> None:
    """Give the writer thread time to send; one more cycle flushes series counts."""
    deadline = time.monotonic() + SETTLE_S
    reporter = h.agent.reporter
    assert reporter is not None, "the exporter wrote nothing: are Events off?"
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        if reporter.settled():
            break


def report(h: Harness) -> dict[str, str]:
    api = h.env.kube_api
    assert api is not None
    now = h.env.node.wall_time()
    writes = api.writes
    node_name = h.env.node.scenario.node_name
    out: dict[str, str] = {}
    regarded = sorted(
        {
            (e["regarding"].get("namespace", ""), e["regarding"]["name"])
            for e in writes.events()
            if e["regarding"]["kind"] == "Pod"
        }
    )
    for namespace, name in regarded:
        out[f"kubectl describe pod -n {namespace} {name}"] = describe_events(
            writes.events_regarding("Pod", namespace, name), now
        )
    for reason in ("GPUFatalXID", "GPUOrphanedMemory"):
        found = writes.events(field_selector=f"reason={reason}")
        if found:
            out[f"kubectl get events -A --field-selector reason={reason}"] = get_events(found, now)
    node_events = writes.events_regarding("Node", "", node_name)
    if node_events:
        out[f"kubectl describe node {node_name}"] = describe_events(node_events, now)
    node = writes.node(node_name)
    if node is not None and any(c["type"] == "GPUUnhealthy" for c in node["status"]["conditions"]):
        out[f"kubectl get node {node_name} -o yaml"] = node_conditions(node)
    rules = writes.device_taint_rules()
    if rules:
        shown = [{k: r[k] for k in ("apiVersion", "kind", "metadata", "spec")} for r in rules]
        for rule in shown:
            rule["metadata"] = {k: rule["metadata"][k] for k in ("name", "labels")}
        out["kubectl get devicetaintrules -o yaml"] = yaml.safe_dump_all(shown, sort_keys=False)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="node-8gpu")
    parser.add_argument("--until", type=float, default=175.0, help="simulated seconds to play")
    parser.add_argument(
        "--dra-taints", action="store_true", help="the dra scenario with a fatal XID on GPU 0"
    )
    args = parser.parse_args(argv)
    if args.dra_taints:
        run = play(dra_with_a_fatal_xid(), 20.0, ["--dra-device-taints"])
    else:
        run = play(args.scenario, args.until, ["--node-condition"])
    results = asyncio.run(run)
    for command, text in results.items():
        print(f"$ {command}\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
