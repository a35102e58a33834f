"""The demo's narration is checked against the manager: it cannot claim what did not happen."""

import re

import pytest

from kvref.verify.trace_replay import replay
from kvref.viz.player import TracePlayer
from kvref.viz.walkthroughs import (NarrationError, PrefixCachingWalkthrough,
                                    SlidingWindowWalkthrough)


@pytest.mark.parametrize("cls", [PrefixCachingWalkthrough, SlidingWindowWalkthrough])
def test_every_claim_of_every_step_holds(cls):
    walk = cls()
    trace = walk.record()
    assert len(walk.claims) == len(walk.narration) == len(TracePlayer(trace).steps)
    assert all(claims for claims in walk.claims)             # every step claims something
    assert all(holds for claims in walk.claims for _, holds in claims)
    assert replay(trace).divergence is None


def test_a_false_claim_stops_the_recording():
    class Liar(PrefixCachingWalkthrough):
        def _a_decodes(self):
            text = super()._a_decodes()
            self.claim("the decode evicted something", False)
            return text

    with pytest.raises(NarrationError, match="step 1.*the decode evicted something"):
        Liar().record()


def _step(trace, k):
    player = TracePlayer(trace)
    player.seek_step(k)
    return player


def test_the_partial_last_block_is_not_the_cap():
    walk = PrefixCachingWalkthrough()
    trace = walk.record()
    story = walk.narration[4]
    hit = next(f for f in _step(trace, 4).step_facts() if f.hit_tokens is not None)
    assert (hit.query_tokens, hit.hit_tokens) == (13, 12)
    assert "plays no role" in story and "12 tokens" in story and "(12)" in story


def test_the_cap_recomputes_a_whole_block_when_the_prompt_fills_its_blocks():
    walk = PrefixCachingWalkthrough()
    trace = walk.record()
    story = walk.narration[5]
    player = _step(trace, 5)
    hit = next(f for f in player.step_facts() if f.hit_tokens is not None)
    assert (hit.query_tokens, hit.hit_tokens) == (12, 8)
    assert "num_tokens - 1 = 11" in story and "only 8 tokens" in story
    assert "whole last block is recomputed" in story
    assert "one token short" not in story


def test_the_eviction_step_names_the_blocks_that_were_evicted():
    walk = PrefixCachingWalkthrough()
    trace = walk.record()
    player = _step(trace, 7)
    evicted = [b for f in player.step_facts() for b in f.evicted]
    assert evicted
    listed = re.search(r"the cached ones \(([\d, ]+)\)", walk.narration[7]).group(1)
    assert [int(x) for x in listed.split(", ")] == evicted


def test_sliding_window_story_shows_nulls_and_a_shortened_hybrid_hit():
    walk = SlidingWindowWalkthrough()
    trace = walk.record()
    player = _step(trace, 1)
    window = player.manager.get_block_ids("A")[1]
    assert window[:3] == [0, 0, 0] and "first 3 blocks" in walk.narration[1]
    player.seek_step(4)
    hit = next(f for f in player.step_facts() if f.hit_tokens is not None)
    assert hit.hit_tokens == 8
    assert "alone could hit 16 tokens" in walk.narration[4]
    assert "agrees on 8 tokens" in walk.narration[4]


def test_the_stated_pool_size_is_the_drawn_one():
    """The title's pool size is the number of cells the grid draws, null block included."""
    from kvref.viz.player import TracePlayer
    from kvref.viz.panels import render_frame
    from tests.viz.helpers import text_of

    trace = PrefixCachingWalkthrough().record()
    player = TracePlayer(trace)
    player.seek_step(0)
    n = player.manager.block_pool.num_gpu_blocks
    assert f"a {n}-block pool (block 0 is the null block, {n - 1} to allocate)" in \
        PrefixCachingWalkthrough.title
    assert f"{n} blocks (block 0 is the null block), one cell each" in \
        text_of(render_frame(player))
