"""The pool grid and the free queue: what they say, at every scale, within 80 columns."""

import re

from kvref.viz.panels import render_pool
from kvref.viz.pool import render_free_queue, render_grid
from tests.viz.helpers import admit, full_manager, text_of, widest_line

SYSTEM = list(range(100, 108))


def test_small_pool_shows_each_block_with_state_and_ref_count():
    m = full_manager(12)
    admit(m, "A", SYSTEM + [1, 2, 3])           # blocks 1, 2 cached, 3 partial
    admit(m, "B", SYSTEM + [7, 7, 7, 7, 7])     # shares 1, 2
    text = text_of(render_grid(m.block_pool))
    cells = dict(re.findall(r"(\d+)([∅●◉○·]\d*)", text))
    assert cells["0"] == "∅"
    assert cells["1"] == "◉2" and cells["2"] == "◉2"       # shared prefix, two holders
    assert cells["3"] == "●1"                               # A's partial block: no hash
    assert cells["4"] == "◉1" and cells["5"] == "●1"        # B's own blocks
    assert cells["11"] == "·"
    assert "in use 5 (cached 3)  evictable cached 0  free empty 6  null 1" in text


def test_a_finished_requests_cached_blocks_are_free_but_cached():
    m = full_manager(12)
    a = admit(m, "A", SYSTEM + [1, 2, 3, 4, 5])
    m.free(a)
    text = text_of(render_grid(m.block_pool))
    assert re.search(r"\b1○", text) and re.search(r"\b3○", text)
    assert re.search(r"\b4·", text)                         # the partial block lost nothing
    assert "evictable cached 3" in text


def test_free_queue_puts_unhashed_blocks_first_and_cached_ones_last():
    m = full_manager(12)
    a = admit(m, "A", SYSTEM + [1, 2, 3, 4, 5])             # blocks 1-3 cached, 4 partial
    m.free(a)
    text = text_of(render_free_queue(m.block_pool))
    order = [int(x) for x in re.findall(r"(\d+)[○·]", text)]
    assert order[0] == 4                                     # unhashed: front
    assert order[-3:] == [3, 2, 1]                           # cached, freed tail first
    assert "(11 free: 8 empty, 3 cached)" in text


def test_a_long_free_queue_says_how_many_it_leaves_out():
    m = full_manager(200)
    text = text_of(render_free_queue(m.block_pool, head=10, tail=3))
    assert "…186 more…" in text
    assert "(199 free: 199 empty, 0 cached)" in text


def test_medium_pool_is_one_character_per_block_with_shared_counts_as_digits():
    m = full_manager(300)
    for rid in "ABC":
        admit(m, rid, SYSTEM + [ord(rid)])
    text = text_of(render_grid(m.block_pool))
    assert "300 blocks, one character each" in text
    first_row = next(line for line in text.splitlines() if line.startswith("    0 "))
    assert first_row[6:10] == "∅33●"                        # null, 2 shared blocks, a private one
    assert "  256 " in text                                  # row labels count blocks
    assert widest_line(text) <= 80


def test_huge_pool_is_aggregated_and_says_so_with_exact_counts():
    m = full_manager(5000)
    admit(m, "A", list(range(4 * 100)))                      # 100 blocks in use
    text = text_of(render_grid(m.block_pool))
    assert "5000 blocks drawn aggregated: one character = 5 blocks" in text
    assert "in use 100 (cached 100)" in text and "free empty 4899" in text
    rows = [line for line in text.splitlines() if re.match(r"\s+\d+ [∅●◉○·]", line)]
    assert len(rows) == 16 and sum(len(r) - 6 for r in rows) == 1000
    assert widest_line(text) <= 80


def test_render_pool_combines_grid_queue_usage_and_tables():
    m = full_manager(12)
    admit(m, "A", SYSTEM + [1])
    text = text_of(render_pool(m))
    assert "usage 27%   free blocks 8 of 11" in text
    assert "free queue, next evicted first:" in text
    assert re.search(r"^A\s+1-3\s*$", text, re.M)
