"""Block tables and the prefix tree."""

import re

from kvref.viz.tables import compress_ids, render_block_tables, render_prefix_tree
from tests.viz.helpers import admit, full_manager, hybrid_manager, text_of, widest_line

SYSTEM = list(range(100, 116))


def test_compress_ids_writes_runs_and_null_runs_short():
    assert compress_ids([0, 0, 3, 4, 5, 9]) == "∅×2 3-5 9"
    assert compress_ids([7]) == "7"
    assert compress_ids([5, 4, 0, 2]) == "5 4 ∅ 2"
    assert compress_ids([]) == "-"


def test_block_tables_show_each_group_and_the_window_nulls():
    m = hybrid_manager()
    a = admit(m, "A", SYSTEM + [1, 2, 3, 4, 5, 6])           # 22 tokens
    a.append_output_token_ids(9)
    m.allocate_slots(a, 1)                                   # the window slides: 3 nulls
    text = text_of(render_block_tables(m))
    assert "g0 full /4" in text and "g1 window 8 /4" in text
    row = next(line for line in text.splitlines() if line.startswith("A "))
    full, window = m.get_block_ids("A")
    assert compress_ids(full) in row and window[:3] == [0, 0, 0] and "∅×3" in row


def test_many_requests_are_listed_up_to_a_limit_that_is_stated():
    m = full_manager(200)
    for i in range(15):
        admit(m, f"r{i}", [i] * 5)
    text = text_of(render_block_tables(m))
    assert "r11" in text and "r12" not in text
    assert "… and 3 more requests not shown" in text


def test_prefix_tree_branches_where_requests_stop_sharing():
    m = full_manager(40)
    admit(m, "A", SYSTEM + [1, 1, 1, 1, 1])
    admit(m, "B", SYSTEM + [2, 2, 2, 2, 2])
    admit(m, "C", SYSTEM[:8] + [3] * 9)
    text = text_of(render_prefix_tree(m))
    lines = text.splitlines()
    shared_all = next(i for i, line in enumerate(lines) if "shared by A B C" in line)
    assert re.search(r"1-2 ◉ shared by A B C", lines[shared_all])
    assert any(re.search(r"3-4 ◉ shared by A B", line) for line in lines[shared_all + 1:])
    assert sum(1 for line in lines if re.search(r" [●◉] C$", line)) == 1
    assert widest_line(text) <= 80


def test_prefix_tree_without_a_full_attention_group_says_so():
    from kvref import KVCacheConfig, KVCacheGroupSpec, KVCacheManager, SlidingWindowSpec

    config = KVCacheConfig(10, [KVCacheGroupSpec(["swa"], SlidingWindowSpec(4, 8))])
    m = KVCacheManager(config, max_model_len=64, scheduler_block_size=4, hash_block_size=4)
    assert "no full-attention group" in text_of(render_prefix_tree(m))
