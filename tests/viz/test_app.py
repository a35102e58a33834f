"""The full-screen viewer (``kvref viz`` in a terminal), driven by Textual's pilot.

What is checked is what is on the screen (the compositor's lines), at 80x24
and at 160x50: the header and the narration stay visible after every key, the
key moved to the right step or op, and the details of a selected block or
request are what an independently replayed manager holds at that op.
"""

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("textual")

from kvref.core.kv_cache_utils import get_block_hash  # noqa: E402
from kvref.verify.trace_replay import TraceReplayer  # noqa: E402
from kvref.viz.app import HelpScreen, KVViewer  # noqa: E402
from kvref.viz.player import TracePlayer, read_trace  # noqa: E402

TRACES = Path(__file__).parent / "traces"
SIZES = [(80, 24), (160, 50)]


@pytest.fixture(scope="module")
def multi_turn():
    return read_trace(TRACES / "kvref-multi-turn.json.gz")


def screen_lines(app) -> list[str]:
    return [strip.text for strip in app.screen._compositor.render_strips()]


def top(app, n: int = 2) -> str:
    """The first lines of the screen as one line of words (the header wraps)."""
    return " ".join(" ".join(screen_lines(app)[:n]).split())


def reference(trace: dict, position: int) -> TraceReplayer:
    """A manager of its own, run to ``position`` without the viewer's player."""
    replayer = TraceReplayer(trace["header"])
    for op in trace["ops"][:position]:
        replayer.run(op)
    return replayer


def drive(trace, size, script, **kwargs):
    """Run the viewer headless; ``script(app, pilot)`` is an async check."""
    async def main():
        app = KVViewer(TracePlayer(trace), **kwargs)
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await script(app, pilot)
        return app
    return asyncio.run(main())


def assert_oriented(app, trace, size):
    """Header (step and op), narration and the whole pool grid are on screen."""
    lines = screen_lines(app)
    assert len(lines) == size[1]
    p = app.player
    assert lines[0].strip().startswith(
        f"{trace['name']}: step {p.current_step}/{len(p.steps) - 1}, "
        f"op {p.position - 1}/{len(p.ops) - 1}")
    story = p.narration[p.current_step]
    shown = " ".join(line.strip() for line in lines[1:9])
    assert " ".join(story.split()[:6]) in shown
    num_blocks = trace["header"]["num_blocks"]
    grid = "\n".join(lines)
    assert f"{num_blocks - 1}" in grid and f"{num_blocks} blocks (block 0" in grid
    assert "one cell each" in grid
    pool = app.query_one("#pool").region
    assert pool.y >= 2 and pool.bottom <= size[1] - 1        # above the footer


def test_at_80x24_every_step_of_multi_turn_shows_its_header_narration_and_pool(multi_turn):
    """The issue's test: stepping through `kvref record --workload multi-turn` (the
    vendored trace is exactly what it records) with single keys, at 80x24."""
    async def script(app, pilot):
        for k in range(len(app.player.steps)):
            assert app.player.current_step == k
            assert_oriented(app, multi_turn, (80, 24))
            await pilot.press("n")
            await pilot.pause()

    drive(multi_turn, (80, 24), script)


def test_at_80x24_the_header_says_the_last_op_in_words_and_the_footer_fits(multi_turn):
    """The header names the op just run in a reader's words (no internal call names
    such as make_prefix_cache_stats), and the footer's keys fit 80 columns."""
    internal = {op["op"] for op in multi_turn["ops"] if "_" in op["op"]}   # not "free"
    headers = []

    async def script(app, pilot):
        for key in ["n", "full_stop", "full_stop", "full_stop", "v", "full_stop", "n", "n"]:
            await pilot.press(key)
            await pilot.pause()
            header = top(app)
            headers.append(header)
            assert not any(name in header for name in internal), header
            footer = screen_lines(app)[-1]
            assert footer.rstrip().endswith("q quit") and "palette" not in footer, footer

    drive(multi_turn, (80, 24), script)
    assert any("a new step begins" in h for h in headers), headers
    assert any("asks for slots" in h for h in headers), headers


def test_the_grid_uses_the_width():
    """More cells per row on a wider terminal (the pool is the same)."""
    trace = read_trace(TRACES / "kvref-multi-turn.json.gz")
    rows = {}

    async def script(app, pilot):
        first = next(line for line in screen_lines(app) if "0∅" in line)
        rows[app.size.width] = len(first.split())

    for size in SIZES:
        drive(trace, size, script)
    assert rows[80] == 80 // 7 and rows[160] > rows[80]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_key_moves_to_the_right_place_and_keeps_header_and_narration(multi_turn, size):
    steps = TracePlayer(multi_turn).steps
    end = [e for _, e in steps]
    # key, then the position (ops run) it must lead to
    moves = [("n", end[1]), ("n", end[2]), ("right", end[3]), ("p", end[2]),
             ("left", end[1]), ("full_stop", end[1] + 1), ("full_stop", end[1] + 2),
             ("comma", end[1] + 1), ("g", None), ("1", None), ("2", None), ("enter", end[12]),
             ("o", None), ("2", None), ("0", None), ("0", None), ("enter", 201),
             ("v", 201), ("p", end[TracePlayer(multi_turn).step_of(200) - 1])]

    async def script(app, pilot):
        assert_oriented(app, multi_turn, size)
        assert app.player.position == end[0]
        for key, position in moves:
            await pilot.press(key)
            await pilot.pause()
            if position is None:
                continue
            assert app.player.position == position, key
            assert_oriented(app, multi_turn, size)
        assert "all ops" in screen_lines(app)[0]           # v shows bookkeeping ops
        if size[0] >= 120:                                  # the ops panel is in view
            assert ".num_computed_tokens = " in "\n".join(screen_lines(app))
            await pilot.press("v")
            await pilot.pause()
            assert ".num_computed_tokens = " not in "\n".join(screen_lines(app))
        await pilot.press("q")

    app = drive(multi_turn, size, script)
    assert app.return_code == 0


def first_op_where(trace, holds) -> int:
    replayer = TraceReplayer(trace["header"])
    for i, op in enumerate(trace["ops"]):
        replayer.run(op)
        if any(holds(b) for b in replayer.manager.block_pool.blocks if not b.is_null):
            return i
    raise AssertionError("no such op")


async def check_block_details(app, pilot, trace, size, holds):
    """Select the first block that ``holds`` and compare the details with a reference."""
    ref = reference(trace, app.player.position)
    pool = ref.manager.block_pool
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    block = next(b for b in pool.blocks if not b.is_null and holds(b))
    await pilot.press("b", *str(block.block_id), "enter")
    await pilot.pause()
    text = "\n".join(screen_lines(app))
    assert f"block {block.block_id}: " in text
    assert f"ref count {block.ref_cnt}" in text
    assert get_block_hash(block.block_hash).hex()[:16] in text
    tables = ref.manager.coordinator.single_type_managers[0].req_to_blocks
    holders = [rid for rid, blocks in tables.items() if block in blocks]
    assert len(holders) == block.ref_cnt
    if holders:
        assert "held by " + ", ".join(f"{r} (g0)" for r in holders) in text
        # The parent is the hash before this block's in a holder's chain.
        i = tables[holders[0]].index(block)
        parent = ref.requests[holders[0]].block_hashes[i - 1].hex()[:16] if i else None
        assert (f"parent {parent}…" if parent else "parent: first block of its chain") in text
    else:
        assert "held by no request" in text
        assert f"position {queue.index(block.block_id)} of {len(queue)}" in text
    assert_oriented(app, trace, size)
    return block.block_id


def shared(b):
    return b.ref_cnt > 1


def free_cached(b):
    return b.ref_cnt == 0 and b.block_hash is not None


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_selected_block_shows_the_managers_state_at_that_op(multi_turn, size):
    later = first_op_where(multi_turn, free_cached)

    async def script(app, pilot):
        await check_block_details(app, pilot, multi_turn, size, shared)
        await pilot.press("o", *str(later), "enter")
        await pilot.pause()
        block_id = await check_block_details(app, pilot, multi_turn, size, free_cached)
        # Arrow keys move the selection; the details follow.
        await pilot.press("down")
        await pilot.pause()
        assert f"block {block_id + 1}: " in "\n".join(screen_lines(app))

    drive(multi_turn, size, script, start_op=first_op_where(multi_turn, shared))


def test_a_searched_request_shows_its_block_table_and_follows_the_steps(multi_turn):
    async def script(app, pilot):
        await pilot.press("slash", "c", "1", ".", "t", "1", "enter")
        await pilot.pause()
        assert app.selected_request == "c1.t1"
        for key in ("n", "n", "n"):
            await pilot.press(key)
            await pilot.pause()
            ref = reference(multi_turn, app.player.position)
            req = ref.requests["c1.t1"]
            ids = ref.manager.get_block_ids("c1.t1")[0]
            text = "\n".join(screen_lines(app))
            assert (f"request c1.t1: {req.status.name.lower()}, {req.num_computed_tokens}/"
                    f"{req.num_tokens} tokens computed") in text
            from kvref.viz.tables import compress_ids
            assert f"g0 blocks: {compress_ids(ids)}" in text
        await pilot.press("slash", "z", "z", "enter")
        await pilot.pause()
        assert "no request 'zz' in this trace" in top(app)

    steps = TracePlayer(multi_turn).steps
    first = next(i for i, op in enumerate(multi_turn["ops"])
                 if op["op"] == "add_request" and op["req"] == "c1.t1")
    drive(multi_turn, (100, 30), script, start_op=steps[TracePlayer(multi_turn).step_of(first)][1])


def test_help_opens_and_any_key_closes_it_and_edges_say_so(multi_turn):
    async def script(app, pilot):
        await pilot.press("p")
        await pilot.pause()
        assert "already at the first step" in top(app)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert "go to op N" in "\n".join(screen_lines(app))
        await pilot.press("x")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("pagedown")
        await pilot.pause()
        assert app.query_one("#right").scroll_y > 0          # the panels below the pool
        assert_oriented(app, multi_turn, (80, 24))
        await pilot.press("o", "9", "9", "9", "9", "enter")
        await pilot.pause()
        assert "no op 9999" in top(app)

    drive(multi_turn, (80, 24), script)


def test_opens_at_the_step_or_op_asked_for(multi_turn):
    steps = TracePlayer(multi_turn).steps

    async def at_step(app, pilot):
        assert app.player.position == steps[7][1]
        assert "step 7/" in screen_lines(app)[0]

    async def at_op(app, pilot):
        assert app.player.position == 51 and "op 50/" in screen_lines(app)[0]

    drive(multi_turn, (80, 24), at_step, start_step=7)
    drive(multi_turn, (80, 24), at_op, start_op=50)
