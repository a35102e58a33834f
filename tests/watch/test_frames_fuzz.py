"""Frames from the network are untrusted input: whatever a sender sends, the
watcher says what it dropped in one line, counts it, and keeps its index.

Hypothesis builds truncated, oversized and wrongly typed frames and msgpack
payloads (vLLM's own recorded batches with one field changed, cut short, or
replaced by any msgpack value), and frames out of order; each is handed to
``Watcher.handle`` as the socket would hand it over.
"""

from __future__ import annotations

import copy

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvref.watch import PrefixCacheIndex, Watcher, decode_message

from tests.watch.test_watch import frames_of, free_port

FRAMES = frames_of("full")
PREFIX = 5                                    # batches applied before the fuzzing starts

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) |
    st.floats(allow_nan=True) | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) |
    st.dictionaries(st.text(max_size=6) | st.integers(0, 3), inner, max_size=4),
    max_leaves=20)


@st.composite
def bad_payloads(draw) -> bytes:
    """vLLM's batch PREFIX with one part broken, or bytes that are not msgpack."""
    body = msgspec.msgpack.decode(FRAMES[PREFIX][2])
    how = draw(st.sampled_from(["field", "event", "batch", "truncated", "bytes"]))
    if how == "truncated":
        payload = FRAMES[PREFIX][2]
        return payload[:draw(st.integers(0, len(payload) - 1))]
    if how == "bytes":
        return draw(st.binary(max_size=64))
    body = copy.deepcopy(body)
    if how == "batch":
        body[draw(st.integers(0, len(body) - 1))] = draw(msgpack_values)
    else:
        events = body[1]
        i = draw(st.integers(0, len(events) - 1))
        if how == "event":
            events[i] = draw(msgpack_values)
        else:
            key = draw(st.sampled_from(sorted(events[i]) + ["type"]))
            events[i][key] = draw(msgpack_values)
    return msgspec.msgpack.encode(body)


@st.composite
def bad_frames(draw) -> list[bytes]:
    how = draw(st.sampled_from(["payload", "seq", "count", "oversized"]))
    topic, seq, payload = FRAMES[PREFIX]
    if how == "payload":
        return [topic, seq, draw(bad_payloads())]
    if how == "seq":
        return [topic, draw(st.binary(max_size=12).filter(lambda b: len(b) != 8)), payload]
    if how == "count":
        return draw(st.lists(st.binary(max_size=16), max_size=6).filter(lambda f: len(f) != 3))
    # a block of a million tokens: many blocks' worth, each one checked
    return [topic, seq, msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                "token_ids": list(range(1 << 20)), "block_size": 0, "lora_id": None,
                "medium": "GPU", "lora_name": None}], 0])]


def is_broken(frames: list[bytes]) -> bool:
    try:
        decode_message(frames)
    except ValueError:
        return True
    return False


WATCHER: Watcher | None = None


def fresh_watcher() -> Watcher:
    """One socket for the whole test; its state made new for each example."""
    global WATCHER
    if WATCHER is None:
        WATCHER = Watcher(f"tcp://127.0.0.1:{free_port()}")
    w = WATCHER
    w._start_over("a new example", restart=False)
    w.dropped, w.duplicates, w.batches, w.last_dropped = 0, 0, 0, ""
    for frame in FRAMES[:PREFIX]:
        assert w.handle(frame) == 1
    return w


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(bad_frames() | st.integers(0, PREFIX - 1), min_size=1, max_size=6))
def test_no_frame_a_sender_sends_moves_the_index_or_escapes_as_an_exception(attack):
    watcher = fresh_watcher()
    blocks, next_seq = dict(watcher.index.blocks), watcher.next_seq
    dropped = duplicates = 0
    for item in attack:
        if isinstance(item, int):            # an old batch again: out of order
            frames, duplicates = FRAMES[item], duplicates + 1
        else:
            frames = item
            if not is_broken(frames):        # a change that is still a valid batch
                continue
            dropped += 1
        assert watcher.handle(frames) == 0
        assert (watcher.dropped, watcher.duplicates) == (dropped, duplicates)
        assert dict(watcher.index.blocks) == blocks and watcher.next_seq == next_seq
        if dropped:
            reason = watcher.last_dropped
            assert "\n" not in reason and len(reason) < 400 and "is not vLLM's" in reason
    # and the watcher goes on: the next real batch is applied
    assert watcher.handle(FRAMES[PREFIX]) == 1 and watcher.next_seq == PREFIX + 1
    assert len(watcher.recent) <= watcher.recent.maxlen


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_any_bytes_decode_to_a_batch_or_one_value_error(frames):
    try:
        decode_message(frames)
    except ValueError as exc:
        assert "\n" not in str(exc)


def net_growth(frame) -> tuple[int, int]:
    """(blocks stored, blocks removed) by one recorded batch; a reset gives (-1, -1)."""
    events = msgspec.msgpack.decode(frame[2])[1]
    if any(e["type"] == "AllBlocksCleared" for e in events):
        return -1, -1
    return (sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored"),
            sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockRemoved"))


def test_a_batch_that_would_grow_the_index_past_its_bound_is_dropped():
    watcher = fresh_watcher()
    try:
        i = next(i for i in range(PREFIX, len(FRAMES))
                 if net_growth(FRAMES[i])[0] > max(0, net_growth(FRAMES[i])[1]))
        for frame in FRAMES[PREFIX:i]:
            watcher.handle(frame)
        watcher.max_blocks = watcher.index.cached_blocks   # full: nothing more may come
        blocks = dict(watcher.index.blocks)
        assert watcher.handle(FRAMES[i]) == 0
        assert dict(watcher.index.blocks) == blocks and watcher.dropped == 1
        assert "more than" in watcher.last_dropped and watcher.unknown_since is not None
    finally:
        watcher.max_blocks = 1 << 22


def test_a_full_pool_that_evicts_to_store_is_not_dropped():
    """With --num-gpu-blocks the bound is the pool: a batch that evicts as many
    blocks as it stores keeps the index at the bound, and is applied."""
    watcher = fresh_watcher()
    try:
        i = next(i for i in range(PREFIX, len(FRAMES)) if 0 < net_growth(FRAMES[i])[1])
        for frame in FRAMES[PREFIX:i]:
            watcher.handle(frame)
        stored, removed = net_growth(FRAMES[i])
        watcher.max_blocks = max(watcher.index.cached_blocks,
                                 watcher.index.cached_blocks + stored - removed)
        assert watcher.handle(FRAMES[i]) == 1 and watcher.dropped == 0
    finally:
        watcher.max_blocks = 1 << 22


def test_the_count_of_cached_blocks_is_the_index_itself():
    for workload in ("full", "hybrid", "swa", "bytes-hashes"):
        index = PrefixCacheIndex()
        for frame in frames_of(workload):
            for event in decode_message(frame).events:
                index.apply(event)
                assert index.cached_blocks == sum(index.blocks.values())
