"""The ``GPUUnhealthy`` node condition and DRA DeviceTaintRules, through the real client.

Both are opt-in (``--node-condition``, ``--dra-device-taints``); the real exporter runs
on a simulated node (tests/harness.py) and writes to the API stand-in
(exporter/sim/kube_writes.py), which merges node status patches by condition type and
keeps DeviceTaintRules as kube-apiserver 1.35 serves them (resource.k8s.io/v1alpha3).
What is read back is what ``kubectl get node -o yaml`` and ``kubectl get
devicetaintrules`` would show. The faults (NVML down under the condition, a cluster
without the DeviceTaintRule API) are in tests/faults/test_kube_write_faults.py.
"""

from __future__ import annotations

from exporter.reporting.condition import HEARTBEAT_S
from exporter.reporting.device_taints import TAINT_KEY
from tests.exporter_process import usage_error
from tests.harness import simulated_exporter
from tests.kube_writes import (
    CONDITION,
    condition,
    leave_condition,
    leave_true_condition,
    left_rule,
    recovering_gpu,
    rfc3339,
    status_of,
    status_patches,
)

# re-exported: tests/test_kube_writer_lease.py imports it from here
from tests.kube_writes import dra_with_a_reset as dra_with_a_reset
from tests.test_kube_events import api, quiet, step, until, until_equal

# -- the node condition -------------------------------------------------------------


async def test_node_8gpu_condition_turns_true_naming_the_gpus_and_keeps_its_transition() -> None:
    async with simulated_exporter("node-8gpu", argv=["--node-condition"]) as h:
        await until_equal(lambda: status_of(h), ("False", "GPUsHealthy"), "False at start")
        first = condition(h)
        assert first is not None and first["message"] == "all 8 GPUs are healthy"
        while h.clock() < 140:  # GPU 0's driver asks for a reset at 140 s
            latest = await step(h)
        uuid = {g.gpu: g.uuid for g in latest.health}
        await until_equal(lambda: status_of(h), ("True", "GPUUnhealthy"), "True at 140 s")
        at_140 = condition(h)
        assert at_140 is not None
        assert f"GPU 0 ({uuid[0]}): recovery_action" in at_140["message"]
        while h.clock() < 160:  # GPU 7: XID 79 at 150 s, lost at 151 s
            await step(h)
        await until_equal(lambda: status_of(h), ("True", "GPULost"), "GPULost at 160 s")
        lost = condition(h)
        assert lost is not None
        assert lost["message"].startswith("2 of 8 GPUs unhealthy: ")
        assert f"GPU 0 ({uuid[0]})" in lost["message"]
        assert f"GPU 7 ({uuid[7]}): gpu_lost" in lost["message"]
        # True since 140 s: the transition time stays, the heartbeat moves
        assert lost["lastTransitionTime"] == at_140["lastTransitionTime"]
        assert lost["lastTransitionTime"] > first["lastTransitionTime"]
        # the kubelet's conditions are untouched (a strategic merge by type)
        node = api(h).node(h.env.node.scenario.node_name)
        assert node is not None
        kinds = [c["type"] for c in node["status"]["conditions"]]
        assert kinds == ["MemoryPressure", "DiskPressure", "PIDPressure", "Ready", CONDITION]


async def test_a_healthy_node_gets_the_condition_false() -> None:
    async with simulated_exporter("single-gpu", argv=["--node-condition"]) as h:
        await step(h)
        await until_equal(lambda: status_of(h), ("False", "GPUsHealthy"), "False")
        c = condition(h)
        assert c is not None and c["message"] == "all 1 GPUs are healthy"


async def test_no_condition_without_the_flag() -> None:
    async with simulated_exporter(recovering_gpu("sim-plain", 5, 100)) as h:
        latest = await step(h)
        assert not all(g.healthy for g in latest.health)  # something to tell
        await until(lambda: len(api(h).events()) >= 2, "the Events, which are on")
        await quiet(h)
        assert condition(h) is None
        assert status_patches(h) == 0


async def test_the_heartbeat_is_no_more_often_than_heartbeat_s_and_a_change_goes_at_once() -> None:
    """Thirty cycles with nothing new: one PATCH (the first), as the next heartbeat is
    ``HEARTBEAT_S`` (300 s) of the writer's clock away; then a change is patched at
    once, not held for the heartbeat."""
    async with simulated_exporter(
        recovering_gpu("sim-beat", 305, 900), argv=["--node-condition"]
    ) as h:
        await until_equal(lambda: status_patches(h), 1, "the first PATCH")
        for _ in range(30):
            await step(h)
        await quiet(h)
        assert status_patches(h) == 1  # 300 s of simulated time, a few of the writer's
        assert status_of(h) == ("False", "GPUsHealthy")
        await step(h)  # 310 s: GPU 0 wants a reset
        await until_equal(lambda: status_of(h), ("True", "GPUUnhealthy"), "the change")
        assert status_patches(h) == 2
        assert HEARTBEAT_S >= 60  # "every few minutes", as node-problem-detector does


async def test_the_condition_without_events() -> None:
    argv = ["--node-condition", "--kube-events", "off"]
    async with simulated_exporter(recovering_gpu("sim-cond", 5, 100), argv=argv) as h:
        await step(h)
        await until_equal(lambda: status_of(h), ("True", "GPUUnhealthy"), "True")
        await quiet(h)
        assert api(h).events() == []
        assert all("/events" not in w.path for w in api(h).write_log)


# -- DRA DeviceTaintRules -------------------------------------------------------------


async def test_an_unhealthy_dra_gpu_gets_a_device_taint_rule_removed_when_healthy() -> None:
    async with simulated_exporter(dra_with_a_reset(), argv=["--dra-device-taints"]) as h:
        await step(h)
        assert api(h).device_taint_rules() == []  # all healthy
        latest = await step(h)  # 20 s: GPU 0 asks for a reset
        gpu0 = next(g for g in latest.health if g.gpu == 0)
        assert not gpu0.healthy
        await until(lambda: len(api(h).device_taint_rules()) == 1, "the DeviceTaintRule")
        (rule,) = api(h).device_taint_rules()
        assert rule["apiVersion"] == "resource.k8s.io/v1alpha3"  # what Kubernetes 1.35 serves
        assert rule["spec"]["deviceSelector"] == {
            "driver": "gpu.nvidia.com",
            "pool": "sim-dra-node",
            "device": "gpu-2",  # GPU 0 is minor 2: the driver's name for it
        }
        taint = rule["spec"]["taint"]
        assert (taint["key"], taint["value"], taint["effect"]) == (
            TAINT_KEY,
            "recovery_action",
            "None",  # seen, nothing evicted or kept off: the default
        )
        assert gpu0.uuid.lower() in rule["metadata"]["name"]
        assert rule["metadata"]["labels"]["gpu-occupancy-exporter/node"] == "sim-dra-node"
        # the slice publishing that device carries the UUID the rule was made for
        assert h.env.kube_api is not None
        devices = [d for s in h.env.kube_api.resource_slices() for d in s["spec"]["devices"]]
        (gpu2,) = [d for d in devices if d["name"] == "gpu-2"]
        assert gpu2["attributes"]["uuid"]["string"] == gpu0.uuid

        await step(h)
        await step(h)  # 40 s: the reset is done
        await until(lambda: api(h).device_taint_rules() == [], "the rule removed")
        assert h.agent.reporter is not None
        assert h.agent.reporter.write_counts() == {("device_taint_rule", "ok"): 2}


async def test_the_taint_effect_no_schedule_when_configured() -> None:
    argv = ["--dra-device-taints", "--dra-device-taint-effect", "NoSchedule"]
    async with simulated_exporter(dra_with_a_reset(5), argv=argv) as h:
        await step(h)
        await until(lambda: len(api(h).device_taint_rules()) == 1, "the DeviceTaintRule")
        (rule,) = api(h).device_taint_rules()
        assert rule["spec"]["taint"]["effect"] == "NoSchedule"


async def test_no_device_taint_rules_without_the_flag() -> None:
    async with simulated_exporter(dra_with_a_reset(5)) as h:
        await step(h)
        await until(lambda: len(api(h).events()) >= 2, "the Events, which are on")
        await quiet(h)
        assert api(h).device_taint_rules() == []
        assert all("devicetaintrules" not in w.path for w in api(h).write_log)


# -- asked for without the Kubernetes API -------------------------------------------------


def test_condition_or_taints_with_kube_api_off_is_one_line_and_exit_2() -> None:
    for flags in (["--node-condition"], ["--dra-device-taints"]):
        line, stdout = usage_error(*flags, "--kube-api", "off", "--listen", "127.0.0.1:0")
        assert line.startswith("gpu-occupancy-exporter: error: ")
        assert f"{flags[0]} need the Kubernetes API" in line
        assert stdout == ""


# -- what an earlier run left, and evidence that is missing ---------------------------


async def test_a_true_condition_left_by_an_earlier_run_is_kept_for_the_xid_window() -> None:
    """A restarted exporter has no XID history (without --kmsg): its "all healthy" may
    rest on XIDs it never saw, so the earlier run's True stays for --health-xid-window."""
    scenario = recovering_gpu("sim-restart", unhealthy_at=10_000, healthy_at=20_000)
    argv = ["--node-condition", "--health-xid-window", "60"]
    # the hold is a deadline on the writer's monotonic clock: the simulated one here
    async with simulated_exporter(
        scenario, argv=argv, first_cycle=False, writer_on_simulated_clock=True
    ) as h:
        await leave_true_condition(h)
        for _ in range(4):  # 40 s: all healthy, but within the window
            await step(h)
        await quiet(h)
        assert status_of(h) == ("True", "GPUUnhealthy")
        assert status_patches(h) == 0
        await step(h, 30.0)  # 70 s: the window is over
        await until(lambda: status_of(h) == ("False", "GPUsHealthy"), "the condition False")


async def test_a_device_taint_rule_left_by_an_earlier_run_is_kept_for_the_xid_window() -> None:
    scenario = dra_with_a_reset(unhealthy_at=10_000, healthy_at=20_000)
    argv = ["--dra-device-taints", "--health-xid-window", "60"]
    async with simulated_exporter(
        scenario, argv=argv, first_cycle=False, writer_on_simulated_clock=True
    ) as h:
        uuid = next(g.uuid for g in h.env.node.gpus if g.index == 0)
        await left_rule(h, uuid)
        for _ in range(4):
            await step(h)
        await quiet(h)
        assert len(api(h).device_taint_rules()) == 1  # healthy now, but within the window
        await step(h, 30.0)
        await until(lambda: api(h).device_taint_rules() == [], "the rule removed")


async def test_a_rule_stays_while_its_device_is_missing_from_the_resource_slices() -> None:
    """The DRA driver withdrawing its slice (a restart) is no verdict of healthy."""
    async with simulated_exporter(
        dra_with_a_reset(unhealthy_at=15, healthy_at=10_000), argv=["--dra-device-taints"]
    ) as h:
        await step(h)
        await step(h)
        await until(lambda: len(api(h).device_taint_rules()) == 1, "the DeviceTaintRule")
        assert h.env.kube_api is not None
        for s in h.env.kube_api.resource_slices():
            h.env.kube_api.delete_resource_slice(s["metadata"]["name"])
        for _ in range(3):
            await step(h)
        await quiet(h)
        assert len(api(h).device_taint_rules()) == 1


async def test_a_refused_node_condition_does_not_silence_the_events() -> None:
    scenario = recovering_gpu("sim-refused", unhealthy_at=15, healthy_at=10_000)
    async with simulated_exporter(scenario, argv=["--node-condition"]) as h:
        api(h).set_write_fault("forbidden", only="/status")
        for _ in range(3):
            await step(h)
        await until(
            lambda: any(e["reason"] == "GPUUnhealthy" for e in api(h).events()),
            "the GPUUnhealthy Event despite the refused condition",
        )
        assert h.agent.reporter is not None
        counts = h.agent.reporter.event_counts()
        assert not any(result == "dropped" for _, result in counts)
        assert h.agent.reporter.write_counts().get(("node_condition", "failed"), 0) >= 1


async def test_an_earlier_runs_rule_older_than_the_window_goes_at_once_when_healthy() -> None:
    """The hold counts from the rule's creation, not from this run's start: an exporter
    restarted more often than the window still removes a rule once its GPU is healthy."""
    from exporter.reporting.device_taints import TaintRule, rule_body, rule_name

    scenario = dra_with_a_reset(unhealthy_at=10_000, healthy_at=20_000)
    argv = ["--dra-device-taints", "--health-xid-window", "60"]
    async with simulated_exporter(scenario, argv=argv, first_cycle=False) as h:
        uuid = next(g.uuid for g in h.env.node.gpus if g.index == 0)
        rule = TaintRule(
            rule_name("sim-dra-node", uuid), "gpu.nvidia.com", "sim-dra-node", "gpu-2", uuid, "x"
        )
        body = rule_body(rule, "v1alpha3", "sim-dra-node", "None")
        body["metadata"]["creationTimestamp"] = rfc3339(h.env.node.wall_time() - 3600)
        api(h).set_device_taint_rule(body)
        await step(h)
        await until(lambda: api(h).device_taint_rules() == [], "the old rule removed")


async def test_a_taken_rule_name_does_not_hold_up_the_other_gpus_rules() -> None:
    """A rule with our name already there (a listing missed it) is ours: a 409 on its
    create is "exists", and the next GPU's rule is still made."""
    from exporter.reporting.device_taints import TaintRule, rule_body, rule_name

    scenario = dra_with_a_reset(unhealthy_at=15, healthy_at=10_000)
    scenario["timeline"] = [  # type: ignore[index]
        {"at": 15, "set": {"gpu": 0, "recovery_action": 1}},
        {"at": 15, "set": {"gpu": 3, "recovery_action": 1}},
    ]
    async with simulated_exporter(scenario, argv=["--dra-device-taints"], first_cycle=False) as h:
        uuid = next(g.uuid for g in h.env.node.gpus if g.index == 0)
        rule = TaintRule(
            rule_name("sim-dra-node", uuid), "gpu.nvidia.com", "sim-dra-node", "gpu-2", uuid, "x"
        )
        body = rule_body(rule, "v1alpha3", "sim-dra-node", "None")
        body["metadata"]["labels"] = {"someone": "else"}  # not found by our label selector
        api(h).set_device_taint_rule(body)
        await step(h)
        await step(h)
        await until(lambda: len(api(h).device_taint_rules()) == 2, "both GPUs' rules")
        assert h.agent.reporter is not None
        assert h.agent.reporter.write_counts().get(("device_taint_rule", "failed"), 0) == 0


async def test_a_node_condition_time_no_server_would_send_is_no_crash() -> None:
    scenario = recovering_gpu("sim-odd-times", unhealthy_at=10_000, healthy_at=20_000)
    async with simulated_exporter(scenario, argv=["--node-condition"], first_cycle=False) as h:
        leave_condition(
            h,
            {
                "type": CONDITION,
                "status": "False",
                "reason": "GPUsHealthy",
                "message": "",
                "lastHeartbeatTime": "9999-12-31T23:59:59-23:59",
                "lastTransitionTime": "0001-01-01T00:00:00+23:59",
            },
        )
        await step(h)
        await until(lambda: status_patches(h) == 1, "the condition written")
        assert status_of(h) == ("False", "GPUsHealthy")
