"""The two implementations a benchmark can drive: kvref, and vLLM v0.25.1 itself.

No vLLM counterpart (benchmark harness). A *side* builds, from a recorded
trace's header or from a pool size, the objects the scheduler would hold: the
``KVCacheManager``, a request factory, the ``RequestStatus`` enum. Everything
after construction is the same method calls on both sides (the names are
vLLM's), so ``replay.py`` and ``scaling.py`` do not know which side they run.

    side = get_side("kvref")            # or "vllm", under a python that has vLLM
    built = side.from_header(trace["header"])
    req = built.request_factory({"req": "r0", "prompt": [1, 2, 3]})()

vLLM is imported only by ``VLLMSide``, so this module also loads where vLLM is
not installed.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

MAX_TOKENS_DEFAULT = 1 << 20  # what the trace recorder gave requests without max_tokens


@dataclass
class Built:
    """What one side built for one trace (or one pool size)."""

    manager: Any
    status: Any                                  # the RequestStatus enum
    request_factory: Callable[[dict], Callable]  # op -> zero-argument Request builder
    pin_none_hash: Callable[[], None]            # re-seed the hash chain for this trace


def built_from_replayer(replayer, status, utils, request_factory) -> Built:
    """What a side built, from a replayer that built the manager from a header
    (kvref's ``TraceReplayer`` or the recorder's ``VllmReplayer``)."""
    none_hash = replayer.none_hash

    def pin_none_hash() -> None:
        utils.NONE_HASH = none_hash

    return Built(replayer.manager, status,
                 functools.partial(request_factory, replayer.block_hasher), pin_none_hash)


class KvrefSide:
    """kvref, built the way ``kvref.verify.trace_replay`` builds it."""

    name = "kvref"

    def __init__(self) -> None:
        from kvref import RequestStatus
        from kvref.core import kv_cache_utils
        from kvref.request import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request
        from kvref.verify.trace_replay import TraceReplayer, prompt_embeds_tensor
        self._utils = kv_cache_utils
        self._status = RequestStatus
        self._replayer = TraceReplayer
        self._types = (Request, LoRARequest, MultiModalFeatureSpec, PlaceholderRange)
        self._prompt_embeds = prompt_embeds_tensor

    def from_header(self, header: dict) -> Built:
        replayer = self._replayer(header)  # manager, block hasher, seeded NONE_HASH
        return built_from_replayer(replayer, self._status, self._utils, self._request_factory)

    def _request_factory(self, block_hasher, op: dict) -> Callable:
        Request, LoRARequest, MultiModalFeatureSpec, PlaceholderRange = self._types
        lora = op.get("lora")
        features = [MultiModalFeatureSpec(f["identifier"],
                                          PlaceholderRange(f["offset"], f["length"]),
                                          f.get("modality", "image"))
                    for f in op.get("mm_features") or []]
        return functools.partial(
            Request, op["req"], list(op["prompt"]), block_hasher=block_hasher,
            lora_request=LoRARequest(lora["name"], lora["id"]) if lora else None,
            cache_salt=op.get("cache_salt"), mm_features=features or None,
            skip_reading_prefix_cache=bool(op.get("skip_reading_prefix_cache")),
            max_tokens=op.get("max_tokens"), prompt_embeds=self._prompt_embeds(op))

    def full_attention(self, num_blocks: int, block_size: int, max_model_len: int) -> Built:
        """A one-group full-attention manager with caching on (the scaling runs)."""
        from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                           KVCacheManager, get_request_block_hasher, init_none_hash, sha256)
        init_none_hash(sha256)
        config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["layer.0"],
                                                             FullAttentionSpec(block_size))])
        manager = KVCacheManager(config, max_model_len=max_model_len,
                                 scheduler_block_size=block_size, hash_block_size=block_size)
        hasher = get_request_block_hasher(block_size, sha256)
        return Built(manager, self._status,
                     functools.partial(self._request_factory, hasher), lambda: None)


class VLLMSide:
    """The real vLLM v0.25.1 KV layer (needs an importable ``vllm``)."""

    name = "vllm"

    def __init__(self) -> None:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs on import
        import torch
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256, sha256_cbor
        from vllm.v1 import kv_cache_interface as kvi
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.request import Request, RequestStatus
        # vLLM 0.25.1 cannot build a sink group's manager; the sink traces were
        # recorded with that one constructor fixed (tools/record_vllm_traces.py).
        from vllm.v1.core.single_type_kv_cache_manager import SinkFullAttentionManager
        tools = str(Path(__file__).resolve().parent.parent / "tools")
        if tools not in sys.path:
            sys.path.insert(0, tools)
        from record_vllm_traces import VllmReplayer, let_sink_manager_take_scheduler_block_size
        let_sink_manager_take_scheduler_block_size(SinkFullAttentionManager)
        self._replayer = VllmReplayer
        # A running engine caches its environment switches once started
        # (EngineCore calls this); without it every event hash re-reads os.environ.
        from vllm import envs
        envs.enable_envs_cache()
        self._envs = envs
        self._torch_dtype = torch.float16
        self._kvi = kvi
        self._utils = kv_cache_utils
        self._manager_cls = KVCacheManager
        self._status = RequestStatus
        self._hash_fns = {"sha256": sha256, "sha256_cbor": sha256_cbor}
        self._types = (Request, SamplingParams, LoRARequest, MultiModalFeatureSpec,
                       PlaceholderRange)
        # The same float tensor kvref's side gets (the trace's rows, read by
        # kvref's reader: torch is what both Requests take).
        from kvref.verify.trace_replay import prompt_embeds_tensor
        self._prompt_embeds = prompt_embeds_tensor

    def _build(self, num_blocks: int, groups: list, manager_kwargs: dict, hash_fn,
               seed: str | None, use_hasher: bool) -> Built:
        kvi = self._kvi
        config = kvi.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                   kv_cache_groups=groups)
        from kvref.verify.trace_replay import seeded_none_hash
        none_hash = seeded_none_hash(self._utils, hash_fn, seed)
        manager = self._manager_cls(config, **manager_kwargs)
        hasher = (self._utils.get_request_block_hasher(manager_kwargs["hash_block_size"],
                                                       hash_fn)
                  if use_hasher else None)
        utils = self._utils

        def pin_none_hash() -> None:
            utils.NONE_HASH = none_hash

        return Built(manager, self._status, functools.partial(self._request_factory, hasher),
                     pin_none_hash)

    def from_header(self, header: dict) -> Built:
        """vLLM's manager built from a trace header by the recorder's own
        ``VllmReplayer`` (``tools/record_vllm_traces.py``): the same specs,
        retention interval and sink fix the traces were recorded with."""
        # The replayer sets the retention variable around the build, and vLLM's
        # coordinator reads it then: the environment cache is off meanwhile.
        self._envs.disable_envs_cache()
        try:
            replayer = self._replayer(header)
        finally:
            self._envs.enable_envs_cache()
        return built_from_replayer(replayer, self._status, self._utils, self._request_factory)

    def _request_factory(self, block_hasher, op: dict) -> Callable:
        Request, SamplingParams, LoRARequest, MultiModalFeatureSpec, PlaceholderRange = \
            self._types
        lora = op.get("lora")
        features = [MultiModalFeatureSpec(data=None, modality=f.get("modality", "image"),
                                          identifier=f["identifier"],
                                          mm_position=PlaceholderRange(offset=f["offset"],
                                                                       length=f["length"]))
                    for f in op.get("mm_features") or []]
        # SamplingParams and LoRARequest are arguments, built before the clock starts.
        params = SamplingParams(
            max_tokens=op.get("max_tokens") or MAX_TOKENS_DEFAULT,
            skip_reading_prefix_cache=bool(op.get("skip_reading_prefix_cache", False)))
        return functools.partial(
            Request, request_id=op["req"], prompt_token_ids=list(op["prompt"]),
            sampling_params=params, pooling_params=None, mm_features=features or None,
            lora_request=(LoRARequest(lora_name=lora["name"], lora_int_id=lora["id"],
                                      lora_path=f"/loras/{lora['name']}") if lora else None),
            cache_salt=op.get("cache_salt"), block_hasher=block_hasher,
            prompt_embeds=self._prompt_embeds(op))

    def full_attention(self, num_blocks: int, block_size: int, max_model_len: int) -> Built:
        kvi = self._kvi
        spec = kvi.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                     dtype=self._torch_dtype)
        groups = [kvi.KVCacheGroupSpec(["layer.0"], spec)]
        kwargs = dict(max_model_len=max_model_len, scheduler_block_size=block_size,
                      hash_block_size=block_size, enable_caching=True)
        return self._build(num_blocks, groups, kwargs, self._hash_fns["sha256"], "0", True)


def get_side(name: str):
    """``"kvref"`` or ``"vllm"``; the latter raises ImportError without vLLM."""
    if name == "kvref":
        return KvrefSide()
    if name == "vllm":
        return VLLMSide()
    raise ValueError(f"unknown side {name!r}; expected 'kvref' or 'vllm'")
