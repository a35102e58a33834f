"""docs/pictures.md's tables of one disaggregated request are today's run, and their claims hold."""

from pathlib import Path

import pytest

from kvref.viz import disagg_life as life_module
from kvref.viz.disagg_life import BRANCHES, LifeError, disagg_life, render_disagg_life

PAGE = Path(__file__).resolve().parents[2] / "docs" / "pictures.md"


@pytest.mark.parametrize("branch", BRANCHES)
def test_the_page_shows_exactly_what_the_run_draws(branch):
    picture = render_disagg_life(disagg_life(branch))
    text = PAGE.read_text(encoding="utf-8")
    assert "```text\n" + picture + "\n```" in text, (
        f"docs/pictures.md's table of the {branch!r} branch differs from the run: paste the "
        "output of python3 -m kvref.viz.disagg_life")


@pytest.mark.parametrize("branch", BRANCHES)
def test_every_branch_checks_its_claims(branch):
    life = disagg_life(branch)
    assert len(life.claims) >= 5
    assert life.rows[0].call.startswith("allocate_slots(D, 0,")


def test_an_unknown_branch_is_refused():
    with pytest.raises(ValueError, match="unknown branch 'nope'"):
        disagg_life("nope")


@pytest.mark.parametrize("knob, value, branch, why", [
    ("FAILED_BLOCK", 0, "recompute", "blocks before it are cached"),   # nothing to keep
    ("CHUNK", 32, "lands", "reserved_blocks"),    # P prefilled at once: nothing reserved
])
def test_a_run_that_changes_the_story_fails_the_table(monkeypatch, knob, value, branch, why):
    """The claims are checked, not decoration: change the workload and the
    table cannot be drawn."""
    monkeypatch.setattr(life_module, knob, value)
    with pytest.raises(LifeError, match=why):
        disagg_life(branch)
