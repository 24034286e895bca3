"""End to end: ``rate()`` of every activity counter is the true mean (docs/e2e.md,
"Exactness of the activity counters"; docs/metrics.md, "Activity counters").

The exporter runs on tests/e2e/node-exactness.yaml, a real Prometheus scrapes it with
three jobs, and benchmarks/exactness.py (the same code as the full-scale benchmark)
reads ``rate(x[w])``, ``rate(x[w]) / rate(gpu_activity_sampled_seconds_total[w])`` and
the matching gauge's ``avg_over_time(g[w])`` as range queries over the instants after
the window has filled.

Time-scaled 10x to fit CI: GPU 0 busy 1 s of every 3 s (production: 10 s of 30 s);
``--interval 0.5 --gpm-interval 1 --process-utilization-interval 1``; scrapes every
1.5 s, 3 s and 6 s; ``w`` = 30 s (production's 5m). GPU 1 keeps production's 100 ms
bursts once a second, NOT scaled: GPU-Util's samples come every 1/6 s whatever the scale
(the simulator's period), and 10 ms bursts every 100 ms would put activity in every
sample period, so the sparse buffer of a bursty GPU (most periods idle, no sample) would
go untested; 1 s divides the 30 s window, so the truth is the same. Instants every 0.1 s
over 6 s: a whole number of both duty periods, of the slowest scrape and of two of the
fastest, so their mean covers every phase of the scrapes against the workload.

What is asserted, for every activity counter (the eight GPM ones,
gpu_utilization_seconds_total, gpu_container_sm_seconds_total), both GPUs and each
scrape interval:
- the mean of ``rate(x[w])`` over the instants is within 2 % of the truth (level x busy
  share, from the scenario file);
- every single instant is within ``instant_bound`` (benchmarks/exactness.py): one counter
  window plus one cycle of lag, and a partial duty period, over the span between the
  first and last sample in the range. A single instant at the 1.5 s scrape is NOT held
  to 2 %: with 20 samples in a 30 s range, rate() sees 28.5 s of increase, which is 9.5
  of GPU 0's periods, and the 1 s GPM windows end half a second earlier or later than the
  scrapes in turn; measured up to 3.7 % here, 5.6 % at full scale (docs/e2e.md);
- ``rate(x) / rate(sampled)`` (GPM and GPU-Util) is within 2 % of the truth too;
- except GPU 1's GPU-Util counter, held to one burst in the scrapes' span instead
  (``mean_bound``): it steps once a burst, when the burst's sample reaches the exporter
  (a 1/6 s sample period's end, then the next 0.5 s cycle), so the samples a range
  holds span a whole number of scrape intervals (27 s at the 3 s scrape) holding 27
  bursts, or one more or less as the arrivals drift against the scrape phase (the
  sample period is 167 ms, six of them 1.002 s): 1/27 = 3.7 %, and since that phase
  barely moves over the 6 s of instants, their mean does not average it out (two runs
  on 2026-11-29 read -3.3 % at the 3 s scrape, at two commits; others 0.0 %);
- the GPU-Util gauge's sampled mean aliases on GPU 0 at the scrape intervals that are a
  whole number of its duty period (3 s, 6 s): each sample reads 0 or 99 %, so the mean
  of 10 (5) of them is k x 9.9 % (k x 19.8 %), never within 5 % of 33 %. The other
  gauges' sampled means are recorded, not asserted (they hit the truth for some phases).

Prometheus (`/usr/bin/prometheus`, Debian's package) is needed: without it the run skips
with a one-line reason, or fails in CI (tests/system_tools.py).
"""

from __future__ import annotations

import math

import pytest
import yaml

from benchmarks.exactness import (
    BOUND,
    CONTAINER,
    COUNTERS,
    SCENARIO,
    UTILIZATION,
    Run,
    Scale,
    duty_of,
    execute,
    markdown,
    scaled_scenario,
    truths,
)
from tests.system_tools import require_tool

SPEEDUP = 10
SCALE = Scale.of(SPEEDUP)
ALIASING_MIN = 0.05  # the GPU-Util gauge's sampled mean is at least this far off (see above)


@pytest.fixture(scope="module")
def run() -> Run:
    binary = require_tool("prometheus")
    result = execute(SCALE, binary)
    print(markdown(result), flush=True)
    return result


# --- the inputs (no Prometheus needed) ------------------------------------------------


def test_the_truth_is_level_times_busy_share_from_the_scenario() -> None:
    doc = yaml.safe_load(SCENARIO.read_text(encoding="utf-8"))
    truth = truths(doc)
    assert len(truth) == 2 * len(COUNTERS)  # every counter on both GPUs
    gpu0, gpu1 = doc["gpus"]
    assert truth[("gpu_sm_active_seconds_total", "0")] == pytest.approx(
        gpu0["gpm"]["sm_active"] / 100 / 3
    )
    assert truth[(UTILIZATION, "1")] == pytest.approx(gpu1["utilization_gpu"] / 100 * 0.1)
    (proc,) = doc["pods"][0]["containers"][0]["processes"]
    assert truth[(CONTAINER, "0")] == pytest.approx(proc["sm"] / 100 / 3)
    # 10 s of every 30 s and 100 ms bursts, as the claim says
    assert duty_of(doc, "0") == pytest.approx((30.0, 10.0))
    assert duty_of(doc, "1") == pytest.approx((1.0, 0.1))
    # whole percents per process: no rounding bias from the driver's integer samples
    for pod in doc["pods"]:
        for container in pod["containers"]:
            for p in container["processes"]:
                share = p["sm"] * doc["gpus"][p["gpu"]]["duty"]["busy"]
                assert abs(share - round(share)) < 1e-9


def test_the_scaled_scenario_differs_only_in_the_duty_periods() -> None:
    doc = yaml.safe_load(SCENARIO.read_text(encoding="utf-8"))
    scaled = scaled_scenario(doc, SPEEDUP)
    assert truths(scaled) == truths(doc)
    for before, after in zip(doc["gpus"], scaled["gpus"], strict=True):
        assert {**after, "duty": None} == {**before, "duty": None}
    assert duty_of(scaled, "0") == pytest.approx((3.0, 1.0))  # 10 s of 30 s, 10x faster
    assert duty_of(scaled, "1") == duty_of(doc, "1")  # the bursts as in production
    assert {**scaled, "gpus": None} == {**doc, "gpus": None}
    # the rate window is a whole number of both duty periods (the truth does not depend
    # on where it starts), and the span of the instants of GPU 0's period and the scrapes
    for gpu in ("0", "1"):
        period, _ = duty_of(scaled, gpu)
        for length in (SCALE.window_s, SCALE.eval_span_s):
            assert math.isclose(length / period, round(length / period), abs_tol=1e-9)
    for scrape_s in SCALE.scrapes_s:
        assert math.isclose(SCALE.eval_span_s / scrape_s, round(SCALE.eval_span_s / scrape_s))


# --- against Prometheus ---------------------------------------------------------------


def test_every_counter_is_measured_on_every_instant(run: Run) -> None:
    expected = round(SCALE.eval_span_s / SCALE.eval_step_s)
    assert len(run.rows) == len(SCALE.scrapes_s) * len(COUNTERS) * 2
    short = [(r.job, r.counter, r.gpu, r.instants) for r in run.rows if r.instants != expected]
    assert not short, f"rows without a value at each of the {expected} instants: {short}"


def mean_bound(run: Run, counter: str, gpu: str, scrape_s: float) -> float:
    """2 %, or for a counter that steps once a burst (GPU 1's GPU-Util: its sparse
    sample buffer) one burst more or less in the span the scrapes in a range cover."""
    if (counter, gpu) != (UTILIZATION, "1"):
        return BOUND
    period, _ = duty_of(run.scenario, gpu)
    return max(BOUND, period / (SCALE.window_s - scrape_s))


def test_the_bursty_bound_is_one_burst_in_the_scraped_span(run: Run) -> None:
    assert mean_bound(run, UTILIZATION, "0", 3.0) == BOUND
    assert mean_bound(run, UTILIZATION, "1", 3.0) == pytest.approx(1 / 27)


def test_rate_of_every_counter_is_the_true_mean_within_2_percent(run: Run) -> None:
    off = [
        f"{r.counter} gpu {r.gpu} at {r.scrape_s:g} s: {r.rate_mean:.5f} vs {r.truth:.5f} "
        f"({r.err_mean * 100:+.2f} %)"
        for r in run.rows
        if not abs(r.err_mean) <= mean_bound(run, r.counter, r.gpu, r.scrape_s)
    ]
    assert not off, "\n".join(off)


def test_every_instant_is_within_its_bound(run: Run) -> None:
    off = [
        f"{r.counter} gpu {r.gpu} at {r.scrape_s:g} s: worst instant {r.err_worst * 100:+.2f} % "
        f"> ±{r.instant_bound * 100:.1f} %"
        for r in run.rows
        if not abs(r.err_worst) <= r.instant_bound
    ]
    assert not off, "\n".join(off)


def test_rate_over_sampled_time_is_the_true_mean_within_2_percent(run: Run) -> None:
    rows = [r for r in run.rows if COUNTERS[r.counter][1] is not None]  # not the container
    assert len(rows) == len(SCALE.scrapes_s) * 9 * 2
    off = [
        f"{r.counter} gpu {r.gpu} at {r.scrape_s:g} s: {r.measured_mean:.5f} vs {r.truth:.5f}"
        for r in rows
        if not abs(r.measured_mean / r.truth - 1) <= mean_bound(run, r.counter, r.gpu, r.scrape_s)
    ]
    assert not off, "\n".join(off)


def test_the_gpu_util_gauge_aliases_at_a_multiple_of_the_duty_period(run: Run) -> None:
    period, _ = duty_of(run.scenario, "0")
    checked = 0
    for r in run.rows:
        if r.counter != UTILIZATION or r.gpu != "0":
            continue
        if not math.isclose(r.scrape_s / period, round(r.scrape_s / period)):
            continue
        checked += 1
        assert abs(r.gauge_err) > ALIASING_MIN, (
            f"gpu_utilization_ratio's sampled mean at {r.scrape_s:g} s: {r.gauge_mean:.4f} "
            f"against {r.truth:.4f}"
        )
        assert abs(r.err_mean) <= BOUND  # while the counter beside it is right
    assert checked == 2
