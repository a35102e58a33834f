"""What ``kvref watch`` draws: a running vLLM's prefix cache, from its KV events.

No vLLM counterpart. ``render_watch`` gives one frame: where the watcher
listens and what has arrived, each KV cache group's cached blocks, every
query's hit as it stands now (a bar of the prompt, the hit part filled), and
the last events; printed once when not in a terminal::

    Console().print(render_watch(watcher, [Query("system prompt", tokens)]))

In a terminal, ``WatchApp`` (Textual, as ``kvref viz``) redraws it four times a
second while it reads the socket, and asks: ``/`` opens a prompt where typed
token ids (``1 2 3``) or, with a tokenizer, text become a new query; ``q`` quits.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Input, Static

from kvref.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvref.viz.panels import plural
from kvref.watch import Watcher, parse_tokens

BAR = 24


class Query(NamedTuple):
    """A prompt to ask about; ``lora_name`` and ``cache_salt`` as the request would
    carry them (both change every block's hash in vLLM)."""
    name: str
    tokens: list[int]
    lora_name: str | None = None
    cache_salt: str | None = None


def hit_bar(hit: int, total: int, width: int = BAR) -> Text:
    """``█████░░░░░``: the share of the prompt served from the cache."""
    filled = 0 if total == 0 else round(width * hit / total)
    return Text("█" * filled, style="green") + Text("░" * (width - filled), style="dim")


def describe_event(event) -> str:
    if isinstance(event, BlockStored):
        sparse = len(event.token_ids) != event.block_size * len(event.block_hashes)
        first = event.token_ids[:4]
        return (f"stored {plural(len(event.block_hashes), 'block')} in group {event.group_idx}, "
                f"tokens {first}{'...' if len(event.token_ids) > 4 else ''}"
                f"{' (sparse)' if sparse else ''}")
    if isinstance(event, BlockRemoved):
        return f"removed {plural(len(event.block_hashes), 'block')} from group {event.group_idx}"
    if isinstance(event, AllBlocksCleared):
        return "prefix cache reset: everything cleared"
    return type(event).__name__


def best_answer(watchers: list[Watcher], query: Query):
    """(rank, answers): the data-parallel rank that would serve most of the prompt,
    and every rank's answer."""
    answers = [w.index.query(query.tokens, lora_name=query.lora_name,
                             cache_salt=query.cache_salt) for w in watchers]
    rank = max(range(len(answers)), key=lambda r: answers[r].hit_tokens)
    return rank, answers


def render_watch(watchers: Watcher | list[Watcher], queries: list[Query]) -> Group:
    """One frame; ``watchers``: one, or one per data-parallel rank."""
    watchers = [watchers] if isinstance(watchers, Watcher) else list(watchers)
    several = len(watchers) > 1
    lines = []
    for rank, watcher in enumerate(watchers):
        lines += status_lines(watcher.status(), f"rank {rank} " if several else "")
    groups = Table(title="KV cache groups", title_justify="left", box=None, pad_edge=False)
    columns = (["rank"] if several else []) + ["group", "kind", "block size", "cached blocks"]
    for column in columns:
        groups.add_column(column, justify="left" if column == "kind" else "right")
    for rank, watcher in enumerate(watchers):
        for g in watcher.index.summary():
            groups.add_row(*([str(rank)] if several else []), str(g["group"]), str(g["kind"]),
                           str(g["block_size"]), str(g["cached_blocks"]))
    lines.append(groups)
    if queries:
        table = Table(title="would it hit? (a new request with this prompt, now)",
                      title_justify="left", box=None, pad_edge=False)
        for column in ["query", "tokens", "hit", ""] + (["best rank", "by rank"] if several
                                                         else []) + ["note"]:
            table.add_column(column)
        for q in queries:
            rank, answers = best_answer(watchers, q)
            best = answers[rank]
            per_rank = [str(rank), " ".join(str(a.hit_tokens) for a in answers)] if several \
                else []
            # "?": the index cannot be trusted (a restart or a gap not yet resolved)
            hit = str(best.hit_tokens) + ("?" if watchers[rank].unknown_since else "")
            table.add_row(q.name, str(best.num_tokens), hit,
                          hit_bar(best.hit_tokens, best.num_tokens), *per_rank, best.note)
        lines.append(table)
    recent = sorted(((ts, rank, seq, event) for rank, w in enumerate(watchers)
                     for ts, seq, event in w.recent), key=lambda item: item[:3])[-8:]
    if recent:
        text = Text("last events:\n", style="bold")
        for _ts, rank, seq, event in recent:
            where = f"rank {rank} " if several else ""
            text.append(f"  {where}#{seq} {describe_event(event)}\n")
        lines.append(text)
    return Group(*lines)


def status_lines(status: dict, prefix: str = "") -> list[Text]:
    """Where one watcher listens, whether a server is there, what arrived, and how
    far the index can be trusted; short lines, for an 80-column terminal."""
    connection = status["connection"]
    alive = connection["state"] == "connected"
    head = Text.assemble(("kvref watch ", "bold"), prefix,
                         (connection["text"], "" if alive else "yellow"))
    lines = [head]
    ago = status["last_message_s_ago"]
    if status["server_batches"]:
        counts = status["events"]
        line = Text.assemble(
            f"{prefix}this server: ",
            (plural(status["server_batches"], "batch", "batches"), "bold"),
            f" (seq {status['first_seq']}..{status['next_seq'] - 1}), "
            f"{plural(status['blocks_stored'], 'block')} stored, "
            f"{status['blocks_removed']} removed, "
            f"{plural(counts.get('AllBlocksCleared', 0), 'reset')}")
        lines.append(line)
    else:
        lines.append(Text(f"{prefix}0 batches from this server (waiting for vLLM's first "
                          "KV events)", style="dim"))
    if ago is not None:
        lines.append(Text(f"{prefix}last message {ago:.0f} s ago", style="dim"))
    pool = status["pool"]
    if pool["num_gpu_blocks"]:
        # one block is the null block, never cached (vllm/v1/core/block_pool.py:191-192)
        lines.append(Text(f"{prefix}{pool['cached_blocks']} of {pool['num_gpu_blocks'] - 1} "
                          "usable blocks hold cached prefixes (blocks still filling are in no "
                          "event)",
                          style="dim"))
    elif status["server_batches"]:
        lines.append(Text(f"{prefix}how full the pool is: not in the events (--num-gpu-blocks N "
                          "shows the cached share)", style="dim"))
    if status["cache_reset_at"]:
        lines.append(Text(f"{prefix}prefix cache reset at {status['cache_reset_at']} "
                          "(AllBlocksCleared): everything cached before it is gone",
                          style="bold"))
    if status["unknown_since"]:
        lines.append(Text(f"{prefix}index UNKNOWN since {status['unknown_since']}: "
                          f"{status['unknown_because']}; hits marked ?", style="bold red"))
    replay = status.get("replay")
    if replay is not None and not replay["answered"]:
        lines.append(Text(f"{prefix}the replay socket {replay['endpoint']} has not answered: "
                          "is the server up, and is that its replay_endpoint?",
                          style="yellow"))
    for restart in status["restarts_seen"][-2:]:
        lines.append(Text(f"{prefix}the server restarted (seen {restart['at']}: "
                          f"{restart['how']}): the index started over", style="yellow"))
    if status["missed_batches"]:
        lines.append(Text(f"{prefix}{plural(status['missed_batches'], 'batch', 'batches')} "
                          "were never received "
                          "(joined late or dropped): blocks they stored are not in the index; "
                          "--replay ENDPOINT fetches them from vLLM", style="yellow"))
    if status["dropped_messages"]:
        lines.append(Text(f"{prefix}{plural(status['dropped_messages'], 'message')} dropped, "
                          f"the last: {status['last_dropped']}", style="yellow"))
    return lines


class WatchApp(App):
    """``render_watch`` kept current, and a prompt that adds queries."""

    TITLE = "kvref watch"
    AUTO_FOCUS = None
    CSS = """
    #view { padding: 0 1; }
    #prompt { dock: bottom; display: none; }
    #prompt.shown { display: block; }
    """
    # Ctrl-C arrives as a key in Textual's raw terminal mode: bound here, with
    # priority, it quits instead of Textual's "press ctrl+q" notice.
    BINDINGS = [Binding("slash", "ask", "ask about a prompt", key_display="/"),
                Binding("escape", "close_prompt", "cancel", show=False),
                Binding("q", "quit", "quit"),
                Binding("ctrl+c", "quit", "quit", show=False, priority=True)]

    def __init__(self, watchers: Watcher | list[Watcher], queries: list[Query], *,
                 duration_s: float | None = None, max_batches: int | None = None,
                 tokenize: Callable[[str], list[int]] | None = None,
                 lora_name: str | None = None, cache_salt: str | None = None) -> None:
        super().__init__()
        self.lora_name, self.cache_salt = lora_name, cache_salt
        self.watchers = [watchers] if isinstance(watchers, Watcher) else list(watchers)
        self.queries, self.tokenize = list(queries), tokenize
        self.deadline = None if duration_s is None else time.monotonic() + duration_s
        self.max_batches = max_batches
        self.error: str | None = None
        self.message = ""

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="view")
        yield Input(id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        import asyncio
        import signal

        # A signal from outside (kill -INT, kill -TERM) leaves through Textual's own
        # exit, which gives the terminal back as it was.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.exit)
            except (NotImplementedError, RuntimeError, ValueError):
                pass        # not the main thread (a test's pilot): nothing to restore
        self.redraw()
        self.set_interval(0.25, self.tick)

    def tick(self) -> None:
        for watcher in self.watchers:
            watcher.poll(0)
            fault = watcher.fault()
            if fault:
                self.error = fault
                self.exit()
                return
        done = (self.deadline is not None and time.monotonic() >= self.deadline) or \
            (self.max_batches is not None and
             sum(w.batches for w in self.watchers) >= self.max_batches)
        if done:
            self.exit()
        else:
            self.redraw()

    def redraw(self) -> None:
        parts = [render_watch(self.watchers, self.queries)]
        if self.message:
            parts.append(Text(self.message, style="yellow"))
        self.query_one("#view", Static).update(Group(*parts))

    def action_ask(self) -> None:
        prompt = self.query_one("#prompt", Input)
        prompt.placeholder = ("token ids (1 2 3)" + (" or text" if self.tokenize else "") +
                              " · Enter to ask, Esc to cancel")
        prompt.value = ""
        prompt.add_class("shown")
        prompt.focus()

    def action_close_prompt(self) -> None:
        self.query_one("#prompt", Input).remove_class("shown")
        self.set_focus(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        self.action_close_prompt()
        if not value:
            return
        try:
            tokens = parse_tokens(value)
        except ValueError:
            if self.tokenize is None:
                self.message = (f"{value[:30]!r} is not token ids; text needs --tokenizer "
                                "(the served model's tokenizer folder)")
                self.redraw()
                return
            tokens = self.tokenize(value)
        self.queries.append(Query(f"asked {len(self.queries) + 1}", tokens,
                                  self.lora_name, self.cache_salt))
        self.message = ""
        self.redraw()
