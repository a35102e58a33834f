"""``kvref viz``: a full-screen terminal viewer of a trace (Textual).

No vLLM counterpart. One key per move; the header (trace, step, op) and the
step's narration stay on screen whatever the terminal's size, the pool grid
uses the width it gets, and a selected block or request shows what the
replayed manager holds for it at this op (``kvref.viz.details``)::

    KVViewer(TracePlayer(read_trace("chat.json")), start_op=40).run()

Keys (``KEYS``): ``n``/``p`` (or right/left) move by step, ``.``/``,`` by op,
``g`` jumps to a step, ``o`` to an op, ``/`` searches a request, ``b`` picks a
block, up/down (or ``[``/``]``) move the selected block, ``r`` cycles through
the requests holding blocks, PgDn/PgUp scroll the panels, ``v`` shows or hides
the scheduler's bookkeeping ops, ``?`` is help, ``q`` quits. Below 120 columns
the panels stack (pool first, the rest scrolls); from 120 on they sit side by
side.

Stepping is ``kvref.viz.interactive.Stepper``'s, so the line-mode viewer
(``--no-interactive``) and this one move the same way.
"""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, Static

from kvref.viz.details import block_details, request_details
from kvref.viz.interactive import Stepper
from kvref.viz.panels import (
    frame_title,
    op_words,
    render_events,
    render_stats,
    render_step_ops,
)
from kvref.viz.player import TracePlayer
from kvref.viz.pool import render_free_queue, render_grid
from kvref.viz.tables import render_block_tables, render_prefix_tree, requests_with_blocks

WIDE = 120          # from this many columns on, the panels sit side by side

KEYS = [
    ("n  →", "next step"), ("p  ←", "previous step"), (".", "next op"), (",", "previous op"),
    ("g", "go to step N"), ("o", "go to op N"), ("/", "search a request by id"),
    ("b", "select block N"), ("↑ ↓ [ ]", "move the selected block"),
    ("r", "next request holding blocks"), ("esc", "clear the selection"),
    ("PgDn PgUp", "scroll the panels (details, ops, tables...)"),
    ("v", "show/hide bookkeeping ops"), ("?", "this help"), ("q", "quit"),
]


class HelpScreen(ModalScreen):
    """The key list; any key closes it."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static { width: 60; height: auto; border: round $accent; padding: 0 1;
                          background: $panel; }
    """

    def compose(self) -> ComposeResult:
        text = Text("kvref viz keys\n", style="bold")
        for key, what in KEYS:
            text.append(f"{key:>9}  ", style="bold cyan")
            text.append(what + "\n")
        text.append("\nany key closes this help", style="dim")
        yield Static(text, id="help")

    def on_key(self, event) -> None:
        event.stop()
        self.dismiss()


class PoolView(Static):
    """The grid and the free queue, as wide as the panel."""

    def __init__(self, viewer: KVViewer, **kwargs) -> None:
        super().__init__(**kwargs)
        self.viewer = viewer

    def render(self):
        pool = self.viewer.player.manager.block_pool
        width = max(20, self.content_region.width or self.size.width or 80)
        return Group(render_grid(pool, width=width, selected=self.viewer.selected_block,
                                 highlight=self.viewer.highlighted_blocks()),
                     render_free_queue(pool))


class KVViewer(App):
    """Step through a ``TracePlayer``; everything shown is read from its manager."""

    TITLE = "kvref viz"
    # The footer fits 80 columns: the keys back (p, ","), the palette and the rest
    # are in the ? help.
    ENABLE_COMMAND_PALETTE = False
    AUTO_FOCUS = None       # keys go to the viewer, not to the (hidden) prompt
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (WIDE, "-wide")]
    CSS = """
    Screen { layout: vertical; }
    #header { height: auto; max-height: 3; background: $primary; color: $text;
              text-style: bold; padding: 0 1; }
    #narration { height: auto; max-height: 8; overflow-y: auto; padding: 0 1; text-style: italic;
                 border-bottom: solid $primary-darken-2; }
    #body { height: 1fr; }
    #pool { height: auto; padding: 0 1; }
    #details { height: auto; padding: 0 1; border: round $accent; }
    #details.empty { display: none; }
    #ops, #tables, #tree, #events, #stats { height: auto; padding: 0 1; }
    #prompt { dock: bottom; display: none; }
    #prompt.shown { display: block; }
    .-narrow #body { layout: vertical; }
    .-narrow #left, .-narrow #right { height: auto; width: 100%; }
    .-narrow #right { height: 1fr; }
    .-narrow #left #stats { display: none; }
    .-narrow #right #stats2 { display: block; }
    .-wide #body { layout: horizontal; }
    .-wide #left { width: 3fr; height: 100%; }
    .-wide #right { width: 2fr; height: 100%; }
    .-wide #right #stats2 { display: none; }
    """

    BINDINGS = [
        Binding("n,right", "step(1)", "next step"),
        Binding("p,left", "step(-1)", "prev step", show=False),
        Binding("full_stop", "op(1)", "next op", key_display="."),
        Binding("comma", "op(-1)", "prev op", key_display=",", show=False),
        Binding("g", "ask('step')", "step N"),
        Binding("o", "ask('op')", "op N"),
        Binding("slash", "ask('request')", "request", key_display="/"),
        Binding("b", "ask('block')", "block", show=False),
        Binding("up,left_square_bracket", "move_block(-1)", "block -", show=False),
        Binding("down,right_square_bracket", "move_block(1)", "block +", show=False),
        Binding("r", "next_request", "next request", show=False),
        Binding("escape", "clear", "clear", show=False),
        Binding("pagedown,space", "scroll_panels(1)", "scroll", show=False),
        Binding("pageup", "scroll_panels(-1)", "scroll up", show=False),
        Binding("v", "toggle_bookkeeping", "all ops"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, player: TracePlayer, start_step: int | None = None,
                 start_op: int | None = None) -> None:
        super().__init__()
        self.player = player
        self.stepper = Stepper(player)          # at step 0
        if start_op is not None:
            player.seek_op(start_op)
        elif start_step is not None:
            player.seek_step(start_step)
        self.selected_block: int | None = None
        self.selected_request: str | None = None
        self.message = ""
        self._asking: str | None = None

    # -- layout ----------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield Static(id="narration")
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield PoolView(self, id="pool")
                yield Static(id="stats")
            with VerticalScroll(id="right"):
                yield Static(id="details", classes="empty")
                yield Static(id="ops")
                yield Static(id="tables")
                yield Static(id="tree")
                yield Static(id="events")
                yield Static(id="stats2")
        yield Input(id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_view()

    # -- what is on screen -------------------------------------------------------

    def header_text(self) -> str:
        p = self.player
        text = frame_title(p)
        if p.position:
            text += f": {op_words(p.ops[p.position - 1])}"
        if self.stepper.verbose:
            text += " · all ops"
        return text + (f" · {self.message}" if self.message else "") + " · ? help"

    def narration_text(self) -> Text:
        story = self.player.narration.get(self.player.current_step)
        if story:
            return Text(story)
        return Text("(no narration for this step: its ops are listed below)", style="dim")

    def details_lines(self) -> list[str]:
        if self.selected_block is not None:
            return block_details(self.player, self.selected_block).lines()
        if self.selected_request is not None:
            return request_details(self.player, self.selected_request).lines()
        return []

    def highlighted_blocks(self) -> set[int]:
        if self.selected_request is None:
            return set()
        return {b for ids in self.player.manager.get_block_ids(self.selected_request)
                for b in ids if b}

    def refresh_view(self) -> None:
        p = self.player
        manager = p.manager
        self.query_one("#header", Static).update(self.header_text())
        self.query_one("#narration", Static).update(self.narration_text())
        self.query_one("#pool", PoolView).refresh(layout=True)
        details = self.query_one("#details", Static)
        lines = self.details_lines()
        details.set_class(not lines, "empty")
        details.update(Text("\n".join(lines)))
        facts = p.step_facts()
        ops = Text(f"ops of step {p.current_step}\n", style="bold")
        ops.append_text(render_step_ops(facts, self.stepper.verbose, limit=40))
        self.query_one("#ops", Static).update(ops)
        self.query_one("#tables", Static).update(
            render_block_tables(manager, requests=p.requests))
        self.query_one("#tree", Static).update(render_prefix_tree(manager))
        self.query_one("#events", Static).update(render_events(facts))
        stats = render_stats(p)
        self.query_one("#stats", Static).update(stats)
        self.query_one("#stats2", Static).update(stats.copy())

    # -- actions -------------------------------------------------------------------

    def _run(self, command: str) -> None:
        self.message = self.stepper.handle(command)
        self.refresh_view()

    def action_step(self, delta: int) -> None:
        self._run("n" if delta > 0 else "p")

    def action_op(self, delta: int) -> None:
        self._run("+" if delta > 0 else "-")

    def action_toggle_bookkeeping(self) -> None:
        self._run("v")

    def action_scroll_panels(self, direction: int) -> None:
        panels = self.query_one("#right", VerticalScroll)
        if direction > 0:
            panels.scroll_page_down(animate=False)
        else:
            panels.scroll_page_up(animate=False)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_clear(self) -> None:
        if self._asking is not None:            # Esc in the prompt only closes it
            self._close_prompt()
            return
        self.selected_block = self.selected_request = None
        self.message = ""
        self.refresh_view()

    def action_move_block(self, delta: int) -> None:
        num_blocks = len(self.player.manager.block_pool.blocks)
        start = self.selected_block if self.selected_block is not None else -delta if \
            delta > 0 else num_blocks
        self.selected_block = (start + delta) % num_blocks
        self.selected_request = None
        self.message = ""
        self.refresh_view()

    def action_next_request(self) -> None:
        holding = requests_with_blocks(self.player.manager)
        if not holding:
            self.message = "no request holds blocks at this op"
        else:
            k = holding.index(self.selected_request) + 1 \
                if self.selected_request in holding else 0
            self.selected_request, self.selected_block = holding[k % len(holding)], None
            self.message = ""
        self.refresh_view()

    def action_ask(self, what: str) -> None:
        p = self.player
        hints = {"step": f"step number, 0..{len(p.steps) - 1}",
                 "op": f"op number, 0..{len(p.ops) - 1}",
                 "request": "request id (or the start of one)",
                 "block": f"block id, 0..{len(p.manager.block_pool.blocks) - 1}"}
        prompt = self.query_one("#prompt", Input)
        prompt.placeholder = f"{hints[what]} · Enter to go, Esc to cancel"
        prompt.value = ""
        prompt.add_class("shown")
        self._asking = what
        prompt.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        what, value = self._asking, event.value.strip()
        self._close_prompt()
        if not value or what is None:
            return
        if what in ("step", "op"):
            self._run(f"{'j' if what == 'step' else 'o'} {value}")
            return
        if what == "block":
            top = len(self.player.manager.block_pool.blocks) - 1
            if not value.isdigit() or int(value) > top:
                self.message = f"no block {value}: blocks are 0..{top}"
            else:
                self.selected_block, self.selected_request = int(value), None
                self.message = ""
        else:
            self.select_request(value)
        self.refresh_view()

    def select_request(self, text: str) -> None:
        ids = list(self.player.requests)
        match = text if text in ids else next((r for r in ids if r.startswith(text)), None)
        if match is None:
            self.message = (f"no request {text!r} yet at op {self.player.position - 1}"
                            if any(op.get("req", "").startswith(text) for op in self.player.ops)
                            else f"no request {text!r} in this trace")
        else:
            self.selected_request, self.selected_block = match, None
            self.message = ""

    def _close_prompt(self) -> None:
        self._asking = None
        prompt = self.query_one("#prompt", Input)
        prompt.remove_class("shown")
        self.set_focus(None)


def run_app(player: TracePlayer, start_step: int | None = None,
            start_op: int | None = None) -> int:
    KVViewer(player, start_step, start_op).run()
    return 0
