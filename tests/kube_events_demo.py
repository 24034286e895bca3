"""What a real `kubectl` shows of the exporter's Kubernetes writes on a simulated node.

Runs the real exporter in-process on a shipped scenario (``tests.harness``: the real
``kubernetes`` client against the API stand-in), plays its timeline, then runs Debian's
``kubectl`` against the stand-in (a kubeconfig for its loopback URL, no auth):
``describe pod``, ``get events``, ``describe node``, ``get node -o yaml``,
``get devicetaintrules -o yaml``. docs/kubernetes-events.md quotes this output between
``<!-- kubectl-output:<name> -->`` markers; tests/test_kube_events_doc.py checks that
the quotes are what kubectl prints now (ages and clock stamps normalised), and
``--write-doc`` rewrites them:

    .venv/bin/python tests/kube_events_demo.py              # print what kubectl shows
    .venv/bin/python tests/kube_events_demo.py --write-doc  # and update the doc's quotes

The simulated wall clock is started ``until`` seconds in the past, so that the node's
"now" at the end of the run is about the real now that kubectl and the stand-in date
ages from (kubectl prints ``<invalid>`` for a time in the future).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import Harness, simulated_exporter

STEP_S = 5.0
SETTLE_S = 10.0  # wall time for the writer thread to send what the last cycles found
KUBECTL_TIMEOUT_S = 60.0
DOC = Path(__file__).resolve().parents[1] / "docs" / "kubernetes-events.md"
REGENERATE = ".venv/bin/python tests/kube_events_demo.py --write-doc"


@dataclass(frozen=True)
class Shown:
    """One kubectl run: the command as quoted, what it printed, and the part quoted."""

    name: str  # the doc marker's name
    command: str
    output: str
    quoted: str


def dra_with_a_fatal_xid() -> dict[str, Any]:
    """The shipped dra scenario, and GPU 0 throwing XID 79 at 10 s."""
    path = Path(__file__).resolve().parents[1] / "exporter" / "sim" / "scenarios" / "dra.yaml"
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data.setdefault("timeline", []).append({"at": 10, "xid": {"gpu": 0, "code": 79}})
    return dict(data)


def kubectl_env(kubeconfig: Path, home: Path) -> dict[str, str]:
    """kubectl's environment: this kubeconfig, and its discovery cache (and anything
    else it keeps under $HOME/.kube) in ``home``, not the user's."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "KUBECONFIG": str(kubeconfig),
        "KUBECACHEDIR": str(home / "kube-cache"),
    }


def run_kubectl(kubectl: str, env: dict[str, str], args: Sequence[str]) -> str:
    """kubectl's stdout; AssertionError with its stderr if it failed."""
    done = subprocess.run(
        [kubectl, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=KUBECTL_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done.stdout


def events_section(describe: str) -> str:
    """The ``Events:`` section that ends ``kubectl describe``'s output."""
    start = describe.index("\nEvents:") + 1
    return describe[start:].rstrip("\n")


def condition_item(node_yaml: str, condition: str = "GPUUnhealthy") -> str:
    """The lines of one ``status.conditions`` item of ``kubectl get node -o yaml``."""
    lines = node_yaml.splitlines()
    items: list[list[str]] = []
    inside = False
    for line in lines:
        if line == "  conditions:":
            inside = True
            continue
        if inside and line.startswith("  - "):
            items.append([line])
        elif inside and line.startswith("    ") and items:
            items[-1].append(line)
        elif inside:
            inside = False
    for item in items:
        if any(line.strip() in (f"type: {condition}", f"- type: {condition}") for line in item):
            return "\n".join(["status:", "  conditions:", "  ...", *item])
    raise AssertionError(f"no {condition} condition in:\n{node_yaml}")


async def _settle(h: Harness) -> None:
    """Give the writer thread time to send what the last cycles found."""
    deadline = time.monotonic() + SETTLE_S
    reporter = h.agent.reporter
    assert reporter is not None, "the exporter wrote nothing: are Events off?"
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        if reporter.settled():
            break


Commands = Callable[[Harness], list[tuple[str, list[str], Callable[[str], str]]]]


def node_8gpu_commands(h: Harness) -> list[tuple[str, list[str], Callable[[str], str]]]:
    """What docs/kubernetes-events.md shows of node-8gpu: a pod's Events, the fatal
    XIDs across the cluster, the Node's Events and its GPUUnhealthy condition."""
    node = h.env.node.scenario.node_name
    same: Callable[[str], str] = str.rstrip
    return [
        ("describe-pod", ["describe", "pod", "-n", "debug", "leaky-shell"], events_section),
        (
            "get-events",
            ["get", "events", "-A", "--field-selector", "reason=GPUFatalXID"],
            same,
        ),
        ("describe-node", ["describe", "node", node], events_section),
        ("get-node", ["get", "node", node, "-o", "yaml"], condition_item),
    ]


def dra_commands(h: Harness) -> list[tuple[str, list[str], Callable[[str], str]]]:
    """The DeviceTaintRule the dra scenario's fatal XID leads to, by name (a list's
    wrapper differs between kubectl releases: 1.20 adds ``selfLink: ""``)."""
    api = h.env.kube_api
    assert api is not None
    names = [r["metadata"]["name"] for r in api.writes.device_taint_rules()]
    assert len(names) == 1, f"expected one DeviceTaintRule, found {names}"
    args = ["get", "devicetaintrule", names[0], "-o", "yaml"]
    return [("get-devicetaintrules", args, str.rstrip)]


async def play(
    scenario: str | dict[str, Any],
    until_s: float,
    argv: Sequence[str],
    commands: Commands,
    kubectl: str,
) -> list[Shown]:
    """Play ``scenario`` to ``until_s`` with the exporter's ``argv``, then run
    ``commands`` with ``kubectl`` against the stand-in while it still serves."""
    async with simulated_exporter(scenario, argv=argv, first_cycle=False) as h:
        # Simulated time 0 is ``until_s`` before now: the run ends at about the real now.
        h.env.node.epoch -= until_s
        while True:
            # the agent's refresh task would have asked by now: a new GPU container asks
            # for a PodResources snapshot at once, and every 30 s one is taken anyway
            await h.refresh_pod_resources()
            await h.cycle()
            if h.clock() >= until_s:
                break
            await h.advance(STEP_S, cycle=False)
        await _settle(h)
        kubeconfig = h.env.paths.kubeconfig
        assert kubeconfig is not None
        with tempfile.TemporaryDirectory(prefix="kubectl-") as home:
            env = kubectl_env(kubeconfig, Path(home))
            shown = []
            for name, args, quote in commands(h):
                output = await asyncio.to_thread(run_kubectl, kubectl, env, args)
                shown.append(Shown(name, "kubectl " + " ".join(args), output, quote(output)))
        return shown


def play_node_8gpu(kubectl: str) -> list[Shown]:
    return asyncio.run(play("node-8gpu", 175.0, ["--node-condition"], node_8gpu_commands, kubectl))


def play_dra(kubectl: str) -> list[Shown]:
    return asyncio.run(
        play(dra_with_a_fatal_xid(), 20.0, ["--dra-device-taints"], dra_commands, kubectl)
    )


# -- the doc's quotes -------------------------------------------------------------------

# kubectl's ages (duration.HumanDuration, also "5s (x3 over 2m)") and the stamps the
# writers take from a clock: they differ from run to run.
_AGE = re.compile(r"(?<![\w.-])(\d+[smhdy])+(?![\w.-])|<invalid>|<unknown>")
_STAMP = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z")
_UID = re.compile(r"^(\s*uid: ).*$", re.M)
_RESOURCE_VERSION = re.compile(r"^(\s*resourceVersion: ).*$", re.M)


def normalized(text: str) -> list[str]:
    """``text`` with ages, stamps, uids and resourceVersions replaced and every run of
    blanks one space (kubectl pads columns to the widest age), blank lines dropped."""
    text = _STAMP.sub("<time>", text)
    text = _UID.sub(r"\1<uid>", text)
    text = _RESOURCE_VERSION.sub(r"\1<rv>", text)
    text = _AGE.sub("<age>", text)
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def block(shown: Shown) -> str:
    """The fenced block the doc quotes for one run."""
    fence = "```yaml" if shown.name.startswith("get-devicetaintrules") else "```"
    body = shown.quoted if fence == "```yaml" else f"$ {shown.command}\n{shown.quoted}"
    return f"{fence}\n{body}\n```"


_QUOTE = re.compile(
    r"(<!-- kubectl-output:([\w-]+) -->\n)"
    r"((?:(?!<!-- kubectl-output:).)*?)"
    r"(<!-- kubectl-output:end -->)",
    re.S,
)


def quoted_blocks(doc: str) -> dict[str, str]:
    """The doc's quoted blocks by marker name."""
    return {m.group(2): m.group(3).strip("\n") for m in _QUOTE.finditer(doc) if m.group(2) != "end"}


def write_doc(doc: str, shown: Sequence[Shown]) -> str:
    """``doc`` with each quoted block replaced by what kubectl printed now."""
    by_name = {s.name: s for s in shown}
    missing = by_name.keys() - quoted_blocks(doc).keys()
    if missing:
        raise ValueError(f"{DOC.name} has no kubectl-output marker for {sorted(missing)}")

    def replace(m: re.Match[str]) -> str:
        s = by_name.get(m.group(2))
        return m.group(0) if s is None else m.group(1) + block(s) + "\n" + m.group(4)

    return _QUOTE.sub(replace, doc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-doc", action="store_true", help=f"update {DOC.name}'s quotes")
    args = parser.parse_args(argv)
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        print(
            "kubectl not found on PATH (Debian: apt-get install kubernetes-client)", file=sys.stderr
        )
        return 2
    shown = play_node_8gpu(kubectl) + play_dra(kubectl)
    for s in shown:
        print(f"$ {s.command}\n{s.output}")
    if args.write_doc:
        DOC.write_text(write_doc(DOC.read_text(encoding="utf-8"), shown), encoding="utf-8")
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
