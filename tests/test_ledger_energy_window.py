"""The energy split when NVML's energy counter is read in the slow tier.

The counter costs ~3 ms a read on an H200, so it is read every ``--slow-interval`` and
carried in between (``GpuSample.slow_read`` False). The ledger then splits a delta that
spans many cycles: each cycle since the last read weighs in by its own split x power x
step (exporter/analysis/ledger.py, ``EnergyWindow``). Pure tests over hand-built cycles.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from exporter.model import ContainerGpuUsage
from tests.test_ledger import Ledger, alloc, gpu, use

SHARED = [alloc(p, f"GPU-0::{i}", "GPU-0", shared=True) for i, p in enumerate("ab")]


def usage(a: float, b: float) -> list[ContainerGpuUsage]:
    return [use("a", "GPU-0", a), use("b", "GPU-0", b)]


def run(
    cycles: Sequence[tuple[float, float, int, int]], read_every: int, step: float = 1.0
) -> list[dict[str, float]]:
    """Cycles of (a's SM, b's SM, power mW, energy counter mJ); the counter read at the
    first cycle and every ``read_every`` cycles, carried as last read in between. The
    holders' joules after each cycle."""
    ledger, out, read = Ledger(), [], 0
    for n, (a, b, power_mw, energy_mj) in enumerate(cycles):
        fresh = n % read_every == 0
        read = energy_mj if fresh else read
        sample = gpu(0, energy_mj=read, power_milliwatts=power_mw, slow_read=fresh)
        ledger.cycle(SHARED, [sample], usage(a, b), elapsed=0 if n == 0 else step)
        out.append(ledger.joules())
    return out


# a's and b's SM shares change every cycle; 300 W throughout: 300 J a second
STEADY = [(0.1 * (n % 5), 0.4, 300_000, 300_000 * n) for n in range(31)]


def test_a_delta_over_many_cycles_is_split_as_each_cycle_read_would_have_split_it() -> None:
    per_cycle = run(STEADY, read_every=1)
    every_10 = run(STEADY, read_every=10)
    for n in (10, 20, 30):  # at each read, the same joules as reading every cycle
        assert every_10[n] == pytest.approx(per_cycle[n])
    assert sum(every_10[30].values()) == pytest.approx(300.0 * 30)  # the whole delta


def test_cycles_that_only_carry_the_counter_split_nothing() -> None:
    every_10 = run(STEADY, read_every=10)
    assert every_10[1] == every_10[9] == {"a": 0.0, "b": 0.0}  # series exist, nothing split
    assert every_10[10] != every_10[9]


def test_the_bound_on_a_rise_is_the_power_limit_over_the_time_since_the_last_read() -> None:
    """30 s at 600 W with 1 s cycles is 18 kJ: far above what a 700 W GPU draws in one
    1 s step (1.4 kJ at twice the limit), within what it draws in 30 s."""
    cycles = [(0.5, 0.5, 600_000, 600_000 * n) for n in range(31)]
    ledger, read = Ledger(), 0
    for n, (a, b, power_mw, energy_mj) in enumerate(cycles):
        fresh = n % 30 == 0
        read = energy_mj if fresh else read
        sample = gpu(
            0,
            energy_mj=read,
            power_milliwatts=power_mw,
            power_limit_milliwatts=700_000,
            slow_read=fresh,
        )
        ledger.cycle(SHARED, [sample], usage(a, b), elapsed=0 if n == 0 else 1.0)
    assert ledger.joules() == pytest.approx({"a": 9000.0, "b": 9000.0})


def test_each_cycle_weighs_in_by_its_power() -> None:
    """a alone uses the GPU for a cycle at 600 W, then b alone for a cycle at 200 W: of
    the 800 J delta, a had 600 and b 200 (by time alone it would be 400 each)."""
    cycles = [(0.5, 0.5, 400_000, 0), (1.0, 0.0, 600_000, 600_000), (0.0, 1.0, 200_000, 800_000)]
    assert run(cycles, read_every=2)[2] == pytest.approx({"a": 600.0, "b": 200.0})
    # a cycle whose power was not read (a's, carried): the window is split by time
    ledger = Ledger()
    samples = [
        gpu(0, energy_mj=0, power_milliwatts=400_000),
        gpu(0, energy_mj=0, slow_read=False),
        gpu(0, energy_mj=800_000, power_milliwatts=200_000),
    ]
    for n, ((a, b, _, _), sample) in enumerate(zip(cycles, samples, strict=True)):
        ledger.cycle(SHARED, [sample], usage(a, b), elapsed=0 if n == 0 else 1.0)
    assert ledger.joules() == pytest.approx({"a": 400.0, "b": 400.0})


def test_a_gap_inside_a_window_leaves_that_delta_uncounted_and_the_next_one_counted() -> None:
    ledger, read = Ledger(), 0
    for n in range(21):
        fresh = n % 10 == 0
        read = 300_000 * n if fresh else read
        sample = gpu(0, energy_mj=read, power_milliwatts=300_000, slow_read=fresh)
        elapsed = 0 if n == 0 else (120.0 if n == 5 else 1.0)  # a 120 s gap at cycle 5
        ledger.cycle(SHARED, [sample], usage(0.5, 0.5), elapsed=elapsed)
        if n == 10:
            assert ledger.joules() == {"a": 0.0, "b": 0.0}  # nobody saw the gap: not split
    assert ledger.joules() == pytest.approx({"a": 1500.0, "b": 1500.0})  # 10 to 20 s


def test_a_holder_gone_before_the_read_takes_no_part_and_a_newcomer_only_its_own() -> None:
    """b holds the GPU for the first 5 cycles of the window, c for the last 5: at the read
    b has no series; c gets the part of its own cycles, never b's."""
    ledger, read = Ledger(), 0
    c = alloc("c", "GPU-0::1", "GPU-0", shared=True)
    for n in range(11):
        fresh = n % 10 == 0
        read = 300_000 * n if fresh else read
        sample = gpu(0, energy_mj=read, power_milliwatts=300_000, slow_read=fresh)
        held = [SHARED[0], SHARED[1] if n <= 5 else c]
        shares = [use("a", "GPU-0", 0.5), use("b" if n <= 5 else "c", "GPU-0", 0.5)]
        ledger.cycle(held, [sample], shares, elapsed=0 if n == 0 else 1.0)
    assert ledger.joules() == pytest.approx({"a": 1500.0, "c": 750.0})
