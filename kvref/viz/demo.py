"""``kvref demo``'s pacing: one whole frame per step, the story last, a key between steps.

No vLLM counterpart. Each step is printed whole and stays printed (scroll up to
read an earlier one; nothing is redrawn over it or cut to fit): first the
pictures (grid, free queue, block tables, prefix tree, figures), then the
step's ops and its narration, right above the prompt, so what to read is where
the eyes are when the demo waits. Between steps it waits for a key in a
terminal (``q`` stops), or ``pause`` seconds; when the output is not a terminal
(a pipe, CI) it does not wait at all::

    run_demo(console, TracePlayer(trace), wait=terminal_waiter(pause=None))
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.rule import Rule
from rich.text import Text

from kvref.viz.panels import frame_title, render_stats, render_step_ops
from kvref.viz.player import TracePlayer
from kvref.viz.pool import render_free_queue, render_grid
from kvref.viz.tables import render_block_tables, render_prefix_tree

# wait(prompt) -> False to stop the demo
Waiter = Callable[[str], bool]


def demo_frame(player: TracePlayer) -> Group:
    """One step, pictures first and the story last."""
    manager = player.manager
    parts = [Rule(frame_title(player)), render_grid(manager.block_pool),
             render_free_queue(manager.block_pool),
             render_block_tables(manager, requests=player.requests),
             render_prefix_tree(manager), render_stats(player),
             Text(f"what happened in step {player.current_step}:", style="bold"),
             render_step_ops(player.step_facts())]
    story = player.narration.get(player.current_step)
    if story:
        parts.append(Text(story, style="bold italic"))
    return Group(*parts)


def read_key(prompt: Callable[[], None] = lambda: None) -> str:
    """Show ``prompt`` and read one key press, without Enter (Enter where termios is
    missing). The terminal leaves line mode before the prompt is shown, and keeps
    what was typed ahead, so no key pressed once the prompt is visible is lost."""
    try:
        import termios
        import tty
    except ImportError:                                     # not a POSIX terminal
        prompt()
        return (input() or "\n")[:1]
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd, termios.TCSANOW)       # TCSANOW: do not flush typed-ahead keys
        prompt()
        return sys.stdin.read(1)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def terminal_waiter(console: Console, pause: float | None,
                    key: Callable[[Callable[[], None]], str] = read_key) -> Waiter | None:
    """How to wait between steps when the output is a terminal: ``pause`` seconds if
    given, else a key press (if the input is a terminal too). Into a pipe or a file
    (CI), not at all: ``None``."""
    if not console.is_terminal:
        return None
    if pause is not None:
        def sleep(_prompt: str) -> bool:
            time.sleep(pause)
            return True
        return sleep
    if not sys.stdin.isatty():
        return None

    def wait(prompt: str) -> bool:
        def show() -> None:
            console.print(Text(prompt, style="reverse"), end="")
            console.file.flush()
        pressed = key(show)
        console.file.write("\r\x1b[2K")         # the prompt goes; the frame stays
        console.file.flush()
        return pressed.lower() != "q"
    return wait


def run_demo(console: Console, player: TracePlayer, wait: Waiter | None) -> int:
    """Print every step whole, waiting in between; return how many steps were shown."""
    last = len(player.steps) - 1
    for k in range(last + 1):
        player.seek_step(k)
        console.print(demo_frame(player))
        if k < last and wait is not None:
            if not wait(f" step {k}/{last} · any key: step {k + 1} · q: stop "):
                console.print(f"stopped after step {k} of {last}", style="dim")
                return k + 1
    return last + 1
