"""Record how a scheduler drives a ``KVCacheManager`` as a ``kvtrace/1`` trace.

No vLLM counterpart: this is the writing half of ``trace_replay.py``. A
``RecordingKVCacheManager`` stands in for the manager: the scheduler calls it
exactly as it would call the manager, every call is written down as a trace op,
and the scheduler's own bookkeeping on a request (``num_computed_tokens``,
``status``, ``num_preemptions``, new output tokens) is written as the
``set_*`` / ``append_output_token_ids`` ops just before the next call that
passes that request, which is when the manager could first see it
(``sync_requests()`` writes everyone's bookkeeping at once, e.g. at a step's
end). ``pop_blocks_for_free`` and writes to ``block_pool`` are not recordable
(kvref's scheduler uses neither); they raise ``AttributeError``::

    recorder = RecordingKVCacheManager(header)        # builds the manager from the header
    scheduler = Scheduler(recorder, max_num_batched_tokens=64)
    ...                                               # run the scheduler
    trace = recorder.finish_trace(name="chat")        # ops + kvref's observations
    write_trace(trace, "chat.json")

``finish_trace`` fills each op's ``expect`` by replaying the ops on a fresh
kvref manager (``TraceReplayer``), and refuses to return a trace whose replay
answers differ from what the live run saw. The shared conformance tools can then
replay the file on a real vLLM v0.25.1.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any

from kvref import VLLM_VERSION
from kvref.core.kv_cache_manager import KVCacheBlocks
from kvref.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvref.request import Request
from kvref.verify.trace_replay import TRACE_FORMAT, TraceReplayer

# Block-pool attributes a scheduler may read through the recorder (nothing that changes state).
_READ_ONLY_POOL = frozenset({"blocks", "null_block", "free_block_queue", "num_gpu_blocks",
                             "hash_block_size", "enable_caching", "get_num_free_blocks",
                             "get_usage", "cached_block_hash_to_block", "get_cached_block",
                             "enable_kv_cache_events"})
# Manager attributes that read state only.
_READ_ONLY_MANAGER = frozenset({"empty_kv_cache_blocks", "num_kv_cache_groups",
                                "max_model_len", "kv_cache_config", "enable_caching",
                                "log_stats", "use_eagle", "watermark_blocks",
                                "create_kv_cache_blocks"})


def group_header(spec) -> dict:
    """One ``header.groups`` entry for a KV cache spec."""
    heads = {}
    if not isinstance(spec, MambaSpec):
        heads = {"num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size}
    if isinstance(spec, SlidingWindowSpec):
        return {"kind": "sliding_window", "block_size": spec.block_size,
                "sliding_window": spec.sliding_window, **heads}
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return {"kind": "chunked_local", "block_size": spec.block_size,
                "attention_chunk_size": spec.attention_chunk_size, **heads}
    if isinstance(spec, CrossAttentionSpec):
        return {"kind": "cross_attention", "block_size": spec.block_size, **heads}
    if isinstance(spec, MambaSpec):
        return {"kind": "mamba", "block_size": spec.block_size,
                "mamba_cache_mode": spec.mamba_cache_mode,
                "num_speculative_blocks": spec.num_speculative_blocks}
    if isinstance(spec, RSWASpec):
        return {"kind": "rswa", "block_size": spec.block_size,
                "rswa_window": spec.rswa_window, **heads}
    if isinstance(spec, SinkFullAttentionSpec):
        return {"kind": "sink_full", "block_size": spec.block_size,
                "sink_len": spec.sink_len, **heads}
    if isinstance(spec, FullAttentionSpec):
        return {"kind": "full", "block_size": spec.block_size, **heads}
    raise TypeError(f"no kvtrace group kind for {type(spec).__name__}")


def prompt_embeds_json(embeds) -> dict:
    """A ``[num_prompt_tokens, hidden_size]`` tensor as a trace writes it
    (``trace_replay.prompt_embeds_tensor`` reads it back, bit for bit for
    values the JSON floats hold exactly)."""
    return {"dtype": str(embeds.dtype).removeprefix("torch."), "rows": embeds.tolist()}


def make_header(config: KVCacheConfig, *, max_model_len: int, scheduler_block_size: int,
                hash_block_size: int, max_num_batched_tokens: int | None = None,
                enable_caching: bool = True, watermark: float = 0.0,
                enable_kv_cache_events: bool = True, log_stats: bool = True,
                none_hash_seed: str = "0") -> dict:
    """A ``kvtrace/1`` header: how to build the manager, hashing with a fixed
    seed (so the hash values themselves are compared on replay)."""
    groups = []
    for g in config.kv_cache_groups:
        entry = group_header(g.kv_cache_spec)
        entry["layer_names"] = list(g.layer_names)
        if g.is_eagle_group:
            entry["is_eagle_group"] = True
        groups.append(entry)
    return {"num_blocks": config.num_blocks, "groups": groups,
            "manager": {"max_model_len": max_model_len,
                        "scheduler_block_size": scheduler_block_size,
                        "hash_block_size": hash_block_size,
                        "enable_caching": enable_caching,
                        "enable_kv_cache_events": enable_kv_cache_events,
                        "log_stats": log_stats, "watermark": watermark, "use_eagle": False,
                        "max_num_batched_tokens": max_num_batched_tokens},
            "hash": {"algo": "sha256", "none_hash_seed": none_hash_seed,
                     "block_hasher": True},
            "event_hash_format": "int64"}


class _ReadOnlyCoordinator:
    """The coordinator as the recorder lets a scheduler see it: one query, no writes
    (the scheduler sizes ``reserved_blocks`` with it; what it decides is in the
    recorded ``allocate_slots``)."""

    def __init__(self, coordinator) -> None:
        self.get_num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate

    def __getattr__(self, name: str):
        raise AttributeError(f"RecordingKVCacheManager cannot record coordinator.{name}; "
                             "a recorded scheduler may only call get_num_blocks_to_allocate")


class _ReadOnlyBlockPool:
    """The pool as the recorder lets a scheduler see it: reads pass, writes refuse."""

    def __init__(self, pool) -> None:
        self._pool = pool

    def __getattr__(self, name: str):
        if name in _READ_ONLY_POOL:
            return getattr(self._pool, name)
        raise AttributeError(f"RecordingKVCacheManager cannot record block_pool.{name}; "
                             f"a recorded scheduler may only read {sorted(_READ_ONLY_POOL)}")


class RecordingKVCacheManager:
    """A ``KVCacheManager`` look-alike that writes every call down as a trace op.

    Args:
        header: a ``kvtrace/1`` header (``make_header``); the real manager is
            built from it exactly as a replayer will build it.
    """

    def __init__(self, header: dict) -> None:
        self.header = json.loads(json.dumps(header))    # the JSON form replay will read
        self._replayer = TraceReplayer(self.header)     # seeds NONE_HASH from the header
        self.manager = self._replayer.manager
        self.block_pool = _ReadOnlyBlockPool(self.manager.block_pool)
        self.coordinator = _ReadOnlyCoordinator(self.manager.coordinator)
        self.ops: list[dict] = []
        self.live: list[Any] = []                       # what each op returned in the live run
        self._known: dict[str, dict] = {}               # request id -> what the trace has told
        self._last_hit: dict[str, KVCacheBlocks] = {}

    # -- plumbing ----------------------------------------------------------------

    def __getattr__(self, name: str):
        if name in _READ_ONLY_MANAGER:
            return getattr(self.manager, name)
        raise AttributeError(f"RecordingKVCacheManager has no recordable {name!r}")

    def _emit(self, op: dict, live: Any = None) -> None:
        self.ops.append(op)
        self.live.append(live)

    def _sync(self, request: Request) -> None:
        """Tell the trace what the scheduler did to ``request`` since the last call."""
        rid = request.request_id
        known = self._known.get(rid)
        if known is None or known["obj"] is not request:
            if known is not None:
                raise ValueError(f"request id {rid!r} was recorded for another Request "
                                 "object; request ids must be unique in a trace")
            op: dict = {"op": "add_request", "req": rid, "prompt": list(request.prompt_token_ids)}
            if request.max_tokens is not None:
                op["max_tokens"] = request.max_tokens
            if request.cache_salt is not None:
                op["cache_salt"] = request.cache_salt
            if request.lora_request is not None:
                op["lora"] = {"name": request.lora_request.lora_name,
                              "id": request.lora_request.lora_int_id}
            if request.skip_reading_prefix_cache:
                op["skip_reading_prefix_cache"] = True
            if request.mm_features:
                op["mm_features"] = [{"identifier": f.identifier, "offset": f.mm_position.offset,
                                      "length": f.mm_position.length, "modality": f.modality}
                                     for f in request.mm_features]
            if request.prompt_embeds is not None:
                op["prompt_embeds"] = prompt_embeds_json(request.prompt_embeds)
            self._emit(op)
            known = self._known[rid] = {"obj": request, "num_tokens": request.num_prompt_tokens,
                                        "num_computed_tokens": 0, "status": "WAITING",
                                        "num_preemptions": 0}
        tokens = request.all_token_ids
        if len(tokens) < known["num_tokens"]:
            raise ValueError(f"request {rid!r} lost tokens ({known['num_tokens']} -> "
                             f"{len(tokens)}); a trace can only append")
        if len(tokens) > known["num_tokens"]:
            self._emit({"op": "append_output_token_ids", "req": rid,
                        "tokens": list(tokens[known["num_tokens"]:])})
            known["num_tokens"] = len(tokens)
        for field, op_name, value in (
                ("num_computed_tokens", "set_num_computed_tokens", request.num_computed_tokens),
                ("status", "set_status", request.status.name),
                ("num_preemptions", "set_num_preemptions", request.num_preemptions)):
            if known[field] != value:
                self._emit({"op": op_name, "req": rid, "value": value})
                known[field] = value

    def sync_requests(self) -> None:
        """Write down the bookkeeping of every request seen so far (call at the end
        of a step, so a trace's state at step ends shows what the scheduler set)."""
        for known in list(self._known.values()):
            self._sync(known["obj"])

    def _call(self, op: dict, fn, *args, **kwargs):
        try:
            ret = fn(*args, **kwargs)
        except Exception as exc:
            self._emit(op, ("raises", type(exc).__name__))
            raise
        self._emit(op, _snapshot(ret))
        return ret

    # -- the recorded API (names and arguments as KVCacheManager) ----------------

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        self._sync(request)
        ret = self._call({"op": "get_computed_blocks", "req": request.request_id},
                         self.manager.get_computed_blocks, request)
        self._last_hit[request.request_id] = ret[0]
        return ret

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True) -> KVCacheBlocks | None:
        self._sync(request)
        rid = request.request_id
        if new_computed_blocks is None:
            which = None
        elif new_computed_blocks is self.manager.empty_kv_cache_blocks:
            which = "empty"
        elif new_computed_blocks is self._last_hit.get(rid):
            which = "last"
        else:
            raise ValueError("new_computed_blocks must be None, empty_kv_cache_blocks or "
                             f"the last get_computed_blocks answer for {rid!r} to be recorded")
        op: dict = {"op": "allocate_slots", "req": rid, "num_new_tokens": num_new_tokens}
        for key, value, default in (
                ("num_new_computed_tokens", num_new_computed_tokens, 0),
                ("new_computed_blocks", which, None),
                ("num_lookahead_tokens", num_lookahead_tokens, 0),
                ("num_external_computed_tokens", num_external_computed_tokens, 0),
                ("delay_cache_blocks", delay_cache_blocks, False),
                ("num_encoder_tokens", num_encoder_tokens, 0),
                ("full_sequence_must_fit", full_sequence_must_fit, False),
                ("reserved_blocks", reserved_blocks, 0),
                ("has_scheduled_reqs", has_scheduled_reqs, True)):
            if value != default:
                op[key] = value
        return self._call(op, self.manager.allocate_slots, request, num_new_tokens,
                          num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
                          num_external_computed_tokens, delay_cache_blocks,
                          num_encoder_tokens, full_sequence_must_fit, reserved_blocks,
                          has_scheduled_reqs)

    def free(self, request: Request) -> None:
        self._sync(request)
        self._call({"op": "free", "req": request.request_id}, self.manager.free, request)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self._sync(request)
        self._call({"op": "cache_blocks", "req": request.request_id,
                    "num_computed_tokens": num_computed_tokens},
                   self.manager.cache_blocks, request, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        self._call({"op": "remove_skipped_blocks", "req": request_id,
                    "total_computed_tokens": total_computed_tokens,
                    "num_prompt_tokens": num_prompt_tokens},
                   self.manager.remove_skipped_blocks, request_id, total_computed_tokens,
                   num_prompt_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._call({"op": "evict_blocks", "block_ids": sorted(block_ids)},
                   self.manager.evict_blocks, set(block_ids))

    def reset_prefix_cache(self) -> bool:
        return self._call({"op": "reset_prefix_cache"}, self.manager.reset_prefix_cache)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return self._call({"op": "get_num_common_prefix_blocks", "req": running_request_id},
                          self.manager.get_num_common_prefix_blocks, running_request_id)

    def take_events(self) -> list:
        return self._call({"op": "take_events"}, self.manager.take_events)

    def take_new_block_ids(self) -> list[int]:
        return self._call({"op": "take_new_block_ids"}, self.manager.take_new_block_ids)

    def new_step_starts(self) -> None:
        self._call({"op": "new_step_starts"}, self.manager.new_step_starts)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        # Read-only; written as the get_block_ids op, which observes the same thing.
        return self._call({"op": "get_block_ids", "req": request_id},
                          self.manager.get_blocks, request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self._call({"op": "get_block_ids", "req": request_id},
                          self.manager.get_block_ids, request_id)

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int):
        return self._call({"op": "get_block_ids_for_computed_tokens", "req": request_id,
                           "num_computed_tokens": num_computed_tokens},
                          self.manager.get_block_ids_for_computed_tokens, request_id,
                          num_computed_tokens)

    @property
    def usage(self) -> float:
        return self._call({"op": "usage"}, lambda: self.manager.usage)

    def make_prefix_cache_stats(self):
        return self._call({"op": "make_prefix_cache_stats"},
                          self.manager.make_prefix_cache_stats)

    # -- the trace -----------------------------------------------------------------

    def finish_trace(self, name: str, config_class: str = "kvref-workload",
                     generator: dict | None = None, narration: dict | None = None) -> dict:
        """The trace so far, each op with kvref's observation as ``expect``.

        Raises ``RuntimeError`` if replaying the ops on a fresh manager answers
        differently from the live run (the recording would then be a lie)."""
        ops = json.loads(json.dumps(self.ops))
        replayer = TraceReplayer(self.header)
        expect_init = replayer.initial_observation()
        previous_state = expect_init["state"]
        for i, (op, live) in enumerate(zip(ops, self.live)):
            observed = replayer.run(op)
            _check_live(i, op, live, observed)
            expect = {k: observed[k] for k in ("ret", "raises") if k in observed}
            if observed["state"] != previous_state:
                expect["state"] = observed["state"]
                previous_state = observed["state"]
            op["expect"] = expect
        trace = {"format": TRACE_FORMAT, "name": name, "config_class": config_class,
                 "vllm_version": VLLM_VERSION, "header": self.header,
                 "expect_init": expect_init,
                 "generator": {"tool": "kvref record", **(generator or {})}}
        if narration:
            trace["narration"] = {str(k): v for k, v in narration.items()}
        trace["ops"] = ops
        return trace


def _block_ids(blocks: KVCacheBlocks) -> list[list[int]]:
    return [[b.block_id for b in group] for group in blocks.blocks]


def _snapshot(ret):
    """The answer as plain data, taken now: KVCacheBlocks lists change later."""
    if isinstance(ret, KVCacheBlocks):
        return _block_ids(ret)
    if isinstance(ret, tuple) and len(ret) == 2 and isinstance(ret[0], KVCacheBlocks):
        return {"blocks": _block_ids(ret[0]), "num_computed_tokens": ret[1]}
    if isinstance(ret, (bool, int, float)) or ret is None:
        return ret
    if isinstance(ret, (list, tuple)) and all(isinstance(x, (int, list)) for x in ret):
        return json.loads(json.dumps(ret))
    return _UNCOMPARED


_UNCOMPARED = object()      # events and stats: compared by the replay's own expect


def _check_live(index: int, op: dict, live, observed: dict) -> None:
    """The replay must answer what the live manager answered."""
    if isinstance(live, tuple) and len(live) == 2 and live[0] == "raises":
        same = observed.get("raises") == live[1]
    elif live is _UNCOMPARED:
        same = "raises" not in observed
    elif op["op"] == "add_request" or op["op"] in ("append_output_token_ids", "set_status",
                                                   "set_num_computed_tokens",
                                                   "set_num_preemptions"):
        same = "raises" not in observed
    else:
        same = "raises" not in observed and observed.get("ret") == live
    if not same:
        raise RuntimeError(f"op #{index} {op['op']}: the replay answered "
                           f"{observed.get('ret', observed.get('raises'))!r}, the live run "
                           f"{live!r}; the recording is inconsistent")


def dump_trace(trace: dict) -> str:
    """JSON text with one top-level key per line and one op per line (diffs well)."""
    lines = ["{"]
    keys = [k for k in trace if k != "ops"]
    for key in keys:
        lines.append(f"  {json.dumps(key)}: {json.dumps(trace[key])},")
    lines.append('  "ops": [')
    ops = trace.get("ops", [])
    for i, op in enumerate(ops):
        lines.append("    " + json.dumps(op) + ("," if i < len(ops) - 1 else ""))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_trace(trace: dict, path: str | os.PathLike) -> None:
    """Write ``.json`` (or gzip-compressed ``.json.gz``)."""
    text = dump_trace(trace)
    path = str(path)
    if path.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
