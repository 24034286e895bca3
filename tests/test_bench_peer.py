"""The benchmark's peer (benchmarks/peer.py): nvitop-exporter over the simulated NVML
library of a node process, as ours runs under ``--simulated-node``. Needs the optional
``bench`` extra (CI installs it: ``.[test,bench]``); without it the module is skipped."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

pytest.importorskip("nvitop_exporter")

from benchmarks.peer import peer_available, peer_command
from benchmarks.processes import ExporterProcess, NodeServer, free_port, get
from exporter.sim.scenario import load_scenario

MiB = 1024 * 1024


@pytest.mark.slow
def test_nvitop_exporter_reads_the_simulated_gpus() -> None:
    assert peer_available() is None
    scenario = load_scenario("node-8gpu")
    devices = len(scenario.gpus) + sum(len(gpu.mig) for gpu in scenario.gpus)  # 8 + 3 MIG
    node = NodeServer("node-8gpu", kube_api=False)
    try:
        port = free_port()
        peer = ExporterProcess(
            peer_command(node.dir, port, 0.5),
            port,
            ready_when=lambda body: body.count(b"\ngpu_memory_total_MiB{") == devices,
            name="nvitop-exporter",
        )
        try:
            peer.wait_ready()
            body = get(port).decode()
        finally:
            stderr = peer.stop()
    finally:
        node.stop()

    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    info = samples["nvitop_info"][0].labels
    assert (info["device_count"], info["driver_version"]) == ("8", scenario.driver_version)
    total = {s.labels["uuid"]: s.value for s in samples["gpu_memory_total_MiB"]}
    assert {uuid: total[uuid] for uuid in total if uuid.startswith("GPU-")} == {
        gpu.uuid: gpu.memory_total / MiB for gpu in scenario.gpus
    }
    used = [s.value for s in samples["gpu_memory_used_MiB"] if s.labels["uuid"].startswith("GPU-")]
    assert len(used) == 8 and all(value > 0 for value in used)
    busy = [s.value for s in samples["gpu_utilization_Percentage"] if s.value == s.value]
    assert busy and all(0 <= value <= 100 for value in busy) and max(busy) > 50
    gpu0 = scenario.gpus[0]
    first = {name: samples[name][0].value for name in samples if name.startswith("gpu_")}
    assert first["gpu_power_limit_W"] == gpu0.power_limit_mw / 1000
    assert first["gpu_pcie_tx_throughput_MiBps"] == int(gpu0.pcie_tx_bytes_per_s / 1024) / 1024
    # The simulated pids do not exist on this host: psutil reports them gone, nvitop lists them.
    assert samples["process_gpu_memory_MiB"]
    # Every NVML entry point nvitop needs is in the simulated library (it logs a
    # FunctionNotFound once per missing one).
    assert not [line for line in stderr if "FunctionNotFound" in line]
