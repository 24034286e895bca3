"""Every health transition, logged once: WARNING for a fault, INFO for a recovery.

The words are the Event's (``events.describe``); with ``--log-format json`` the record
also carries the transition's fields (reason, GPU, UUID, XID, pods, ...), so a log
collector can group by them without parsing the message.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from exporter.model import HealthTransition
from exporter.reporting.events import NAME_CHARS, NOTE_CHARS, describe
from exporter.text import one_line

log = logging.getLogger("exporter.health")
# Pods named in one line; the rest are counted (a GPU shared by 48 replicas).
PODS_NAMED = 10


def log_transitions(transitions: Iterable[HealthTransition]) -> None:
    for t in transitions:
        reason, kind, note = describe(t)
        pods = [one_line(f"{p.namespace}/{p.name}", NAME_CHARS) for p in t.pods]
        named = ", ".join(pods[:PODS_NAMED])
        if len(pods) > PODS_NAMED:
            named += f" and {len(pods) - PODS_NAMED} more"
        log.log(
            logging.WARNING if kind == "Warning" else logging.INFO,
            "%s: %s%s",
            reason,
            one_line(note, NOTE_CHARS),
            f" Pods: {named}." if named else "",
            # never held back by the log's repeat filter: a GPU lost, back and lost
            # again within a minute is three lines, each a change
            extra={"fields": fields(t, reason), "once_per_change": True},
        )


def fields(t: HealthTransition, reason: str) -> dict[str, Any]:
    """The transition's facts for a JSON log line (empty ones left out)."""
    out: dict[str, Any] = {
        "reason": reason,
        "gpu": t.gpu,
        "uuid": t.uuid,
        "mig_uuid": t.mig_uuid,
        "xid": t.xid,
        "xid_class": t.xid_class,
        "count": t.count if t.kind in ("fatal_xid", "orphaned_memory") else None,
        "health_reasons": [r.reason for r in t.reasons] or None,
        "memory_bytes": t.memory_bytes,
        "orphan_kind": t.orphan_kind,
        "source": t.source,
        "pods": [f"{p.namespace}/{p.name}" for p in t.pods][:PODS_NAMED] or None,
        "holder_pids": [h.pid for h in t.holders] or None,
        "dead_pids": list(t.dead_pids) or None,
    }
    return {k: v for k, v in out.items() if v is not None}
