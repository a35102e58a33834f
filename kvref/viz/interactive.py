"""Stepping through a trace with typed commands (``kvref viz`` piped, or ``--no-interactive``).

No vLLM counterpart. ``Stepper`` is a pure state machine over a
``TracePlayer``: ``handle(line)`` moves it and returns a message, so tests
script it with a list of commands, and the full-screen viewer
(``kvref.viz.app``) moves through it too; ``run_interactive`` is the text loop
around it (one command per line, read with ``input``)::

    stepper = Stepper(player)
    for line in ["n", "n", "p", "j 5", "o 40", "q"]:
        stepper.handle(line)
    stepper.player.current_step, stepper.done      # (3, True)

Commands: ``n`` (or Enter) next step, ``p`` previous step, ``+`` next op,
``-`` previous op, ``j N`` jump to step N, ``o N`` jump to op N (the state
right after it), ``v`` toggle bookkeeping ops, ``h`` help, ``q`` quit.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console

from kvref.viz.panels import render_frame
from kvref.viz.player import TracePlayer

HELP = ("n/Enter next step · p previous step · + next op · - previous op · "
        "j N step N · o N op N · v bookkeeping on/off · q quit")


class Stepper:
    """Where the viewer is in a trace, moved by commands."""

    def __init__(self, player: TracePlayer) -> None:
        self.player = player
        self.done = False
        self.verbose = False
        if player.steps:
            player.seek_step(0)

    def handle(self, line: str) -> str:
        """Apply one command; return what to tell the user ("" if nothing)."""
        words = line.strip().split()
        cmd, args = (words[0].lower(), words[1:]) if words else ("n", [])
        p = self.player
        last_step = len(p.steps) - 1
        if cmd in ("q", "quit", "exit"):
            self.done = True
            return ""
        if cmd in ("h", "help", "?"):
            return HELP
        if cmd == "v":
            self.verbose = not self.verbose
            return f"bookkeeping ops {'shown' if self.verbose else 'hidden'}"
        if cmd in ("n", "next"):
            if p.current_step >= last_step:
                return "already at the last step"
            p.seek_step(p.current_step + 1)
            return ""
        if cmd in ("p", "prev", "previous"):
            if p.current_step <= 0:
                return "already at the first step"
            p.seek_step(p.current_step - 1)
            return ""
        if cmd == "+":
            if p.position >= len(p.ops):
                return "already at the last op"
            p.seek(p.position + 1)
            return ""
        if cmd == "-":
            if p.position <= 1:
                return "already at the first op"
            p.seek(p.position - 1)
            return ""
        if cmd in ("j", "o"):
            what, top = ("step", last_step) if cmd == "j" else ("op", len(p.ops) - 1)
            if len(args) != 1 or not args[0].lstrip("-").isdigit():
                return f"usage: {cmd} N  ({what} number, 0..{top})"
            n = int(args[0])
            if not 0 <= n <= top:
                return f"no {what} {n}: {what}s are 0..{top}"
            if cmd == "j":
                p.seek_step(n)
            else:
                p.seek_op(n)
            return ""
        return f"unknown command {line.strip()!r}; {HELP}"


def run_interactive(console: Console, player: TracePlayer,
                    read: Callable[[str], str] = input) -> int:
    """Draw, read a command, repeat until ``q`` or end of input."""
    stepper = Stepper(player)
    message = HELP
    while not stepper.done:
        if console.is_terminal:
            console.clear()                 # one frame on screen at a time
        console.print(render_frame(player, verbose=stepper.verbose))
        if message:
            console.print(message, style="dim")
        try:
            line = read("viz> ")
        except EOFError:
            break
        message = stepper.handle(line)
    return 0
