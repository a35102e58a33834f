"""``kvref demo``'s pacing: whole frames that stay, a key between steps, never a block on a pipe."""

import fcntl
import io
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from rich.console import Console

from kvref.viz.demo import run_demo, terminal_waiter
from kvref.viz.player import TracePlayer
from kvref.viz.walkthroughs import PrefixCachingWalkthrough

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


@pytest.fixture(scope="module")
def trace():
    return PrefixCachingWalkthrough().record()


def words(text: str) -> str:
    return " ".join(ANSI.sub("", text).split())


def test_every_step_is_printed_whole_with_its_story_last_and_a_wait_between(trace):
    out = io.StringIO()
    console = Console(file=out, width=80, color_system=None)
    prompts = []
    shown = run_demo(console, TracePlayer(trace), lambda p: prompts.append(p) or True)
    text = words(out.getvalue())
    assert shown == 9 and len(prompts) == 8            # no wait after the last step
    assert prompts[0].strip().startswith("step 0/8 · any key: step 1")
    for k, story in trace["narration"].items():
        assert f"step {k}/8" in text and " ".join(story.split()) in text   # never cut
    # Within a frame the story comes after the pictures, right above the prompt.
    frame = text.split("kvref-prefix-caching: step 2/8")[1]
    assert frame.index("free queue") < frame.index("what happened in step 2") \
        < frame.index(" ".join(trace["narration"]["2"].split()[:5]))


def test_q_stops_after_the_step_on_screen(trace):
    out = io.StringIO()
    keys = iter([" ", "q"])
    console = Console(file=out, width=80, color_system=None)
    assert run_demo(console, TracePlayer(trace), lambda p: next(keys) != "q") == 2
    assert "step 2/8" not in out.getvalue() and "stopped after step 1 of 8" in out.getvalue()


def test_how_it_waits_pause_key_or_not_at_all(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    console = Console(file=io.StringIO(), force_terminal=True)
    assert terminal_waiter(console, 0.5)("x") is True and slept == [0.5]
    # A pipe: no waiting whatever stdin is, not even a pause.
    assert terminal_waiter(Console(file=io.StringIO()), None) is None
    assert terminal_waiter(Console(file=io.StringIO()), 0.5) is None


def _pty_demo(*args):
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(ROOT), TERM="xterm-256color", COLUMNS="80",
               LINES="24")
    proc = subprocess.Popen([sys.executable, "-m", "kvref.cli", "demo", *args], stdin=slave,
                            stdout=slave, stderr=slave, env=env, cwd=ROOT)
    os.close(slave)
    return proc, master


def _read_until(master, needle: str, timeout: float = 60) -> str:
    seen, end = "", time.monotonic() + timeout
    while needle not in words(seen):
        left = end - time.monotonic()
        if left <= 0 or not select.select([master], [], [], left)[0]:
            raise AssertionError(f"no {needle!r} within {timeout}s; got {words(seen)[-300:]!r}")
        try:
            chunk = os.read(master, 65536)
        except OSError:             # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk.decode("utf-8", "replace")
    return seen


def test_in_a_real_terminal_it_waits_for_a_key():
    proc, master = _pty_demo("--steps", "3")
    try:
        first = _read_until(master, "step 0/2 · any key: step 1")
        # It waits: nothing more comes until a key is pressed.
        assert not select.select([master], [], [], 1.0)[0]
        assert "step 1/2" not in words(first)
        os.write(master, b" ")
        second = _read_until(master, "step 1/2 · any key: step 2")
        assert "what happened in step 1" in words(second)
        os.write(master, b"q")
        rest = _read_until(master, "summary of prefix-caching")
        assert "stopped after step 1 of 2" in words(rest)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
