"""Stepping through a trace, driven by scripted commands."""

import io

import pytest
from rich.console import Console

from kvref.viz.interactive import HELP, Stepper, run_interactive
from kvref.viz.player import TracePlayer
from kvref.viz.walkthroughs import PrefixCachingWalkthrough


@pytest.fixture(scope="module")
def trace():
    return PrefixCachingWalkthrough().record()


def test_next_previous_and_jumps_move_by_steps_and_ops(trace):
    s = Stepper(TracePlayer(trace))
    assert s.player.current_step == 0
    for cmd in ["n", "", "n"]:
        assert s.handle(cmd) == ""
    assert s.player.current_step == 3
    s.handle("p")
    assert s.player.current_step == 2
    s.handle("j 6")
    assert s.player.current_step == 6 and s.player.position == s.player.steps[6][1]
    s.handle("o 10")
    assert s.player.position == 11
    s.handle("+")
    s.handle("+")
    s.handle("-")
    assert s.player.position == 12
    assert not s.done
    s.handle("q")
    assert s.done


def test_bad_commands_and_edges_explain_themselves(trace):
    s = Stepper(TracePlayer(trace))
    last = len(s.player.steps) - 1
    assert s.handle("p") == "already at the first step"
    assert s.handle("j 999") == f"no step 999: steps are 0..{last}"
    assert s.handle("j x").startswith("usage: j N")
    assert s.handle("o -1").startswith("no op -1")
    assert s.handle("zap").startswith("unknown command 'zap'")
    assert s.handle("h") == HELP
    s.handle(f"j {last}")
    assert s.handle("n") == "already at the last step"
    assert s.player.current_step == last


def test_the_loop_draws_each_frame_until_quit(trace):
    out = io.StringIO()
    console = Console(file=out, width=80, color_system=None)
    script = iter(["n", "j 4", "q", "n"])
    assert run_interactive(console, TracePlayer(trace), read=lambda _: next(script)) == 0
    text = out.getvalue()
    assert [f"step {k}/8" in text for k in (0, 1, 4)] == [True, True, True]
    assert "step 2/8" not in text


def test_end_of_input_quits(trace):
    console = Console(file=io.StringIO(), width=80)

    def eof(_):
        raise EOFError

    assert run_interactive(console, TracePlayer(trace), read=eof) == 0
