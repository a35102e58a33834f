#!/usr/bin/env python3
"""Record what vLLM 0.25.1's BlockPool answers to random pool operations,
partial-block entries included, for tests/conformance/test_block_pool_traces.py.

    /root/.cache/vllm-oracle/bin/python tools/record_block_pool_traces.py

Why a pool-level recording: in vLLM 0.25.1 nothing outside the block pool calls
``cache_partial_block``, so the manager-level traces (``tests/conformance/traces``)
cannot reach it. This drives ``vllm.v1.core.block_pool.BlockPool`` directly,
as a few requests would (at most three hold blocks at a time), and writes
``tests/conformance/block_pool_traces/seed<N>.json``, one trace per seed.

A trace (``blockpooltrace/1``) is ``{"format", "vllm", "seed", "pool",
"group_block_sizes", "ops"}``. Each op names a pool method and its arguments
(blocks by id, requests by name), or request bookkeeping (``add_request``,
``append_tokens``), and carries ``expect``:

- ``ret`` (block ids, a key, a bool, ``None``) or ``raises`` (the class name);
- ``events``: what ``take_events()`` returned right after, hashes as vLLM's
  events carry them (the low 64 bits as an int);
- ``state``, only when it changed: the free queue head to tail, ``ref_cnt`` of
  blocks in use, each hashed block's key and ``block_hash_num_tokens``, the
  extra keys per block (sorted: vLLM keeps a set), and the index
  (key -> block ids, oldest first). A key is written ``<first 8 bytes of the
  hash, hex>/<group id>``.

Runs with ``PYTHONHASHSEED=0`` (it re-executes itself so): the hash chain's
seed, and vLLM's set order, are then fixed.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests/conformance/block_pool_traces"
SEEDS = (1, 2, 3)
NUM_OPS = 200
NUM_GPU_BLOCKS = 10
HASH_BLOCK_SIZE = 2
GROUP_BLOCK_SIZES = {0: 6, 1: 4}     # group id -> block_size; both coarser than the hashes
MAX_OWNERS = 3
PREFIXES = [list(range(100, 112)), list(range(100, 106)) + list(range(300, 306)),
            list(range(500, 508))]


def short_key(key: bytes) -> str:
    return f"{key[:8].hex()}/{int.from_bytes(key[-4:], 'big')}"


def event_json(event) -> dict:
    kind = type(event).__name__
    if kind == "BlockStored":
        return {"type": kind, "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": event.lora_id,
                "lora_name": event.lora_name, "medium": event.medium,
                "extra_keys": (None if event.extra_keys is None else
                               [None if k is None else list(k) for k in event.extra_keys]),
                "group_idx": event.group_idx}
    if kind == "BlockRemoved":
        return {"type": kind, "block_hashes": list(event.block_hashes),
                "medium": event.medium, "group_idx": event.group_idx}
    return {"type": kind}


def pool_state(pool) -> dict:
    """The snapshot a trace compares (null block left out)."""
    extra = getattr(pool, "cached_block_hashes_by_block", {})
    index: dict[str, list[int]] = {}
    for key, value in pool.cached_block_hash_to_block._cache.items():
        blocks = value.values() if isinstance(value, dict) else [value]
        index[short_key(key)] = [b.block_id for b in blocks]
    return {
        "free": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "ref": {str(b.block_id): b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt},
        "hash": {str(b.block_id): [short_key(b.block_hash), b.block_hash_num_tokens]
                 for b in pool.blocks if b.block_hash is not None},
        "extra": {str(bid): sorted(short_key(k) for k in keys) for bid, keys in extra.items()},
        "index": dict(sorted(index.items())),
    }


class Recorder:
    """Draws operations as a few requests would make them and records vLLM's answers."""

    def __init__(self, seed: int) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_utils import init_none_hash

        init_none_hash(sha256)
        self.rng = random.Random(seed)
        self.pool = BlockPool(NUM_GPU_BLOCKS, enable_caching=True,
                              hash_block_size=HASH_BLOCK_SIZE, enable_kv_cache_events=True)
        self.requests: dict = {}                  # every request ever added, by name
        self.owners: dict[str, dict] = {}         # name -> group, table (ids), num_cached
        self.ops: list[dict] = []
        self.last_state = pool_state(self.pool)

    # -- running one op on vLLM -------------------------------------------------

    def call(self, op: dict, run) -> object:
        expect: dict = {}
        try:
            result = run()
        except (AssertionError, ValueError) as error:
            expect["raises"], result = type(error).__name__, error
        else:
            expect["ret"] = self.encode(result)
        expect["events"] = [event_json(e) for e in self.pool.take_events()]
        state = pool_state(self.pool)
        if state != self.last_state:
            expect["state"] = self.last_state = state
        op["expect"] = expect
        self.ops.append(op)
        return result

    @staticmethod
    def encode(result):
        if isinstance(result, bytes):
            return short_key(result)
        if isinstance(result, list):
            return [b.block_id for b in result]
        return result

    def blocks(self, ids):
        return [self.pool.blocks[i] for i in ids]

    # -- the operations -----------------------------------------------------------

    def add_request(self) -> None:
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.utils.hashing import sha256
        from vllm.v1.request import Request

        name = f"r{len(self.requests)}"
        prompt = self.rng.choice(PREFIXES)[: self.rng.randint(4, 12)]
        prompt += [self.rng.randrange(1000, 1004) for _ in range(self.rng.randint(0, 8))]
        lora = ["sql", 7] if self.rng.random() < 0.2 else None
        params = SamplingParams(max_tokens=17)
        params.update_from_generation_config({}, eos_token_id=100)
        request = Request(request_id=name, prompt_token_ids=prompt, sampling_params=params,
                          pooling_params=None,
                          block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256),
                          lora_request=LoRARequest(*lora, lora_path="/adapters/sql")
                          if lora else None)
        self.requests[name] = request
        group = self.rng.choice(sorted(GROUP_BLOCK_SIZES))
        self.owners[name] = {"group": group, "table": [], "num_cached": 0}
        self.call({"op": "add_request", "req": name, "prompt": prompt, "lora": lora},
                  lambda: len(request.block_hashes))
        self.hit_prefix(name)

    def hit_prefix(self, name: str) -> None:
        """Look the new request's full blocks up one by one, then touch the hit."""
        owner, request = self.owners[name], self.requests[name]
        scale = GROUP_BLOCK_SIZES[owner["group"]] // HASH_BLOCK_SIZE
        hit: list[int] = []
        for i in range(len(request.block_hashes) // scale):
            found = self.lookup(name, (i + 1) * scale - 1, [owner["group"]])
            if found is None:
                break
            hit.append(found[0].block_id)
        if hit:
            self.call({"op": "touch", "blocks": hit}, lambda: self.pool.touch(self.blocks(hit)))
            owner["table"], owner["num_cached"] = list(hit), len(hit)

    def lookup(self, name: str, hash_index: int, group_ids: list[int]):
        block_hash = self.requests[name].block_hashes[hash_index]
        return self.call({"op": "get_cached_block", "req": name, "hash_index": hash_index,
                          "kv_cache_group_ids": group_ids},
                         lambda: self.pool.get_cached_block(block_hash, group_ids))

    def allocate(self, name: str) -> None:
        n = self.rng.choice([1, 1, 2, 3, 0, 9])
        got = self.call({"op": "get_new_blocks", "num_blocks": n},
                        lambda: self.pool.get_new_blocks(n))
        if isinstance(got, list):
            self.owners[name]["table"] += [b.block_id for b in got]

    def append_tokens(self, name: str) -> None:
        request = self.requests[name]
        tokens = [self.rng.randrange(2000, 2003) for _ in range(self.rng.randint(1, 5))]
        self.call({"op": "append_tokens", "req": name, "tokens": tokens},
                  lambda: (request.append_output_token_ids(tokens), len(request.block_hashes))[1])

    def cache_full(self, name: str) -> None:
        owner, request = self.owners[name], self.requests[name]
        block_size = GROUP_BLOCK_SIZES[owner["group"]]
        most = min(len(owner["table"]), len(request.block_hashes) * HASH_BLOCK_SIZE // block_size)
        if most < owner["num_cached"]:
            return
        num_full = self.rng.randint(owner["num_cached"], most)
        table = list(owner["table"])
        self.call({"op": "cache_full_blocks", "req": name, "blocks": table,
                   "num_cached_blocks": owner["num_cached"], "num_full_blocks": num_full,
                   "block_size": block_size, "kv_cache_group_id": owner["group"]},
                  lambda: self.pool.cache_full_blocks(request, self.blocks(table),
                                                      owner["num_cached"], num_full,
                                                      block_size, owner["group"]))
        owner["num_cached"] = max(owner["num_cached"], num_full)

    def cache_partial(self, name: str) -> None:
        """A prefix ending inside one of the owner's blocks; now and then an
        argument vLLM refuses (off the hash grid, a block boundary, beyond the
        request's hashes, a block size no coarser than the hashes)."""
        owner, request = self.owners[name], self.requests[name]
        block_size = GROUP_BLOCK_SIZES[owner["group"]]
        # Mostly the block being filled (so longer prefixes replace shorter
        # ones), sometimes an earlier one (a full block: an extra key) or a
        # released slot (the null block: nothing).
        table = owner["table"]
        held = [i for i, b in enumerate(table) if b != 0] or [len(table) - 1]
        position = self.rng.choice([held[-1], held[-1], self.rng.choice(held),
                                    self.rng.randrange(len(table))])
        num_tokens = position * block_size + self.rng.randrange(HASH_BLOCK_SIZE, block_size,
                                                                HASH_BLOCK_SIZE)
        bad = self.rng.random()
        if bad < 0.05:
            num_tokens += 1
        elif bad < 0.1:
            num_tokens = (position + 1) * block_size
        elif bad < 0.12:
            block_size = HASH_BLOCK_SIZE
        block_id = owner["table"][position]
        self.call({"op": "cache_partial_block", "req": name, "block": block_id,
                   "num_tokens": num_tokens, "kv_cache_group_id": owner["group"],
                   "block_size": block_size},
                  lambda: self.pool.cache_partial_block(request, self.pool.blocks[block_id],
                                                        num_tokens, owner["group"], block_size))

    def release(self, name: str) -> None:
        """One block leaves the owner's table (a window slid past it)."""
        table = self.owners[name]["table"]
        held = [i for i, b in enumerate(table) if b != 0]
        if not held:
            return
        position = self.rng.choice(held)
        block_id, table[position] = table[position], 0
        self.call({"op": "free_blocks", "blocks": [block_id]},
                  lambda: self.pool.free_blocks(self.blocks([block_id])))

    def finish(self, name: str) -> None:
        owner = self.owners.pop(name)
        order = [b for b in reversed(owner["table"]) if b != 0]
        if self.rng.random() < 0.3:
            self.rng.shuffle(order)
        self.call({"op": "free_blocks", "blocks": order},
                  lambda: self.pool.free_blocks(self.blocks(order)))

    def evict(self) -> None:
        ids = sorted(self.rng.sample(range(NUM_GPU_BLOCKS), self.rng.randint(1, 2)))
        self.call({"op": "evict_blocks", "blocks": ids},
                  lambda: self.pool.evict_blocks(set(ids)))

    def look_around(self) -> None:
        name = self.rng.choice(sorted(self.requests))
        hashes = self.requests[name].block_hashes
        if hashes:
            self.lookup(name, self.rng.randrange(len(hashes)),
                        self.rng.choice([[0], [1], [0, 1]]))

    def reset(self) -> None:
        self.call({"op": "reset_prefix_cache"}, self.pool.reset_prefix_cache)

    # -- the random walk -----------------------------------------------------------

    def run(self, num_ops: int) -> list[dict]:
        while len(self.ops) < num_ops:
            holders = [n for n, o in self.owners.items() if o["table"]]
            choices = ["allocate", "append", "look"] * 2
            if len(self.owners) < MAX_OWNERS:
                choices += ["add"] * 2
            if holders:
                choices += ["partial"] * 4 + ["full"] * 3 + ["release", "evict"]
            if self.owners:
                choices += ["finish"]
            if self.rng.random() < 0.03:
                choices = ["reset"]
            what = self.rng.choice(choices)
            if what == "add":
                self.add_request()
            elif what == "reset":
                self.reset()
            elif what == "evict":
                self.evict()
            elif what == "look" and self.requests:
                self.look_around()
            elif what in ("partial", "full", "release"):
                name = self.rng.choice(holders)
                {"partial": self.cache_partial, "full": self.cache_full,
                 "release": self.release}[what](name)
            elif self.owners and what in ("allocate", "append", "finish"):
                name = self.rng.choice(sorted(self.owners))
                {"allocate": self.allocate, "append": self.append_tokens,
                 "finish": self.finish}[what](name)
        return self.ops


def write_trace(path: Path, trace: dict) -> None:
    """JSON with one op per line, so a diff of two recordings reads op by op."""
    head = {k: v for k, v in trace.items() if k != "ops"}
    lines = [json.dumps(head)[:-1] + ', "ops": [']
    lines += [json.dumps(op) + ("," if i < len(trace["ops"]) - 1 else "")
              for i, op in enumerate(trace["ops"])]
    lines.append("]}")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    import vllm

    OUT.mkdir(parents=True, exist_ok=True)
    for seed in SEEDS:
        ops = Recorder(seed).run(NUM_OPS)
        trace = {"format": "blockpooltrace/1", "vllm": vllm.__version__, "seed": seed,
                 "pool": {"num_gpu_blocks": NUM_GPU_BLOCKS, "enable_caching": True,
                          "hash_block_size": HASH_BLOCK_SIZE, "enable_kv_cache_events": True},
                 "group_block_sizes": {str(g): b for g, b in GROUP_BLOCK_SIZES.items()},
                 "ops": ops}
        path = OUT / f"seed{seed}.json"
        write_trace(path, trace)
        counts: dict[str, int] = {}
        for op in ops:
            counts[op["op"]] = counts.get(op["op"], 0) + 1
        print(f"{path.name}: {len(ops)} ops {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
