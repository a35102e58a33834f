"""Lesson 07's instruments: record the hit searches the coordinator makes, and draw them.

No vLLM counterpart: a teaching aid. ``recorded_lookups`` wraps each
attention type's ``find_longest_cache_hit`` (a classmethod the hybrid
coordinator calls once per group per pass) so that every call is noted as
``(manager class, candidate length in, length out)``; the real method still
does the work, and the originals come back when the ``with`` block ends.
``draw_lookups`` turns the notes into a table, one row per lookup.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from rich.table import Table
from rich.text import Text

from kvref import KVCacheManager


@contextmanager
def recorded_lookups(manager_classes: Iterable[type]) -> Iterator[list[tuple[type, int, int]]]:
    """Note every ``find_longest_cache_hit`` of these manager classes while open."""
    calls: list[tuple[type, int, int]] = []
    originals = {cls: cls.__dict__["find_longest_cache_hit"] for cls in manager_classes}
    for cls, original in originals.items():

        def recording(klass, block_hashes, max_length, kv_cache_group_ids, block_pool,
                      kv_cache_spec, drop_eagle_block, alignment_tokens,
                      _real=original.__func__):
            hit = _real(klass, block_hashes, max_length, kv_cache_group_ids, block_pool,
                        kv_cache_spec, drop_eagle_block, alignment_tokens)
            calls.append((klass, max_length, len(hit[0]) * kv_cache_spec.block_size))
            return hit

        cls.find_longest_cache_hit = classmethod(recording)
    try:
        yield calls
    finally:
        for cls, original in originals.items():
            cls.find_longest_cache_hit = original


def cached_row(manager: KVCacheManager, group: int, hashes: list[bytes], block_size: int,
               hit_tokens: int | None = None) -> Text:
    """One group's blocks: x cached, . not; ``|`` after the accepted length
    (which is also shaded green on a colour terminal)."""
    row = Text()
    for i, block_hash in enumerate(hashes):
        mark = "x" if manager.block_pool.get_cached_block(block_hash, [group]) else "."
        inside = hit_tokens is not None and i < hit_tokens // block_size
        row.append(f" {mark} ", style="black on green" if inside else "")
        if hit_tokens is not None and i + 1 == hit_tokens // block_size:
            row.append("|", style="bold")
    return row


def draw_lookups(manager: KVCacheManager, calls: list[tuple[type, int, int]],
                 hashes: list[bytes], names: dict[type, str], block_size: int) -> Table:
    """Each lookup as a row: the type, the candidate length in and out, and a
    bar of that group's cache with the length it accepted."""
    table = Table(title="lookups, in the coordinator's order", title_justify="left")
    table.add_column("#")
    table.add_column("type")
    table.add_column("in", justify="right")
    table.add_column("out", justify="right")
    table.add_column("that group's cache, | after the length it accepts")
    group_of = {type(m): m.kv_cache_group_id for m in manager.coordinator.single_type_managers}
    for n, (cls, length_in, length_out) in enumerate(calls, start=1):
        table.add_row(str(n), names[cls], str(length_in), str(length_out),
                      cached_row(manager, group_of[cls], hashes, block_size, length_out))
    return table
