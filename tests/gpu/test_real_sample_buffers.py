"""NVML's sample buffers on a real driver, against what the simulator assumes.

The activity counters (docs/metrics.md, "Activity counters") integrate two buffers, and
the simulator models them from documentation and issue reports, not from a measurement
(docs/simulator.md, "Sample buffers"): ``nvmlDeviceGetSamples`` (GPU-Util) holds 1/6 s
samples, about 20 s of them, none for a period with no activity; and
``nvmlDeviceGetProcessUtilization`` returns one entry per process, averaged since
``lastSeenTimeStamp``. Each check prints what the driver returned, so a run records the
facts (docs/validation.md), and fails where the simulator's assumption is wrong.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Any

import pynvml
import pytest

from tests.gpu.conftest import Gpu, requires_gpu, requires_torch

pytestmark = [requires_gpu, pytest.mark.gpu]


def _samples(gpu: Gpu, last_seen_us: int) -> list[tuple[int, int]]:
    try:
        _, samples = pynvml.nvmlDeviceGetSamples(
            gpu.handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, last_seen_us
        )
    except pynvml.NVMLError_NotFound:
        return []
    return [(int(s.timeStamp), int(s.sampleValue.uiVal)) for s in samples]


@requires_torch
def test_gpu_util_buffer_period_history_and_idle_periods(whole_gpu: Gpu, workload: Any) -> None:
    """Under a busy load the buffer holds samples 1/6 to 1 s apart, stamped in epoch µs;
    idle, it holds no sample newer than the last busy one (the simulator's assumption:
    a period with no activity holds no sample)."""
    workload("heavy", "30", uuid=whole_gpu.uuid)
    time.sleep(25.0)
    busy = _samples(whole_gpu, 0)
    steps = sorted(b[0] - a[0] for a, b in itertools.pairwise(busy))
    span_s = (busy[-1][0] - busy[0][0]) / 1e6 if busy else 0.0
    print(f"\nbusy: {len(busy)} samples over {span_s:.1f} s; steps (µs) {steps[:5]}..{steps[-5:]}")
    print(f"values: {Counter(v for _, v in busy).most_common(8)}")
    assert busy and abs(busy[-1][0] / 1e6 - time.time()) < 60  # epoch µs, recent
    assert 160_000 <= steps[len(steps) // 2] <= 1_000_000  # "between 1 s and 1/6 s"
    time.sleep(10.0)  # the load ended at 30 s
    newest = busy[-1][0]
    idle = _samples(whole_gpu, newest)
    print(f"idle, since the last busy sample: {len(idle)} samples, values {idle[:10]}")
    assert all(value == 0 for _, value in idle[-5:])  # whatever is there reads idle


@requires_torch
def test_process_utilization_is_one_entry_per_process_averaged_since_last_seen(
    whole_gpu: Gpu, workload: Any
) -> None:
    """One entry per process for a 5 s window (the simulator's assumption), its value the
    mean over that window; with a window of 0.5 s it is the busy process's share."""
    pid = workload("heavy", "30", uuid=whole_gpu.uuid).pid
    time.sleep(8.0)
    since_us = int((time.time() - 5.0) * 1e6)
    entries = pynvml.nvmlDeviceGetProcessUtilization(whole_gpu.handle, since_us)
    mine = [(int(e.timeStamp), int(e.smUtil)) for e in entries if e.pid == pid]
    print(f"\n5 s window: {len(entries)} entries, {len(mine)} for the workload: {mine[:20]}")
    assert mine
    assert len(mine) == 1, (
        "several entries per process: nvml_samples.process_sm_seconds "
        "handles them (each covers the span since the one before), but the simulator does not"
    )
