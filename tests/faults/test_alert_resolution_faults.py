"""The exporter's absence and one incident, through a real Alertmanager: the run of
tests/e2e/test_alertmanager_restart.py (real Prometheus 2.42 and Alertmanager 0.25, the
exporter SIGKILLed under two critical pages), measured as fault-matrix rows.

Before the rules held critical alerts on their last samples, the kill
sent "resolved" for GPUFatalXID 1.6 s and for both GPUUnhealthy 2.6 s after it, only the
warning GPUExporterDown replaced them (7.1 s), and GPU 1's XID 79 paged twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.e2e.test_alertmanager_restart import CRITICAL_PAGES, Run, killed
from tests.faults.conftest import RecordFault
from tests.test_alert_rules import ALERTS, run_promtool

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


_UP = 'up{instance="10.0.0.1:9445",job="gpu-occupancy-exporter",node="n1"}'
_HEALTHY = (
    'gpu_healthy{gpu="0",uuid="GPU-aaaa",instance="10.0.0.1:9445",'
    'job="gpu-occupancy-exporter",node="n1"}'
)


def _firing(at: str, name: str, labels: dict[str, str] | None) -> dict[str, object]:
    exp = [] if labels is None else [{"exp_labels": labels}]
    return {"eval_time": at, "alertname": name, "exp_alerts": exp}


def test_a_crash_looping_exporter_on_a_lost_gpu_pages_critical(
    tmp_path: Path, record_fault: RecordFault
) -> None:
    """promtool on the shipped rules: CrashLoopBackOff (up 0 0 0 0 1 after 3 healthy
    minutes, each scrape that succeeds serving gpu_healthy 0), and the exporter dead one
    minute after serving gpu_healthy 0 (GPUUnhealthy only pending)."""
    gpu = {"severity": "critical", "gpu": "0", "uuid": "GPU-aaaa"}
    target = {"instance": "10.0.0.1:9445", "job": "gpu-occupancy-exporter", "node": "n1"}
    crash = {
        "interval": "1m",
        "input_series": [
            {"series": _UP, "values": "1 1 1" + " 0 0 0 0 1" * 8},
            {"series": _HEALTHY, "values": "1 1 1 stale" + " _ _ _ 0 stale" * 8},
        ],
        "alert_rule_test": [
            _firing("8m", "GPUUnhealthy", None),
            *(_firing(t, "GPUUnhealthy", gpu | target) for t in ("9m", "20m", "40m")),
            _firing("40m", "GPUExporterDown", None),
        ],
    }
    dead = {
        "interval": "1m",
        "input_series": [
            {"series": _UP, "values": "1 1 0x40"},
            {"series": _HEALTHY, "values": "0 0 stale"},
        ],
        "alert_rule_test": [
            _firing("2m", "GPUUnhealthy", gpu | target),
            _firing("20m", "GPUExporterDownDuringCriticalAlert", {"severity": "critical"} | target),
            _firing("20m", "GPUExporterDown", None),
        ],
    }
    runbook = (
        "https://github.com/gpu-occupancy-exporter/gpu-occupancy-exporter/blob/main/"
        "docs/runbooks.md#"
    )
    text = {
        "GPUUnhealthy": {
            "summary": "GPU 0 (GPU-aaaa) on node n1 is unhealthy",
            "description": "GPU 0 (GPU-aaaa) on node n1 is unhealthy:. "
            "It should not receive new work.",
            "runbook_url": runbook + "gpuunhealthy",
        },
        "GPUExporterDownDuringCriticalAlert": {
            "summary": "gpu-occupancy-exporter on node n1 is down during a critical GPU alert",
            "description": "Prometheus has failed to scrape 10.0.0.1:9445 (job "
            "gpu-occupancy-exporter) on node n1 for 5 minutes while a critical alert fired "
            "for it. Nothing has resolved that alert: its GPUs are unmonitored, and what "
            "was wrong is presumably still wrong.",
            "runbook_url": runbook + "gpuexporterdownduringcriticalalert",
        },
    }
    for test in (crash, dead):
        for check in test["alert_rule_test"]:  # type: ignore[union-attr]
            for exp in check["exp_alerts"]:  # type: ignore[index]
                exp["exp_annotations"] = text[check["alertname"]]  # type: ignore[index]
    path = tmp_path / "crashloop.test.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(ALERTS / "gpu-occupancy-exporter.rules.yaml")],
                "evaluation_interval": "1m",
                "tests": [crash, dead],
            }
        ),
        encoding="utf-8",
    )
    result = run_promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout
    record_fault(
        "exporter-crash-looping-on-unhealthy-gpu",
        expected="Served unhealthy evidence pages critical whatever the exporter does next: "
        "held on its last sample while the target is not up, GPUUnhealthy matures across "
        "crash-loop gaps and after the exporter's death; one page, no warning beside it.",
        figure="Crash loop (up 0 0 0 0 1): GPUUnhealthy critical 2 min after the first "
        "served 0 (9m) and still at 40m, no GPUExporterDown. Dead 1 min after the first 0: "
        "GPUUnhealthy critical at 2m, GPUExporterDownDuringCriticalAlert at 20m, no warning. "
        "Before: nothing in 40 min of crash loop; a warning alone, forever, after the death.",
    )
