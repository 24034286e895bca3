"""The machine a run was measured on, in one place for every report that prints it.

Figures depend on the machine, so every benchmark and the fault matrix's table say where
they ran: ``machine_line()`` is the one sentence they print ("CPU model, N cores, Python
X.Y.Z"), and ``cpu_model()`` / ``cores()`` are its parts for the reports that keep them in
a table of their own. Standard library only, and no import of the other scripts, so that
any of them (and tests/faults/report.py) can import it without a cycle: the scripts here
import each other by bare name (``import machine``), tests/faults/report.py as
``benchmarks.machine``.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_model() -> str:
    """The first "model name" of /proc/cpuinfo, or "unknown CPU" where it has none (arm64
    kernels print no such line) or cannot be read."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return "unknown CPU"
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown CPU"


def cores() -> int | None:
    """Logical CPUs of the machine (``os.cpu_count()``; None where it cannot tell), not the
    ones this process may use: a report states the usable ones beside it where they differ."""
    return os.cpu_count()


def machine_line() -> str:
    """``"<CPU model>, <cores> cores, Python <version>"``: the line every report prints."""
    return f"{cpu_model()}, {cores()} cores, Python {platform.python_version()}"
