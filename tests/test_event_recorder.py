"""Event aggregation and rate limits (exporter/reporting/recorder.py), on a hand-moved
clock: a storm is one Event and a few PATCHes, the node's budget holds, memory stays
bounded, and every body passes the API server's validation (the stand-in's rules,
exporter/sim/kube_rules.py, are kube-apiserver 1.35's)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from exporter.model import HealthTransition, PodRef
from exporter.reporting.events import (
    NOTE_BYTES,
    EventIntent,
    ObjectRef,
    event_intents,
    fit_note,
    node_ref,
)
from exporter.reporting.recorder import (
    CREATE_WAIT_S,
    MAX_SERIES,
    NEW_EVENT_EVERY_S,
    NODE_BURST,
    NODE_WRITES_PER_MINUTE,
    SERIES_FLUSH_S,
    SERIES_SHARE,
    Recorder,
    Result,
    Write,
)
from exporter.sim.kube_rules import event_create_errors, micro_time_error
from tests.clock import Clock

NODE = "node-a"
WALL0 = 1_790_000_000.25
MICRO_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z")


class Walls:
    """Wall time that moves with the monotonic clock (epoch = WALL0 + clock)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __call__(self) -> float:
        return WALL0 + self.clock.now


def recorder(clock: Clock, **kwargs: Any) -> Recorder:
    return Recorder(NODE, clock=clock, wall=Walls(clock), **kwargs)


def intent(
    pod: str = "train", reason: str = "GPUFatalXID", device: str = "GPU-a", count: int = 1
) -> EventIntent:
    regarding = ObjectRef("Pod", pod, "ml", f"uid-{pod}")
    return EventIntent(regarding, node_ref(NODE), reason, "Warning", "note", device, count)


def drain(r: Recorder) -> tuple[list[Write], list[tuple[str, Result]]]:
    """Every write due now, each answered by the API at once."""
    writes: list[Write] = []
    settled: list[tuple[str, Result]] = []
    while True:
        write, done = r.next_write()
        settled += done
        if write is None:
            return writes, settled
        r.sent(write)
        writes.append(write)


# -- aggregation ---------------------------------------------------------------------------


def test_250_occurrences_of_one_key_are_one_create_with_series_count_250() -> None:
    clock = Clock()
    r = recorder(clock)
    r.observe(tuple(intent() for _ in range(250)))
    writes, settled = drain(r)
    (create,) = writes
    assert create.verb == "create" and settled == []
    assert create.body["series"]["count"] == 250
    assert create.count == 250


def test_an_xid_storm_intent_with_a_count_is_one_create() -> None:
    clock = Clock()
    r = recorder(clock)
    r.observe((intent(count=250),))
    (create,), _ = drain(r)
    assert create.body["series"]["count"] == 250


def test_a_single_occurrence_is_created_without_a_series() -> None:
    r = recorder(Clock())
    r.observe((intent(),))
    (create,), _ = drain(r)
    assert "series" not in create.body  # the API refuses a series counting under 2


def test_later_repeats_become_patches_at_most_every_series_flush_s() -> None:
    clock = Clock()
    r = recorder(clock)
    r.observe((intent(),))
    writes, _ = drain(r)
    for second in range(1, 301):  # one occurrence a second for 5 minutes
        clock.now = float(second)
        r.observe((intent(),))
        writes += drain(r)[0]
    create, *patches = writes
    assert create.verb == "create"
    assert {w.verb for w in patches} == {"patch"}
    assert {w.name for w in patches} == {create.name}
    sent_at = [w.body["series"]["lastObservedTime"] for w in patches]
    assert len(sent_at) == 300 // SERIES_FLUSH_S
    counts = [w.count for w in patches]
    assert counts == sorted(counts) and counts[-1] == 301
    clock.now = 400.0
    assert drain(r) == ([], [])  # nothing new, nothing sent


def test_patch_series_counts_all_occurrences_and_their_last_time() -> None:
    clock = Clock()
    r = recorder(clock)
    r.observe((intent(),))
    drain(r)
    clock.now = 5.0
    r.observe((intent(count=7),))
    clock.now = 31.0
    (patch,), _ = drain(r)
    assert patch.body == {"series": {"count": 8, "lastObservedTime": "2026-09-21T14:13:25.250000Z"}}
    assert patch.namespace == "ml"


def test_a_quiet_key_after_new_event_every_s_is_a_new_event_with_a_new_name() -> None:
    clock = Clock()
    r = recorder(clock)
    r.observe((intent(),))
    (first,), _ = drain(r)
    clock.now = NEW_EVENT_EVERY_S - 1
    r.observe((intent(),))
    (within,), _ = drain(r)
    assert within.verb == "patch"
    clock.now = NEW_EVENT_EVERY_S + 1
    r.observe((intent(),))
    (second,), _ = drain(r)
    assert second.verb == "create"
    assert second.name != first.name
    assert "series" not in second.body  # the new Event counts from one


def test_keys_differ_by_object_reason_and_gpu() -> None:
    r = recorder(Clock())
    r.observe(
        (
            intent(),
            intent(pod="other"),
            intent(reason="GPULost"),
            intent(device="GPU-b"),
            intent(),
        )
    )
    writes, _ = drain(r)
    assert [w.verb for w in writes] == ["create"] * 4


def test_names_are_unique_for_events_created_in_the_same_instant() -> None:
    r = recorder(Clock())
    node = node_ref(NODE)
    gpus = [f"GPU-{i}" for i in range(8)]  # eight GPUs lost in one cycle
    r.observe(tuple(EventIntent(node, None, "GPULost", "Warning", "n", g) for g in gpus))
    writes, _ = drain(r)
    names = [w.name for w in writes]
    assert len(names) == 8 == len(set(names))
    assert all(n.startswith(f"{NODE}.") for n in names)
    assert {w.body["eventTime"] for w in writes} == {"2026-09-21T14:13:20.250000Z"}


# -- the node's budget -------------------------------------------------------------------


def test_node_burst_creates_b_events_and_rate_limits_the_rest() -> None:
    clock = Clock()
    r = recorder(clock, create_wait_s=0.0)
    r.observe(tuple(intent(pod=f"p{i}") for i in range(NODE_BURST + 10)))
    writes, settled = drain(r)
    assert len(writes) == NODE_BURST
    assert settled == [("GPUFatalXID", "rate_limited")] * 10
    assert len(r) == NODE_BURST  # the refused ones are forgotten, not queued


def test_the_node_budget_refills_at_the_stated_rate() -> None:
    clock = Clock()
    r = recorder(clock, create_wait_s=0.0)
    r.observe(tuple(intent(pod=f"p{i}") for i in range(NODE_BURST)))
    drain(r)
    every = 60.0 / NODE_WRITES_PER_MINUTE
    clock.now = every * 0.9
    r.observe((intent(pod="early"),))
    assert drain(r) == ([], [("GPUFatalXID", "rate_limited")])
    clock.now = every * 1.9  # 1.9 tokens since the empty bucket, one spent on nothing
    r.observe((intent(pod="on-time"), intent(pod="too-many")))
    writes, settled = drain(r)
    assert [w.body["regarding"]["name"] for w in writes] == ["on-time"]
    assert settled == [("GPUFatalXID", "rate_limited")]
    clock.now = 1_000.0  # a long quiet: the bucket holds at most the burst
    r.observe(tuple(intent(pod=f"q{i}") for i in range(NODE_BURST + 1)))
    writes, settled = drain(r)
    assert len(writes) == NODE_BURST and len(settled) == 1


def test_the_documented_burst_of_25_then_12_a_minute_holds() -> None:
    """docs/kubernetes-events.md's numbers as literals, not the constants: 25 writes
    go at once, the 26th waits for a token (one per 60 / 12 = 5 s), then goes."""
    clock = Clock()
    r = recorder(clock)
    r.observe(tuple(intent(pod=f"p{i}") for i in range(26)))
    writes, settled = drain(r)
    assert len(writes) == 25 and settled == []  # the 26th is held, not refused
    clock.now = 4.9
    assert drain(r) == ([], [])
    clock.now = 5.0
    writes, settled = drain(r)
    assert [w.body["regarding"]["name"] for w in writes] == ["p25"] and settled == []


DOC = Path(__file__).resolve().parents[1] / "docs" / "kubernetes-events.md"


def documented(pattern: str) -> list[int]:
    """Every number ``pattern`` (one group) matches in docs/kubernetes-events.md."""
    found = [int(m.replace(",", "")) for m in re.findall(pattern, DOC.read_text("utf-8"))]
    assert found, f"docs/kubernetes-events.md no longer says {pattern!r}"
    return found


def test_the_numbers_docs_kubernetes_events_states_are_the_recorders() -> None:
    """The tables "Aggregated and rate-limited like the kubelet's recorder" and "A
    budget for every kind of write" state the recorder's constants in prose."""
    assert documented(r"\| writes per node \(creates and PATCHes\) \| a burst of (\d+),") == [
        NODE_BURST
    ]
    assert documented(r"\| per node: a burst of (\d+), then") == [NODE_BURST]
    assert documented(r"a burst of \d+, then (\d+) per minute;") == [NODE_WRITES_PER_MINUTE]
    assert documented(r"per node: a burst of \d+, then (\d+) a minute;") == [NODE_WRITES_PER_MINUTE]
    assert set(documented(r"finds no token waits up to (\d+) s for one")) == {int(CREATE_WAIT_S)}
    assert set(documented(r"finds no token within (\d+) s")) == {int(CREATE_WAIT_S)}
    assert documented(r"every (\d+)th token goes to a due series update") == [SERIES_SHARE]
    assert documented(r"\| at most one per (\d+) minutes;") == [NEW_EVENT_EVERY_S / 60]
    assert documented(r"\| at most one PATCH per (\d+) s,") == [SERIES_FLUSH_S]
    assert documented(r"a series PATCH per Event per (\d+) s") == [SERIES_FLUSH_S]
    assert documented(r"\| Events remembered \| ([\d,]+) keys") == [MAX_SERIES]
    assert documented(r"Events in the recorder \((\d+) keys") == [MAX_SERIES]


def test_a_new_event_without_a_token_waits_for_one_then_is_rate_limited() -> None:
    clock = Clock()
    r = recorder(clock)
    r.observe(tuple(intent(pod=f"p{i}") for i in range(NODE_BURST + 20)))
    writes, settled = drain(r)
    assert len(writes) == NODE_BURST and settled == []  # 20 wait for tokens
    clock.now = CREATE_WAIT_S - 1.0  # 11.8 tokens refilled: 11 of them are created
    writes, settled = drain(r)
    assert len(writes) == int((CREATE_WAIT_S - 1.0) * NODE_WRITES_PER_MINUTE / 60)
    assert settled == []
    clock.now = CREATE_WAIT_S  # one more token; the wait is over for the rest
    writes, settled = drain(r)
    assert len(writes) == 1
    assert settled == [("GPUFatalXID", "rate_limited")] * (20 - 12)


def test_the_most_urgent_new_event_takes_the_next_token() -> None:
    """A storm's 60 new Events and a GPU lost in the same cycle: the GPULost Events (the
    Node's first) go as soon as a token comes, not after the storm's."""
    clock = Clock()
    r = recorder(clock, burst=1, writes_per_minute=6)
    storm = tuple(intent(pod=f"p{i}", reason="GPUFatalXID") for i in range(60))
    lost_node = EventIntent(node_ref(NODE), None, "GPULost", "Warning", "lost", "GPU-b")
    r.observe((*storm, intent(pod="p0", reason="GPULost", device="GPU-b"), lost_node))
    writes, _ = drain(r)
    assert [(w.reason, w.body["regarding"]["kind"]) for w in writes] == [("GPULost", "Node")]
    clock.now = 10.0
    writes, _ = drain(r)
    assert [(w.reason, w.body["regarding"]["kind"]) for w in writes] == [("GPULost", "Pod")]


def test_while_new_events_wait_a_due_series_update_gets_a_share_of_the_tokens() -> None:
    clock = Clock()
    r = recorder(clock, burst=1, writes_per_minute=60)
    r.observe((intent(pod="storm"),))
    drain(r)
    patches = 0
    for second in range(1, 200):
        clock.now = float(second)
        r.observe((intent(pod="storm"), intent(pod=f"new{second}", reason="GPUIsolationLeak")))
        writes, _ = drain(r)
        patches += sum(1 for w in writes if w.verb == "patch")
    assert patches >= 199 // SERIES_FLUSH_S - 1  # every flush that came due was sent


def test_series_updates_never_take_the_token_a_new_event_waits_for() -> None:
    """An XID storm keeps 30 series due; a GPU lost later still gets its Event."""
    clock = Clock()
    r = recorder(clock, burst=30, writes_per_minute=6)
    r.observe(tuple(intent(pod=f"storm{i}") for i in range(30)))
    drain(r)  # the burst is spent on the 30 creates
    for second in range(30, 300, 5):
        clock.now = float(second)
        r.observe(tuple(intent(pod=f"storm{i}") for i in range(30)))
        if second == 150:
            r.observe((intent(pod="node-lost", reason="GPULost"),))
        writes, settled = drain(r)
        assert not settled
        if any(w.reason == "GPULost" for w in writes):
            break
    assert any(w.reason == "GPULost" and w.verb == "create" for w in writes)
    assert clock.now <= 150.0 + 60.0 / 6 + 5.0  # the next token went to it


def test_a_patch_waiting_for_a_token_keeps_its_count() -> None:
    clock = Clock()
    r = recorder(clock, burst=2, writes_per_minute=1)
    r.observe((intent(),))
    drain(r)
    r.observe((intent(pod="spends-the-last-token"),))
    drain(r)
    clock.now = SERIES_FLUSH_S  # due, but half a token only
    r.observe((intent(count=4),))
    assert drain(r) == ([], [])  # waiting, not refused
    clock.now = 50.0
    r.observe((intent(count=5),))
    assert drain(r) == ([], [])
    clock.now = 61.0
    (patch,), settled = drain(r)
    assert patch.verb == "patch" and patch.count == 10 and settled == []


def test_memory_stays_bounded_under_100k_distinct_keys() -> None:
    clock = Clock()
    r = recorder(clock, create_wait_s=0.0)
    dropped = rate_limited = 0
    for batch in range(100):  # 100 cycles of 1,000 new keys each
        clock.now = float(batch)
        settled = r.observe(tuple(intent(pod=f"p{batch}-{i}") for i in range(1_000)))
        assert len(r) <= MAX_SERIES
        _, more = drain(r)
        settled += more
        dropped += sum(1 for _, result in settled if result == "dropped")
        rate_limited += sum(1 for _, result in settled if result == "rate_limited")
        assert len(r) <= MAX_SERIES
    assert dropped + rate_limited >= 100_000 - NODE_BURST - 100 * NODE_WRITES_PER_MINUTE / 60


def test_a_full_table_drops_a_burst_of_new_keys_without_scanning_it_for_each() -> None:
    r = recorder(Clock())
    burst = tuple(intent(pod=f"p{i}") for i in range(100_000))
    started = time.perf_counter()
    settled = r.observe(burst)
    elapsed = time.perf_counter() - started  # 7 s when each refusal scanned the table
    assert len(r) == MAX_SERIES
    assert len(settled) == 100_000 - MAX_SERIES
    assert {result for _, result in settled} == {"dropped"}
    assert elapsed < 3.0, f"{elapsed:.1f} s to drop 100k intents"


def test_a_full_table_of_unsent_events_makes_room_for_a_more_urgent_one() -> None:
    """Full of GPUOrphanedMemory Events not yet sent (a Lease outage holds them), a
    GPULost takes the place of the newest of them; another GPUOrphanedMemory is dropped
    itself (an adversarial review: the newest was dropped whatever it was)."""
    clock = Clock()
    r = recorder(clock, max_series=3)
    r.observe(tuple(intent(pod=p, reason="GPUOrphanedMemory") for p in "abc"))
    assert r.observe((intent(pod="d", reason="GPUOrphanedMemory"),)) == [
        ("GPUOrphanedMemory", "dropped")
    ]
    lost = EventIntent(node_ref(NODE), None, "GPULost", "Warning", "lost", "GPU-b")
    assert r.observe((lost,)) == [("GPUOrphanedMemory", "dropped")]
    writes, _ = drain(r)
    assert [(w.reason, w.body["regarding"]["name"]) for w in writes] == [
        ("GPULost", NODE),
        ("GPUOrphanedMemory", "a"),
        ("GPUOrphanedMemory", "b"),
    ]


def test_room_for_a_more_urgent_one_is_made_neither_from_the_retried_write_nor_lost() -> None:
    """Full of GPUOrphanedMemory Events: ``a`` sent with an occurrence still to send,
    ``b`` created but its answer not back (the writer's retry, ``keep``), ``c`` not
    sent. Two GPULost come: ``c`` and ``a``'s count make room, never ``b``, which its
    retry settles (an adversarial review: displaced and then created, counted twice; a
    sent series never made room)."""
    clock = Clock()
    r = recorder(clock, max_series=3)
    r.observe(tuple(intent(pod=p, reason="GPUOrphanedMemory") for p in "ab"))
    first, _ = r.next_write()
    assert first is not None
    r.sent(first)
    retried, _ = r.next_write()  # in flight: neither sent nor failed yet
    assert retried is not None and retried.body["regarding"]["name"] == "b"
    r.observe(
        (intent(pod="a", reason="GPUOrphanedMemory"), intent(pod="c", reason="GPUOrphanedMemory"))
    )
    lost = [
        EventIntent(node_ref(NODE), None, "GPULost", "Warning", "lost", g) for g in ("G1", "G2")
    ]
    settled = r.observe(tuple(lost), keep=retried.key)
    assert settled == [("GPUOrphanedMemory", "dropped")] * 2
    assert r.sent(retried) == "created"
    writes, _ = drain(r)
    assert [w.reason for w in writes] == ["GPULost", "GPULost"]


def test_time_held_is_not_spent_from_a_new_events_wait_for_a_token() -> None:
    """Events held 10 minutes (the writer Lease undecided) then let go: the burst goes,
    and the rest still wait CREATE_WAIT_S for tokens rather than being rate-limited at
    once (an adversarial review: 25 created, every other one rate_limited on the spot)."""
    clock = Clock()
    r = recorder(clock)
    r.observe(tuple(intent(pod=f"p{i}") for i in range(NODE_BURST + 20)))
    for minute in range(1, 11):
        clock.now = 60.0 * minute
        r.restart_waits()
    writes, settled = drain(r)
    assert len(writes) == NODE_BURST and settled == []
    clock.now += CREATE_WAIT_S - 1.0
    writes, settled = drain(r)
    assert len(writes) == int((CREATE_WAIT_S - 1.0) * NODE_WRITES_PER_MINUTE / 60)
    assert settled == []


def test_a_settled_key_is_forgotten_to_make_room_for_a_new_one() -> None:
    clock = Clock()
    r = recorder(clock, max_series=3)
    r.observe((intent(pod="a"), intent(pod="b"), intent(pod="c")))
    drain(r)
    assert r.observe((intent(pod="d"),)) == []
    assert len(r) == 3
    (create,), _ = drain(r)
    assert create.body["regarding"]["name"] == "d"


# -- what became of a write ------------------------------------------------------------


def test_lost_after_a_404_recreates_the_event_with_the_whole_count() -> None:
    clock = Clock()
    r = recorder(clock)
    r.observe((intent(),))
    (create,), _ = drain(r)
    clock.now = SERIES_FLUSH_S
    r.observe((intent(count=4),))
    patch, _ = r.next_write()
    assert patch is not None and patch.verb == "patch"
    r.lost(patch)  # the API answered 404: expired or deleted
    clock.now = SERIES_FLUSH_S + 1
    again, _ = r.next_write()
    assert again is not None and again.verb == "create"
    assert again.body["series"]["count"] == 5
    assert again.name != create.name


def test_drop_unsent_drops_new_events_and_keeps_series() -> None:
    clock = Clock()
    r = recorder(clock)
    r.observe((intent(pod="known"),))
    drain(r)
    r.observe((intent(pod="known", count=3), intent(pod="new", reason="GPULost")))
    assert r.drop_unsent() == [("GPULost", "dropped")]
    clock.now = SERIES_FLUSH_S
    (patch,), _ = drain(r)
    assert patch.verb == "patch" and patch.count == 4


def test_abandon_forgets_a_new_event_and_keeps_a_series_count() -> None:
    clock = Clock()
    r = recorder(clock)
    r.observe((intent(pod="new"),))
    create, _ = r.next_write()
    assert create is not None
    r.abandon(create)
    assert len(r) == 0
    r.observe((intent(),))
    drain(r)
    clock.now = SERIES_FLUSH_S
    r.observe((intent(count=2),))
    patch, _ = r.next_write()
    assert patch is not None
    r.abandon(patch)
    clock.now = 2 * SERIES_FLUSH_S
    (again,), _ = drain(r)
    assert again.count == 3


# -- the body the API validates ------------------------------------------------------


def first_create(transitions: tuple[HealthTransition, ...], node: str = NODE) -> list[Write]:
    """The creates of one cycle, the pod's before the Node's (the recorder sends the
    Node's first: the more urgent)."""
    r = Recorder(node, clock=Clock(), wall=lambda: WALL0)
    r.observe(event_intents(transitions, node))
    writes, _ = drain(r)
    return sorted(writes, key=lambda w: w.body["regarding"]["kind"] == "Node")


def assert_valid(body: dict[str, Any]) -> None:
    assert event_create_errors(body) == [], body
    assert micro_time_error(body) is None


LOST = HealthTransition(
    "gpu_lost", 3, "GPU-d", pods=(PodRef("ml", "train", "uid-1"),), detail="GpuIsLost"
)


def test_a_pod_event_has_every_field_the_api_validates() -> None:
    pod_event, _node_event = first_create((LOST,))
    body = pod_event.body
    assert_valid(body)
    assert MICRO_TIME.fullmatch(body["eventTime"])
    assert body["reportingController"] == "gpu-occupancy-exporter"
    assert body["reportingInstance"] == NODE
    assert body["action"] and body["reason"] == "GPULost" and body["type"] == "Warning"
    assert body["metadata"]["namespace"] == "ml"
    assert body["regarding"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "train",
        "namespace": "ml",
        "uid": "uid-1",
    }
    assert body["related"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}


def test_a_node_event_lives_in_default_and_names_the_node_by_uid() -> None:
    _pod_event, node_event = first_create((LOST,))
    body = node_event.body
    assert_valid(body)
    assert body["metadata"]["namespace"] == "default" == node_event.namespace
    assert body["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
    assert "related" not in body


def test_a_series_at_create_time_is_valid() -> None:
    storm = HealthTransition(
        "fatal_xid", 0, "GPU-a", xid=79, xid_class="fatal", count=250, pods=LOST.pods
    )
    (create,) = first_create((storm,))
    assert_valid(create.body)
    assert MICRO_TIME.fullmatch(create.body["series"]["lastObservedTime"])


def test_notes_fit_1024_bytes_with_multi_byte_names() -> None:
    pods = (PodRef("ml", "训练" * 40, "uid-1"),)
    wide = HealthTransition("gpu_lost", 0, "GPU-a", pods=pods, detail="错误" * 300)
    leak = HealthTransition(
        "isolation_leak",
        0,
        "GPU-a",
        pods=pods,
        container=None,
        memory_bytes=1,
        detail="🙂" * 300,
    )
    for write in first_create((wide, leak)):
        assert len(write.body["note"].encode()) <= NOTE_BYTES
    for text in ("é" * 2000, "🙂" * 2000, "训" * 1023 + "a", "a" * 5000):
        note = fit_note(text)
        assert len(note.encode()) <= NOTE_BYTES
        assert len(note) > 200  # cut to fit, not emptied


def test_reason_action_and_instance_fit_128_bytes_even_for_a_long_node_name() -> None:
    node = "n" * 63 + "." + "x" * 63 + "." + "y" * 63 + "." + "z" * 61  # 253: the longest name
    for write in first_create((LOST,), node=node):
        body = write.body
        assert_valid(body)
        for key in ("reason", "action", "reportingInstance"):
            assert 0 < len(body[key].encode()) <= 128


def test_an_event_about_a_pod_with_the_longest_name_has_a_valid_name() -> None:
    name = "a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 61
    (write, _) = first_create(
        (HealthTransition("gpu_lost", 0, "GPU-a", pods=(PodRef("ml", name, "uid-1"),)),)
    )
    assert_valid(write.body)
    assert write.body["regarding"]["name"] == name


def test_a_series_update_still_waiting_for_a_token_when_its_window_ends_is_counted() -> None:
    clock = Clock()
    r = recorder(clock, burst=1, writes_per_minute=0.001)
    r.observe((intent(),))
    writes, _ = drain(r)
    assert [w.verb for w in writes] == ["create"]
    clock.now += SERIES_FLUSH_S
    r.observe((intent(),))  # a repeat: its PATCH waits for a token that does not come
    assert drain(r) == ([], [])
    clock.now += NEW_EVENT_EVERY_S
    settled = r.observe((intent(),))  # a new window: the old update is given up, counted
    assert settled == [("GPUFatalXID", "rate_limited")]
