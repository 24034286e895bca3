"""Serve the /metrics of many simulated nodes from one process, for benchmarks/fleet.py.

Each node is a copy of a text the real exporter served on a shipped scenario
(benchmarks/fleet.py captures it), with identities of its own: every GPU and MIG UUID
(wherever it appears: ``uuid``, ``mig_uuid``, ``device_id="GPU-…::3"``) becomes a
UUID derived from the node's name, and every pod name gets the node's suffix, so that no
two nodes share a GPU or a pod (as on a real fleet, where aggregations by pod or uuid
must not merge nodes). Namespaces and owners (Deployments) are kept: a team spans nodes.

Each node listens on a port of its own (``127.0.0.1:<port>``), as each exporter pod has an
address of its own: Prometheus then keeps one scrape loop, one connection and one
``instance`` per node, as it does in a cluster.

Values: counters (and histogram buckets, sums and counts) advance at the scenario's
average rate: ``value * (1 + t / CAPTURE_S)``, ``t`` seconds since this server started,
which keeps every counter monotonic and every histogram's buckets cumulative; gauges that
are Unix times (``*_timestamp_seconds``) move with the wall clock; other gauges keep
their captured value (Prometheus stores an unchanged value in about a bit per sample, so
this underestimates chunk memory a little; series, index and label memory, which
dominate, are exact). Templates are split once at start: a scrape formats only the
values that move and joins pre-built pieces, so the server is not what Prometheus waits on
(``/stats`` says how long rendering took).

Usage: ``python benchmarks/fleet_server.py --text A.txt [--text B.txt] --nodes N
--ports-file PORTS.json``; nodes take the texts in turn; PORTS.json ({node: port}) is
written once every port listens. Stop it with SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

from aiohttp import web

# The golden schedule's simulated seconds (tests/golden/record.py: CYCLES x STEP_S): the
# time over which a captured counter grew to its value.
CAPTURE_S = 160.0
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
UUID_RE = re.compile(r"\b(GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
POD_LABELS = frozenset({"pod", "owner_name"})  # owner_name is the pod's own for bare pods
MOVING_TYPES = frozenset({"counter", "histogram", "summary"})
TIMESTAMP_SUFFIX = "_timestamp_seconds"
COUNTER, TIMESTAMP = 0, 1


def node_name(index: int) -> str:
    return f"fleet-{index:04d}"


def identity_uuid(node: str, original: str) -> str:
    """A UUID of the same form, the same for the same (node, original), distinct across nodes."""
    kind = original.split("-", 1)[0]
    return f"{kind}-{uuid.uuid5(uuid.NAMESPACE_URL, f'{node}/{original}')}"


def pod_names(text: str) -> frozenset[str]:
    return frozenset(
        value
        for line in text.splitlines()
        if not line.startswith("#")
        for key, value in LABEL_RE.findall(line)
        if key == "pod" and value
    )


def distinct(text: str, node: str) -> str:
    """The text with this node's identities: UUIDs derived from the node, pods suffixed."""
    pods = pod_names(text)
    suffix = node.rsplit("-", 1)[-1]

    def label(match: re.Match[str]) -> str:
        key, value = match.group(1), match.group(2)
        if key in POD_LABELS and value in pods:
            return f'{key}="{value}-{suffix}"'
        return match.group(0)

    def gpu(match: re.Match[str]) -> str:
        return identity_uuid(node, match.group(0))

    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            line = UUID_RE.sub(gpu, LABEL_RE.sub(label, line))
        lines.append(line)
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Template:
    """A node's text split once: ``pieces[0] v0 pieces[1] v1 … pieces[-1]``, where each
    ``v`` is computed per scrape from ``bases`` and ``kinds`` (COUNTER or TIMESTAMP)."""

    pieces: tuple[str, ...]
    bases: tuple[float, ...]
    kinds: tuple[int, ...]
    reference: float  # the captured last-sample time the timestamps are relative to

    def render(self, elapsed_s: float, now: float) -> bytes:
        factor = 1.0 + elapsed_s / CAPTURE_S
        shift = now - self.reference
        values = [
            repr(b * factor) if k == COUNTER else repr(b + shift)
            for b, k in zip(self.bases, self.kinds, strict=True)
        ]
        return (
            self.pieces[0] + "".join(chain.from_iterable(zip(values, self.pieces[1:], strict=True)))
        ).encode()


def _kind(family_type: str, family: str) -> int | None:
    if family_type in MOVING_TYPES:
        return COUNTER
    if family_type == "gauge" and family.endswith(TIMESTAMP_SUFFIX):
        return TIMESTAMP
    return None


def template(text: str) -> Template:
    """Split a text exposition into the fixed text and the values that move.

    The exporter writes no sample timestamps: a sample line is ``name{labels} value``,
    and label values may hold spaces, so the value is what follows the last space.
    """
    pieces: list[str] = []
    bases: list[float] = []
    kinds: list[int] = []
    fixed: list[str] = []
    family, family_type, reference = "", "", time.time()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, family_type = line.split(" ", 3)
        head, _, value = line.rpartition(" ")
        kind = None if line.startswith("#") else _kind(family_type, family)
        if line.startswith("gpu_exporter_last_sample_timestamp_seconds "):
            reference = float(value)
        if kind is None or not math.isfinite(float(value)) or float(value) == 0.0:
            fixed.append(line + "\n")
            continue
        fixed.append(head + " ")
        pieces.append("".join(fixed))
        fixed = ["\n"]
        bases.append(float(value))
        kinds.append(kind)
    pieces.append("".join(fixed))
    return Template(tuple(pieces), tuple(bases), tuple(kinds), reference)


@dataclass
class Stats:
    scrapes: int = 0
    render_s: float = 0.0
    bytes: int = 0


def build_app(
    templates: dict[int, Template], stats: Stats, clock: Callable[[], float]
) -> web.Application:
    """One app on every port: the port a request came in on says which node it is."""
    started = clock()

    async def metrics(request: web.Request) -> web.Response:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        node = templates.get(sockname[1]) if sockname else None
        if node is None:
            raise web.HTTPNotFound(text="no simulated node on this port\n")
        began = time.perf_counter()
        body = node.render(clock() - started, time.time())
        stats.render_s += time.perf_counter() - began
        stats.scrapes += 1
        stats.bytes += len(body)
        return web.Response(body=body, headers={"Content-Type": TEXT_CONTENT_TYPE})

    async def stats_view(request: web.Request) -> web.Response:
        cpu = os.times()
        return web.json_response(
            {
                "scrapes": stats.scrapes,
                "render_s": stats.render_s,
                "bytes": stats.bytes,
                "cpu_s": cpu.user + cpu.system,
                "uptime_s": clock() - started,
            }
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats_view)
    return app


def listening_sockets(count: int) -> list[socket.socket]:
    """Bound and listening before anyone learns the port (no free-port race)."""
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.setblocking(False)
        socks.append(sock)
    return socks


async def serve(texts: list[str], nodes: int, ports_file: Path) -> None:
    socks = listening_sockets(nodes)
    templates: dict[int, Template] = {}
    names: dict[str, int] = {}
    for index, sock in enumerate(socks):
        port = int(sock.getsockname()[1])
        name = node_name(index)
        templates[port] = template(distinct(texts[index % len(texts)], name))
        names[name] = port
    runner = web.AppRunner(build_app(templates, Stats(), time.monotonic), access_log=None)
    await runner.setup()
    for sock in socks:
        await web.SockSite(runner, sock).start()
    tmp = ports_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(names), "utf-8")
    tmp.replace(ports_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--text",
        action="append",
        type=Path,
        required=True,
        help="a captured /metrics text (repeat: nodes take them in turn)",
    )
    parser.add_argument("--nodes", type=int, required=True, help="how many nodes to serve")
    parser.add_argument(
        "--ports-file", type=Path, required=True, help="where to write {node: port} once serving"
    )
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error(f"--nodes {args.nodes}: give at least 1")
    texts = []
    for path in args.text:
        try:
            texts.append(path.read_text("utf-8"))
        except OSError as exc:
            parser.error(f"--text {path}: cannot read it ({exc.strerror}); capture it first")
    asyncio.run(serve(texts, args.nodes, args.ports_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
