"""docs/pictures.md's picture of one request's life is today's run, and its claims hold."""

from pathlib import Path

import pytest

from kvref.viz import request_life as life_module
from kvref.viz.request_life import STAGES, LifeError, render_request_life, request_life

PAGE = Path(__file__).resolve().parents[2] / "docs" / "pictures.md"


def test_the_page_shows_exactly_what_the_run_draws():
    picture = render_request_life(request_life())
    text = PAGE.read_text(encoding="utf-8")
    assert "```text\n" + picture + "\n```" in text, (
        "docs/pictures.md's request-life picture differs from the run: paste the output of "
        "python3 -m kvref.viz.request_life")


def test_every_stage_is_drawn_in_order_and_every_claim_was_checked():
    life = request_life()
    order = [s for row in life.rows for s in row.stage.split(" + ")]
    firsts = [order.index(s) for s in STAGES]
    assert firsts == sorted(firsts), order
    assert len(life.claims) >= 12
    steps = [row.step for row in life.rows]
    assert steps == sorted(steps)


@pytest.mark.parametrize("knob, value, why", [
    ("BUDGET", 64, "chunk"),              # the whole prompt fits one step
    ("NUM_BLOCKS", 14, "preempted"),      # room for everyone: nobody is preempted
])
def test_a_run_that_misses_a_stage_fails_the_picture(monkeypatch, knob, value, why):
    """The claims are checked, not decoration: change the workload so that A
    skips a stage, and the life cannot be drawn."""
    monkeypatch.setattr(life_module, knob, value)
    with pytest.raises(LifeError, match=why):
        request_life()
