"""What a KV cache group looks like: one spec per attention type.

Mirrors ``vllm/v1/kv_cache_interface.py``. A *spec* tells the KV layer how a
group of layers uses its blocks (every token, a window, one chunk, one state);
a *group* is the set of layers that share one block table; the *config* is the
pool size, the list of groups and the tensors the workers allocate.

    >>> spec = FullAttentionSpec(block_size=16)
    >>> config = KVCacheConfig(num_blocks=64,
    ...                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    >>> config.kv_cache_groups[0].kv_cache_spec.block_size
    16

Specs are frozen and compare by value: the hybrid coordinator looks groups with
equal specs up together.

Specs also carry the capacity arithmetic vLLM sizes the pool with: a block of
one layer holds ``page_size_bytes`` (keys and values of ``block_size`` tokens),
and ``max_num_blocks_per_request`` / ``max_memory_usage_bytes`` say how much one
request can hold at its peak. ``max_memory_usage_bytes`` takes vLLM's
``VllmConfig`` (any object with its ``model_config``, ``scheduler_config``,
``cache_config`` and ``parallel_config`` attributes) or the plain numbers:

    >>> FullAttentionSpec(16, num_kv_heads=8, head_size=128).page_size_bytes
    65536
    >>> FullAttentionSpec(16).max_num_blocks_per_request(max_model_len=1000)
    63
    >>> SlidingWindowSpec(16, 128).max_num_blocks_per_request(
    ...     max_model_len=1000, max_num_batched_tokens=256)
    25

``kvref.core.kv_cache_utils`` turns these into pool-wide answers
(``get_max_concurrency_for_kv_cache_config``) and builds the config from the
model's per-layer specs (``get_kv_cache_configs``); ``specs/capacity.md`` works
the numbers through.

Which spec classes exist and which managers serve them is the registry's
business (``kvref.kv_cache_spec_registry``): every spec class here is
registered there by ``register_all_kvcache_specs``.

Adding an attention type starts here; ``docs/contributing.md`` lists every
other file it touches (the manager and its registration, the config builder,
the attention masks, the runner, the checks), in order.
"""

from __future__ import annotations

import copy
import enum
import math
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvref.kv_cache_spec_registry import KVCacheSpecRegistry

from kvref.math_utils import cdiv

# Bytes per element of the KV cache dtypes kvref knows (names as torch spells them).
_DTYPE_SIZES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
                "int8": 1, "uint8": 1}

MAMBA_CACHE_MODES = ("none", "all", "align")


class KVQuantMode(enum.IntEnum):
    """How the KV cache is quantized (vLLM's values), read from the
    ``kv_cache_dtype`` string by ``get_kv_quant_mode``. It changes the page
    size: per-token-head modes add a float32 scale per token, head and side;
    INT4 packs two values a byte; NVFP4 packs fp4 data plus one fp8 scale
    per 16 values."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5

    @property
    def is_per_token_head(self) -> bool:
        return self in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD,
                        KVQuantMode.INT4_PER_TOKEN_HEAD)

    @property
    def is_nvfp4(self) -> bool:
        return self is KVQuantMode.NVFP4


def get_kv_quant_mode(kv_cache_dtype: str) -> KVQuantMode:
    """The quantization a ``kv_cache_dtype`` string selects (``"fp8..."``:
    per tensor, unless it names a per-token-head mode).

    >>> get_kv_quant_mode("fp8_e4m3").name, get_kv_quant_mode("auto").name
    ('FP8_PER_TENSOR', 'NONE')
    """
    named = {"int4_per_token_head": KVQuantMode.INT4_PER_TOKEN_HEAD,
             "int8_per_token_head": KVQuantMode.INT8_PER_TOKEN_HEAD,
             "fp8_per_token_head": KVQuantMode.FP8_PER_TOKEN_HEAD,
             "nvfp4": KVQuantMode.NVFP4}
    if kv_cache_dtype in named:
        return named[kv_cache_dtype]
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype.startswith("fp8"):
        return KVQuantMode.FP8_PER_TENSOR
    return KVQuantMode.NONE


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    return get_kv_quant_mode(kv_cache_dtype) is not KVQuantMode.NONE


def kv_cache_uses_per_token_head_scales(kv_cache_dtype: str) -> bool:
    return get_kv_quant_mode(kv_cache_dtype).is_per_token_head


def _stored_head_dim(head_size: int, mode: KVQuantMode) -> int:
    """Elements one head of one token takes in the cache under ``mode``:
    NVFP4 stores ``head_size / 2`` data bytes and ``head_size / 16`` scales;
    INT4 two values a byte."""
    if mode.is_nvfp4:
        return head_size // 2 + head_size // 16
    if mode is KVQuantMode.INT4_PER_TOKEN_HEAD:
        return head_size // 2
    return head_size


class KVCacheSpecKind(str, enum.Enum):
    """The kind a ``BlockStored`` event reports for its group (vLLM's values)."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


def _positive_int(name: str, value: object, owner: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def get_dtype_size(dtype: object) -> int:
    """Bytes per element of ``dtype``: a name (``"bfloat16"``) or a torch dtype
    (read through ``str()``, so the core never imports torch).

    >>> get_dtype_size("float16"), get_dtype_size("float32")
    (2, 4)
    """
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_SIZES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; kvref knows "
                         f"{sorted(_DTYPE_SIZES)}")
    return _DTYPE_SIZES[name]


@dataclass(frozen=True)
class _Limits:
    """The numbers a peak-usage count reads, from a ``VllmConfig`` or given."""

    max_model_len: int
    max_num_batched_tokens: int | None = None
    max_num_encoder_input_tokens: int | None = None
    context_parallel_size: int = 1  # decode x prefill context parallel ranks
    mamba_cache_mode: str | None = None  # vLLM reads it from the cache config

    @classmethod
    def of(cls, vllm_config: Any, max_model_len: int | None,
           max_num_batched_tokens: int | None,
           max_num_encoder_input_tokens: int | None) -> _Limits:
        if vllm_config is None:
            if max_model_len is None:
                raise TypeError("give a VllmConfig or max_model_len=")
            return cls(max_model_len, max_num_batched_tokens, max_num_encoder_input_tokens)
        parallel = getattr(vllm_config, "parallel_config", None)
        dcp = getattr(parallel, "decode_context_parallel_size", 1) or 1
        pcp = getattr(parallel, "prefill_context_parallel_size", 1) or 1
        scheduler = vllm_config.scheduler_config
        return cls(vllm_config.model_config.max_model_len,
                   scheduler.max_num_batched_tokens,
                   getattr(scheduler, "max_num_encoder_input_tokens", None),
                   dcp * pcp,
                   getattr(vllm_config.cache_config, "mamba_cache_mode", None))


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of every spec: how many tokens one block holds."""

    block_size: int

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size, type(self).__name__)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer takes in the KV cache tensor."""
        raise TypeError(f"{type(self).__name__} does not define a page size")

    @property
    def storage_block_size(self) -> int:
        """Token slots one block stores (fewer than ``block_size`` when a layer
        compresses its tokens, as DeepSeek-V4's MLA layers do)."""
        return self.block_size

    def max_num_blocks_per_request(self, *, max_model_len: int,
                                   max_num_batched_tokens: int | None = None,
                                   max_num_encoder_input_tokens: int | None = None) -> int:
        """The most blocks one request can hold at once in a group of this spec
        (what the pool must have for one request of ``max_model_len`` tokens).

        kvref's name for vLLM's ``max_memory_usage_bytes / page_size_bytes``,
        so it also works for specs without a page size. Each attention type
        answers differently; ``specs/capacity.md`` lists them.
        """
        return self._max_blocks(_Limits(max_model_len, max_num_batched_tokens,
                                        max_num_encoder_input_tokens))

    def _max_blocks(self, limits: _Limits) -> int:
        raise TypeError(f"{type(self).__name__} does not say how many blocks a "
                        "request holds")

    def max_memory_usage_bytes(self, vllm_config: Any = None, *,
                               max_model_len: int | None = None,
                               max_num_batched_tokens: int | None = None,
                               max_num_encoder_input_tokens: int | None = None) -> int:
        """Bytes one layer of this spec needs for one request at its peak:
        the peak block count times ``page_size_bytes``.

        vLLM's form reads the numbers from its config,
        ``spec.max_memory_usage_bytes(vllm_config)``; kvref's takes them as
        keywords: ``max_num_batched_tokens`` (sliding window, chunked local;
        defaults to ``max_model_len``, as ``KVCacheManager`` does) and
        ``max_num_encoder_input_tokens`` (cross-attention) matter only where
        named.
        """
        limits = _Limits.of(vllm_config, max_model_len, max_num_batched_tokens,
                            max_num_encoder_input_tokens)
        return self._max_blocks(limits) * self.page_size_bytes

    def copy_with_new_block_size(self, block_size: int) -> KVCacheSpec:
        """This spec with another ``block_size``."""
        return replace(self, block_size=block_size)

    @classmethod
    def merge(cls, specs: list[KVCacheSpec]) -> KVCacheSpec:
        """The one spec of a group whose layers have ``specs``: they must be
        equal (an ``AssertionError`` otherwise, which vLLM's callers catch)."""
        if any(spec != specs[0] for spec in specs[1:]):
            raise AssertionError("All layers in the same KV cache group must be "
                                 "the same.")
        return copy.deepcopy(specs[0])

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """Whether every spec of ``kv_cache_specs`` groups with this one: each
        is an instance of this spec's registered uniform-type base."""
        base = KVCacheSpecRegistry.get_uniform_type_base_spec(self)
        if base is None:
            raise AssertionError(f"Unsupported KV cache spec type: {type(self)}. "
                                 "Please register it using @register_kv_cache_spec "
                                 "decorator.")
        return all(isinstance(spec, base) for spec in kv_cache_specs.values())


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """A spec whose blocks hold keys and values of attended tokens.

    The block manager never reads the head fields; they make equal specs equal
    and give the page size. They are keyword-only so each subclass can add its
    own positional field. ``dtype`` is a name (``"bfloat16"``) or a torch dtype.
    ``page_size_padded`` makes a page larger than its contents (to give every
    group one page size); ``indexes_kv_by_block_stride`` says the layer's
    backend reads pages through a strided view, so such padding is allowed.
    """

    num_kv_heads: int = field(default=1, kw_only=True)
    head_size: int = field(default=1, kw_only=True)
    dtype: Any = field(default="float16", kw_only=True)
    kv_quant_mode: KVQuantMode = field(default=KVQuantMode.NONE, kw_only=True)
    page_size_padded: int | None = field(default=None, kw_only=True)
    indexes_kv_by_block_stride: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int("num_kv_heads", self.num_kv_heads, type(self).__name__)
        _positive_int("head_size", self.head_size, type(self).__name__)
        if self.page_size_padded is not None:
            _positive_int("page_size_padded", self.page_size_padded, type(self).__name__)

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes the keys and values of one block take, unpadded:
        ``2 * block_size * num_kv_heads * head_size * dtype size`` (fewer
        elements per head when quantized to 4 bits)."""
        return (2 * self.block_size * self.num_kv_heads
                * _stored_head_dim(self.head_size, self.kv_quant_mode)
                * get_dtype_size(self.dtype))

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: ``page_size_padded`` when given,
        else ``real_page_size_bytes``.

        The pool's size follows from it: ``num_blocks = available bytes //
        page_size_bytes // num_layers``, ``num_layers`` being the layers of the
        largest KV cache group (``get_num_blocks``).
        """
        real = self.real_page_size_bytes
        if self.kv_quant_mode.is_per_token_head:
            # One float32 scale per token, head, and key/value side, carved
            # from the same allocation.
            real += 2 * self.block_size * self.num_kv_heads * 4
        if self.page_size_padded is None:
            return real
        if self.page_size_padded < real:
            raise ValueError(f"{type(self).__name__}.page_size_padded "
                             f"{self.page_size_padded} is below the page's "
                             f"{real} bytes")
        return self.page_size_padded


def _one_or_none(values: set, what: str) -> Any:
    if len(values) > 1:
        raise ValueError(f"All attention layers in the same KV cache group must "
                         f"have the same {what}, got {sorted(values)}")
    return next(iter(values), None)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token attends to every earlier token: blocks are kept to the end.

    ``head_size_v`` (the value head size) defaults to ``head_size``. When the
    hybrid allocator is off, window and chunked-local layers join the full
    attention group (they keep every block) and remember their
    ``sliding_window`` / ``attention_chunk_size`` here; ``non_causal`` marks
    layers that attend both ways (prefix LM).
    """

    head_size_v: int | None = field(default=None, kw_only=True)
    sliding_window: int | None = field(default=None, kw_only=True)
    attention_chunk_size: int | None = field(default=None, kw_only=True)
    non_causal: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def real_page_size_bytes(self) -> int:
        """Keys of ``head_size`` and values of ``head_size_v`` per token and head."""
        mode = self.kv_quant_mode
        return (self.block_size * self.num_kv_heads
                * (_stored_head_dim(self.head_size, mode)
                   + _stored_head_dim(self.head_size_v, mode))
                * get_dtype_size(self.dtype))

    def _max_blocks(self, limits: _Limits) -> int:
        """Every block of the longest sequence: ``cdiv(max_model_len, block_size)``
        (with context parallelism each rank keeps ``1/ranks`` of the tokens)."""
        return cdiv(cdiv(limits.max_model_len, limits.context_parallel_size),
                    self.block_size)

    def _merged_fields(self, specs: list[FullAttentionSpec]) -> dict:
        """The fields a merged full-attention spec takes from its layers."""
        for spec in specs:
            if not isinstance(spec, FullAttentionSpec):
                raise AssertionError("All attention layers in the same KV cache "
                                     "group must be FullAttentionSpec.")
        window = _one_or_none({s.sliding_window for s in specs} - {None}, "window size")
        chunk = _one_or_none({s.attention_chunk_size for s in specs} - {None},
                             "attention chunk size")
        if window is not None and chunk is not None:
            raise AssertionError("Model with both sliding window layers and chunked "
                                 "local attention layers is not supported.")
        for f in fields(AttentionSpec):
            if any(getattr(s, f.name) != getattr(self, f.name) for s in specs):
                raise AssertionError("All attention layers in the same KV cache "
                                     "group must have the same attention spec.")
        return dict(sliding_window=window, attention_chunk_size=chunk,
                    non_causal=any(s.non_causal for s in specs))

    @classmethod
    def merge(cls, specs: list[FullAttentionSpec]) -> FullAttentionSpec:
        """One spec for a group of full-attention layers: the attention fields
        must agree; a window or chunk size is kept if the layers agree on it;
        the group is non-causal if any layer is."""
        if any(isinstance(spec, MLAAttentionSpec) for spec in specs):
            raise AssertionError("MLAAttentionSpec should be merged in "
                                 "MLAAttentionSpec.merge")
        return replace(specs[0], **specs[0]._merged_fields(specs))


@dataclass(frozen=True)
class TQFullAttentionSpec(FullAttentionSpec):
    """Full attention whose tokens are stored in ``tq_slot_size`` bytes per
    head (a TurboQuant-style packed layout) instead of ``head_size`` elements."""

    tq_slot_size: int = field(default=0, kw_only=True)

    @property
    def real_page_size_bytes(self) -> int:
        if self.tq_slot_size > 0:
            return self.block_size * self.num_kv_heads * self.tq_slot_size
        return super().real_page_size_bytes

    @classmethod
    def merge(cls, specs: list[TQFullAttentionSpec]) -> TQFullAttentionSpec:
        if len({spec.tq_slot_size for spec in specs}) > 1:
            raise AssertionError("All TQ layers in the same KV cache group must use "
                                 "the same tq_slot_size.")
        return super().merge(specs)


# The fixed per-token bytes of DeepSeek's fp8 MLA cache layouts ("fp8_ds_mla").
_FP8_DS_MLA_BYTES_PER_TOKEN = 656   # V3.2: 512 latent + 64 rope, with scales
_FP8_DS_MLA_V4_BYTES_PER_TOKEN = 584  # V4: 448 NoPE + 128 RoPE + 8 scale bytes


def _pad_to_alignment(spec: MLAAttentionSpec | SlidingWindowMLASpec) -> None:
    """Round the page up to ``spec.alignment`` bytes (DeepSeek-V4)."""
    if spec.alignment is None:
        return
    real = spec.real_page_size_bytes
    padded = cdiv(real, spec.alignment) * spec.alignment
    if padded != real:
        object.__setattr__(spec, "page_size_padded", padded)


def _mla_fields_agree(specs: list, names: tuple[str, ...]) -> None:
    for name in names:
        if len({getattr(spec, name) for spec in specs}) > 1:
            raise AssertionError(f"All attention layers in the same KV cache group "
                                 f"must use the same {name}.")


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one compressed latent per token instead of
    a key and a value, so a page is ``storage_block_size * num_kv_heads *
    head_size * dtype size`` (no factor 2). ``cache_dtype_str="fp8_ds_mla"``
    selects DeepSeek's fixed-size fp8 layout; ``compress_ratio`` tokens share
    one slot; ``alignment`` pads the page (DeepSeek-V4)."""

    cache_dtype_str: str | None = field(default=None, kw_only=True)
    alignment: int | None = field(default=None, kw_only=True)
    compress_ratio: int = field(default=1, kw_only=True)
    model_version: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _pad_to_alignment(self)

    @property
    def storage_block_size(self) -> int:
        return self.block_size // self.compress_ratio

    @property
    def real_page_size_bytes(self) -> int:
        if self.cache_dtype_str == "fp8_ds_mla":
            if self.model_version == "deepseek_v4":
                return self.storage_block_size * _FP8_DS_MLA_V4_BYTES_PER_TOKEN
            return self.block_size * _FP8_DS_MLA_BYTES_PER_TOKEN
        head_dim = (self.head_size // 2 if self.kv_quant_mode is KVQuantMode.INT4_PER_TOKEN_HEAD
                    else self.head_size)
        return (self.storage_block_size * self.num_kv_heads * head_dim
                * get_dtype_size(self.dtype))

    @classmethod
    def merge(cls, specs: list[MLAAttentionSpec]) -> MLAAttentionSpec:
        """MLA layers group when they agree on the layout fields; the window
        and chunk fields of full attention do not apply."""
        if not all(isinstance(spec, MLAAttentionSpec) for spec in specs):
            raise AssertionError("All attention layers in the same KV cache group "
                                 "must be MLAAttentionSpec.")
        _mla_fields_agree(specs, ("cache_dtype_str", "compress_ratio", "model_version",
                                  "indexes_kv_by_block_stride"))
        first = specs[0]
        return cls(block_size=first.block_size, num_kv_heads=first.num_kv_heads,
                   head_size=first.head_size, dtype=first.dtype,
                   kv_quant_mode=first.kv_quant_mode,
                   page_size_padded=first.page_size_padded,
                   indexes_kv_by_block_stride=first.indexes_kv_by_block_stride,
                   cache_dtype_str=first.cache_dtype_str,
                   compress_ratio=first.compress_ratio,
                   model_version=first.model_version)


@dataclass(frozen=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Layers that store hidden states in the KV cache (vLLM's
    extract-hidden-states connector); they keep every token, like MLA."""


@dataclass(frozen=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` sink tokens whose blocks the group's
    manager takes from the pool once, when it is built (a whole number of
    blocks), and holds for every request."""

    sink_len: int | None = field(default=None, kw_only=True)

    @classmethod
    def merge(cls, specs: list[SinkFullAttentionSpec]) -> SinkFullAttentionSpec:
        if any(isinstance(spec, MLAAttentionSpec) for spec in specs):
            raise AssertionError("MLAAttentionSpec should be merged in "
                                 "MLAAttentionSpec.merge")
        return replace(specs[0], **specs[0]._merged_fields(specs))


@dataclass(frozen=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding-window attention: every prompt token stays visible;
    of the generated tokens only the last ``rswa_window`` are attended to, so
    blocks between the prompt's end and the window are freed
    (``RSWAManager``). Sized like full attention."""

    rswa_window: int = field(default=None, kw_only=True)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int("rswa_window", self.rswa_window, "RSWASpec")

    @classmethod
    def merge(cls, specs: list[RSWASpec]) -> RSWASpec:
        if not all(isinstance(spec, RSWASpec) for spec in specs):
            raise AssertionError("All attention layers in the same KV cache group "
                                 "must be RSWASpec.")
        if len({spec.rswa_window for spec in specs}) > 1:
            raise AssertionError("All R-SWA layers must share the same rswa_window.")
        return replace(specs[0], **specs[0]._merged_fields(specs))


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A token attends to the last ``sliding_window`` tokens (itself included)."""

    sliding_window: int
    head_size_v: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int("sliding_window", self.sliding_window, type(self).__name__)
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def real_page_size_bytes(self) -> int:
        """As full attention's: keys and values may differ in head size."""
        if self.kv_quant_mode.is_nvfp4:
            dims = (_stored_head_dim(self.head_size, self.kv_quant_mode)
                    + _stored_head_dim(self.head_size_v, self.kv_quant_mode))
        else:
            dims = self.head_size + self.head_size_v
        return self.block_size * self.num_kv_heads * dims * get_dtype_size(self.dtype)

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int,
                                         max_model_len: int) -> int:
        """Most blocks one request can hold at once, given that blocks left of
        the window are freed before each chunk: ``window - 1`` old tokens plus a
        chunk, and one more block because the window need not start on a block
        boundary. One number for two uses, as in vLLM: sizing the pool and
        capping the full-sequence admission check, so that a request the pool
        was sized for is never refused for good."""
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens,
                         max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def _max_blocks(self, limits: _Limits) -> int:
        """The admission cap: a request never holds more, however long it is."""
        if limits.context_parallel_size != 1:
            raise ValueError("decode context parallelism does not support sliding "
                             "window attention")
        batched = limits.max_num_batched_tokens
        return self.max_admission_blocks_per_request(
            limits.max_model_len if batched is None else batched, limits.max_model_len)

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """Windows group only with windows of the same size."""
        return all(isinstance(spec, SlidingWindowSpec)
                   and spec.sliding_window == self.sliding_window
                   for spec in kv_cache_specs.values())


@dataclass(frozen=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """A sliding window over MLA latents (DeepSeek-V4's local layers): the
    window's block handling, MLA's page (no factor 2, ``compress_ratio``)."""

    cache_dtype_str: str | None = field(default=None, kw_only=True)
    alignment: int | None = field(default=None, kw_only=True)
    compress_ratio: int = field(default=1, kw_only=True)
    model_version: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_version not in (None, "deepseek_v4"):
            raise ValueError(f"SlidingWindowMLASpec.model_version "
                             f"{self.model_version!r} is not supported")
        _pad_to_alignment(self)

    @property
    def storage_block_size(self) -> int:
        return self.block_size // self.compress_ratio

    @property
    def real_page_size_bytes(self) -> int:
        if self.model_version == "deepseek_v4" and self.cache_dtype_str == "fp8_ds_mla":
            return self.storage_block_size * _FP8_DS_MLA_V4_BYTES_PER_TOKEN
        return (self.storage_block_size * self.num_kv_heads * self.head_size
                * get_dtype_size(self.dtype))

    @classmethod
    def merge(cls, specs: list[SlidingWindowMLASpec]) -> SlidingWindowMLASpec:
        if not all(isinstance(spec, SlidingWindowMLASpec) for spec in specs):
            raise AssertionError("All attention layers in the same KV cache group "
                                 "must be SlidingWindowMLASpec.")
        _mla_fields_agree(specs, ("cache_dtype_str", "compress_ratio", "model_version",
                                  "sliding_window", "indexes_kv_by_block_stride"))
        first = specs[0]
        return cls(block_size=first.block_size, sliding_window=first.sliding_window,
                   num_kv_heads=first.num_kv_heads, head_size=first.head_size,
                   dtype=first.dtype, page_size_padded=first.page_size_padded,
                   indexes_kv_by_block_stride=first.indexes_kv_by_block_stride,
                   cache_dtype_str=first.cache_dtype_str,
                   compress_ratio=first.compress_ratio,
                   model_version=first.model_version)

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        return all(isinstance(spec, SlidingWindowMLASpec)
                   and spec.sliding_window == self.sliding_window
                   for spec in kv_cache_specs.values())


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Tokens attend only inside their own chunk of ``attention_chunk_size``."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int("attention_chunk_size", self.attention_chunk_size,
                      "ChunkedLocalAttentionSpec")

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int,
                                         max_model_len: int) -> int:
        """Most blocks one request can hold at once: one chunk plus a batch
        (used, like the sliding window's, both to size the pool and to cap
        the full-sequence admission check)."""
        num_tokens = min(self.attention_chunk_size + max_num_batched_tokens,
                         max_model_len)
        return cdiv(num_tokens, self.block_size)

    def _max_blocks(self, limits: _Limits) -> int:
        """The admission cap: a request never holds more, however long it is."""
        batched = limits.max_num_batched_tokens
        return self.max_admission_blocks_per_request(
            limits.max_model_len if batched is None else batched, limits.max_model_len)

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """Chunked layers group only with chunks of the same size."""
        return all(isinstance(spec, ChunkedLocalAttentionSpec)
                   and spec.attention_chunk_size == self.attention_chunk_size
                   for spec in kv_cache_specs.values())


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A recurrent state instead of per-token keys and values.

    ``mamba_cache_mode``: ``"none"`` (vLLM's default) keeps only the running
    state, ``"all"`` keeps a state per block (prefix caching), ``"align"``
    keeps the running state plus the last block-aligned one.
    ``num_speculative_blocks`` extra states hold draft tokens for speculative
    decoding.

    For capacity arithmetic only (the block manager never reads them):
    ``shapes`` and ``dtypes``, the state tensors one block holds, give
    ``page_size_bytes`` (paired up in order, as vLLM zips them; they are not
    checked when the spec is built, as vLLM does not check them);
    ``page_size_padded`` overrides it, as vLLM pads Mamba and attention pages
    to one size when a model has both. ``mamba_type`` names the state kind
    (vLLM's ``MambaAttentionBackendEnum``; kvref never reads it).
    """

    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    shapes: tuple = field(default=(), kw_only=True)
    dtypes: tuple = field(default=(), kw_only=True)
    page_size_padded: int | None = field(default=None, kw_only=True)
    mamba_type: Any = field(default="mamba2", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(f"MambaSpec.mamba_cache_mode must be one of "
                             f"{MAMBA_CACHE_MODES}, got {self.mamba_cache_mode!r}")
        if (isinstance(self.num_speculative_blocks, bool)
                or not isinstance(self.num_speculative_blocks, int)
                or self.num_speculative_blocks < 0):
            raise ValueError("MambaSpec.num_speculative_blocks must be an int "
                             f">= 0, got {self.num_speculative_blocks!r}")
        if self.page_size_padded is not None:
            _positive_int("page_size_padded", self.page_size_padded, "MambaSpec")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one state: every state tensor's elements times its dtype
        size, or ``page_size_padded`` when given (it may not be smaller)."""
        if not self.shapes and self.page_size_padded is None:
            raise ValueError("MambaSpec has no page size: give shapes and dtypes "
                             "(the state tensors of one block) or page_size_padded")
        if len(self.shapes) != len(self.dtypes):
            raise ValueError(f"MambaSpec needs one dtype per state shape for a page "
                             f"size, got shapes={self.shapes!r}, dtypes={self.dtypes!r}")
        real = sum(math.prod(shape) * get_dtype_size(dtype)
                   for shape, dtype in zip(self.shapes, self.dtypes))
        if self.page_size_padded is None:
            return real
        if self.page_size_padded < real:
            raise ValueError(f"MambaSpec.page_size_padded {self.page_size_padded} is "
                             f"below the states' {real} bytes")
        return self.page_size_padded

    def _max_blocks(self, limits: _Limits) -> int:
        """``"all"``: a state per block of the longest sequence; ``"align"``: the
        running state and the last aligned one; ``"none"``: the running state;
        each plus the speculative states. (vLLM makes a ``"none"`` block hold the
        whole sequence; with a smaller ``block_size`` a chunk spanning several
        blocks holds more for a moment, which this count, like vLLM's, ignores.)

        Given a ``VllmConfig``, the mode is the config's
        ``cache_config.mamba_cache_mode``, as vLLM reads it; given numbers, the
        spec's own.
        """
        mode = limits.mamba_cache_mode or self.mamba_cache_mode
        if mode == "all":
            return cdiv(limits.max_model_len, self.block_size) + self.num_speculative_blocks
        if mode == "align":
            return 2 + self.num_speculative_blocks
        return 1 + self.num_speculative_blocks

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """Mamba layers group when they hold the same speculative states."""
        return all(isinstance(spec, MambaSpec)
                   and spec.num_speculative_blocks == self.num_speculative_blocks
                   for spec in kv_cache_specs.values())


@dataclass(frozen=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Encoder layers attend within one forward pass and keep nothing: a
    request needs no blocks for them."""

    def _max_blocks(self, limits: _Limits) -> int:
        return 0


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder tokens attend to the encoder's output (Whisper): one static
    allocation per request, never shared."""

    def _max_blocks(self, limits: _Limits) -> int:
        """The encoder's longest output: ``cdiv(max_num_encoder_input_tokens,
        block_size)``, whatever the decoder's length."""
        if limits.max_num_encoder_input_tokens is None:
            raise ValueError("CrossAttentionSpec holds the encoder's output: pass "
                             "max_num_encoder_input_tokens (1500 for Whisper)")
        return cdiv(limits.max_num_encoder_input_tokens, self.block_size)


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one attention type (they need the same token slots) whose
    pages differ in size, e.g. MLA layers with different head sizes: one KV
    cache group, one block table, and a block id names one page in each
    layer's own tensor. A page of the group is the sum of its layers' pages.

    >>> a = FullAttentionSpec(16, head_size=64)
    >>> b = FullAttentionSpec(16, head_size=128)
    >>> both = UniformTypeKVCacheSpecs.from_specs({"l0": a, "l1": b})
    >>> both.page_size_bytes == a.page_size_bytes + b.page_size_bytes
    True
    >>> UniformTypeKVCacheSpecs.from_specs({"l0": a, "sw": SlidingWindowSpec(16, 8)}) is None
    True
    """

    kv_cache_specs: dict[str, KVCacheSpec]

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def _max_blocks(self, limits: _Limits) -> int:
        """The most blocks any of its layers needs."""
        return max(spec._max_blocks(limits) for spec in self.kv_cache_specs.values())

    def max_memory_usage_bytes(self, vllm_config: Any = None, **numbers: Any) -> int:
        """The most pages any layer needs, times the group's page."""
        return self.max_memory_usage_pages(vllm_config, **numbers) * self.page_size_bytes

    def max_memory_usage_pages(self, vllm_config: Any = None, **numbers: Any) -> int:
        """The most pages any one of its layers needs for one request."""
        return max(cdiv(spec.max_memory_usage_bytes(vllm_config, **numbers),
                        spec.page_size_bytes)
                   for spec in self.kv_cache_specs.values())

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """Whether the layers can be one group: one block size, and every spec
        groups with the first (``is_uniform_with_collection``)."""
        if len({spec.block_size for spec in kv_cache_specs.values()}) > 1:
            return False
        first = next(iter(kv_cache_specs.values()))
        return first.is_uniform_with_collection(kv_cache_specs)

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """The layers as one spec, or None if they cannot be one group."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=kv_cache_specs)

    def get_page_sizes(self) -> list[int]:
        """The distinct page sizes of its layers."""
        return list({spec.page_size_bytes for spec in self.kv_cache_specs.values()})

    def get_num_layer_tuples(self) -> int:
        """How many layers share the most common page size (a "layer tuple"
        is one layer of each page size)."""
        counts = Counter(spec.page_size_bytes for spec in self.kv_cache_specs.values())
        return counts.most_common(1)[0][1]


@dataclass
class KVCacheTensor:
    """One tensor a worker allocates: ``size`` bytes shared by the layers in
    ``shared_by`` (one layer from each group; their block tables never name
    the same block). In a packed layout every block's pages lie side by side:
    the layer's page starts ``offset`` bytes into a block of ``block_stride``
    bytes (0: not packed)."""

    size: int
    shared_by: list[str]
    offset: int = 0
    block_stride: int = 0


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table (``is_eagle_group``: EAGLE/MTP draft layers)."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False


@dataclass
class KVCacheConfig:
    """The pool size, the groups that draw from it, and the tensors behind it.

    kvref's positional order is ``(num_blocks, kv_cache_groups,
    kv_cache_tensors)``; vLLM's is ``(num_blocks, kv_cache_tensors,
    kv_cache_groups)``. With keywords (as vLLM's own code builds it) both read
    the same. A model without attention has no groups and one block (the
    pool's null block).
    """

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        _positive_int("num_blocks", self.num_blocks, "KVCacheConfig")
        for i, group in enumerate(self.kv_cache_groups):
            if not isinstance(group.kv_cache_spec, KVCacheSpec):
                raise ValueError(f"kv_cache_groups[{i}].kv_cache_spec is not a "
                                 f"KVCacheSpec: {group.kv_cache_spec!r}")

    @property
    def has_mamba_layers(self) -> bool:
        """Whether a group holds Mamba states."""
        return any(isinstance(g.kv_cache_spec, MambaSpec) for g in self.kv_cache_groups)

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        """Whether freshly allocated blocks must be zeroed before use: a Mamba
        state is read before it is written (a new request starts from zeros),
        while attention only reads slots it has written."""
        return self.has_mamba_layers


def get_kv_cache_spec_kind(spec: KVCacheSpec) -> KVCacheSpecKind:
    """The kind a ``BlockStored`` event carries for a group with this spec
    (subclasses first, so an MLA group says MLA, not full attention)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {get_kv_cache_spec_kind(s) for s in spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else KVCacheSpecKind.UNKNOWN
    kinds = [
        (SlidingWindowMLASpec, KVCacheSpecKind.SLIDING_WINDOW_MLA),
        (MLAAttentionSpec, KVCacheSpecKind.MLA_ATTENTION),
        (SinkFullAttentionSpec, KVCacheSpecKind.SINK_FULL_ATTENTION),
        (FullAttentionSpec, KVCacheSpecKind.FULL_ATTENTION),
        (ChunkedLocalAttentionSpec, KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION),
        (SlidingWindowSpec, KVCacheSpecKind.SLIDING_WINDOW),
        (MambaSpec, KVCacheSpecKind.MAMBA),
        (EncoderOnlyAttentionSpec, KVCacheSpecKind.ENCODER_ONLY_ATTENTION),
        (CrossAttentionSpec, KVCacheSpecKind.CROSS_ATTENTION),
    ]
    for cls, kind in kinds:
        if isinstance(spec, cls):
            return kind
    return KVCacheSpecKind.UNKNOWN


def get_kv_cache_spec_sliding_window(spec: KVCacheSpec) -> int | None:
    """The window a ``BlockStored`` event carries (sliding-window groups only)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        windows = {get_kv_cache_spec_sliding_window(s) for s in spec.kv_cache_specs.values()}
        return windows.pop() if len(windows) == 1 else None
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
