"""Which metric families are served: ``--families-disable`` / ``--families-enable``.

A family is selected by its name as served (the ``# TYPE`` line: counters without
``_total``) with shell-style globs (``*``, ``?``, ``[...]``). The order is fixed, whatever
the order of the flags: the defaults (``DEFAULT_OFF`` off, everything else on;
``--per-process-metrics`` turns ``gpu_process_*`` on), then ``--families-disable`` turns
off, then ``--families-enable`` turns on, so enable wins where both match:
``--families-disable '*' --families-enable 'gpu_memory_*'`` serves only memory (and the
exporter's own metrics). The exporter's own ``gpu_exporter_*`` families are always
served: the shipped alerts tell a dead or blind exporter from a quiet GPU by them.

A pattern that selects nothing is refused (a typo must not silently do nothing).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from fnmatch import fnmatchcase

from exporter.exposition.metrics import CATALOGUE, COUNTER

SELF_PREFIX = "gpu_exporter_"
PER_PROCESS = "gpu_process_*"

# Off unless enabled, with the reason. Every family that a shipped alert, recording rule
# or dashboard reads stays ON (tests/test_families.py holds this): the per-pipe
# gpu_fp{64,32,16}_active_ratio, which dcgm-exporter leaves out by default, are read by the
# dcgm-exporter compatibility rules and so stay on (docs/metrics.md, "Choosing families").
DEFAULT_OFF: dict[str, str] = {
    PER_PROCESS: "a pid label: one series per GPU process, new ones with every process",
}

_NAME = re.compile(r"[a-zA-Z0-9_:*?\[\]!-]+")


class FamilySelectionError(ValueError):
    """One line naming the flag and the pattern at fault."""


def selectable() -> list[str]:
    """Families the flags may switch: every catalogued one but the exporter's own."""
    return sorted(name for name in CATALOGUE if not name.startswith(SELF_PREFIX))


def always_served() -> frozenset[str]:
    return frozenset(name for name in CATALOGUE if name.startswith(SELF_PREFIX))


def patterns(text: str) -> list[str]:
    """A comma-separated list of globs; blanks and empty entries are ignored."""
    return [p.strip() for p in text.split(",") if p.strip()]


def matching(pattern: str, names: Iterable[str]) -> set[str]:
    return {name for name in names if fnmatchcase(name, pattern)}


def select_families(
    enable: str = "", disable: str = "", *, per_process: bool = False
) -> frozenset[str]:
    """The names of the families to serve (the exporter's own included)."""
    names = selectable()
    on = set(names)
    for pattern in DEFAULT_OFF:
        on -= matching(pattern, names)
    if per_process:
        on |= matching(PER_PROCESS, names)
    for pattern in patterns(disable):
        on -= _checked(pattern, names, "--families-disable")
    for pattern in patterns(enable):
        on |= _checked(pattern, names, "--families-enable")
    return frozenset(on) | always_served()


DEFAULT_FAMILIES = select_families()


def _checked(pattern: str, names: list[str], flag: str) -> set[str]:
    found = matching(pattern, names)
    if found:
        return found
    where = f"{flag}: {pattern!r}"
    if not _NAME.fullmatch(pattern):
        raise FamilySelectionError(
            f"{where} is not a glob over metric family names (letters, digits, _ and "
            "the wildcards * ? [...]; e.g. 'gpu_fp*')"
        )
    if pattern.startswith(SELF_PREFIX) or matching(pattern, always_served()):
        raise FamilySelectionError(
            f"{where} names only the exporter's own metrics ({SELF_PREFIX}*), "
            "which are always served"
        )
    bare = pattern.removesuffix("_total")
    if bare != pattern and any(CATALOGUE[n][0] == COUNTER for n in matching(bare, names)):
        raise FamilySelectionError(
            f"{where} matches no metric family: counters are named without _total (use {bare!r})"
        )
    raise FamilySelectionError(
        f"{where} matches no metric family (names as in docs/metrics.md, e.g. 'gpu_clock_event_*')"
    )
