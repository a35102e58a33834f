"""The KV layer the state machines drive: kvref's (the default) or vLLM's own.

No vLLM counterpart (test harness). Every machine in ``tests/stateful`` takes
the objects it drives from here, never from ``kvref`` directly::

    python3 -m pytest tests/stateful                            # kvref
    python3 -m pytest tests/stateful --kv-backend vllm          # the vllm that imports here
    python3 -m pytest tests/stateful --kv-backend vllm --vllm-src ~/src/vllm   # a checkout

``--kv-backend`` (``tests/conftest.py``) sets ``KVREF_KV_BACKEND`` before any
machine is imported; ``--vllm-src PATH`` puts ``PATH`` first on ``sys.path`` so
that ``PATH/vllm`` is the vLLM imported. ``tools/vllm_machines.py`` runs the
machines on vLLM 0.25.1 in the oracle environment the project builds.

What the machines describe stays kvref's: the model configurations
(``configs.py``) and the specs in them are kvref's spec classes, which the
models read with ``isinstance``; on vLLM they are turned into vLLM's specs of
the same names when a manager is built (``make_kv_cache_config``). Everything
the machines *drive* comes from the backend: managers, pools, blocks, queues,
requests, request states, hashing and events.

The seam is small on purpose, and every difference between kvref and vLLM
0.25.1 that the machines meet is one function here:

- constructors whose arguments differ (``Request``, ``LoRARequest``,
  ``MultiModalFeatureSpec``, ``PlaceholderRange``, the specs, ``KVCacheConfig``;
  the prefix-cache retention interval, an environment variable on vLLM);
- ``index_items``: vLLM's ``BlockHashToBlockMap`` keeps one block bare and
  several in a dict, and has no ``items()``;
- ``free_blocks_in_order``: vLLM's free queue is read with
  ``get_all_free_blocks()`` (kvref's is also iterable);
- ``partial_entry_keys``: the extra index keys of a block, a set on vLLM;
- ``EVICT_OUT_OF_RANGE``, ``POPLEFT_N_TOO_MANY``: how a bad call is refused.

A newer vLLM whose API moved (``tools/vllm_versions.py`` lists 0.33.0's changes:
``max_in_flight_tokens=``, a third value from ``get_computed_blocks``, the retention
interval in ``KVCacheConfig``) is bridged here the same way, leaving the machines as
they are.
A check the machines make on kvref that cannot be made on vLLM is named in
``UNCHECKABLE_ON_VLLM`` with its reason and skipped only there (``checks``);
every other check runs unchanged on both.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from contextlib import contextmanager
from pathlib import Path

BACKEND = os.environ.get("KVREF_KV_BACKEND", "kvref")
if BACKEND not in ("kvref", "vllm"):
    raise ValueError(f"KVREF_KV_BACKEND={BACKEND!r}: choose kvref or vllm")

# Checks the machines make on kvref that cannot be made on vLLM, each with its
# reason: kvref's guards against a caller's misuse, which vLLM does not have (its
# scheduler never makes those calls). Every other check runs on both.
UNCHECKABLE_ON_VLLM: dict[str, str] = {
    "double free refused": (
        "kvref's BlockPool.free_blocks refuses a block that is already free (ValueError); "
        "vLLM 0.25.1's has no such guard (v1/core/block_pool.py:614-635 decrements ref_cnt "
        "below 0) and its scheduler never frees a block twice"),
    "append of a free block refused": (
        "kvref's FreeKVCacheBlockQueue.append refuses a block already in the queue "
        "(RuntimeError); vLLM 0.25.1's links it in again (v1/core/kv_cache_utils.py:321-342), "
        "and its block pool only appends blocks whose ref_cnt just reached 0"),
}


# The error ``evict_blocks`` raises for a block id outside the pool: kvref's
# ValueError; vLLM 0.25.1 asserts (v1/core/block_pool.py:648).
EVICT_OUT_OF_RANGE = ValueError if BACKEND == "kvref" else AssertionError
# The error ``FreeKVCacheBlockQueue.popleft_n(n)`` raises for more blocks than are free:
# kvref's ValueError; vLLM 0.25.1 asserts before taking any (v1/core/kv_cache_utils.py:279).
POPLEFT_N_TOO_MANY = ValueError if BACKEND == "kvref" else AssertionError


def checks(name: str) -> bool:
    """Whether the check ``name`` (a key of ``UNCHECKABLE_ON_VLLM``) is made here."""
    if name not in UNCHECKABLE_ON_VLLM:
        raise KeyError(f"{name!r} is not listed in UNCHECKABLE_ON_VLLM")
    return BACKEND == "kvref"

RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"


def index_items(index):
    """``(key, block)`` for every block a ``BlockHashToBlockMap`` indexes, on
    either backend: a key maps to one block, or to a dict of blocks by id."""
    for key, value in index._cache.items():
        if isinstance(value, dict):
            yield from ((key, block) for block in value.values())
        else:
            yield key, value


def partial_entry_keys(keys_by_block: dict) -> dict:
    """``BlockPool.cached_block_hashes_by_block`` (or the model's copy) in this
    backend's terms: kvref keeps each block's extra index keys in a list, in the
    order they were added; vLLM 0.25.1 in a set (v1/core/block_pool.py:186)."""
    if BACKEND == "kvref":
        return keys_by_block
    return {block_id: set(keys) for block_id, keys in keys_by_block.items()}


def free_blocks_in_order(queue) -> list:
    """The free queue head to tail (the eviction order)."""
    return queue.get_all_free_blocks()


if BACKEND == "kvref":
    import kvref.core.kv_cache_utils as kv_cache_utils
    from kvref import (
        AllBlocksCleared,
        BlockHashListWithBlockSize,
        BlockPool,
        BlockRemoved,
        BlockStored,
        FreeKVCacheBlockQueue,
        KVCacheBlock,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheManager,
        LoRARequest,
        MultiModalFeatureSpec,
        PlaceholderRange,
        Request,
        RequestStatus,
        get_request_block_hasher,
        init_none_hash,
        make_block_hash_with_group_id,
        sha256,
    )

    DESCRIPTION = "kvref (this checkout)"

    def make_kv_cache_config(num_blocks: int, specs, eagle_groups=()):
        groups = [KVCacheGroupSpec([f"layer.{i}"], spec, is_eagle_group=i in eagle_groups)
                  for i, spec in enumerate(specs)]
        return KVCacheConfig(num_blocks, groups)

    def make_manager(config, *, retention_interval=None, **kwargs):
        return KVCacheManager(config, retention_interval=retention_interval, **kwargs)

    def imported_files() -> list[str]:
        return []

else:
    _src = os.environ.get("KVREF_VLLM_SRC")
    if _src:
        _src = str(Path(_src).resolve())
        if not (Path(_src) / "vllm" / "__init__.py").is_file():
            raise ValueError(f"--vllm-src {_src}: there is no vllm/__init__.py under it")
        if "vllm" in sys.modules:
            raise RuntimeError("--vllm-src: vllm was imported before the path was set")
        sys.path.insert(0, _src)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs on import
    try:
        import torch
        import vllm
        import vllm.v1.core.kv_cache_utils as kv_cache_utils
        from vllm import envs as _envs
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
        from vllm.lora.request import LoRARequest as _VllmLoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec as _VllmFeature
        from vllm.multimodal.inputs import PlaceholderRange as _VllmRange
        from vllm.sampling_params import SamplingParams as _SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1 import kv_cache_interface as _kvi
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import (
            BlockHashListWithBlockSize,
            FreeKVCacheBlockQueue,
            KVCacheBlock,
            get_request_block_hasher,
            init_none_hash,
            make_block_hash_with_group_id,
        )
        from vllm.v1.request import Request as _VllmRequest
        from vllm.v1.request import RequestStatus
    except ImportError as exc:
        raise ImportError(
            f"--kv-backend vllm: vLLM's KV layer does not import in {sys.executable} ({exc}); "
            "run in a Python where vLLM imports (python3 tools/vllm_machines.py uses the "
            "oracle environment of tools/setup_vllm_venv.py)") from exc
    if _src and not str(Path(vllm.__file__).resolve()).startswith(_src + os.sep):
        raise RuntimeError(f"--vllm-src {_src}: vllm was imported from {vllm.__file__}")

    DESCRIPTION = f"vLLM {getattr(vllm, '__version__', '?')} from {Path(vllm.__file__).parent}"

    def Request(request_id, prompt_token_ids, *, block_hasher=None, lora_request=None,
                cache_salt=None, mm_features=None, skip_reading_prefix_cache=False,
                max_tokens=None):
        """vLLM's Request from kvref's arguments (a sampling request, greedy)."""
        params = _SamplingParams(max_tokens=max_tokens or 1 << 20,
                                 skip_reading_prefix_cache=skip_reading_prefix_cache)
        return _VllmRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                            sampling_params=params, pooling_params=None,
                            mm_features=mm_features or None, lora_request=lora_request,
                            cache_salt=cache_salt, block_hasher=block_hasher)

    def LoRARequest(lora_name, lora_int_id):
        return _VllmLoRARequest(lora_name=lora_name, lora_int_id=lora_int_id,
                                lora_path=f"/loras/{lora_name}")

    def PlaceholderRange(offset, length):
        return _VllmRange(offset=offset, length=length)

    def MultiModalFeatureSpec(identifier, mm_position, modality="image"):
        return _VllmFeature(data=None, modality=modality, identifier=identifier,
                            mm_position=mm_position)

    _ATTENTION_DEFAULTS = dict(num_kv_heads=1, head_size=1, dtype=torch.float16)

    def vllm_spec(spec):
        """vLLM's spec of the same class name and fields as a kvref spec; the
        tensor shape fields kvref leaves at placeholders get vLLM's types."""
        cls = getattr(_kvi, type(spec).__name__)
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        args = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
                if f.name in names and f.name not in ("dtype", "dtypes", "shapes",
                                                      "kv_quant_mode", "mamba_type")}
        if "dtype" in names:
            args["dtype"] = _ATTENTION_DEFAULTS["dtype"]
        if cls.__name__ == "MambaSpec":
            args.update(shapes=((1,),), dtypes=(torch.float16,))
        return cls(**args)

    def make_kv_cache_config(num_blocks: int, specs, eagle_groups=()):
        groups = [_kvi.KVCacheGroupSpec([f"layer.{i}"], vllm_spec(spec),
                                        is_eagle_group=i in eagle_groups)
                  for i, spec in enumerate(specs)]
        return _kvi.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=groups)

    @contextmanager
    def _retention_interval(value):
        """vLLM's coordinator reads the interval from its environment when built."""
        saved = os.environ.pop(RETENTION_ENV, None)
        if value is not None:
            os.environ[RETENTION_ENV] = str(value)
        disable = getattr(_envs, "disable_envs_cache", None)
        if disable is not None:
            disable()
        try:
            yield
        finally:
            os.environ.pop(RETENTION_ENV, None)
            if saved is not None:
                os.environ[RETENTION_ENV] = saved

    def make_manager(config, *, retention_interval=None, **kwargs):
        with _retention_interval(retention_interval):
            return KVCacheManager(config, **kwargs)

    def imported_files() -> list[str]:
        """The files of vLLM's KV layer this run imported (``--vllm-src`` proof)."""
        wanted = ("vllm.v1.core.", "vllm.v1.kv_cache_interface", "vllm.v1.request",
                  "vllm.distributed.kv_events", "vllm.utils.hashing")
        return sorted(getattr(m, "__file__", None) or name
                      for name, m in list(sys.modules.items())
                      if name.startswith(wanted) and m is not None)
