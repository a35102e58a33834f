"""Replay recorded vLLM traces (format ``kvtrace/1``) against kvref.

A trace records how a scheduler drove the real vLLM v0.25.1 KV cache manager:
the config, every call, and what vLLM answered (return value, exception, and a
digest of the pool after the call). Replaying it on kvref and comparing answer
by answer shows the first place where kvref would teach something else.
``tests/conformance/README.md`` summarises the format. Use::

    result = replay_file("tests/conformance/traces/full/full-public-00001.json.gz")
    print(result.divergence or "identical to vLLM")

or ``kvref replay PATH...`` from the command line.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvref.core import kv_cache_utils
from kvref.hashing import sha256, sha256_cbor
from kvref.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvref.core.kv_cache_manager import KVCacheManager
from kvref.request import (
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    RequestStatus,
)
from kvref.verify.invariants import check_kv_cache_manager

TRACE_FORMAT = "kvtrace/1"
HASH_FUNCTIONS = {"sha256": sha256, "sha256_cbor": sha256_cbor}
# allocate_slots keyword arguments a trace may set, with vLLM's defaults.
ALLOCATE_DEFAULTS = {
    "num_new_computed_tokens": 0, "new_computed_blocks": None, "num_lookahead_tokens": 0,
    "num_external_computed_tokens": 0, "delay_cache_blocks": False,
    "num_encoder_tokens": 0, "full_sequence_must_fit": False, "reserved_blocks": 0,
    "has_scheduled_reqs": True,
}
_NO_RETURN = object()


class MalformedTrace(ValueError):
    """The trace itself is wrong (unknown op, unknown request): not a divergence."""


@dataclass
class Divergence:
    """The first observation where kvref and vLLM disagree."""

    index: int          # op index, -1 for construction
    op: dict | None
    path: str           # where in the observation, e.g. "state.free[0]"
    expected: Any
    actual: Any

    def __str__(self) -> str:
        where = "construction" if self.op is None else f"op #{self.index} {self.op.get('op')}"
        return f"{where}: {self.path}: expected {self.expected!r}, got {self.actual!r}"


@dataclass
class ReplayResult:
    name: str
    num_ops: int
    divergence: Divergence | None


def load_trace(path: str | os.PathLike) -> dict:
    """Read a ``.json`` or ``.json.gz`` trace; ``ValueError`` if not kvtrace/1."""
    path = str(path)
    with (gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz")
          else open(path, encoding="utf-8")) as f:
        trace = json.load(f)
    if trace.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: not a {TRACE_FORMAT} trace "
                         f"(format={trace.get('format')!r})")
    return trace


def find_traces(paths) -> Iterator[Path]:
    """Trace files under the given files and folders, sorted."""
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(q for q in p.rglob("*")
                              if q.name.endswith((".json", ".json.gz")))
        else:
            yield p


# --------------------------------------------------------------------------
# what is observed after each op


def _hash_hex(h) -> str | None:
    if h is None:
        return None
    return format(h, "016x") if isinstance(h, int) else bytes(h).hex()


def _jsonable(value):
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value.hex() if isinstance(value, bytes) else value


def _event(ev) -> dict:
    kind = type(ev).__name__
    if kind == "BlockStored":
        return {"type": kind, "block_hashes": [_hash_hex(h) for h in ev.block_hashes],
                "parent_block_hash": _hash_hex(ev.parent_block_hash),
                "token_ids": list(ev.token_ids), "block_size": ev.block_size,
                "lora_id": ev.lora_id, "medium": ev.medium, "lora_name": ev.lora_name,
                "extra_keys": _jsonable(ev.extra_keys), "group_idx": ev.group_idx,
                "kv_cache_spec_kind": ev.kv_cache_spec_kind,
                "kv_cache_spec_sliding_window": ev.kv_cache_spec_sliding_window}
    if kind == "BlockRemoved":
        return {"type": kind, "block_hashes": [_hash_hex(h) for h in ev.block_hashes],
                "medium": ev.medium, "group_idx": ev.group_idx}
    return {"type": kind}


def _request_digest(req: Request) -> dict:
    return {"num_tokens": req.num_tokens, "num_block_hashes": len(req.block_hashes),
            "last_block_hash": _hash_hex(req.block_hashes[-1]) if req.block_hashes else None}


def pool_digest(manager: KVCacheManager) -> dict:
    """Free-queue order, ref counts and hashed blocks (the null block left out:
    vLLM does not keep its ref_cnt)."""
    pool = manager.block_pool
    real = [b for b in pool.blocks if not b.is_null]
    return {"nfree": pool.get_num_free_blocks(),
            "free": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "ref": [[b.block_id, b.ref_cnt] for b in real if b.ref_cnt != 0],
            "hashed": [b.block_id for b in real if b.block_hash is not None]}


def _ids(kv_blocks) -> list[list[int]]:
    return [[b.block_id for b in group] for group in kv_blocks.blocks]


# --------------------------------------------------------------------------
# building kvref from a trace header, and running ops


def _spec(group: dict):
    kind, block_size = group["kind"], group["block_size"]
    heads = dict(num_kv_heads=group.get("num_kv_heads", 1), head_size=group.get("head_size", 1))
    if kind == "full":
        return FullAttentionSpec(block_size, **heads)
    if kind == "rswa":
        return RSWASpec(block_size, rswa_window=group["rswa_window"], **heads)
    if kind == "sink_full":
        return SinkFullAttentionSpec(block_size, sink_len=group["sink_len"], **heads)
    if kind == "sliding_window":
        return SlidingWindowSpec(block_size, group["sliding_window"], **heads)
    if kind == "chunked_local":
        return ChunkedLocalAttentionSpec(block_size, group["attention_chunk_size"], **heads)
    if kind == "mamba":
        return MambaSpec(block_size, group["mamba_cache_mode"],
                         group.get("num_speculative_blocks", 0))
    if kind == "cross_attention":
        return CrossAttentionSpec(block_size, **heads)
    raise MalformedTrace(f"unknown group kind {kind!r}")


def seeded_none_hash(utils: Any, hash_fn: Any, seed: str | None) -> bytes:
    """Run ``utils.init_none_hash(hash_fn)`` as a process with ``PYTHONHASHSEED=seed``
    would (``None``: unset), leave the environment as it was, return ``NONE_HASH``.

    ``utils`` is kvref's ``kv_cache_utils`` or vLLM's (the benchmarks pass either):
    the first block's parent hash depends on the seed, so a replay must reproduce it.
    """
    saved = os.environ.get("PYTHONHASHSEED")
    try:
        if seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = seed
        utils.init_none_hash(hash_fn)
    finally:
        if saved is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved
    return utils.NONE_HASH


def prompt_embeds_tensor(op: dict):
    """The ``prompt_embeds`` of an ``add_request`` op as a tensor
    ``[num_prompt_tokens, hidden_size]``, or None when the op has none.

    A trace writes them as ``{"dtype": "float32", "rows": [[...], ...]}``, one
    row per prompt position; the bytes of each block's rows join its hash.
    Only such traces need torch (the tensor is made on the engine side).
    """
    embeds = op.get("prompt_embeds")
    if embeds is None:
        return None
    rows = embeds.get("rows")
    if (not isinstance(rows, list) or len(rows) != len(op["prompt"])
            or len({len(row) for row in rows}) != 1):
        raise MalformedTrace(f"request {op.get('req')!r}: prompt_embeds needs one row of "
                             f"equal length per prompt token ({len(op['prompt'])})")
    try:
        return prompt_embeds_from_rows(rows, embeds.get("dtype"))
    except ValueError as exc:
        raise MalformedTrace(f"request {op.get('req')!r}: {exc}") from None


def prompt_embeds_from_rows(rows: list[list[float]], dtype: str) -> Any:
    """Prompt embeddings ``[num_prompt_tokens, hidden_size]`` from plain rows, as
    a tensor of the dtype named ``dtype`` (``"float32"``). Only traces with
    embeddings need torch, so it is imported here on first use; the KV layer
    itself only hashes the tensor's bytes. ``ValueError`` if ``dtype`` names no
    torch dtype."""
    import torch

    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"prompt_embeds dtype {dtype!r} is not a torch dtype name")
    return torch.tensor(rows, dtype=torch_dtype)


class TraceReplayer:
    """One kvref manager built from a trace header, and the ops run against it.

    What it builds (``utils``, ``hash_functions``, ``build_manager``,
    ``make_request``) is all that ties it to kvref: ``tools/record_vllm_traces.py``
    overrides those four to run the same ops, observed the same way, on vLLM.
    """

    utils: Any = kv_cache_utils                 # the module whose NONE_HASH seeds the chain
    hash_functions: dict = HASH_FUNCTIONS
    manager_class: type = KVCacheManager        # kvref explain's player keeps the gates

    def __init__(self, header: dict) -> None:
        hashing = header["hash"]
        self.hash_fn = self.hash_functions[hashing["algo"]]
        self.none_hash = seeded_none_hash(self.utils, self.hash_fn,
                                          hashing.get("none_hash_seed"))
        self.manager = self.build_manager(header)
        m = header["manager"]
        use_hasher = hashing.get("block_hasher", m["enable_caching"])
        self.block_hasher = (self.utils.get_request_block_hasher(m["hash_block_size"],
                                                                 self.hash_fn)
                             if use_hasher else None)
        self.requests: dict[str, Any] = {}
        self.last_hit: dict[str, Any] = {}      # the KVCacheBlocks object itself
        self.handles: dict[str, list] = {}

    def build_manager(self, header: dict) -> KVCacheManager:
        """The manager of the header: groups, then ``manager_class(config, **manager)``."""
        groups = [KVCacheGroupSpec(g.get("layer_names", [f"layer.{i}"]), _spec(g),
                                   is_eagle_group=g.get("is_eagle_group", False))
                  for i, g in enumerate(header["groups"])]
        m = header["manager"]
        return self.manager_class(
            KVCacheConfig(header["num_blocks"], groups),
            max_model_len=m["max_model_len"], scheduler_block_size=m["scheduler_block_size"],
            hash_block_size=m["hash_block_size"],
            max_num_batched_tokens=m.get("max_num_batched_tokens"),
            enable_caching=m["enable_caching"], use_eagle=m.get("use_eagle", False),
            log_stats=m.get("log_stats", False),
            enable_kv_cache_events=m.get("enable_kv_cache_events", False),
            watermark=m.get("watermark", 0.0),
            # Recorded with VLLM_PREFIX_CACHE_RETENTION_INTERVAL set to this
            # (absent: unset); explicit, so the replaying shell's variable is ignored.
            retention_interval=header.get("prefix_cache_retention_interval"))

    def make_request(self, op: dict) -> Request:
        """The ``Request`` of an ``add_request`` op."""
        lora = op.get("lora")
        features = [MultiModalFeatureSpec(f["identifier"],
                                          PlaceholderRange(f["offset"], f["length"]),
                                          f.get("modality", "image"))
                    for f in op.get("mm_features") or []]
        return Request(op["req"], list(op["prompt"]), block_hasher=self.block_hasher,
                       lora_request=LoRARequest(lora["name"], lora["id"]) if lora else None,
                       cache_salt=op.get("cache_salt"), mm_features=features or None,
                       skip_reading_prefix_cache=bool(op.get("skip_reading_prefix_cache")),
                       max_tokens=op.get("max_tokens"),
                       prompt_embeds=prompt_embeds_tensor(op))

    def initial_observation(self) -> dict:
        return {"watermark_blocks": self.manager.watermark_blocks,
                "num_free_blocks": self.manager.block_pool.get_num_free_blocks(),
                "num_kv_cache_groups": len(self.manager.empty_kv_cache_blocks.blocks),
                "state": pool_digest(self.manager)}

    def run(self, op: dict) -> dict:
        """Run one op; return ``{"ret"?, "raises"?, "state"}``."""
        # Another trace may have re-seeded the chain in between.
        self.utils.NONE_HASH = self.none_hash
        handler = getattr(self, "_op_" + op["op"], None)
        if handler is None:
            raise MalformedTrace(f"unknown op {op['op']!r}")
        observed: dict = {}
        try:
            ret = handler(op)
            if ret is not _NO_RETURN:
                observed["ret"] = ret
        except (MalformedTrace, ModuleNotFoundError):
            raise                                 # bad input, or a trace that needs torch
        except Exception as exc:  # the exception is what vLLM is compared on
            observed["raises"] = type(exc).__name__
        observed["state"] = pool_digest(self.manager)
        return observed

    def _request(self, op: dict) -> Request:
        try:
            return self.requests[op["req"]]
        except KeyError:
            raise MalformedTrace(f"unknown request {op['req']!r}") from None

    # One method per op type; names follow the trace's op names.

    def _op_add_request(self, op):
        if op["req"] in self.requests:
            raise MalformedTrace(f"duplicate request {op['req']!r}")
        req = self.make_request(op)
        self.requests[op["req"]] = req
        return _request_digest(req)

    def _op_get_computed_blocks(self, op):
        blocks, num_tokens = self.manager.get_computed_blocks(self._request(op))
        self.last_hit[op["req"]] = blocks
        return {"blocks": _ids(blocks), "num_computed_tokens": num_tokens}

    def _op_allocate_slots(self, op):
        kwargs = {k: op.get(k, default) for k, default in ALLOCATE_DEFAULTS.items()}
        which = kwargs["new_computed_blocks"]
        if which == "last":
            if op["req"] not in self.last_hit:
                raise MalformedTrace("new_computed_blocks='last' before get_computed_blocks")
            kwargs["new_computed_blocks"] = self.last_hit[op["req"]]
        elif which == "empty":
            kwargs["new_computed_blocks"] = self.manager.empty_kv_cache_blocks
        elif which is not None:
            raise MalformedTrace(f"bad new_computed_blocks {which!r}")
        new = self.manager.allocate_slots(self._request(op), op["num_new_tokens"], **kwargs)
        return None if new is None else _ids(new)

    def _op_free(self, op):
        self.manager.free(self._request(op))
        return _NO_RETURN

    def _op_pop_blocks_for_free(self, op):
        blocks = self.manager.pop_blocks_for_free(self._request(op))
        self.handles[op["handle"]] = blocks
        return [b.block_id for b in blocks]

    def _op_block_pool_free_blocks(self, op):
        if op["handle"] not in self.handles:
            raise MalformedTrace(f"unknown handle {op['handle']!r}")
        blocks = self.handles.pop(op["handle"])
        self.manager.block_pool.free_blocks(
            list(reversed(blocks)) if op.get("reverse", True) else blocks)
        return _NO_RETURN

    def _op_remove_skipped_blocks(self, op):
        self.manager.remove_skipped_blocks(op["req"], op["total_computed_tokens"],
                                           op.get("num_prompt_tokens"))
        return _NO_RETURN

    def _op_evict_blocks(self, op):
        self.manager.evict_blocks(set(op["block_ids"]))
        return _NO_RETURN

    def _op_reset_prefix_cache(self, op):
        return self.manager.reset_prefix_cache()

    def _op_get_num_common_prefix_blocks(self, op):
        return list(self.manager.get_num_common_prefix_blocks(op["req"]))

    def _op_take_events(self, op):
        return [_event(ev) for ev in self.manager.take_events()]

    def _op_take_new_block_ids(self, op):
        return list(self.manager.take_new_block_ids())

    def _op_new_step_starts(self, op):
        self.manager.new_step_starts()
        return _NO_RETURN

    def _op_get_block_ids(self, op):
        return [list(ids) for ids in self.manager.get_block_ids(op["req"])]

    def _op_get_block_ids_for_computed_tokens(self, op):
        return [list(ids) for ids in self.manager.get_block_ids_for_computed_tokens(
            op["req"], op["num_computed_tokens"])]

    def _op_cache_blocks(self, op):
        self.manager.cache_blocks(self._request(op), op["num_computed_tokens"])
        return _NO_RETURN

    def _op_usage(self, op):
        return self.manager.usage

    def _op_num_free_blocks(self, op):
        return self.manager.block_pool.get_num_free_blocks()

    def _op_make_prefix_cache_stats(self, op):
        stats = self.manager.make_prefix_cache_stats()
        if stats is None:
            return None
        return {k: getattr(stats, k) for k in ("requests", "queries", "hits",
                                               "preempted_requests", "preempted_queries",
                                               "preempted_hits", "reset")}

    def _op_set_num_computed_tokens(self, op):
        self._request(op).num_computed_tokens = op["value"]
        return _NO_RETURN

    def _op_set_status(self, op):
        self._request(op).status = RequestStatus[op["value"]]
        return _NO_RETURN

    def _op_set_num_preemptions(self, op):
        self._request(op).num_preemptions = op["value"]
        return _NO_RETURN

    def _op_append_output_token_ids(self, op):
        req = self._request(op)
        req.append_output_token_ids(list(op["tokens"]))
        return _request_digest(req)


# --------------------------------------------------------------------------
# comparing


def first_difference(expected, actual, path: str = "") -> tuple[str, Any, Any] | None:
    """``(path, expected, actual)`` of the first difference, or None.

    Exact for ints, strings, bools (a bool never equals an int) and None;
    floats within 1e-9 (only ``usage`` is a float); lists by length and item;
    dicts by keys both ways.
    """
    if isinstance(expected, bool) or isinstance(actual, bool):
        same = type(expected) is type(actual) and expected == actual
    elif isinstance(expected, float) or isinstance(actual, float):
        same = (isinstance(expected, (int, float)) and isinstance(actual, (int, float))
                and math.isclose(expected, actual, rel_tol=0, abs_tol=1e-9))
    elif isinstance(expected, dict) and isinstance(actual, dict):
        for key in list(expected) + [k for k in actual if k not in expected]:
            if key not in actual or key not in expected:
                return f"{path}.{key}", expected.get(key, "<missing>"), \
                    actual.get(key, "<missing>")
            diff = first_difference(expected[key], actual[key], f"{path}.{key}")
            if diff:
                return diff
        return None
    elif isinstance(expected, list) and isinstance(actual, list):
        for i, (e, a) in enumerate(zip(expected, actual)):
            diff = first_difference(e, a, f"{path}[{i}]")
            if diff:
                return diff
        same = len(expected) == len(actual)
        if not same:
            return f"{path or '.'} (length)", expected, actual
    else:
        same = type(expected) is type(actual) and expected == actual
    return None if same else (path or ".", expected, actual)


def _mask_hashes(op_name: str, ret):
    """Hashes are only comparable when the trace fixed the seed."""
    if ret is None:
        return None
    if op_name in ("add_request", "append_output_token_ids"):
        return {**ret, "last_block_hash": "#" if ret["last_block_hash"] else None}
    if op_name == "take_events":
        return [{**ev, **({"block_hashes": ["#"] * len(ev["block_hashes"])}
                          if "block_hashes" in ev else {}),
                 **({"parent_block_hash": "#"} if ev.get("parent_block_hash") else {})}
                for ev in ret]
    return ret


def replay(trace: dict, compare_hashes: bool = True,
           check_invariants: bool = False, replayer_class: type | None = None) -> ReplayResult:
    """Replay a whole trace; stop at the first divergence.

    ``check_invariants`` also runs ``invariants.check_kv_cache_manager`` after every op
    (a violation raises ``InvariantViolation``). ``replayer_class`` replays on
    something else than kvref (a ``TraceReplayer`` subclass building another
    manager, as ``tools/vllm_versions.py`` does for a named vLLM release)."""
    name = trace.get("name", "?")
    header = trace["header"]
    compare_hashes = compare_hashes and header["hash"].get("none_hash_seed") is not None
    try:
        replayer = (replayer_class or TraceReplayer)(header)
    except Exception as exc:  # noqa: BLE001 - reported as a divergence
        return ReplayResult(name, 0, Divergence(-1, None, "construction", "a manager",
                                                f"{type(exc).__name__}: {exc}"))
    expected_init = trace.get("expect_init")
    state = expected_init["state"] if expected_init else None
    if expected_init is not None:
        diff = first_difference(expected_init, replayer.initial_observation(), "init")
        if diff:
            return ReplayResult(name, 0, Divergence(-1, None, *diff))
    for i, op in enumerate(trace["ops"]):
        observed = replayer.run(op)
        if check_invariants:
            check_kv_cache_manager(replayer.manager, popped_blocks=replayer.handles.values())
        expected = op.get("expect")
        if expected is None:
            continue
        state = expected.get("state", state)  # absent = unchanged since the last op
        diff = compare_observation(op, expected, observed, state, compare_hashes)
        if diff:
            return ReplayResult(name, i + 1, Divergence(i, op, *diff))
    return ReplayResult(name, len(trace["ops"]), None)


def compare_observation(op: dict, expected: dict, observed: dict, state: dict,
                        compare_hashes: bool) -> tuple[str, Any, Any] | None:
    """``(path, expected, actual)`` of the first difference between what an op
    was recorded answering (``expected``, with the pool digest ``state`` carried
    forward) and what a replay ``observed``; None when they agree."""
    if expected.get("raises") != observed.get("raises"):
        return "raises", expected.get("raises"), observed.get("raises")
    if ("ret" in expected) != ("ret" in observed):
        return "ret", expected.get("ret", "<nothing>"), observed.get("ret", "<nothing>")
    if "ret" in expected:
        want, got = expected["ret"], observed["ret"]
        if not compare_hashes:
            want, got = _mask_hashes(op["op"], want), _mask_hashes(op["op"], got)
        diff = first_difference(want, got, "ret")
        if diff:
            return diff
    return first_difference(state, observed["state"], "state")


def replay_file(path: str | os.PathLike, compare_hashes: bool = True,
                check_invariants: bool = False) -> ReplayResult:
    return replay(load_trace(path), compare_hashes, check_invariants)
