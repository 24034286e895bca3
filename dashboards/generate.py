#!/usr/bin/env python3
"""Generate the Grafana dashboards in this folder from their descriptions.

Generated rather than hand-kept so that every panel gets the same datasource variable,
label filters, units and layout, and a change to a selector changes it everywhere.
Edit the modules below, then run ``python dashboards/generate.py``; ``--check`` exits 1
when the committed JSON differs (tests/test_dashboards.py does the same comparison).

One module per dashboard, each holding its panels and queries:

- ``gpu_node_overview.py``  -> gpu-node-overview.json (GPU / Node overview)
- ``gpu_pods.py``           -> gpu-pods.json (GPU / Pods)
- ``gpu_health_orphans.py`` -> gpu-health-orphans.json (GPU / Health and orphaned memory)
- ``gpu_waste.py``          -> gpu-waste.json (GPU / Waste and chargeback)

and what they share:

- ``series_labels.py``      the label filters (job, node, instance, GPU, namespace, pod,
  whole GPU or MIG) and legends
- ``grafana_panels.py``     the panel builders (time series, stat, bar gauge, table,
  state timeline) and the ``${datasource}`` reference
- ``grafana_variables.py``  the template variables
- ``grafana_dashboard.py``  the dashboard around the panels: layout, annotations, links

Conventions: every panel and query uses the ``${datasource}`` variable (no datasource
UIDs); label filters are regexes whose "All" (``.*``) also matches series without the
label (series_labels.py says why).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by path (tests/test_dashboards.py) rather than run
    sys.path.insert(0, str(HERE))  # the modules import each other by name

from gpu_health_orphans import health_orphans  # noqa: E402
from gpu_node_overview import node_overview  # noqa: E402
from gpu_pods import pods  # noqa: E402
from gpu_waste import waste  # noqa: E402
from grafana_panels import Json  # noqa: E402


def build_all() -> dict[str, Json]:
    """File name -> dashboard."""
    return {
        "gpu-node-overview.json": node_overview(),
        "gpu-pods.json": pods(),
        "gpu-health-orphans.json": health_orphans(),
        "gpu-waste.json": waste(),
    }


def render(board: Json) -> str:
    return json.dumps(board, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if a committed dashboard differs from the generated one",
    )
    args = parser.parse_args(argv)
    stale = []
    for name, board in build_all().items():
        path = HERE / name
        text = render(board)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print(
            f"out of date: {', '.join(stale)}; run python dashboards/generate.py", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
