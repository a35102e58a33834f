"""An outside observer of the prefix cache that sees nothing but the KV events.

An external KV-aware router follows vLLM's cache through ``BlockStored``,
``BlockRemoved`` and ``AllBlocksCleared`` alone. INV-EVT-1 says that is
enough: applying the events in order rebuilds the pool's index exactly.

The index is a multiset of ``(group, event hash)``: two blocks may hold the
same content (each stored once), so a hash can be cached several times over.
"""

from __future__ import annotations

from collections import Counter

from .backend import AllBlocksCleared, BlockRemoved, BlockStored, index_items, kv_cache_utils


class EventConsumer:
    """The cached hashes per group, rebuilt from events only."""

    def __init__(self) -> None:
        self.cached: Counter = Counter()

    def apply(self, events: list) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self.cached[(event.group_idx, block_hash)] += 1
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    key = (event.group_idx, block_hash)
                    assert self.cached[key] > 0, (
                        f"INV-EVT-1: BlockRemoved for hash {block_hash} of group "
                        f"{event.group_idx}, which no BlockStored announced")
                    self.cached[key] -= 1
                    if not self.cached[key]:
                        del self.cached[key]
            elif isinstance(event, AllBlocksCleared):
                self.cached.clear()
            else:
                raise AssertionError(f"INV-EVT-1: unknown event {event!r}")


def pool_index_as_events_see_it(pool) -> Counter:
    """The pool's own index in the events' terms: ``(group, hash) -> blocks``."""
    seen: Counter = Counter()
    utils = kv_cache_utils
    for key, _block in index_items(pool.cached_block_hash_to_block):
        seen[(utils.get_group_id(key),
              utils.maybe_convert_block_hash(utils.get_block_hash(key)))] += 1
    return seen


def assert_consumer_agrees(consumer: EventConsumer, pool) -> None:
    """INV-EVT-1: the consumer's index equals the pool's, hash for hash."""
    actual = pool_index_as_events_see_it(pool)
    if consumer.cached != actual:
        only_events = consumer.cached - actual
        only_pool = actual - consumer.cached
        raise AssertionError(
            "INV-EVT-1: an index rebuilt from the events differs from the pool's: "
            f"announced but not cached {dict(only_events)}, "
            f"cached but not announced {dict(only_pool)}")
