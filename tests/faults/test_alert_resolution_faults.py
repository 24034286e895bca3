"""The exporter's absence and one incident, through a real Alertmanager: the run of
tests/e2e/test_alertmanager_restart.py (real Prometheus 2.42 and Alertmanager 0.25, the
exporter SIGKILLed under two critical pages), measured as fault-matrix rows.

Before the rules held critical alerts on their last samples (issue 40 item 11), the kill
sent "resolved" for GPUFatalXID 1.6 s and for both GPUUnhealthy 2.6 s after it, only the
warning GPUExporterDown replaced them (7.1 s), and GPU 1's XID 79 paged twice.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_alertmanager_restart import CRITICAL_PAGES, Run, killed
from tests.faults.conftest import RecordFault

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # a real Prometheus and Alertmanager, ~25 s

__all__ = ["killed"]  # the module-scoped run, shared by the two tests below


def test_killing_the_exporter_resolves_no_critical_page_and_pages_as_loud(
    killed: Run, record_fault: RecordFault
) -> None:
    resolved = killed.hook.pages("resolved", killed.killed_at) & CRITICAL_PAGES
    assert not resolved, f"resolved by the exporter's absence: {resolved}{killed.state}"
    assert killed.replaced_at is not None, f"no replacement page{killed.state}"
    assert killed.firing_in_prometheus_when_replaced >= CRITICAL_PAGES, killed.state
    assert killed.hook.severities("GPUExporterDownDuringCriticalAlert") == {"critical"}
    assert not killed.hook.severities("GPUExporterDown"), killed.state
    after_s = killed.replaced_at - killed.killed_at
    record_fault(
        "exporter-killed-during-critical-alert",
        expected="No 'resolved' for a critical alert because the exporter is gone: the "
        "critical alerts hold on their last samples for 15 min, and the critical "
        "GPUExporterDownDuringCriticalAlert replaces them after 5 min (e2e: 15 s, 5 s).",
        figure=f"0 'resolved' for the 2 critical pages; the critical replacement paged "
        f"{after_s:.1f} s after the SIGKILL (e2e scale), both pages still firing in "
        "Prometheus then; no warning GPUExporterDown. Before: 'resolved' for all within "
        "1.6-2.6 s, replaced 7.1 s later by a warning.",
    )


def test_a_fatal_xid_then_a_lost_gpu_pages_once(killed: Run, record_fault: RecordFault) -> None:
    gpu1 = {name for name, gpu in killed.hook.pages("firing") if gpu == "1"}
    assert gpu1 == {"GPUFatalXID"}, f"GPU 1's fatal XID paged as {gpu1}{killed.state}"
    lost = {name for name, gpu in killed.hook.pages("firing") if gpu == "0"}
    assert "GPUUnhealthy" in lost, f"a lost GPU without an XID must still page{killed.state}"
    record_fault(
        "fatal-xid-pages-once",
        expected="One page per incident: GPUFatalXID for a GPU whose unhealthy reasons "
        "include a fatal XID (held while its verdict stands); GPUUnhealthy stays quiet for "
        "it and still pages for a GPU lost without one.",
        figure="GPU 1 (XID 79, then lost): 1 critical page (GPUFatalXID), 0 GPUUnhealthy; "
        "GPU 0 (lost, no XID): GPUUnhealthy paged. Before: 2 pages for GPU 1.",
    )
