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
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

# Bytes per element, for page-size arithmetic in the tutorials.
_DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1}

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


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of every spec: how many tokens one block holds."""

    block_size: int

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size, type(self).__name__)


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """A spec whose blocks hold keys and values of attended tokens.

    The head fields only matter for equality (and the tutorials' page size);
    they are keyword-only so each subclass can add its own positional field.
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
        """Bytes of one block: keys and values, ``2 * block_size * H * D * dtype``."""
        return (2 * self.block_size * self.num_kv_heads * self.head_size
                * _DTYPE_SIZES.get(self.dtype, 2))


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token attends to every earlier token: blocks are kept to the end."""


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
        boundary."""
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens,
                         max_model_len)
        return math.ceil(num_tokens / self.block_size) + 1


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
        """Most blocks one request can hold at once: one chunk plus a batch."""
        num_tokens = min(self.attention_chunk_size + max_num_batched_tokens,
                         max_model_len)
        return math.ceil(num_tokens / self.block_size)


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A recurrent state instead of per-token keys and values.

    ``mamba_cache_mode``: ``"none"`` keeps only the running state, ``"all"``
    keeps a state per block (prefix caching), ``"align"`` keeps the running
    state plus the last block-aligned one. ``num_speculative_blocks`` extra
    states hold draft tokens for speculative decoding.
    """

    mamba_cache_mode: str = "all"
    num_speculative_blocks: int = 0

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


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder tokens attend to the encoder's output (Whisper): one static
    allocation per request, never shared."""


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
