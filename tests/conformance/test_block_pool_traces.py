"""kvref's BlockPool against vLLM 0.25.1's, op by op, partial-block entries included.

``block_pool_traces/seed<N>.json`` were recorded on vLLM's own ``BlockPool`` by
``tools/record_block_pool_traces.py`` (the format is in its docstring): random
sequences of pool calls as a few requests make them, ``cache_partial_block``
among them. vLLM 0.25.1 has no caller of the partial-entry primitives outside
the pool, so the manager-level traces in ``traces/`` cannot reach them; these
do. Replaying needs no vLLM: every op runs on kvref's pool and its answer, the
events it queued and the pool's state afterwards must equal vLLM's.

One thing is compared as a multiset: a run of consecutive ``BlockRemoved``
events (a block losing several keys at once). vLLM keeps a block's extra keys
in a set, so their order follows ``PYTHONHASHSEED``; kvref's follows insertion.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from kvref.core import kv_cache_utils as ku
from kvref.core.block_pool import BlockPool
from kvref.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from kvref.hashing import sha256
from kvref.request import LoRARequest, Request
from kvref.verify.invariants import check_block_pool

# Events are written as the recorder wrote vLLM's (one function for both sides).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from record_block_pool_traces import event_json  # noqa: E402

TRACES = sorted((Path(__file__).parent / "block_pool_traces").glob("*.json"))


@pytest.fixture(autouse=True)
def recorded_hash_seed(monkeypatch):
    """The recording's hash chain: sha256 seeded with PYTHONHASHSEED=0; int event hashes."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    monkeypatch.setattr(ku, "NONE_HASH", ku.NONE_HASH)
    init_none_hash(sha256)


def load(path: Path) -> dict:
    trace = json.loads(path.read_text())
    assert trace["format"] == "blockpooltrace/1" and trace["vllm"] == "0.25.1", path.name
    return trace


# -- what is compared, in the recording's terms -----------------------------------------


def short_key(key: bytes) -> str:
    return f"{key[:8].hex()}/{ku.get_group_id(key)}"


def removals_as_multisets(events: list[dict]) -> list:
    """Each run of consecutive BlockRemoved events sorted; every other event in place."""
    out: list = []
    for event in events:
        if event["type"] == "BlockRemoved" and out and isinstance(out[-1], list):
            out[-1].append(event)
        else:
            out.append([event] if event["type"] == "BlockRemoved" else event)
    return [sorted(x, key=json.dumps) if isinstance(x, list) else x for x in out]


def pool_state(pool: BlockPool) -> dict:
    index: dict[str, list[int]] = {}
    for key, block in pool.cached_block_hash_to_block.items():
        index.setdefault(short_key(key), []).append(block.block_id)
    return {
        "free": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "ref": {str(b.block_id): b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt},
        "hash": {str(b.block_id): [short_key(b.block_hash), b.block_hash_num_tokens]
                 for b in pool.blocks if b.block_hash is not None},
        "extra": {str(bid): sorted(short_key(k) for k in keys)
                  for bid, keys in pool.cached_block_hashes_by_block.items()},
        "index": dict(sorted(index.items())),
    }


# -- the replay ---------------------------------------------------------------------------


def replay(trace: dict) -> int:
    """Run every op on a fresh kvref pool; AssertionError at the first difference
    from vLLM. Returns the number of ops replayed."""
    pool = BlockPool(**trace["pool"])
    check_block_pool(pool)
    requests: dict[str, Request] = {}
    state = pool_state(pool)
    blocks = lambda ids: [pool.blocks[i] for i in ids]  # noqa: E731

    for n, op in enumerate(trace["ops"]):
        name, expect = op["op"], op["expect"]
        req = requests.get(op.get("req"))
        calls = {
            "add_request": lambda: add_request(requests, op),
            "append_tokens": lambda: (req.append_output_token_ids(op["tokens"]),
                                      len(req.block_hashes))[1],
            "get_new_blocks": lambda: pool.get_new_blocks(op["num_blocks"]),
            "touch": lambda: pool.touch(blocks(op["blocks"])),
            "free_blocks": lambda: pool.free_blocks(blocks(op["blocks"])),
            "evict_blocks": lambda: pool.evict_blocks(set(op["blocks"])),
            "reset_prefix_cache": pool.reset_prefix_cache,
            "get_cached_block": lambda: pool.get_cached_block(
                req.block_hashes[op["hash_index"]], op["kv_cache_group_ids"]),
            "cache_full_blocks": lambda: pool.cache_full_blocks(
                req, blocks(op["blocks"]), op["num_cached_blocks"], op["num_full_blocks"],
                op["block_size"], op["kv_cache_group_id"]),
            "cache_partial_block": lambda: pool.cache_partial_block(
                req, pool.blocks[op["block"]], op["num_tokens"], op["kv_cache_group_id"],
                op["block_size"]),
        }
        where = f"op {n} ({name} {json.dumps({k: v for k, v in op.items() if k != 'expect'})})"
        try:
            result = calls[name]()
        except (AssertionError, ValueError) as error:
            got = {"raises": type(error).__name__}
        else:
            got = {"ret": encode(result)}
        want = {k: expect[k] for k in ("ret", "raises") if k in expect}
        assert got == want, f"{where}: kvref answered {got}, vLLM {want}"
        events = [event_json(e) for e in pool.take_events()]
        assert removals_as_multisets(events) == removals_as_multisets(expect["events"]), (
            f"{where}: kvref queued events {events}, vLLM {expect['events']}")
        state = expect.get("state", state)
        now = pool_state(pool)
        for part in state:
            assert now[part] == state[part], (
                f"{where}: pool {part} after the op is {now[part]} on kvref, "
                f"{state[part]} on vLLM")
        check_block_pool(pool)
    return len(trace["ops"])


def add_request(requests: dict, op: dict) -> int:
    lora = LoRARequest(*op["lora"]) if op["lora"] else None
    request = Request(op["req"], op["prompt"], lora_request=lora,
                      block_hasher=get_request_block_hasher(2, sha256))
    requests[op["req"]] = request
    return len(request.block_hashes)


def encode(result):
    if isinstance(result, bytes):
        return short_key(result)
    if isinstance(result, list):
        return [b.block_id for b in result]
    return result


# -- the tests ------------------------------------------------------------------------------


def test_the_recordings_are_here_and_reach_the_partial_entry_paths():
    """Three traces; between them vLLM answered every kind of partial-entry call:
    a new entry, a repeated one, the null block, a refusal, a longer prefix
    replacing a shorter one, a promotion, and blocks holding extra keys."""
    assert len(TRACES) == 3
    seen = set()
    for path in TRACES:
        for op in load(path)["ops"]:
            expect, kinds = op["expect"], [e["type"] for e in op["expect"]["events"]]
            if op["op"] == "cache_partial_block":
                seen.add("raises" if "raises" in expect else
                         "null" if expect["ret"] is None else
                         "replace" if "BlockRemoved" in kinds else
                         "new" if kinds else "repeat")
            if op["op"] == "cache_full_blocks" and "BlockRemoved" in kinds:
                seen.add("promote")
            if expect.get("state", {}).get("extra"):
                seen.add("extra keys")
    assert seen == {"raises", "null", "replace", "new", "repeat", "promote", "extra keys"}


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_kvref_block_pool_answers_as_vllm(path):
    assert replay(load(path)) == 200


def first_op(trace: dict, name: str, has: str) -> dict:
    return next(op for op in trace["ops"] if op["op"] == name and has in op["expect"])


@pytest.mark.parametrize("perturb, message", [
    (lambda t: first_op(t, "cache_partial_block", "ret")["expect"].update(ret="00/0"),
     "kvref answered"),
    (lambda t: first_op(t, "cache_partial_block", "state")["expect"]["state"]["hash"].clear(),
     "pool hash after the op"),
    (lambda t: first_op(t, "get_new_blocks", "state")["expect"]["state"]["free"].append(99),
     "pool free after the op"),
    (lambda t: next(op for op in t["ops"] if op["op"] == "cache_partial_block"
                    and op["expect"]["events"])["expect"]["events"][-1].update(block_size=6),
     "kvref queued events"),
])
def test_the_replay_fails_on_one_perturbed_observation(perturb, message):
    trace = copy.deepcopy(load(TRACES[0]))
    perturb(trace)
    with pytest.raises(AssertionError, match=message):
        replay(trace)
