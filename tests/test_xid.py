"""XID events: the NVML listener on the simulated library, the kernel-log reader, and the
pure severity table and ledger."""

from __future__ import annotations

import queue
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from exporter.analysis.xid import (
    RECOVERY_ACTIONS,
    XID_DESCRIPTION,
    XID_SEVERITY,
    XidKey,
    XidLedger,
    bus_id_map,
    classify,
    normalize_pci_bus_id,
    recovery_action_name,
)
from exporter.model import GpuSample, XidEvent
from exporter.model.xid_classes import (
    APPLICATION,
    FATAL,
    OVERRIDABLE,
    SEVERITIES,
    UNKNOWN,
    WARNING,
    parse_overrides,
)
from exporter.sim.node import ManualClock, SimNode, monotonic_clock
from exporter.sim.nvml_library import install
from exporter.sim.scenario import parse_scenario
from exporter.sources.kmsg import (
    KmsgReader,
    boot_epoch,
    parse_kmsg_record,
    parse_xid_attribution,
    parse_xid_message,
)
from exporter.sources.xid import (
    INTERRUPT_SIGNAL,
    UNINTERRUPTIBLE_WAIT_TIMEOUT_MS,
    WAIT_TIMEOUT_MS,
    XidListener,
    interrupt_handler_ready,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "xid.md"


def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# ---------------------------------------------------------------------------
# NVML listener on the simulated library
# ---------------------------------------------------------------------------


def sim_node(**root: Any) -> tuple[SimNode, ManualClock]:
    """A 3-GPU node (GPU 2 in MIG mode) with ``root`` merged into the scenario."""
    gpus = root.pop("gpus", [{}, {}, {"mig": [{"profile": "3g.40gb", "gpu_instance_id": 1}]}])
    scenario = parse_scenario({"gpus": gpus, **root}, "xid-test")
    clock = ManualClock()
    node = SimNode(scenario, clock)
    install(node)
    return node, clock


class Listening:
    """A started listener and what it delivered."""

    def __init__(self, **kwargs: Any) -> None:
        self.events: queue.Queue[XidEvent] = queue.Queue()
        self.listener = XidListener(self.events.put, **kwargs)

    def next(self, timeout_s: float = 5.0) -> XidEvent:
        return self.events.get(timeout=timeout_s)


@pytest.fixture
def listen() -> Iterator[Callable[..., Listening]]:
    started: list[Listening] = []

    def make(**kwargs: Any) -> Listening:
        kwargs.setdefault("backoff_initial_s", 0.05)
        kwargs.setdefault("backoff_max_s", 0.2)
        kwargs.setdefault("wait_timeout_ms", 100)
        listening = Listening(**kwargs)
        listening.listener.start()
        started.append(listening)
        return listening

    yield make
    for listening in started:
        listening.listener.stop()


def test_listener_delivers_xids_with_gpu_uuid_and_mig_instance(
    listen: Callable[..., Listening],
) -> None:
    node, clock = sim_node(
        timeline=[
            {
                "at": 60,
                "xid": {"gpu": 2, "code": 31, "gpu_instance_id": 1, "compute_instance_id": 0},
            },
            {"at": 61, "xid": {"gpu": 0, "code": 79}},
        ]
    )
    got = listen(clock=lambda: 1234.5)
    assert eventually(lambda: got.listener.registered == (0, 1, 2))
    clock.advance(60)
    first = got.next()
    assert (first.gpu, first.uuid, first.xid) == (2, node.gpus[2].uuid, 31)
    assert (first.gpu_instance_id, first.compute_instance_id) == (1, 0)
    assert (first.source, first.timestamp, first.pci_bus_id) == ("nvml", 1234.5, None)
    clock.advance(1)
    second = got.next()
    assert (second.gpu, second.uuid, second.xid) == (0, node.gpus[0].uuid, 79)
    # 0xFFFFFFFF ("not a MIG event") becomes None, not a bogus instance id
    assert (second.gpu_instance_id, second.compute_instance_id) == (None, None)
    assert got.listener.errors_total == 0


def test_listener_survives_many_wait_timeouts(listen: Callable[..., Listening]) -> None:
    _, clock = sim_node(timeline=[{"at": 5, "xid": {"gpu": 1, "code": 13}}])
    got = listen(wait_timeout_ms=20)
    assert eventually(lambda: got.listener.registered == (0, 1, 2))
    time.sleep(0.3)  # ~15 timeouts with nothing to deliver
    assert got.events.empty()
    assert got.listener.alive and got.listener.errors_total == 0
    clock.advance(5)
    assert got.next().xid == 13


def test_stop_returns_within_one_wait_timeout(listen: Callable[..., Listening]) -> None:
    sim_node()
    got = listen(wait_timeout_ms=500)
    assert eventually(lambda: got.listener.registered == (0, 1, 2))
    started = time.monotonic()
    got.listener.stop()
    assert time.monotonic() - started < 1.5
    assert not got.listener.alive
    assert got.listener.registered == ()


def test_a_listener_outliving_its_library_leaves_the_next_one_initialised(
    listen: Callable[..., Listening],
) -> None:
    """NVML's init is reference-counted and process-wide: a listener's thread that ends
    after another library was installed (a test's next simulated node) balances its own
    init only, not the new library's. Such a thread's stray shutdown made a later test's
    nvmlShutdown answer Uninitialized in one CI run."""
    sim_node()
    got = listen(wait_timeout_ms=50)
    assert eventually(lambda: got.listener.registered == (0, 1, 2))
    sim_node()  # another library, as the next test installs
    pynvml.nvmlInit()
    try:
        got.listener.stop()
        assert not got.listener.alive
    finally:
        pynvml.nvmlShutdown()  # Uninitialized if the listener's ended the new library's


def test_event_set_error_backs_off_then_recreates_the_set(
    listen: Callable[..., Listening],
) -> None:
    node, clock = sim_node(
        missing_functions=["nvmlEventSetWait_v2"],
        timeline=[{"at": 10, "xid": {"gpu": 1, "code": 48}}],
    )
    got = listen(backoff_initial_s=0.05, backoff_max_s=0.2)
    assert eventually(lambda: got.listener.errors_total >= 2)
    time.sleep(0.5)
    # backing off, not spinning: delays of 0.05, 0.1, 0.2, 0.2 ... allow a handful in 0.5 s
    assert 2 <= got.listener.errors_total <= 10
    assert got.listener.last_error == "FunctionNotFound"
    assert got.listener.alive
    node.scenario.missing_functions.discard("nvmlEventSetWait_v2")  # the driver recovers
    assert eventually(lambda: got.listener.registered == (0, 1, 2))
    clock.advance(10)
    event = got.next()
    assert (event.gpu, event.xid) == (1, 48)
    assert got.listener.last_error is None  # listening again: the source is up


def test_registration_skips_a_gpu_without_event_support(
    listen: Callable[..., Listening],
) -> None:
    _, clock = sim_node(
        gpus=[{}, {"unsupported": ["nvmlDeviceRegisterEvents"]}, {}],
        timeline=[
            {"at": 1, "xid": {"gpu": 1, "code": 79}},
            {"at": 2, "xid": {"gpu": 2, "code": 94}},
        ],
    )
    got = listen()
    assert eventually(lambda: got.listener.registered == (0, 2))
    clock.advance(2)
    event = got.next()
    assert (event.gpu, event.xid) == (2, 94)  # GPU 1's XID was never subscribed
    assert got.events.empty()
    assert got.listener.errors_total == 0  # unsupported is not an error


def test_gpu_lost_at_registration_is_skipped_and_picked_up_after_rebuild(
    listen: Callable[..., Listening],
) -> None:
    node, _ = sim_node(gpus=[{"lost": True}, {}, {}])
    got = listen(rebuild_after_lost_s=0.2)
    assert eventually(lambda: got.listener.registered == (1, 2))
    assert got.listener.errors_total >= 1
    # the other GPUs are listened to, so the lost one does not mark the source down
    assert eventually(lambda: got.listener.last_error is None)
    node.gpus[0].lost = False  # the GPU was reset and answers again
    assert eventually(lambda: got.listener.registered == (0, 1, 2))


def test_xid79_from_a_gpu_that_no_longer_answers_is_still_attributed(
    listen: Callable[..., Listening],
) -> None:
    node, clock = sim_node(
        timeline=[{"at": 3, "xid": {"gpu": 1, "code": 79}}, {"at": 3, "lose": 1}]
    )
    got = listen()
    assert eventually(lambda: got.listener.registered == (0, 1, 2))
    clock.advance(3)
    event = got.next()
    # nvmlDeviceGetUUID(event.device) answers GpuIsLost; the handle still names GPU 1
    assert (event.gpu, event.uuid, event.xid) == (1, node.gpus[1].uuid, 79)


def test_nvml_init_failure_is_retried_with_backoff(listen: Callable[..., Listening]) -> None:
    node, _ = sim_node(nvml_init_error="DRIVER_NOT_LOADED")
    got = listen()
    assert eventually(lambda: got.listener.errors_total >= 2)
    assert got.listener.registered == () and got.listener.last_error == "DriverNotLoaded"
    node.scenario.nvml_init_error = None  # the driver finished loading
    assert eventually(lambda: got.listener.registered == (0, 1, 2))


def test_a_failing_callback_does_not_stop_the_listener() -> None:
    _, clock = sim_node(
        timeline=[
            {"at": 1, "xid": {"gpu": 0, "code": 13}},
            {"at": 2, "xid": {"gpu": 0, "code": 31}},
        ]
    )
    seen: list[int] = []

    def consumer(event: XidEvent) -> None:
        seen.append(event.xid)
        if event.xid == 13:
            raise RuntimeError("event loop is closed")

    listener = XidListener(consumer, wait_timeout_ms=50)
    listener.start()
    try:
        assert eventually(lambda: listener.registered == (0, 1, 2))
        clock.advance(1)
        assert eventually(lambda: seen == [13])
        clock.advance(1)
        assert eventually(lambda: seen == [13, 31])
        assert listener.alive and listener.errors_total == 1
    finally:
        listener.stop()


def test_a_double_bit_ecc_error_arrives_as_xid_48(listen: Callable[..., Listening]) -> None:
    _, clock = sim_node(timeline=[{"at": 1, "xid": {"gpu": 2, "code": 48}}])
    got = listen()
    assert eventually(lambda: got.listener.registered == (0, 1, 2))
    clock.advance(1)
    assert got.next().xid == 48


# ---------------------------------------------------------------------------
# Kernel log parsing
# ---------------------------------------------------------------------------

KMSG_RECORDS = [
    # (record, expected (seq, seconds since boot, message) or None)
    (
        "4,1227,437812449,c;NVRM: Xid (PCI:0000:01:00): 43, pid=1814139, name=cuda_assert_64b, "
        "Ch 00000018",
        (
            1227,
            437.812449,
            "NVRM: Xid (PCI:0000:01:00): 43, pid=1814139, name=cuda_assert_64b, Ch 00000018",
        ),
    ),
    ("4,1227,437812449,c,1,-;NVRM: hello", (1227, 437.812449, "NVRM: hello")),
    ("6,2,0,-;Linux version 6.8.0\n", (2, 0.0, "Linux version 6.8.0")),
    (" SUBSYSTEM=pci", None),  # dictionary continuation line
    (" DEVICE=+pci:0000:3b:00.0", None),
    ("", None),
    ("rubbish", None),
    ("4,x,1,-;text", None),
    ("[ 5107.644336] NVRM: Xid (PCI:0000:03:00): 79, GPU has fallen off the bus.", None),
]


@pytest.mark.parametrize(("line", "expected"), KMSG_RECORDS)
def test_parse_kmsg_record(line: str, expected: tuple[int, float, str] | None) -> None:
    assert parse_kmsg_record(line) == expected


XID_MESSAGES = [
    # (message, (pci, xid, detail) or None, (gi, ci))
    (
        "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off "
        "the bus.",
        ("0000:3b:00", 79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus."),
        (None, None),
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",  # before pid= was added
        ("0000:3b:00", 79, "GPU has fallen off the bus."),
        (None, None),
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 43, pid=1234, name=python, Ch 00000008",
        ("0000:3b:00", 43, "pid=1234, name=python, Ch 00000008"),
        (None, None),
    ),
    (
        "NVRM: Xid (PCI:0000:b7:00 GPU-I:05 GPU-CI:01): 31, pid=4242, name=python3, "
        "channel 0x0000000a, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC1 faulted @ "
        "0x7f_ed000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
        (
            "0000:b7:00",
            31,
            "pid=4242, name=python3, channel 0x0000000a, intr 00000000. MMU Fault: ENGINE "
            "GRAPHICS GPC1 faulted @ 0x7f_ed000000. Fault is of type FAULT_PDE "
            "ACCESS_TYPE_VIRT_READ",
        ),
        (5, 1),
    ),
    (
        "NVRM: Xid (PCI:0000:b7:00 GPU-I:02): 43, pid=77, name=python, Ch 00000010",
        ("0000:b7:00", 43, "pid=77, name=python, Ch 00000010"),
        (2, None),
    ),
    (
        "NVRM: Xid (PCI:0000:00:16): 119, pid=36055, name=dcgm-exporter, Timeout after 6s of "
        "waiting for RPC response from GPU0 GSP!",
        (
            "0000:00:16",
            119,
            "pid=36055, name=dcgm-exporter, Timeout after 6s of waiting for RPC response from "
            "GPU0 GSP!",
        ),
        (None, None),
    ),
    (
        "NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 "
        "(GPU Reset Required)",
        (
            "0008:01:00",
            154,
            "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
        ),
        (None, None),
    ),
    (
        "NVRM: Xid (0000:03:00): 14, Channel 00000001",
        ("0000:03:00", 14, "Channel 00000001"),
        (None, None),
    ),
    ("NVRM: Xid (PCI:0000:3b:00): 79", ("0000:3b:00", 79, ""), (None, None)),
    ("NVRM: Xid PCI:0000:01:00: 43, pid=1814139, name=x, Ch 00000018", None, (None, None)),
    ("NVRM: Xid (PCI:0000:66:00): abc, pid=2280636", None, (None, None)),
    ("NVRM: Xid : 32, pid=2280636", None, (None, None)),
    ("NVRM: GPU at PCI:0000:01:00: GPU-aeab3757-56a6-7e30-3f7c-1f322454bde2", None, (None, None)),
    ("NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.", None, (None, None)),
    ("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32", None, (None, None)),
]


@pytest.mark.parametrize(("message", "expected", "mig"), XID_MESSAGES)
def test_parse_xid_message(
    message: str,
    expected: tuple[str, int, str] | None,
    mig: tuple[int | None, int | None],
) -> None:
    assert parse_xid_message(message) == expected
    assert parse_xid_attribution(message) == mig


# ---------------------------------------------------------------------------
# Kernel log reader over a file in /dev/kmsg format
# ---------------------------------------------------------------------------


def kmsg_line(seq: int, usec: int, message: str, prio: int = 4) -> str:
    return f"{prio},{seq},{usec},-;{message}\n"


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    (root / "uptime").write_text("1000.00 7800.00\n")
    return root


def test_boot_epoch_is_now_minus_uptime(proc_root: Path, tmp_path: Path) -> None:
    assert boot_epoch(proc_root, 10_000.0) == pytest.approx(9_000.0)
    assert boot_epoch(tmp_path / "nowhere", 10_000.0) is None


def test_kmsg_reader_reads_backlog_then_follows_appended_records(
    proc_root: Path, tmp_path: Path
) -> None:
    log = tmp_path / "kmsg"
    log.write_text(
        kmsg_line(1, 1_000_000, "Linux version 6.8.0", prio=5)
        + kmsg_line(2, 5_000_000, "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07")
        + kmsg_line(3, 200_500_000, "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off")
        + " SUBSYSTEM=pci\n"
        + kmsg_line(4, 201_000_000, "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.")
    )
    events: queue.Queue[XidEvent] = queue.Queue()
    reader = KmsgReader(
        events.put, path=log, proc_root=proc_root, poll_interval_s=0.02, clock=lambda: 10_000.0
    )
    reader.start()
    try:
        assert reader.wait_caught_up(5.0)
        backlog = events.get(timeout=5)
        assert (backlog.xid, backlog.pci_bus_id, backlog.source) == (79, "0000:3b:00", "kmsg")
        assert (backlog.gpu, backlog.uuid) == (None, None)
        assert backlog.timestamp == pytest.approx(9_000.0 + 200.5)  # boot epoch + usec
        assert backlog.message == "pid=0, GPU has fallen off"
        assert events.empty()

        # appended after start, one record arriving in two writes, plus a stale seq
        with log.open("a") as f:
            f.write("4,5,300000000,-;NVRM: Xid (PCI:0000:5e:00 GPU-I:03 GPU-CI:00): 31, pid=")
            f.flush()
            time.sleep(0.1)
            f.write("777, name=python, Ch 00000002\n")
            f.write(kmsg_line(3, 200_500_000, "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, again"))
            f.write(kmsg_line(6, 301_000_000, "usb 1-1: new high-speed USB device"))
        followed = events.get(timeout=5)
        assert (followed.xid, followed.pci_bus_id) == (31, "0000:5e:00")
        assert (followed.gpu_instance_id, followed.compute_instance_id) == (3, 0)
        assert followed.message == "pid=777, name=python, Ch 00000002"
        time.sleep(0.2)
        assert events.empty()  # seq 3 already read; the USB line is no XID
        assert reader.events_total == 2 and reader.errors_total == 0
        started = time.monotonic()
    finally:
        reader.stop()
    assert time.monotonic() - started < 1.0
    assert not reader.alive


def test_kmsg_reader_stamps_live_records_on_arrival_and_marks_only_the_backlog(
    proc_root: Path, tmp_path: Path
) -> None:
    """printk's clock stops during suspend and drifts from NTP time, so a live record's
    stamp converted through /proc/uptime can land far from when it was raised (here an
    hour early); the reader's own clock at arrival is what NVML's events are stamped by."""
    log = tmp_path / "kmsg"
    log.write_text(kmsg_line(1, 200_500_000, "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, old"))
    now = [10_000.0]
    events: queue.Queue[XidEvent] = queue.Queue()
    reader = KmsgReader(
        events.put, path=log, proc_root=proc_root, poll_interval_s=0.02, clock=lambda: now[0]
    )
    reader.start()
    try:
        assert reader.wait_caught_up(5.0)
        backlog = events.get(timeout=5)
        assert backlog.backlog and backlog.timestamp == pytest.approx(9_000.0 + 200.5)
        now[0] = 14_000.0  # an hour on: the uptime-derived stamp would say 9_000 + 300
        with log.open("a") as f:
            f.write(kmsg_line(2, 300_000_000, "NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE"))
        live = events.get(timeout=5)
        assert (live.xid, live.backlog, live.timestamp) == (48, False, 14_000.0)
    finally:
        reader.stop()


def test_kmsg_reader_waits_for_a_missing_log_with_backoff(proc_root: Path, tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    events: queue.Queue[XidEvent] = queue.Queue()
    reader = KmsgReader(
        events.put,
        path=log,
        proc_root=proc_root,
        poll_interval_s=0.02,
        backoff_initial_s=0.05,
        backoff_max_s=0.1,
    )
    reader.start()
    try:
        assert eventually(lambda: reader.errors_total >= 1)
        assert reader.alive and reader.last_error == "ENOENT"
        log.write_text(kmsg_line(9, 1_000, "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, x"))
        assert events.get(timeout=5).xid == 13
        assert reader.last_error is None
    finally:
        reader.stop()


def test_kmsg_reader_without_uptime_stamps_records_when_read(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(kmsg_line(1, 5_000_000, "NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=a, DBE"))
    events: queue.Queue[XidEvent] = queue.Queue()
    reader = KmsgReader(
        events.put,
        path=log,
        proc_root=tmp_path / "noproc",
        poll_interval_s=0.02,
        clock=lambda: 42.0,
    )
    reader.start()
    try:
        event = events.get(timeout=5)
        assert event.timestamp == 42.0
        assert reader.errors_total == 1 and reader.last_error == "uptime"
    finally:
        reader.stop()


# ---------------------------------------------------------------------------
# Severity table, overrides, recovery action
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("xid", "severity"),
    [
        (13, APPLICATION),
        (31, APPLICATION),
        (43, APPLICATION),
        (45, APPLICATION),
        (68, APPLICATION),
        (63, WARNING),
        (92, WARNING),
        (94, WARNING),
        (154, WARNING),
        (48, FATAL),
        (64, FATAL),
        (74, FATAL),
        (79, FATAL),
        (95, FATAL),
        (119, FATAL),
        (120, FATAL),
        (140, FATAL),
        (1, UNKNOWN),  # "unused" in the catalog: we do not guess
        (99_999, UNKNOWN),
    ],
)
def test_classify_uses_the_table_and_unknown_for_unlisted_codes(xid: int, severity: str) -> None:
    assert classify(xid) == severity


def test_overrides_win_over_the_table() -> None:
    overrides = {13: FATAL, 99_999: WARNING}
    assert classify(13, overrides) == FATAL
    assert classify(99_999, overrides) == WARNING
    assert classify(79, overrides) == FATAL


def test_table_uses_only_known_classes_and_describes_every_code() -> None:
    assert set(XID_SEVERITY.values()) <= set(SEVERITIES) - {UNKNOWN}
    assert all(text.strip() for text in XID_DESCRIPTION.values())


def test_device_plugin_ignored_xids_are_application_errors_except_109() -> None:
    # k8s-device-plugin internal/rm/health.go ignoredXids keeps a GPU healthy after these.
    # 109 joined them in v0.18.0, but NVIDIA's Xid catalog says RESET_GPU for it: fatal
    # here, on purpose (docs/xid.md, judgement calls); --xid-severity 109=application
    # follows the plugin instead.
    assert {x: XID_SEVERITY[x] for x in (13, 31, 43, 45, 68, 109)} == {
        13: APPLICATION,
        31: APPLICATION,
        43: APPLICATION,
        45: APPLICATION,
        68: APPLICATION,
        109: FATAL,
    }
    assert classify(109, parse_overrides("109=application")) == APPLICATION


def test_dcgm_devastating_xids_are_not_downgraded() -> None:
    # DCGM fails a GPU on these (94 only warns); our table must not be milder.
    assert all(XID_SEVERITY[x] == FATAL for x in (48, 74, 79, 95, 119, 120, 140))


def test_parse_overrides_accepts_a_comma_list() -> None:
    assert parse_overrides("13=fatal, 94=warning ,31 = application") == {
        13: FATAL,
        94: WARNING,
        31: APPLICATION,
    }
    assert parse_overrides("") == {}
    assert parse_overrides("13=fatal,13=fatal") == {13: FATAL}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("13", "'13' is not XID=CLASS"),
        ("x=fatal", "'x=fatal' is not XID=CLASS"),
        ("-1=fatal", "'-1=fatal' is not XID=CLASS"),
        ("13=bad", "class must be one of application, warning, fatal"),
        ("13=unknown", "class must be one of"),
        ("13=", "class must be one of"),
        ("13=fatal,13=warning", "XID 13 is given two classes"),
    ],
)
def test_parse_overrides_rejects_bad_input_with_one_line(text: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_overrides(text)
    message = str(info.value)
    assert fragment in message and "\n" not in message
    assert message.startswith("--xid-class: ")


def test_recovery_action_names_match_nvml_constants() -> None:
    assert RECOVERY_ACTIONS[pynvml.NVML_GPU_RECOVERY_ACTION_NONE] == "none"
    assert RECOVERY_ACTIONS[pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET] == "gpu_reset"
    assert RECOVERY_ACTIONS[pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT] == "node_reboot"
    assert RECOVERY_ACTIONS[pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P] == "drain_p2p"
    assert RECOVERY_ACTIONS[pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET] == "drain_and_reset"
    assert recovery_action_name(pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET) == "gpu_reset"
    assert recovery_action_name(42) == "unknown"


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("00000000:3B:00.0", "0000:3b:00"),
        ("0000:3b:00", "0000:3b:00"),
        ("PCI:0000:3b:00", "0000:3b:00"),
        ("00000008:01:00.0", "0008:01:00"),
        ("3b:00.0", "0000:3b:00"),
        ("not a bus", None),
    ],
)
def test_normalize_pci_bus_id(raw: str, normal: str | None) -> None:
    assert normalize_pci_bus_id(raw) == normal


# ---------------------------------------------------------------------------
# Ledger: counting, de-duplication, fatal window
# ---------------------------------------------------------------------------

UUID_A, UUID_B = "GPU-aaaa", "GPU-bbbb"
BUS_IDS = {"00000000:3B:00.0": (0, UUID_A), "00000000:5E:00.0": (1, UUID_B)}
START = 1_000.0


def nvml(xid: int, ts: float, gpu: int = 0, uuid: str = UUID_A, **kw: Any) -> XidEvent:
    return XidEvent(gpu=gpu, uuid=uuid, xid=xid, timestamp=ts, source="nvml", **kw)


def kmsg(xid: int, ts: float, bus: str = "0000:3b:00", **kw: Any) -> XidEvent:
    return XidEvent(gpu=None, uuid=None, xid=xid, timestamp=ts, source="kmsg", pci_bus_id=bus, **kw)


def test_ledger_counts_cumulatively_and_never_mutates() -> None:
    empty = XidLedger()
    one = empty.record([nvml(13, 1_010.0), nvml(13, 1_011.0)], now=1_011.0)
    two = one.record([nvml(79, 1_020.0, gpu=1, uuid=UUID_B), nvml(13, 1_021.0)], now=1_021.0)
    assert empty.counts == {}
    assert one.counts == {XidKey(0, UUID_A, 13, APPLICATION): 2}
    assert two.counts == {
        XidKey(0, UUID_A, 13, APPLICATION): 3,
        XidKey(1, UUID_B, 79, FATAL): 1,
    }


def test_ledger_counts_with_operator_overrides() -> None:
    ledger = XidLedger(overrides={13: FATAL}).record([nvml(13, 1_010.0)], 1_010.0)
    assert ledger.counts == {XidKey(0, UUID_A, 13, FATAL): 1}
    assert [e.xid for e in ledger.fatal_since(UUID_A, START)] == [13]


@pytest.mark.parametrize("kmsg_first", [False, True])
def test_ledger_counts_an_xid_seen_by_nvml_and_kmsg_once(kmsg_first: bool) -> None:
    pair = [nvml(79, 1_100.0), kmsg(79, 1_100.4, message="pid=0, GPU has fallen off the bus.")]
    batches = [pair[::-1]] if kmsg_first else [[pair[0]], [pair[1]]]
    ledger = XidLedger()
    for batch in batches:
        ledger = ledger.record(batch, now=1_101.0, bus_ids=BUS_IDS)
    assert ledger.counts == {XidKey(0, UUID_A, 79, FATAL): 1}
    (entry,) = ledger.events_since(UUID_A, START)
    assert entry.sources == frozenset({"nvml", "kmsg"})


def test_ledger_matches_duplicates_one_to_one_within_the_window() -> None:
    ledger = XidLedger(dedup_window_s=5.0).record(
        [
            nvml(13, 1_100.0),
            nvml(13, 1_100.2),  # a burst: two real XIDs
            kmsg(13, 1_100.1),  # the kernel's copy of one of them
            kmsg(13, 1_120.0),  # same code, far outside the window: a third XID
            kmsg(13, 1_100.3, bus="0000:5e:00"),  # another GPU
        ],
        now=1_121.0,
        bus_ids=BUS_IDS,
    )
    assert ledger.counts == {
        XidKey(0, UUID_A, 13, APPLICATION): 3,
        XidKey(1, UUID_B, 13, APPLICATION): 1,
    }
    merged = [e for e in ledger.events_since(UUID_A, START) if len(e.sources) == 2]
    assert [e.event.timestamp for e in merged] == [1_100.0]  # the closest nvml sighting


def test_ledger_does_not_merge_different_mig_instances() -> None:
    ledger = XidLedger().record(
        [nvml(31, 1_100.0, gpu_instance_id=1), kmsg(31, 1_100.1, gpu_instance_id=2)],
        now=1_101.0,
        bus_ids=BUS_IDS,
    )
    assert ledger.counts == {
        XidKey(0, UUID_A, 31, APPLICATION, 1, None): 1,
        XidKey(0, UUID_A, 31, APPLICATION, 2, None): 1,
    }
    assert all(len(e.sources) == 1 for e in ledger.events_since(UUID_A, START))


def test_ledger_counts_unresolvable_kmsg_events_without_a_gpu() -> None:
    ledger = XidLedger().record([kmsg(79, 1_100.0, bus="0000:99:00")], 1_100.0)
    assert ledger.counts == {XidKey(None, None, 79, FATAL): 1}


def test_ledger_counts_backlog_xids_apart_from_new_ones() -> None:
    """The kernel log's backlog is history: counted before start, never as a new XID,
    whatever its (approximate) time says; it still weighs in the health verdict."""
    ledger = XidLedger().record(
        [kmsg(79, 900.0, backlog=True), kmsg(13, 1_050.0, backlog=True), nvml(13, 1_060.0)],
        now=1_060.0,
        bus_ids=BUS_IDS,
    )
    assert ledger.counts == {XidKey(0, UUID_A, 13, APPLICATION): 1}
    assert ledger.counts_before_start == {
        XidKey(0, UUID_A, 79, FATAL): 1,
        XidKey(0, UUID_A, 13, APPLICATION): 1,
    }
    assert [e.event.xid for e in ledger.events_since(UUID_A, 0.0) if e.historical] == [79, 13]
    (fatal,) = ledger.events_since(UUID_A, 0.0, FATAL)
    assert fatal.historical and fatal.event.uuid == UUID_A and fatal.event.gpu == 0
    assert ledger.recent_fatal(0.0) == {UUID_A: [79]}


def test_ledger_never_counts_a_backlog_xid_as_new_even_when_its_stamp_is_after_start() -> None:
    # printk's clock drifted ahead of /proc/uptime: the converted stamp lands "now"
    ledger = XidLedger().record([kmsg(79, 1_100.0, backlog=True)], now=1_050.0, bus_ids=BUS_IDS)
    assert ledger.counts == {}
    assert ledger.counts_before_start == {XidKey(0, UUID_A, 79, FATAL): 1}


@pytest.mark.parametrize("same_cycle", [False, True])
def test_a_backlog_xid_that_nvml_also_reports_was_raised_after_start(same_cycle: bool) -> None:
    """The backlog was still being read when the XID was raised: NVML's report proves it
    new, so it moves from before-start to the counter, once."""
    backlog, live = kmsg(79, 1_100.2, backlog=True), nvml(79, 1_100.5)
    batches = [[backlog, live]] if same_cycle else [[backlog], [live]]
    ledger = XidLedger()
    for batch in batches:
        ledger = ledger.record(batch, now=1_101.0, bus_ids=BUS_IDS)
    assert ledger.counts == {XidKey(0, UUID_A, 79, FATAL): 1}
    assert ledger.counts_before_start == {}
    (entry,) = ledger.events_since(UUID_A, 0.0)
    assert entry.sources == frozenset({"nvml", "kmsg"}) and not entry.historical


def test_a_backlog_xid_matching_a_counted_nvml_xid_is_not_counted_again() -> None:
    ledger = XidLedger().record([nvml(79, 1_100.5)], now=1_101.0)
    ledger = ledger.record([kmsg(79, 1_100.2, backlog=True)], now=1_102.0, bus_ids=BUS_IDS)
    assert ledger.counts == {XidKey(0, UUID_A, 79, FATAL): 1}
    assert ledger.counts_before_start == {}


def test_fatal_since_returns_only_fatal_xids_of_that_gpu_in_the_window() -> None:
    ledger = XidLedger().record(
        [
            nvml(79, 1_100.0),
            nvml(13, 1_200.0),
            nvml(48, 1_300.0),
            nvml(95, 1_250.0, gpu=1, uuid=UUID_B),
        ],
        now=1_300.0,
    )
    assert [e.xid for e in ledger.fatal_since(UUID_A, 1_000.0)] == [79, 48]
    assert [e.xid for e in ledger.fatal_since(UUID_A, 1_150.0)] == [48]
    assert ledger.fatal_since("GPU-none", 0.0) == []
    assert ledger.recent_fatal(1_150.0) == {UUID_A: [48], UUID_B: [95]}


def test_ledger_forgets_recent_events_after_retention_but_keeps_counting() -> None:
    ledger = XidLedger(retention_s=600.0).record([nvml(79, 1_100.0)], 1_100.0)
    later = ledger.record([], now=1_800.0)
    assert later.fatal_since(UUID_A, 0.0) == []
    assert later.counts == {XidKey(0, UUID_A, 79, FATAL): 1}


def test_ledger_caps_recent_events_per_gpu() -> None:
    storm = [nvml(13, 1_100.0 + i / 100) for i in range(50)]
    ledger = XidLedger(max_recent_per_gpu=10).record(storm, now=1_101.0)
    recent = ledger.events_since(UUID_A, 0.0)
    assert len(recent) == 10 and recent[-1].event.timestamp == pytest.approx(1_100.49)
    assert ledger.counts[XidKey(0, UUID_A, 13, APPLICATION)] == 50


def test_bus_id_map_skips_gpus_without_a_bus_id() -> None:
    gpus = [
        GpuSample(index=0, uuid=UUID_A, pci_bus_id="00000000:3B:00.0"),
        GpuSample(index=1, uuid=UUID_B, error="GpuIsLost"),
    ]
    assert bus_id_map(gpus) == {"0000:3b:00": (0, UUID_A)}


# ---------------------------------------------------------------------------
# docs/xid.md stays in step with the table
# ---------------------------------------------------------------------------


def test_docs_list_every_xid_with_its_class() -> None:
    rows = {
        int(m.group(1)): m.group(2)
        for m in re.finditer(r"^\|\s*(\d+)\s*\|[^|]*\|\s*`(\w+)`\s*\|", DOCS.read_text(), re.M)
    }
    assert rows == XID_SEVERITY
    text = DOCS.read_text()
    for severity in OVERRIDABLE:
        assert f"`{severity}`" in text
    assert "gpu_xid_errors_total" in text and "--xid-class" in text


def test_mig_xids_are_counted_per_gpu_and_compute_instance() -> None:
    ledger = XidLedger().record(
        [
            XidEvent(
                gpu=0,
                uuid=UUID_A,
                xid=43,
                timestamp=1.0,
                source="nvml",
                gpu_instance_id=1,
                compute_instance_id=0,
            ),
            XidEvent(
                gpu=0,
                uuid=UUID_A,
                xid=43,
                timestamp=2.0,
                source="nvml",
                gpu_instance_id=2,
                compute_instance_id=0,
            ),
            XidEvent(gpu=0, uuid=UUID_A, xid=43, timestamp=3.0, source="nvml"),
        ],
        now=3.0,
    )
    assert ledger.counts == {
        XidKey(0, UUID_A, 43, APPLICATION, 1, 0): 1,
        XidKey(0, UUID_A, 43, APPLICATION, 2, 0): 1,
        XidKey(0, UUID_A, 43, APPLICATION): 1,
    }


def test_kmsg_reader_skips_a_line_without_end_in_bounded_time(
    proc_root: Path, tmp_path: Path
) -> None:
    """/dev/kmsg hands out whole records, but --kmsg-path may name a regular file with a
    32 MiB "line": the reader keeps at most MAX_PENDING of it (it used to hold all of it
    and re-split it at every 8 KiB read, quadratic: minutes of a core), and the record
    after it is read."""
    log = tmp_path / "kmsg"
    with log.open("w") as f:
        f.write(kmsg_line(1, 1_000_000, "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, before"))
        f.write("4,2,2000000,-;" + "x" * (32 * 1024 * 1024) + "\n")
        f.write(kmsg_line(3, 3_000_000, "NVRM: Xid (PCI:0000:3b:00): 31, pid=1, after"))
    events: queue.Queue[XidEvent] = queue.Queue()
    reader = KmsgReader(events.put, path=log, proc_root=proc_root, poll_interval_s=0.02)
    began = time.monotonic()
    reader.start()
    try:
        assert events.get(timeout=5).xid == 13
        assert events.get(timeout=5).xid == 31
        assert time.monotonic() - began < 5.0
        assert reader.alive and reader.errors_total == 0
    finally:
        reader.stop()


@pytest.fixture
def interrupt_signal() -> Iterator[None]:
    """The process's disposition of the interrupt signal, restored after the test."""
    before = signal.getsignal(INTERRUPT_SIGNAL)
    yield
    signal.signal(INTERRUPT_SIGNAL, before)


@pytest.mark.slow  # a real wait, then a stop
def test_the_default_wait_is_long_and_stop_interrupts_it(
    listen: Callable[..., Listening], interrupt_signal: None
) -> None:
    """Each timeout is a wake-up, the listener's share of the idle floor, so the wait is
    long (benchmarks/README.md, idle floor); stop() cuts it short with a signal, which
    the driver's wait returns on (nvml.h) and so does the simulated one."""
    assert WAIT_TIMEOUT_MS == 2500
    node = SimNode(parse_scenario({"gpus": [{}, {}]}, "xid-wait"))  # its clock runs alone
    library = install(node)
    got = listen(wait_timeout_ms=WAIT_TIMEOUT_MS)
    assert got.listener.wait_timeout_ms == WAIT_TIMEOUT_MS
    assert eventually(lambda: got.listener.registered == (0, 1))
    before = library.calls.by_function["nvmlEventSetWait_v2"]
    time.sleep(3.0)
    assert library.calls.by_function["nvmlEventSetWait_v2"] - before <= 2  # not three, as at 1 s
    started = time.monotonic()
    got.listener.stop()
    assert time.monotonic() - started < 0.5
    assert not got.listener.alive
    assert got.listener.errors_total == 0


def test_where_the_signal_is_ignored_the_wait_is_short_enough_to_stop(
    listen: Callable[..., Listening], interrupt_signal: None
) -> None:
    signal.signal(INTERRUPT_SIGNAL, signal.SIG_IGN)  # someone wants it ignored: left so
    sim_node()
    got = listen(wait_timeout_ms=WAIT_TIMEOUT_MS)
    assert got.listener.wait_timeout_ms == UNINTERRUPTIBLE_WAIT_TIMEOUT_MS
    assert eventually(lambda: got.listener.registered == (0, 1, 2))
    time.sleep(0.2)  # inside a wait
    started = time.monotonic()
    got.listener.stop()
    assert time.monotonic() - started < UNINTERRUPTIBLE_WAIT_TIMEOUT_MS / 1000 + 1.0
    assert not got.listener.alive
    assert signal.getsignal(INTERRUPT_SIGNAL) is signal.SIG_IGN


def test_started_off_the_main_thread_it_installs_nothing_and_waits_short(
    interrupt_signal: None,
) -> None:
    signal.signal(INTERRUPT_SIGNAL, signal.SIG_DFL)
    sim_node()
    listener = XidListener(wait_timeout_ms=WAIT_TIMEOUT_MS)
    starter = threading.Thread(target=listener.start)
    starter.start()
    starter.join()
    try:
        assert listener.wait_timeout_ms == UNINTERRUPTIBLE_WAIT_TIMEOUT_MS
        assert signal.getsignal(INTERRUPT_SIGNAL) is signal.SIG_DFL
    finally:
        listener.stop()
    assert not listener.alive


def test_the_simulated_wait_returns_timeout_when_a_signal_arrives(
    interrupt_signal: None,
) -> None:
    """nvml.h: NVML_ERROR_TIMEOUT "if no event arrived in specified timeout or interrupt
    arrived". The simulated library sleeps in poll(2) as the driver does."""
    assert interrupt_handler_ready()
    sim_node()
    pynvml.nvmlInit()
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(
        pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeXidCriticalError, event_set
    )
    answers: queue.Queue[str] = queue.Queue()

    def wait() -> None:
        try:
            pynvml.nvmlEventSetWait_v2(event_set, 30_000)
            answers.put("event")
        except pynvml.NVMLError as exc:
            answers.put(type(exc).__name__)

    waiter = threading.Thread(target=wait)
    started = time.monotonic()
    waiter.start()
    try:
        while waiter.is_alive() and time.monotonic() - started < 5:
            signal.pthread_kill(waiter.ident or 0, INTERRUPT_SIGNAL)
            waiter.join(0.05)
        assert answers.get(timeout=1) == "NVMLError_Timeout"
        assert time.monotonic() - started < 5
    finally:
        waiter.join(35)
        pynvml.nvmlEventSetFree(event_set)
        pynvml.nvmlShutdown()


async def test_closing_the_last_listener_puts_the_signal_back_to_its_default(
    interrupt_signal: None,
) -> None:
    """A signal sent from outside while the event loop closes was written to the loop's
    closed wake-up pipe ("Exception ignored ... Bad file descriptor", an adversarial review): once
    no listener waits, the handler goes and the signal is ignored again."""
    signal.signal(INTERRUPT_SIGNAL, signal.SIG_DFL)
    sim_node()
    first, second = XidListener(wait_timeout_ms=WAIT_TIMEOUT_MS), XidListener()
    first.start()
    second.start()
    assert first.wait_timeout_ms == second.wait_timeout_ms == WAIT_TIMEOUT_MS
    await first.aclose()
    assert callable(signal.getsignal(INTERRUPT_SIGNAL))  # the second still waits on it
    await second.aclose()
    assert signal.getsignal(INTERRUPT_SIGNAL) is signal.SIG_DFL
    assert not first.alive and not second.alive


async def test_a_handler_of_someone_elses_is_used_and_left_in_place(
    interrupt_signal: None,
) -> None:
    theirs: list[int] = []
    signal.signal(INTERRUPT_SIGNAL, lambda signum, frame: theirs.append(signum))
    sim_node()
    listener = XidListener()
    listener.start()
    assert listener.wait_timeout_ms == WAIT_TIMEOUT_MS
    assert eventually(lambda: listener.registered == (0, 1, 2))
    time.sleep(0.2)
    started = time.monotonic()
    await listener.aclose()
    assert time.monotonic() - started < 0.5
    assert signal.getsignal(INTERRUPT_SIGNAL) is not signal.SIG_DFL


def test_on_a_sped_up_node_an_xid_arrives_when_its_time_comes(
    listen: Callable[..., Listening],
) -> None:
    """--simulate-speed 20: the simulated wait sleeps until the next XID is due in real
    seconds (its `at` over the speed), not in simulated ones (an adversarial review)."""
    origin = time.monotonic()
    clock = monotonic_clock(0.0, 20.0, origin=origin)
    timeline = [{"at": 30, "xid": {"gpu": 0, "code": 31}}]
    install(SimNode(parse_scenario({"gpus": [{}], "timeline": timeline}, "fast"), clock))
    got = listen(wait_timeout_ms=WAIT_TIMEOUT_MS)
    event = got.next(timeout_s=10)
    late = time.monotonic() - (origin + 30 / 20.0)
    assert event.xid == 31
    assert late < 0.3, f"{late:.2f} s late"
