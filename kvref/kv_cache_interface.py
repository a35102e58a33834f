"""What a KV cache group looks like: one spec per attention type.

Mirrors ``vllm/v1/kv_cache_interface.py``. A *spec* tells the KV layer how a
group of layers uses its blocks (every token, a window, one chunk, one state);
a *group* is the set of layers that share one block table; the *config* is the
pool size plus the list of groups.

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
request can hold at its peak. vLLM's versions read ``max_model_len`` and the
batch limits from its ``VllmConfig``; kvref takes those numbers as arguments.

    >>> FullAttentionSpec(16, num_kv_heads=8, head_size=128).page_size_bytes
    65536
    >>> FullAttentionSpec(16).max_num_blocks_per_request(max_model_len=1000)
    63
    >>> SlidingWindowSpec(16, 128).max_num_blocks_per_request(
    ...     max_model_len=1000, max_num_batched_tokens=256)
    25

``kvref.core.kv_cache_utils`` turns these into pool-wide answers
(``get_max_concurrency_for_kv_cache_config``); ``specs/capacity.md`` works the
numbers through.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from kvref.math_utils import cdiv

# Bytes per element of the KV cache dtypes kvref knows (names as torch spells them).
_DTYPE_SIZES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
                "int8": 1, "uint8": 1}

MAMBA_CACHE_MODES = ("none", "all", "align")


class KVCacheSpecKind(str, enum.Enum):
    """The kind a ``BlockStored`` event reports for its group (vLLM's values)."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
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
class KVCacheSpec:
    """Base of every spec: how many tokens one block holds."""

    block_size: int

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size, type(self).__name__)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer takes in the KV cache tensor."""
        raise TypeError(f"{type(self).__name__} does not define a page size")

    def max_num_blocks_per_request(self, *, max_model_len: int,
                                   max_num_batched_tokens: int | None = None,
                                   max_num_encoder_input_tokens: int | None = None) -> int:
        """The most blocks one request can hold at once in a group of this spec
        (what the pool must have for one request of ``max_model_len`` tokens).

        kvref's name for vLLM's ``max_memory_usage_bytes / page_size_bytes``,
        so it also works for specs without a page size. Each attention type
        answers differently; ``specs/capacity.md`` lists them.
        """
        raise TypeError(f"{type(self).__name__} does not say how many blocks a "
                        "request holds")

    def max_memory_usage_bytes(self, *, max_model_len: int,
                               max_num_batched_tokens: int | None = None,
                               max_num_encoder_input_tokens: int | None = None) -> int:
        """Bytes one layer of this spec needs for one request at its peak:
        ``max_num_blocks_per_request(...) * page_size_bytes`` (vLLM's method of
        the same name, which reads the three numbers from its ``VllmConfig``).

        ``max_num_batched_tokens`` (sliding window, chunked local; defaults to
        ``max_model_len``, as ``KVCacheManager`` does) and
        ``max_num_encoder_input_tokens`` (cross-attention) matter only where
        named.
        """
        return self.max_num_blocks_per_request(
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens) * self.page_size_bytes


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """A spec whose blocks hold keys and values of attended tokens.

    The block manager never reads the head fields; they make equal specs equal
    and give the page size. They are keyword-only so each subclass can add its
    own positional field. ``dtype`` is a name (``"bfloat16"``) or a torch dtype.
    """

    num_kv_heads: int = field(default=1, kw_only=True)
    head_size: int = field(default=1, kw_only=True)
    dtype: str = field(default="float16", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int("num_kv_heads", self.num_kv_heads, type(self).__name__)
        _positive_int("head_size", self.head_size, type(self).__name__)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: a key and a value per token, head
        and channel, ``2 * block_size * num_kv_heads * head_size * dtype size``.

        The pool's size follows from it: ``num_blocks = available bytes //
        page_size_bytes // num_layers``, ``num_layers`` being the layers of the
        largest KV cache group (``get_num_blocks``).
        """
        return (2 * self.block_size * self.num_kv_heads * self.head_size
                * get_dtype_size(self.dtype))


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token attends to every earlier token: blocks are kept to the end."""

    def max_num_blocks_per_request(self, *, max_model_len: int,
                                   max_num_batched_tokens: int | None = None,
                                   max_num_encoder_input_tokens: int | None = None) -> int:
        """Every block of the longest sequence: ``cdiv(max_model_len, block_size)``."""
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """A token attends to the last ``sliding_window`` tokens (itself included)."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_int("sliding_window", self.sliding_window, "SlidingWindowSpec")

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

    def max_num_blocks_per_request(self, *, max_model_len: int,
                                   max_num_batched_tokens: int | None = None,
                                   max_num_encoder_input_tokens: int | None = None) -> int:
        """The admission cap: a request never holds more, however long it is."""
        return self.max_admission_blocks_per_request(
            max_model_len if max_num_batched_tokens is None else max_num_batched_tokens,
            max_model_len)


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

    def max_num_blocks_per_request(self, *, max_model_len: int,
                                   max_num_batched_tokens: int | None = None,
                                   max_num_encoder_input_tokens: int | None = None) -> int:
        """The admission cap: a request never holds more, however long it is."""
        return self.max_admission_blocks_per_request(
            max_model_len if max_num_batched_tokens is None else max_num_batched_tokens,
            max_model_len)


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A recurrent state instead of per-token keys and values.

    ``mamba_cache_mode``: ``"none"`` keeps only the running state, ``"all"``
    keeps a state per block (prefix caching), ``"align"`` keeps the running
    state plus the last block-aligned one. ``num_speculative_blocks`` extra
    states hold draft tokens for speculative decoding.

    For capacity arithmetic only (the block manager never reads them):
    ``shapes`` and ``dtypes``, the state tensors one block holds, give
    ``page_size_bytes``; ``page_size_padded`` overrides it, as vLLM pads Mamba
    and attention pages to one size when a model has both.
    """

    mamba_cache_mode: str = "all"
    num_speculative_blocks: int = 0
    shapes: tuple[tuple[int, ...], ...] = field(default=(), kw_only=True)
    dtypes: tuple[object, ...] = field(default=(), kw_only=True)
    page_size_padded: int | None = field(default=None, kw_only=True)

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
        if len(self.shapes) != len(self.dtypes):
            raise ValueError(f"MambaSpec needs one dtype per state shape, got "
                             f"shapes={self.shapes!r}, dtypes={self.dtypes!r}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one state: every state tensor's elements times its dtype
        size, or ``page_size_padded`` when given."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        if not self.shapes:
            raise ValueError("MambaSpec has no page size: give shapes and dtypes "
                             "(the state tensors of one block) or page_size_padded")
        return sum(math.prod(shape) * get_dtype_size(dtype)
                   for shape, dtype in zip(self.shapes, self.dtypes))

    def max_num_blocks_per_request(self, *, max_model_len: int,
                                   max_num_batched_tokens: int | None = None,
                                   max_num_encoder_input_tokens: int | None = None) -> int:
        """``"all"``: a state per block of the longest sequence; ``"align"``: the
        running state and the last aligned one; ``"none"``: the running state;
        each plus the speculative states. (vLLM makes a ``"none"`` block hold the
        whole sequence; with a smaller ``block_size`` a chunk spanning several
        blocks holds more for a moment, which this count, like vLLM's, ignores.)
        """
        if self.mamba_cache_mode == "all":
            return cdiv(max_model_len, self.block_size) + self.num_speculative_blocks
        if self.mamba_cache_mode == "align":
            return 2 + self.num_speculative_blocks
        return 1 + self.num_speculative_blocks


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder tokens attend to the encoder's output (Whisper): one static
    allocation per request, never shared."""

    def max_num_blocks_per_request(self, *, max_model_len: int,
                                   max_num_batched_tokens: int | None = None,
                                   max_num_encoder_input_tokens: int | None = None) -> int:
        """The encoder's longest output: ``cdiv(max_num_encoder_input_tokens,
        block_size)``, whatever the decoder's length."""
        if max_num_encoder_input_tokens is None:
            raise ValueError("CrossAttentionSpec holds the encoder's output: pass "
                             "max_num_encoder_input_tokens (1500 for Whisper)")
        return cdiv(max_num_encoder_input_tokens, self.block_size)


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table (``is_eagle_group``: EAGLE/MTP draft layers)."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False


@dataclass
class KVCacheConfig:
    """The pool size and the groups that draw from it."""

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]
    kv_cache_tensors: tuple = ()

    def __post_init__(self) -> None:
        _positive_int("num_blocks", self.num_blocks, "KVCacheConfig")
        for i, group in enumerate(self.kv_cache_groups):
            if not isinstance(group.kv_cache_spec, KVCacheSpec):
                raise ValueError(f"kv_cache_groups[{i}].kv_cache_spec is not a "
                                 f"KVCacheSpec: {group.kv_cache_spec!r}")


def get_kv_cache_spec_kind(spec: KVCacheSpec) -> KVCacheSpecKind:
    """The kind a ``BlockStored`` event carries for a group with this spec."""
    kinds = {
        FullAttentionSpec: KVCacheSpecKind.FULL_ATTENTION,
        SlidingWindowSpec: KVCacheSpecKind.SLIDING_WINDOW,
        ChunkedLocalAttentionSpec: KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION,
        MambaSpec: KVCacheSpecKind.MAMBA,
        CrossAttentionSpec: KVCacheSpecKind.CROSS_ATTENTION,
    }
    for cls, kind in kinds.items():
        if isinstance(spec, cls):
            return kind
    return KVCacheSpecKind.UNKNOWN


def get_kv_cache_spec_sliding_window(spec: KVCacheSpec) -> int | None:
    """The window a ``BlockStored`` event carries (sliding-window groups only)."""
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
