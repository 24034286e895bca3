"""nvitop-exporter, the benchmark's peer, over the same simulated NVML library as ours.

``python benchmarks/peer.py --simulated-node DIR -- <nvitop-exporter args>`` loads the
simulated node's NVML library (``exporter.sim.external.attach``: it sets
``pynvml.nvmlLib`` process-wide, as dlopen would) and then runs nvitop-exporter's own
console-script target, ``nvitop_exporter.cli:main``, in this process. nvitop reaches NVML
only through pynvml, so it reads the simulated GPUs exactly as our exporter under
``--simulated-node DIR`` does, and the two can be compared in the same run.

nvitop-exporter's flags (nvitop_exporter/cli.py, 1.7.2): ``--bind-address`` (default
127.0.0.1), ``--port`` (8000), ``--interval`` seconds (1.0, at least 0.25), ``--hostname``
(the value of the ``hostname`` label on every series; default a routable local IPv4
address), and TLS options. It is installed by the optional ``bench`` extra.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

PEER = "nvitop-exporter"
PEER_VERSION = "1.7.2"
INSTALL_HINT = "pip install -e '.[bench]'"
# The peer's hostname label: an address, like its default, with no routing lookup.
HOSTNAME = "127.0.0.1"


def peer_available() -> str | None:
    """None when the pinned nvitop-exporter can run here, else a one-line reason."""
    try:
        version = metadata.version(PEER)
    except metadata.PackageNotFoundError:
        return f"{PEER} not installed: {INSTALL_HINT}"
    if version != PEER_VERSION:
        return f"{PEER} {version} installed, the benchmark pins {PEER_VERSION}: {INSTALL_HINT}"
    try:
        importlib.import_module("nvitop_exporter.cli")  # untyped: imported by name
    except ImportError as exc:
        return f"{PEER} {version} does not import: {exc}"
    return None


def peer_command(node_dir: Path, port: int, interval_s: float) -> list[str]:
    """The argv that starts nvitop-exporter on 127.0.0.1:``port`` over the simulated node
    another process serves in ``node_dir``, sampling every ``interval_s`` seconds."""
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--simulated-node",
        str(node_dir),
        "--",
        "--bind-address",
        "127.0.0.1",
        "--port",
        str(port),
        "--interval",
        str(interval_s),
        "--hostname",
        HOSTNAME,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="%(prog)s --simulated-node DIR -- [nvitop-exporter args]",
    )
    parser.add_argument("--simulated-node", type=Path, required=True, metavar="DIR")
    parser.add_argument("peer_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    peer_args = args.peer_args[1:] if args.peer_args[:1] == ["--"] else args.peer_args

    reason = peer_available()
    if reason is not None:
        print(f"peer: {reason}", file=sys.stderr)
        return 2

    from exporter.sim.external import attach
    from exporter.sim.scenario import ScenarioError

    try:
        attach(args.simulated_node)
    except ScenarioError as exc:
        print(f"peer: {exc}", file=sys.stderr)
        return 2

    cli = importlib.import_module("nvitop_exporter.cli")
    # nvitop-exporter stops cleanly on KeyboardInterrupt only; let SIGTERM do the same.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.argv = [PEER, *peer_args]  # its argparse reads sys.argv
    return int(cli.main())


if __name__ == "__main__":
    sys.exit(main())
