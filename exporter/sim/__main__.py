"""``python -m exporter.sim SCENARIO --dir DIR``: a simulated node in its own process.

Serves the node's proc tree, kernel log, kubelet PodResources socket and API stand-in,
describes them in DIR/node.json and runs until SIGTERM or SIGINT. Point an exporter at it
with ``--simulated-node DIR``: only the simulated NVML library is then loaded inside the
exporter, as libnvidia-ml is on a real node, so its CPU and memory figures are its own.
``--cost PROFILE`` makes that library spend each NVML call's CPU as on that hardware, in
every exporter attached (sim/cost_model.py; docs/simulator.md).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path

from exporter.model.vocabulary import (
    SIMULATE_SPEED_MAX,
    SIMULATE_SPEED_MIN,
    SIMULATE_START_MAX_S,
)
from exporter.sim.cost_model import CostProfileError, check_name, known
from exporter.sim.external import serve_until_signalled
from exporter.sim.scenario import SHIPPED, ScenarioError, load_scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m exporter.sim",
        description="Run a simulated GPU node's proc tree, kernel log, kubelet socket and "
        "Kubernetes API stand-in in this process, for an exporter started with "
        "--simulated-node DIR.",
        allow_abbrev=False,  # as the exporter: --di is not --dir
    )
    parser.add_argument(
        "scenario", help=f"a shipped scenario ({', '.join(SHIPPED)}) or a YAML file"
    )
    parser.add_argument(
        "--dir", required=True, type=Path, help="where to write node.json (must exist)"
    )
    parser.add_argument(
        "--kube-api",
        choices=("on", "off"),
        default="on",
        help="serve the Kubernetes API stand-in (default on)",
    )
    parser.add_argument(
        "--simulate-start",
        type=_bounded("--simulate-start", 0.0, SIMULATE_START_MAX_S),
        default=0.0,
        metavar="SECONDS",
        help="start the scenario's clock at this simulated second, the timeline's events "
        "up to it applied at once (default 0)",
    )
    parser.add_argument(
        "--simulate-speed",
        type=_bounded("--simulate-speed", SIMULATE_SPEED_MIN, SIMULATE_SPEED_MAX),
        default=1.0,
        metavar="FACTOR",
        help="simulated seconds per real second (default 1)",
    )
    parser.add_argument(
        "--cost",
        type=_cost_profile,
        default=None,
        metavar="PROFILE",
        help="make every NVML call of each exporter attached to this node spend what it "
        f"costs on that hardware ({known()}; none: Python's cost only); default the "
        "scenario's cost: key (docs/simulator.md)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="sim-node: %(message)s")
    try:
        load_scenario(args.scenario)
    except ScenarioError as exc:
        sys.stderr.write(f"python -m exporter.sim: {exc}\n")
        return 2
    if not args.dir.is_dir():
        sys.stderr.write(f"python -m exporter.sim: --dir {args.dir}: no such directory\n")
        return 2
    scenario = args.scenario if args.scenario in SHIPPED else str(Path(args.scenario).resolve())
    asyncio.run(
        serve_until_signalled(
            scenario,
            args.dir,
            kube_api=args.kube_api == "on",
            start_s=args.simulate_start,
            speed=args.simulate_speed,
            cost=args.cost,
        )
    )
    return 0


def _cost_profile(text: str) -> str:
    """A cost profile's name (or none); argparse turns the error into one line."""
    try:
        return check_name(text, "--cost")
    except CostProfileError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--cost: ")) from None


def _bounded(flag: str, low: float, high: float) -> Callable[[str], float]:
    """A number in ``low..high``; argparse turns the error into one line and exit 2."""

    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text} is not in the range {low:g}..{high:g}")
        return value

    return check


if __name__ == "__main__":
    sys.exit(main())
