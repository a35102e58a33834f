"""Lesson 11's two router indexes: what a KV-aware router remembers of the event stream.

No vLLM counterpart: a teaching aid, modelled on what routers do with vLLM's
KV events. Both answer "how many tokens of this prompt would hit?" with the
same rule (``RouterIndex.score``) and differ in what they remember:
``HashIndex`` keeps vLLM's hashes, keyed as the pool keys them;
``TokenTreeIndex`` keeps a prefix tree of its own keys over token slices
(``skip_sparse=True``: the defence against stores whose slices and hashes do
not pair up). Lesson 11 feeds them a real manager's events and checks their
answers against the pool. ``HashIndex``'s memory is ``kvref.watch``'s
``PrefixCacheIndex``, the index ``kvref watch`` keeps for a running vLLM (which
asks kvref's own coordinator for the hit instead of this two-kind rule).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from functools import lru_cache

from kvref import (AllBlocksCleared, BlockRemoved, BlockStored, Request,
                   get_request_block_hasher, sha256)
from kvref.core.kv_cache_utils import maybe_convert_block_hash
from kvref.watch import PrefixCacheIndex


class RouterIndex(ABC):
    """The hit rule both consumers share; subclasses say which blocks are cached."""

    def __init__(self, group_kinds: dict[int, str], block_size: int) -> None:
        self.group_kinds = group_kinds      # e.g. {0: "full_attention", 1: "mamba"}
        self.block_size = block_size

    @abstractmethod
    def cached(self, group, tokens, i):
        """Is block ``i`` of this prompt cached in ``group``? (each consumer
        answers from its own memory)"""

    def score(self, tokens):
        max_blocks = (len(tokens) - 1) // self.block_size   # the last token is never a hit
        full = [g for g, kind in self.group_kinds.items() if kind == "full_attention"]
        run = 0
        while run < max_blocks and all(self.cached(g, tokens, run) for g in full):
            run += 1
        for g, kind in self.group_kinds.items():
            if kind == "mamba":       # the state at the end of the hit must be cached
                while run > 0 and not self.cached(g, tokens, run - 1):
                    run -= 1
        return run * self.block_size


@lru_cache(maxsize=4096)
def prompt_hashes(tokens: tuple[int, ...], block_size: int) -> list[int]:
    """The prompt's block hashes as vLLM computes them, in the events' int form."""
    probe = Request("probe", list(tokens),
                    block_hasher=get_request_block_hasher(block_size, sha256))
    return [maybe_convert_block_hash(h) for h in probe.block_hashes]


class HashIndex(RouterIndex):
    """Keyed like the pool: (group_idx, external hash) -> copies."""

    def __init__(self, group_kinds: dict[int, str], block_size: int) -> None:
        super().__init__(group_kinds, block_size)
        self.index = PrefixCacheIndex()

    @property
    def blocks(self):
        return self.index.blocks

    def apply(self, event):
        self.index.apply(event)

    def cached(self, group, tokens, i):
        return (group, prompt_hashes(tuple(tokens), self.block_size)[i]) in self.blocks


class TokenTreeIndex(RouterIndex):
    """Per group, a prefix tree of its own keys over token slices paired by position."""

    ROOT = 0

    def __init__(self, group_kinds: dict[int, str], block_size: int,
                 skip_sparse: bool = False) -> None:
        super().__init__(group_kinds, block_size)
        self.skip_sparse = skip_sparse
        self.nodes = Counter()          # (group, own key) -> copies
        self.key_of = {}                # (group, vLLM hash) -> own key

    @staticmethod
    def own_key(parent, tokens):
        return hash((parent, tuple(tokens)))

    def apply(self, event):
        if isinstance(event, BlockStored):
            g = event.group_idx
            if self.skip_sparse and \
                    len(event.token_ids) != event.block_size * len(event.block_hashes):
                return
            if event.parent_block_hash is None:
                parent = self.ROOT
            elif (g, event.parent_block_hash) in self.key_of:
                parent = self.key_of[(g, event.parent_block_hash)]
            else:
                return                  # nowhere to hang it: dropped
            for i, h in enumerate(event.block_hashes):
                tokens = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
                parent = self.own_key(parent, tokens)
                self.nodes[(g, parent)] += 1
                self.key_of[(g, h)] = parent
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                key = self.key_of.get((event.group_idx, h))
                if key is not None and self.nodes[(event.group_idx, key)] > 0:
                    self.nodes[(event.group_idx, key)] -= 1
        elif isinstance(event, AllBlocksCleared):
            self.nodes.clear()
            self.key_of.clear()

    def cached(self, group, tokens, i):
        key = self.ROOT
        for j in range(i + 1):
            key = self.own_key(key, tokens[j * self.block_size:(j + 1) * self.block_size])
        return self.nodes[(group, key)] > 0
