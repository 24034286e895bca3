"""What the exporter tells Kubernetes and the log, decided purely: which transitions
become Events on which objects (events.py), the GPUUnhealthy node condition
(condition.py), DRA DeviceTaintRules (device_taints.py) and the health log
(health_log.py). Bodies are checked with the API stand-in's rules, which are
kube-apiserver 1.35's (exporter/sim/kube_rules.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import pytest

from exporter.analysis.health import HealthPolicy, assess
from exporter.logs import JsonFormatter
from exporter.model import (
    Analysis,
    Attribution,
    ContainerRef,
    GpuHealth,
    GpuSample,
    HealthReason,
    HealthTransition,
    NodeSnapshot,
    NvmlSnapshot,
    OrphanHolder,
    PodRef,
    RemappedRows,
    ResourceSliceSnapshot,
    SliceDevice,
)
from exporter.model.vocabulary import TRANSITION_KINDS
from exporter.reporting.condition import (
    GPUS_NAMED,
    HEARTBEAT_S,
    MESSAGE_CHARS,
    NodeCondition,
    SentCondition,
    condition_body,
    condition_due,
    desired_condition,
)
from exporter.reporting.device_taints import (
    TAINT_KEY,
    desired_rules,
    label_selector,
    rule_body,
)
from exporter.reporting.events import EVENT_REASONS, describe, event_intents, node_ref
from exporter.reporting.health_log import PODS_NAMED, log_transitions
from exporter.sim.kube_rules import device_taint_rule_errors

NODE = "node-a"
ECC = HealthReason("uncorrectable_ecc", "unhealthy", "2 since driver load")
LOST = HealthReason("gpu_lost", "unhealthy", "GpuIsLost")
THERMAL = HealthReason("thermal_slowdown", "degraded")
PODS = (PodRef("ml", "train-a", "uid-a"), PodRef("ml", "train-b", "uid-b"))
DRIVER = "gpu.nvidia.com"


def analysis(
    verdicts: Sequence[tuple[int, str, Sequence[HealthReason]]] = (),
    *,
    nvml_ok: bool = True,
    slices: ResourceSliceSnapshot | None = None,
    node: str = NODE,
) -> Analysis:
    return Analysis(
        node=NodeSnapshot(
            node_name=node,
            nvml=NvmlSnapshot(ok=nvml_ok, timestamp=0.0),
            resource_slices=slices,
        ),
        attribution=Attribution(),
        health=tuple(GpuHealth(i, u, tuple(r)) for i, u, r in verdicts),
    )


# -- Events: which transition, which objects -------------------------------------------


def test_a_fatal_xid_is_an_event_on_each_pod_allocated_the_mig_instance() -> None:
    t = HealthTransition(
        "fatal_xid",
        2,
        "GPU-m",
        mig_uuid="MIG-two",
        gpu_instance_id=2,
        xid=79,
        xid_class="fatal",
        count=250,
        pods=PODS,
    )
    intents = event_intents((t,), NODE)
    assert [(i.regarding.kind, i.regarding.name, i.regarding.uid) for i in intents] == [
        ("Pod", "train-a", "uid-a"),
        ("Pod", "train-b", "uid-b"),
    ]
    assert {i.related for i in intents} == {node_ref(NODE)}
    assert {(i.reason, i.type, i.device, i.count) for i in intents} == {
        ("GPUFatalXID", "Warning", "MIG-two", 250)
    }
    note = intents[0].note
    for fact in ("XID 79", "class fatal", "GPU 2", "GPU-m", "MIG-two", "250 times"):
        assert fact in note


@pytest.mark.parametrize(
    ("kind", "reason"), [("gpu_lost", "GPULost"), ("gpu_unhealthy", "GPUUnhealthy")]
)
def test_lost_and_unhealthy_are_events_on_the_pods_and_the_node(kind: str, reason: str) -> None:
    t = HealthTransition(kind, 0, "GPU-a", reasons=(ECC,), pods=PODS, detail="GpuIsLost")  # type: ignore[arg-type]
    intents = event_intents((t,), NODE)
    assert [i.regarding.kind for i in intents] == ["Pod", "Pod", "Node"]
    assert intents[-1].related is None
    assert {(i.reason, i.type, i.device) for i in intents} == {(reason, "Warning", "GPU-a")}


def test_the_unhealthy_note_names_the_verdicts_reasons() -> None:
    t = HealthTransition("gpu_unhealthy", 1, "GPU-b", reasons=(ECC, LOST))
    _, _, note = describe(t)
    assert "uncorrectable_ecc (2 since driver load)" in note and "gpu_lost" in note
    assert "GPU 1 (GPU-b)" in note


def test_healthy_again_is_a_normal_event_on_the_node_only() -> None:
    (i,) = event_intents((HealthTransition("gpu_healthy", 0, "GPU-a", pods=PODS),), NODE)
    assert (i.regarding, i.reason, i.type) == (node_ref(NODE), "GPUHealthy", "Normal")


def test_an_isolation_leak_is_an_event_on_the_leaking_pod() -> None:
    t = HealthTransition(
        "isolation_leak",
        0,
        "GPU-a",
        pods=(PODS[0],),
        container=ContainerRef("ml", "train-a", "worker"),
        memory_bytes=3 * 2**30,
    )
    (i,) = event_intents((t,), NODE)
    assert (i.regarding.name, i.reason, i.related) == (
        "train-a",
        "GPUIsolationLeak",
        node_ref(NODE),
    )
    assert "container worker" in i.note and "3.0 GiB" in i.note


def test_orphaned_memory_is_one_occurrence_on_the_node_naming_its_holders() -> None:
    holder = OrphanHolder(0, "GPU-a", 4242, "ml", "gone", "main", "python", "holder")
    t = HealthTransition(
        "orphaned_memory",
        0,
        "GPU-a",
        count=3,  # processes behind it, not occurrences
        memory_bytes=2**30,
        orphan_kind="dead_process",
        holders=(holder,),
    )
    (i,) = event_intents((t,), NODE)
    assert (i.regarding, i.reason, i.count) == (node_ref(NODE), "GPUOrphanedMemory", 1)
    assert "pid 4242 python (pod ml/gone)" in i.note and "1.0 GiB" in i.note


@pytest.mark.parametrize(
    "kind", ["gpu_back", "orphaned_memory_cleared", "source_down", "source_up"]
)
def test_transitions_told_only_in_the_log_make_no_event(kind: str) -> None:
    t = HealthTransition(kind, 0, "GPU-a", pods=PODS, source="kube")  # type: ignore[arg-type]
    assert event_intents((t,), NODE) == ()


def test_every_event_reason_is_listed_and_short() -> None:
    reasons = set()
    for kind in TRANSITION_KINDS:
        for i in event_intents((HealthTransition(kind, 0, "GPU-a", pods=PODS),), NODE):
            reasons.add(i.reason)
    assert reasons == set(EVENT_REASONS)
    assert all(0 < len(r) <= 128 for r in reasons)


# -- the node condition ------------------------------------------------------------------


def test_no_condition_while_nvml_is_down_or_no_gpu_is_listed() -> None:
    assert desired_condition(analysis([(0, "GPU-a", (ECC,))], nvml_ok=False)) is None
    assert desired_condition(analysis([])) is None


def test_the_condition_is_false_when_every_gpu_is_healthy() -> None:
    c = desired_condition(analysis([(0, "GPU-a", ()), (1, "GPU-b", (THERMAL,))]))
    assert c == NodeCondition("False", "GPUsHealthy", "all 2 GPUs are healthy")


def test_the_condition_is_true_naming_unhealthy_gpus_by_index_and_uuid() -> None:
    c = desired_condition(analysis([(0, "GPU-a", ()), (1, "GPU-b", (ECC, THERMAL))]))
    assert c is not None and (c.status, c.reason) == ("True", "GPUUnhealthy")
    assert "GPU 1 (GPU-b): uncorrectable_ecc" in c.message
    assert "GPU-a" not in c.message and "thermal" not in c.message


def test_a_lost_gpu_makes_the_condition_reason_gpulost() -> None:
    c = desired_condition(analysis([(0, "GPU-a", (LOST,)), (1, "GPU-b", (ECC,))]))
    assert c is not None and (c.status, c.reason) == ("True", "GPULost")
    assert "GPU 0 (GPU-a): gpu_lost" in c.message and "GPU 1 (GPU-b)" in c.message


def test_the_condition_message_stays_bounded_with_many_unhealthy_gpus() -> None:
    many = [(i, f"GPU-{i:04d}-" + "f" * 30, (ECC,)) for i in range(64)]
    c = desired_condition(analysis(many))
    assert c is not None and len(c.message) <= MESSAGE_CHARS
    assert c.message.startswith("64 of 64 GPUs unhealthy")
    named = c.message.count("(GPU-")
    assert 0 < named <= GPUS_NAMED
    assert c.message.endswith(f"; and {64 - named} more")  # whole GPUs named, the rest counted
    short = desired_condition(analysis([(i, f"GPU-{i}", (ECC,)) for i in range(20)]))
    assert short is not None and short.message.count("(GPU-") == GPUS_NAMED
    assert short.message.endswith(f"; and {20 - GPUS_NAMED} more")


def test_the_condition_is_due_on_a_change_and_on_the_heartbeat_only() -> None:
    bad = NodeCondition("True", "GPUUnhealthy", "1 of 2 GPUs unhealthy: GPU 1 (GPU-b): x")
    good = NodeCondition("False", "GPUsHealthy", "all 2 GPUs are healthy")
    sent = SentCondition(bad, sent_at=100.0, transition_wall=5.0)
    assert condition_due(bad, None, 0.0)
    assert not condition_due(bad, sent, 100.0 + HEARTBEAT_S - 1)
    assert condition_due(bad, sent, 100.0 + HEARTBEAT_S)
    assert condition_due(good, sent, 101.0)
    assert not condition_due(None, sent, 100.0 + 10 * HEARTBEAT_S)  # unknown: left as is
    assert not condition_due(None, None, 0.0)


def test_the_condition_body_is_node_problem_detector_shaped() -> None:
    bad = NodeCondition("True", "GPULost", "m")
    body = condition_body(bad, transition_wall=1_790_000_000.9, heartbeat_wall=1_790_000_300.2)
    assert body == {
        "type": "GPUUnhealthy",
        "status": "True",
        "reason": "GPULost",
        "message": "m",
        "lastHeartbeatTime": "2026-09-21T14:18:20Z",
        "lastTransitionTime": "2026-09-21T14:13:20Z",
    }


# -- DRA device taints -----------------------------------------------------------------


def device(name: str, uuid: str, driver: str = DRIVER) -> SliceDevice:
    return SliceDevice(driver, "node-a-pool", name, (("index", 0), ("uuid", uuid)))


SLICES = ResourceSliceSnapshot(
    ok=True,
    timestamp=0.0,
    devices=(
        device("gpu-0", "GPU-a"),
        device("gpu-1", "GPU-b"),
        device("other-0", "GPU-a", driver="other.example.com"),
    ),
)


def test_no_desired_taints_when_slices_or_verdicts_are_unknown() -> None:
    bad = [(0, "GPU-a", (ECC,))]
    assert desired_rules(analysis(bad, slices=SLICES, nvml_ok=False), (DRIVER,)) is None
    assert desired_rules(analysis(bad), (DRIVER,)) is None
    down = ResourceSliceSnapshot(ok=False, timestamp=0.0, error="refused")
    assert desired_rules(analysis(bad, slices=down), (DRIVER,)) is None


def test_one_rule_per_unhealthy_gpu_a_configured_driver_publishes() -> None:
    a = analysis([(0, "GPU-a", (THERMAL, ECC)), (1, "GPU-b", (THERMAL,))], slices=SLICES)
    rules = desired_rules(a, (DRIVER,))
    assert rules is not None
    (rule,) = rules
    assert (rule.driver, rule.pool, rule.device, rule.uuid, rule.reason) == (
        DRIVER,
        "node-a-pool",
        "gpu-0",
        "GPU-a",
        "uncorrectable_ecc",
    )
    assert desired_rules(a, ()) == frozenset()


def test_no_rules_when_every_gpu_is_healthy() -> None:
    a = analysis([(0, "GPU-a", ()), (1, "GPU-b", (THERMAL,))], slices=SLICES)
    assert desired_rules(a, (DRIVER,)) == frozenset()


def test_no_rule_for_a_uuid_two_gpus_report_even_when_one_is_unhealthy() -> None:
    """Two GPUs answering with one UUID: no hardware verdict can be pinned on it (the
    slice's device may be either), so neither order of the two makes a rule for it;
    another unhealthy GPU still gets its rule."""
    for twins in (
        [(0, "GPU-a", (ECC,)), (1, "GPU-a", ())],
        [(0, "GPU-a", ()), (1, "GPU-a", (ECC,))],
    ):
        a = analysis([*twins, (2, "GPU-b", (LOST,))], slices=SLICES)
        rules = desired_rules(a, (DRIVER,))
        assert rules is not None
        assert sorted((r.device, r.uuid, r.reason) for r in rules) == [
            ("gpu-1", "GPU-b", "gpu_lost")
        ]


def every_unhealthy_reason() -> list[HealthReason]:
    """Each reason the health verdict can give, from the real assessment."""
    worst = GpuSample(
        index=0,
        uuid="GPU-a",
        error="GpuIsLost",
        lost=True,
        ecc_uncorrected_volatile=2,
        remapped_rows=RemappedRows(0, 3, True, True),
        recovery_action=2,
        retired_pages=100,
    )
    (verdict,) = assess(
        [worst],
        recent_fatal_xids={"GPU-a": [79]},
        dcgm_failures={"GPU-a": ["pcie"]},
        policy=HealthPolicy(),
    )
    return [r for r in verdict.reasons if r.severity == "unhealthy"]


@pytest.mark.parametrize("effect", ["None", "NoSchedule"])
def test_every_rule_body_passes_the_apis_validation(effect: str) -> None:
    reasons = every_unhealthy_reason()
    assert len(reasons) >= 8
    uuid = "GPU-8F3C2A1E-5B6D-4C7E-9F0A-1B2C3D4E5F60"
    slices = ResourceSliceSnapshot(ok=True, timestamp=0.0, devices=(device("gpu-0", uuid),))
    for reason in reasons:
        rules = desired_rules(analysis([(0, uuid, (reason,))], slices=slices), (DRIVER,))
        assert rules is not None
        (rule,) = rules
        body = rule_body(rule, "v1alpha3", NODE, effect)
        assert device_taint_rule_errors(body) == [], (reason, body)
        assert body["spec"]["taint"] == {"key": TAINT_KEY, "value": reason.reason, "effect": effect}
        assert body["spec"]["deviceSelector"] == {
            "driver": DRIVER,
            "pool": "node-a-pool",
            "device": "gpu-0",
        }


def valid_label_value(value: str) -> bool:
    body = {
        "metadata": {"name": "x"},
        "spec": {"taint": {"key": "k", "value": value, "effect": "None"}},
    }
    return device_taint_rule_errors(body) == []  # the same rule as a label value's


def test_the_node_label_is_a_valid_label_value_and_tells_long_node_names_apart() -> None:
    prefix = "gpu-node-" + "x" * 53 + "-"  # 63 characters ending in "-"
    one, two = prefix + "pool-a-0001", prefix + "pool-b-0002"
    selectors = {label_selector(one), label_selector(two)}
    assert len(selectors) == 2  # one node's reconcile never lists (and deletes) the other's
    for node in (one, two, NODE):
        value = label_selector(node).rpartition("=")[2]
        assert valid_label_value(value), value
        rule_labels = rule_body(
            next(
                iter(
                    desired_rules(analysis([(0, "GPU-a", (ECC,))], slices=SLICES), (DRIVER,)) or ()
                )
            ),
            "v1alpha3",
            node,
            "None",
        )["metadata"]["labels"]
        assert value in rule_labels.values()
    assert label_selector(NODE).endswith(f"={NODE}")  # a short name is kept as it is


# -- the health log -----------------------------------------------------------------------


WARNING_KINDS = {
    "gpu_lost",
    "fatal_xid",
    "gpu_unhealthy",
    "isolation_leak",
    "orphaned_memory",
    "source_down",
}


def one_of_each() -> list[HealthTransition]:
    return [
        HealthTransition(
            kind,
            0,
            "GPU-a",
            xid=79 if kind == "fatal_xid" else None,
            xid_class="fatal" if kind == "fatal_xid" else None,
            count=250 if kind == "fatal_xid" else 1,
            reasons=(ECC,) if kind == "gpu_unhealthy" else (),
            pods=PODS if kind != "source_down" else (),
            source="kube" if kind.startswith("source") else None,
        )
        for kind in TRANSITION_KINDS
    ]


def test_each_transition_is_logged_once_warning_for_faults_info_for_recoveries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="exporter.health")
    transitions = one_of_each()
    log_transitions(transitions)
    records = [r for r in caplog.records if r.name == "exporter.health"]
    assert len(records) == len(transitions) == len(TRANSITION_KINDS)
    for t, record in zip(transitions, records, strict=True):
        expected = logging.WARNING if t.kind in WARNING_KINDS else logging.INFO
        assert record.levelno == expected, t.kind
        assert "\n" not in record.getMessage()


def test_the_json_log_line_carries_the_transitions_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.health")
    storm = HealthTransition(
        "fatal_xid",
        2,
        "GPU-m",
        mig_uuid="MIG-two",
        xid=79,
        xid_class="fatal",
        count=250,
        pods=PODS,
    )
    log_transitions([storm])
    (record,) = caplog.records
    line = json.loads(JsonFormatter().format(record))
    assert line["level"] == "warning" and line["logger"] == "exporter.health"
    assert line["message"].startswith("GPUFatalXID: XID 79")
    assert "Pods: ml/train-a, ml/train-b." in line["message"]
    assert {
        k: line[k]
        for k in ("reason", "gpu", "uuid", "mig_uuid", "xid", "xid_class", "count", "pods")
    } == {
        "reason": "GPUFatalXID",
        "gpu": 2,
        "uuid": "GPU-m",
        "mig_uuid": "MIG-two",
        "xid": 79,
        "xid_class": "fatal",
        "count": 250,
        "pods": ["ml/train-a", "ml/train-b"],
    }
    assert "memory_bytes" not in line  # empty fields are left out


def test_a_gpu_shared_by_many_pods_names_ten_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.health")
    pods = tuple(PodRef("ml", f"replica-{i:02d}") for i in range(48))
    log_transitions(
        [HealthTransition("gpu_lost", 0, "GPU-a", pods=pods, detail="GpuIsLost\nforged")]
    )
    (record,) = caplog.records
    message = record.getMessage()
    assert f"and {48 - PODS_NAMED} more" in message and "replica-47" not in message
    assert "\n" not in message
    assert len(record.fields["pods"]) == PODS_NAMED  # type: ignore[attr-defined]


def test_a_flapping_gpu_is_logged_at_every_change_past_the_repeat_filter() -> None:
    """The log's RepeatFilter holds back a repeated warning for 60 s; a transition is a
    change, so lost, back and lost again within a minute are three lines."""
    from exporter.logs import RepeatFilter

    lost = HealthTransition("gpu_lost", 0, "GPU-a", pods=PODS, detail="GpuIsLost")
    back = HealthTransition("gpu_back", 0, "GPU-a")
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler = Keep()
    handler.addFilter(RepeatFilter(clock=lambda: 0.0))  # no time passes at all
    logger = logging.getLogger("exporter.health")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        log_transitions([lost])
        log_transitions([back])
        log_transitions([lost])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [r.getMessage().split(":")[0] for r in seen] == ["GPULost", "GPUBack", "GPULost"]


def test_the_mig_devices_a_driver_publishes_on_an_unhealthy_gpu_are_tainted_too() -> None:
    from dataclasses import replace

    from exporter.model import MigInstance

    mig = MigInstance(0, "MIG-a0", 1, 0, "3g.40gb", None, None)
    slices = ResourceSliceSnapshot(
        ok=True,
        timestamp=0.0,
        devices=(device("gpu-0", "GPU-a"), device("gpu-0-mig-9-1-0", "MIG-a0")),
    )
    a = analysis([(0, "GPU-a", (ECC,))], slices=slices)
    gpus = (GpuSample(index=0, uuid="GPU-a", mig_instances=(mig,)),)
    a = replace(a, node=replace(a.node, nvml=replace(a.node.nvml, gpus=gpus)))
    rules = desired_rules(a, (DRIVER,))
    assert rules is not None
    assert sorted((r.device, r.uuid, r.reason) for r in rules) == [
        ("gpu-0", "GPU-a", "uncorrectable_ecc"),
        ("gpu-0-mig-9-1-0", "MIG-a0", "uncorrectable_ecc"),
    ]


def test_a_gpu_known_unhealthy_that_nvml_stops_listing_keeps_the_condition_true() -> None:
    from dataclasses import replace

    a = analysis([(0, "GPU-b", ()), (1, "GPU-c", ())])
    a = replace(a, unlisted_unhealthy=(("GPU-a", ("fatal_xid",)),))
    desired = desired_condition(a)
    assert desired is not None
    assert (desired.status, desired.reason) == ("True", "GPUUnhealthy")
    assert "1 of 3 GPUs unhealthy: GPU ? (GPU-a): fatal_xid, not listed" in desired.message
