"""The model configurations the scheduler machine runs, one per config class.

Each is small on purpose: a pool that holds one max-length request and little
more (vLLM refuses to start with less), so that admissions are refused,
running requests are preempted and cached blocks are evicted within a few steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvref import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvref.math_utils import cdiv

from . import backend


@dataclass(frozen=True)
class ModelConfig:
    """One model's KV layout plus the scheduler settings that drive it.

    ``draft_tokens``: most draft tokens per decode step (0: no speculation);
    ``use_eagle`` then also reserves ``draft_tokens`` lookahead slots per step.
    ``spare_blocks``: blocks beyond what one max-length request needs.
    ``retention_interval``: the prefix-cache retention interval (``None``: unset),
    given to the manager explicitly so the shell's variable never leaks in.
    """

    name: str
    specs: tuple[KVCacheSpec, ...]
    eagle_groups: tuple[int, ...] = ()
    enable_caching: bool = True
    use_eagle: bool = False
    draft_tokens: int = 0
    watermark: float = 0.0
    encoder_tokens: int = 0
    max_model_len: int = 48
    max_num_batched_tokens: int = 16
    spare_blocks: int = 2
    retention_interval: int | None = None

    @property
    def lookahead(self) -> int:
        return self.draft_tokens if self.use_eagle else 0

    @property
    def block_sizes(self) -> list[int]:
        return [s.block_size for s in self.specs]

    @property
    def scheduler_block_size(self) -> int:
        if self.enable_caching and len(self.specs) == 1:
            return self.specs[0].block_size
        return math.lcm(*self.block_sizes)

    @property
    def hash_block_size(self) -> int:
        if self.enable_caching and len(self.specs) > 1:
            return math.gcd(*self.block_sizes)
        return self.scheduler_block_size

    @property
    def mamba_align(self) -> bool:
        return any(isinstance(s, MambaSpec) and s.mamba_cache_mode == "align"
                   for s in self.specs)

    @property
    def attention_block_size(self) -> int:
        """vLLM's cache_config.block_size: what Mamba-aligned chunks are cut to."""
        sizes = [s.block_size for s in self.specs if not isinstance(s, MambaSpec)]
        return min(sizes) if sizes else self.specs[0].block_size

    def blocks_for_one_request(self) -> int:
        """What vLLM's startup check asks of the pool: one request of
        ``max_model_len`` tokens (plus lookahead slots) must fit."""
        length, ahead, batch = self.max_model_len, self.lookahead, self.max_num_batched_tokens
        total = 0
        for spec in self.specs:
            bs = spec.block_size
            if isinstance(spec, SlidingWindowSpec):
                total += cdiv(min(spec.sliding_window - 1 + batch, length) + ahead, bs) + 1
            elif isinstance(spec, ChunkedLocalAttentionSpec):
                total += cdiv(min(spec.attention_chunk_size + batch, length) + ahead, bs) + 1
            elif isinstance(spec, MambaSpec):
                extra = spec.num_speculative_blocks
                total += 2 + extra if spec.mamba_cache_mode == "align" \
                    else cdiv(length + ahead, bs) + extra
            elif isinstance(spec, CrossAttentionSpec):
                total += cdiv(self.encoder_tokens, bs)
            else:
                total += cdiv(length + ahead, bs)
        return total

    @property
    def num_blocks(self) -> int:
        return 1 + self.blocks_for_one_request() + self.spare_blocks

    def make_manager(self):
        """The backend's ``KVCacheManager`` (kvref's or vLLM's, ``backend.py``)."""
        return backend.make_manager(
            backend.make_kv_cache_config(self.num_blocks, self.specs, self.eagle_groups),
            max_model_len=self.max_model_len,
            scheduler_block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_caching=self.enable_caching, use_eagle=self.use_eagle, log_stats=True,
            enable_kv_cache_events=True, watermark=self.watermark,
            retention_interval=self.retention_interval)


def _configs(*configs: ModelConfig) -> dict[str, ModelConfig]:
    return {c.name: c for c in configs}


CONFIGS = _configs(
    # Full attention; n-gram drafts (no lookahead); a watermark for admissions.
    ModelConfig("full", (FullAttentionSpec(4),), draft_tokens=2, watermark=0.2),
    ModelConfig("sliding_window", (SlidingWindowSpec(4, sliding_window=7),)),
    ModelConfig("chunked_local", (FullAttentionSpec(4),
                                  ChunkedLocalAttentionSpec(4, attention_chunk_size=8))),
    ModelConfig("chunked_local_only", (ChunkedLocalAttentionSpec(4, attention_chunk_size=8),)),
    ModelConfig("mamba_all", (MambaSpec(4, mamba_cache_mode="all"),)),
    ModelConfig("mamba_align", (FullAttentionSpec(4), MambaSpec(4, mamba_cache_mode="align"))),
    ModelConfig("mamba_align_only", (MambaSpec(4, mamba_cache_mode="align"),), spare_blocks=4),
    ModelConfig("cross_attention", (FullAttentionSpec(4), CrossAttentionSpec(4)),
                enable_caching=False, encoder_tokens=6),
    # Two windows: three distinct specs, so the hit needs a real fixed point.
    ModelConfig("hybrid_full_swa", (FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=6),
                                    SlidingWindowSpec(4, sliding_window=11))),
    ModelConfig("hybrid_full_mamba", (FullAttentionSpec(4), MambaSpec(4, mamba_cache_mode="all"))),
    # Mamba states every 4 tokens, hits every 8: a single-pass fixed point.
    ModelConfig("hybrid_full_mamba_diff_block_sizes", (FullAttentionSpec(8),
                                                       MambaSpec(4, mamba_cache_mode="all"))),
    ModelConfig("hybrid_diff_block_sizes", (FullAttentionSpec(4),
                                            SlidingWindowSpec(8, sliding_window=11))),
    # Window first in the config; a Mamba state every 4 tokens, hits every 8.
    ModelConfig("hybrid_diff_block_sizes_swa_first",
                (SlidingWindowSpec(4, sliding_window=9), FullAttentionSpec(8),
                 MambaSpec(4, mamba_cache_mode="all"))),
    # A window finer than the scheduler block and full attention coarser: when
    # the window finds no run, its leading run must be cut back to 8 tokens.
    ModelConfig("hybrid_diff_block_sizes_finer_window",
                (FullAttentionSpec(8), SlidingWindowSpec(4, sliding_window=9))),
    ModelConfig("no_caching", (FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=7)),
                enable_caching=False, draft_tokens=2),
    ModelConfig("eagle", (FullAttentionSpec(4),), use_eagle=True, draft_tokens=2),
    ModelConfig("eagle_hybrid_full_swa", (FullAttentionSpec(4),
                                          SlidingWindowSpec(4, sliding_window=9)),
                eagle_groups=(1,), use_eagle=True, draft_tokens=2),
    # EAGLE drops a block from a window group finer than the scheduler block:
    # the hit must be cut back to an aligned length.
    ModelConfig("eagle_hybrid_diff_block_sizes", (FullAttentionSpec(8),
                                                  SlidingWindowSpec(4, sliding_window=9)),
                use_eagle=True, draft_tokens=2),
    ModelConfig("mamba_mtp", (FullAttentionSpec(4),
                              MambaSpec(4, mamba_cache_mode="all", num_speculative_blocks=2)),
                use_eagle=True, draft_tokens=2),
    # Retention intervals: a Mamba state every 8 tokens (and at the replay
    # boundary); a window keeping only the replay boundary's tail.
    ModelConfig("hybrid_full_mamba_retention", (FullAttentionSpec(4),
                                                MambaSpec(4, mamba_cache_mode="all")),
                retention_interval=8),
    ModelConfig("hybrid_full_swa_retain_latest", (FullAttentionSpec(4),
                                                  SlidingWindowSpec(4, sliding_window=4)),
                retention_interval=0),
    ModelConfig("mamba_align_mtp", (FullAttentionSpec(4),
                                    MambaSpec(4, mamba_cache_mode="align",
                                              num_speculative_blocks=2)),
                use_eagle=True, draft_tokens=2),
)
