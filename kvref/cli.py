"""The ``kvref`` command line.

    kvref demo [--workload W] [--steps N] [--pause S]      watch the cache work, narrated
    kvref viz TRACE | --workload W [--export F.svg|F.html]  step through a trace (full screen)
    kvref record --workload W -o FILE                       write a kvtrace/1 trace
    kvref explain TRACE --op N                              why op N did what it did
    kvref replay PATH...                                    replay traces, compare with vLLM's
    kvref watch ENDPOINT [--query TOKENS]                   a running vLLM's cache, live
    kvref simulate TRACE [--kv-cache-tokens N|inf] [--json]  a request trace through vLLM's
                                                            scheduler and KV cache, no model
    kvref --version                                         (also: python -m kvref ...)

Workloads: the walk-throughs ``prefix-caching`` (the default demo) and
``sliding-window``, and the scheduler presets ``chat``, ``multi-turn``, ``rag``,
``agent``, ``hybrid``, ``pressure``, ``connector`` (``kvref.viz.workloads``). Bad input (a
missing or malformed trace, an unknown workload, an op number out of range)
gives one line on stderr and exit code 2. ``kvref viz`` and ``kvref explain``
show kvref's own answers; when a trace's recorded answers differ from them they
say so on stderr first (``kvref replay`` tells the whole difference).
"""

from __future__ import annotations

import argparse
import io
import sys

from rich.console import Console
from rich.progress import Progress
from rich.rule import Rule

EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Bad input from the user: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line instead of usage + error."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _workload_trace(name: str, steps: int | None, console: Console | None = None) -> dict:
    from kvref.viz.workloads import record_workload, workload_names

    if name not in workload_names():
        raise UsageError(f"unknown workload {name!r}; choose from: "
                         + ", ".join(workload_names()))
    if steps is not None and steps < 1:
        raise UsageError(f"--steps must be at least 1, got {steps}")
    if console is None or not console.is_terminal:
        return record_workload(name, max_steps=steps)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"running {name}", total=steps)
        return record_workload(name, max_steps=steps,
                               on_step=lambda k: progress.update(task, completed=k + 1))


def _read(path: str) -> dict:
    from kvref.viz.player import TraceError, read_trace

    try:
        return read_trace(path)
    except TraceError as exc:
        raise UsageError(str(exc)) from None


def _player(trace: dict):
    from kvref.viz.player import TraceError, TracePlayer

    try:
        return TracePlayer(trace)
    except TraceError as exc:
        raise UsageError(str(exc)) from None


def _warn_if_recorded_answers_differ(trace: dict, shown_op: int | None, command: str) -> None:
    """Say on stderr when the trace's recorded answers are not what kvref answers.

    ``kvref viz`` and ``kvref explain`` draw and reason from kvref's own replay;
    a trace recorded elsewhere (a real vLLM, an older kvref) may have recorded
    something else, and a picture that silently showed kvref's answer instead
    would mislead. ``shown_op``: the last op on screen (None: unknown yet)."""
    from kvref.verify.trace_replay import replay

    try:
        divergence = replay(trace).divergence
    except Exception:  # noqa: BLE001 - a malformed op is reported when it is reached
        return
    if divergence is None:
        return
    where = "construction" if divergence.index < 0 else f"op {divergence.index}"
    if shown_op is not None and divergence.index > shown_op:
        scope = (f"up to op {shown_op} the recorded answers are the ones shown; "
                 f"from {where} on kvref answers differently")
    else:
        scope = f"from {where} on, what is shown is kvref's answer, not the recorded one"
    print(f"warning: {command}: this trace's recorded answers differ from kvref's "
          f"({divergence}); {scope}. `kvref replay` reports the difference.",
          file=sys.stderr)


# -- commands -------------------------------------------------------------------


def cmd_demo(args, console: Console) -> int:
    from kvref.viz.demo import run_demo, terminal_waiter
    from kvref.viz.panels import render_summary
    from kvref.viz.player import summarize

    if args.pause is not None and args.pause < 0:
        raise UsageError(f"kvref demo: --pause must be >= 0, got {args.pause}")
    trace = _workload_trace(args.workload, args.steps)
    player = _player(trace)
    console.print(Rule(f"kvref demo: {args.workload}"))
    console.print(trace["generator"].get("description", ""), style="bold")
    wait = None if args.no_animate else terminal_waiter(console, args.pause)
    shown = run_demo(console, player, wait)
    title = f"summary of {args.workload}"
    if shown < len(player.steps):
        title += f" (all {len(player.steps)} steps, {shown} shown)"
    console.print(render_summary(summarize(trace), title=title))
    return 0


def cmd_viz(args, console: Console) -> int:
    from kvref.viz.interactive import run_interactive
    from kvref.viz.panels import render_frame

    if (args.trace is None) == (args.workload is None):
        raise UsageError("kvref viz: give a TRACE file or --workload W (one of them)")
    if args.trace is not None and args.steps is not None:
        raise UsageError("kvref viz: --steps applies to --workload only")
    trace = _read(args.trace) if args.trace else _workload_trace(args.workload, args.steps)
    player = _player(trace)
    if not player.ops:
        raise UsageError("kvref viz: the trace has no ops to show")
    if args.export is not None:
        return _export(args, console, trace, player)
    _seek(player, args)
    if args.trace:
        _warn_if_recorded_answers_differ(
            trace, player.position - 1 if args.step is not None or args.op is not None
            else None, "kvref viz")
    if not args.no_interactive and sys.stdin.isatty() and sys.stdout.isatty():
        from kvref.viz.app import run_app

        return run_app(player, start_op=player.position - 1)
    if args.step is not None or args.op is not None:
        console.print(render_frame(player))
        return 0
    return run_interactive(console, player)


def _export(args, console: Console, trace: dict, player) -> int:
    """``.svg``: one frame, as the terminal draws it. ``.html``: the whole trace as a
    self-contained player page (``kvref.viz.html_player``), opening at --step/--op."""
    from kvref.viz.panels import render_frame

    if not args.export.endswith((".svg", ".html")):
        raise UsageError(f"kvref viz: --export must end in .svg or .html, got {args.export!r}")
    chosen = args.step is not None or args.op is not None
    _seek(player, args, default_last=args.export.endswith(".svg"))
    if args.trace:
        _warn_if_recorded_answers_differ(trace, player.position - 1, "kvref viz")
    try:
        if args.export.endswith(".html"):
            from kvref.viz.html_player import write_player

            size = write_player(trace, args.export,
                                start_op=player.position - 1 if chosen else None)
            console.print(f"wrote {args.export}: a player of {len(player.ops)} ops in "
                          f"{len(player.steps)} steps, {size / 1000:.0f} kB, no network "
                          f"needed (opens at step {player.current_step}, "
                          f"op {player.position - 1})")
            return 0
        recorder = Console(record=True, width=80, file=io.StringIO(), force_terminal=True)
        recorder.print(render_frame(player))
        recorder.save_svg(args.export, title=f"kvref viz: {trace.get('name', 'trace')}")
    except OSError as exc:
        raise UsageError(f"kvref viz: cannot write {args.export}: {exc.strerror}") from None
    console.print(f"wrote {args.export} (step {player.current_step}, op {player.position - 1})")
    return 0


def _seek(player, args, default_last: bool = False) -> None:
    if args.step is not None and args.op is not None:
        raise UsageError("kvref viz: give --step or --op, not both")
    if args.op is not None:
        if not 0 <= args.op < len(player.ops):
            raise UsageError(f"kvref viz: no op {args.op}: ops are 0..{len(player.ops) - 1}")
        player.seek_op(args.op)
    elif args.step is not None:
        if not 0 <= args.step < len(player.steps):
            raise UsageError(f"kvref viz: no step {args.step}: steps are "
                             f"0..{len(player.steps) - 1}")
        player.seek_step(args.step)
    elif default_last:
        player.seek_step(len(player.steps) - 1)
    else:
        player.seek_step(0)


def cmd_record(args, console: Console) -> int:
    from kvref.verify.trace_record import write_trace
    from kvref.viz.player import summarize

    if not args.output.endswith((".json", ".json.gz")):
        raise UsageError(f"kvref record: writes a kvtrace/1 trace, so -o must end in .json or "
                         f".json.gz, got {args.output!r} (for a picture: kvref viz --workload "
                         f"{args.workload} --export FILE.svg)")
    trace = _workload_trace(args.workload, args.steps, console)
    try:
        write_trace(trace, args.output)
    except OSError as exc:
        raise UsageError(f"kvref record: cannot write {args.output}: {exc.strerror}") from None
    s = summarize(trace)
    console.print(f"wrote {args.output}: {s.num_ops} ops, {s.num_steps} steps, "
                  f"{_n(s.num_requests, 'request')}, vLLM's hit rate {s.hit_rate:.0%}")
    return 0


def cmd_explain(args, console: Console) -> int:
    from kvref.viz.explain import explain
    from kvref.viz.player import TraceError

    trace = _read(args.trace)
    if isinstance(args.op, int) and 0 <= args.op < len(trace["ops"]):
        _warn_if_recorded_answers_differ(trace, args.op, "kvref explain")
    try:
        lines = explain(trace, args.op)
    except IndexError as exc:
        raise UsageError(f"kvref explain: {exc}") from None
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    for line in lines:
        console.print(line, highlight=False)
    return 0


def cmd_replay(args, console: Console) -> int:
    """Replay every file named or found; a file that cannot be replayed is
    reported and the others still run. Exit 2 if any file was bad input,
    else 1 if any trace diverged, else 0."""
    from kvref.verify.trace_replay import TRACE_FORMAT, find_traces, replay
    from kvref.viz.player import OTHER_FORMATS, OtherFormatError, TraceError, read_trace

    files = list(find_traces(args.paths))
    if not files:
        raise UsageError(f"kvref replay: no trace files under {' '.join(args.paths)}")
    divergent, bad, skipped, needs_torch, ops = [], [], {}, 0, 0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replaying", total=len(files))
        for path in files:
            try:
                trace = read_trace(str(path))
                result = replay(trace, not args.no_hashes, args.check_invariants)
            except OtherFormatError as exc:
                skipped[exc.trace_format] = skipped.get(exc.trace_format, 0) + 1
            except ModuleNotFoundError as exc:
                if not torch_is_missing(exc):
                    raise
                needs_torch += 1                  # prompt embeddings are built as tensors
            except TraceError as exc:
                bad.append(str(exc))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                bad.append(f"{path}: malformed trace ({type(exc).__name__}: {exc})")
            else:
                ops += result.num_ops
                if result.divergence is not None:
                    divergent.append((path, result.divergence))
            progress.advance(task)
    for path, divergence in divergent:
        console.print(f"[red]DIVERGENCE[/red] {path}: {divergence}", highlight=False)
    for reason in bad:
        print(f"error: {reason}", file=sys.stderr)
    replayed = len(files) - len(bad) - sum(skipped.values()) - needs_torch
    line = (f"{_n(replayed, 'trace')} replayed, {_n(ops, 'op')}, "
            f"{_n(len(divergent), 'divergent trace')}")
    if bad:
        line += f"; {_n(len(bad), 'file')} could not be replayed (listed on stderr)"
    console.print(line, highlight=False)
    for trace_format, count in sorted(skipped.items()):
        # Another format is not bad input: its own tool replays it.
        console.print(f"skipped {_n(count, 'file')} of format {trace_format} "
                      f"(not {TRACE_FORMAT}; {OTHER_FORMATS[trace_format]})",
                      highlight=False)
    if needs_torch:
        # One line; "bad input" only if nothing else could be replayed (below).
        print(f"note: skipped {_n(needs_torch, 'trace')} with prompt embeddings, which "
              f"{'needs' if needs_torch == 1 else 'need'} torch: {TORCH_INSTALL}",
              file=sys.stderr)
    if replayed == 0 and not bad:
        if needs_torch:
            return EXIT_BAD_INPUT
        raise UsageError(f"kvref replay: no {TRACE_FORMAT} traces under {' '.join(args.paths)}")
    return EXIT_BAD_INPUT if bad else (1 if divergent else 0)


def cmd_watch(args, console: Console) -> int:
    import signal

    from kvref.viz.watch import Query
    from kvref.watch import load_tokenizer, read_queries

    try:
        tokenize = None if args.tokenizer is None else load_tokenizer(args.tokenizer)
        queries = [Query(name, tokens, args.lora_name, args.cache_salt) for name, tokens in
                   read_queries(args.query or [], args.query_file, args.prompt or [], tokenize)]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for name, value in (("--duration", args.duration), ("--batches", args.batches),
                        ("--num-gpu-blocks", args.num_gpu_blocks),
                        ("--data-parallel-size", args.data_parallel_size)):
        if value is not None and value <= 0:
            raise UsageError(f"{name} must be positive, got {value}")

    def stop(signum, frame):              # SIGTERM ends the run as Ctrl-C does: a report
        raise KeyboardInterrupt

    live = console.is_terminal and not args.json
    previous = None if live else signal.signal(signal.SIGTERM, stop)
    try:
        return _watch(args, console, queries, tokenize, live)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _watch(args, console: Console, queries, tokenize, live: bool) -> int:
    from contextlib import ExitStack

    from kvref.watch import WatchError, Watcher, rank_endpoint, watch_all

    watchers = []
    try:
        with ExitStack() as stack:
            for rank in range(args.data_parallel_size):
                replay = None if args.replay is None else rank_endpoint(args.replay, rank)
                watchers.append(stack.enter_context(Watcher(
                    rank_endpoint(args.endpoint, rank), host=args.host, topic=args.topic,
                    replay_endpoint=replay, num_gpu_blocks=args.num_gpu_blocks)))
            if live:
                from kvref.viz.watch import WatchApp

                app = WatchApp(watchers, queries, duration_s=args.duration,
                               max_batches=args.batches, tokenize=tokenize,
                               lora_name=args.lora_name, cache_salt=args.cache_salt)
                app.run()
                queries = app.queries
                if app.error is not None:
                    raise WatchError(app.error)
            else:
                watch_all(watchers, duration_s=args.duration, max_batches=args.batches)
            _watch_report(watchers, queries, args.json, console)
    except WatchError as exc:
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt:
        if watchers:
            _watch_report(watchers, queries, args.json, console)
    return 0


def _watch_report(watchers, queries, as_json: bool, console: Console) -> None:
    import json

    from kvref.viz.watch import best_answer, render_watch

    if not as_json:
        console.print(render_watch(watchers, queries))
        return
    answers = []
    for q in queries:
        rank, by_rank = best_answer(watchers, q)
        answers.append({"query": q.name, **by_rank[rank]._asdict(),
                        "index_exact": watchers[rank].unknown_since is None})
        if len(watchers) > 1:
            answers[-1].update(best_rank=rank, hit_tokens_by_rank=[a.hit_tokens for a in by_rank])
    if len(watchers) == 1:
        print(json.dumps({**watchers[0].status(), "queries": answers}))
    else:
        print(json.dumps({"data_parallel_size": len(watchers),
                          "ranks": [w.status() for w in watchers], "queries": answers}))


TORCH_INSTALL = "python3 -m pip install -e '.[torch]'"


def torch_is_missing(exc: ModuleNotFoundError) -> bool:
    """Whether ``exc`` is torch (or one of its modules) not being installed."""
    return exc.name == "torch" or (exc.name or "").startswith("torch.")


def _n(count: int, word: str) -> str:
    return f"{count} {word if count == 1 else word + 's'}"


# -- parsing --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from kvref.viz.workloads import workload_names

    names = ", ".join(workload_names())
    from kvref import __version__

    parser = _Parser(prog="kvref", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"kvref {__version__} (the KV-cache layer of vLLM v0.25.1)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="watch the KV cache work, step by step, narrated",
                          description="Run a workload and print every step whole (the "
                          "pictures, then what happened and why), waiting for a key between "
                          "steps in a terminal (q stops), then a summary: hit rate, prompt "
                          "tokens saved, evictions, preemptions. Not in a terminal it does "
                          "not wait.")
    demo.add_argument("--workload", default="prefix-caching", metavar="W",
                      help=f"what to run (default prefix-caching): {names}")
    demo.add_argument("--steps", type=int, metavar="N", help="stop after N steps")
    demo.add_argument("--no-animate", action="store_true",
                      help="print every step without waiting (automatic when not a terminal)")
    demo.add_argument("--pause", type=float, metavar="S",
                      help="in a terminal, wait S seconds between steps instead of for a key")
    demo.set_defaults(run=cmd_demo)

    viz = sub.add_parser("viz", help="step through a trace or a workload",
                         description="Step through a kvtrace/1 trace (or a workload) in a "
                         "full-screen viewer: n/p step, ./, op, g step N, o op N, / request, "
                         "b block, v bookkeeping, ? help, q quit. Not in a terminal (or with "
                         "--no-interactive): typed commands, one per line (n, p, +, -, j N, "
                         "o N, v, q), or the one frame --step/--op names. With --export, "
                         "write one frame as SVG or HTML instead.")
    viz.add_argument("trace", nargs="?", help="a .json or .json.gz kvtrace/1 file")
    viz.add_argument("--workload", metavar="W", help=f"run a workload instead: {names}")
    viz.add_argument("--steps", type=int, metavar="N", help="with --workload: stop after N steps")
    viz.add_argument("--export", metavar="FILE",
                     help="FILE.svg: write one frame; FILE.html: write the whole trace as a "
                     "self-contained player page (keys, sliders, hover details; no network)")
    viz.add_argument("--step", type=int, metavar="N",
                     help="open at the end of step N (default: step 0; with --export F.svg: the last)")
    viz.add_argument("--op", type=int, metavar="N", help="open right after op N")
    viz.add_argument("--no-interactive", action="store_true",
                     help="text only, for pipes and CI: print the --step/--op frame, or read "
                     "typed commands from stdin (automatic when not a terminal)")
    viz.set_defaults(run=cmd_viz)

    rec = sub.add_parser("record", help="write a workload as a kvtrace/1 trace",
                         description="Run a workload and write every manager call with "
                         "kvref's answer as its expect: a trace `kvref replay`, `kvref viz` "
                         "and the shared conformance tools (on a real vLLM) can replay.")
    rec.add_argument("--workload", required=True, metavar="W", help=f"one of: {names}")
    rec.add_argument("-o", "--output", required=True, metavar="FILE",
                     help="trace file to write: .json, or .json.gz compressed (anything else "
                     "is refused; for a picture use kvref viz --export)")
    rec.add_argument("--steps", type=int, metavar="N", help="stop after N steps")
    rec.set_defaults(run=cmd_record)

    exp = sub.add_parser("explain", help="why an op of a trace did what it did",
                         description="Explain in words which gate refused an allocation, "
                         "why a prefix hit stopped where it did, which blocks an allocation "
                         "evicted, where freed blocks went.")
    exp.add_argument("trace", help="a .json or .json.gz kvtrace/1 file")
    exp.add_argument("--op", type=int, required=True, metavar="N",
                     help="op index (0-based, as `kvref replay` and `kvtrace check` print)")
    exp.set_defaults(run=cmd_explain)

    rep = sub.add_parser("replay", help="replay recorded traces against kvref",
                         description="Replay kvtrace/1 traces and compare every answer "
                         "with the recorded one. Every file is replayed; one that cannot be "
                         "read or replayed is reported and the others go on. Exit 2 if any "
                         "file was bad, else 1 if any trace diverges.")
    rep.add_argument("paths", nargs="+", help="trace files or folders")
    rep.add_argument("--no-hashes", action="store_true",
                     help="do not compare hash values (their count still is)")
    rep.add_argument("--check-invariants", action="store_true",
                     help="also assert the invariants of specs/ after every op")
    rep.set_defaults(run=cmd_replay)
    wat = sub.add_parser("watch", help="a running vLLM's prefix cache, live, from its KV events",
                         description="Subscribe to a running vLLM's KV events over ZMQ (start "
                         "it with --kv-events-config '{\"enable_kv_cache_events\": true, "
                         "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}'), "
                         "keep the prefix-cache index a router keeps, and show it live with "
                         "how far each --query prompt would hit now. ENDPOINT is the one "
                         "vLLM was given: vLLM binds tcp://*:PORT and ipc:// endpoints (the "
                         "watcher connects, to --host) and connects to tcp://HOST:PORT (the "
                         "watcher binds there). Stops after --duration or --batches, or on "
                         "Ctrl-C (in a terminal also q; / asks about a typed prompt), and "
                         "prints the index and answers (--json for scripts).")
    wat.add_argument("endpoint", help="vLLM's kv-events endpoint, e.g. tcp://*:5557")
    wat.add_argument("--host", default="127.0.0.1",
                     help="the server's address when it binds (tcp://*:PORT); default 127.0.0.1")
    wat.add_argument("--replay", metavar="ENDPOINT",
                     help="vLLM's replay_endpoint: fetch batches sent before the watcher "
                     "started or lost on the way")
    wat.add_argument("--topic", default="", help="vLLM's kv-events topic (default: none)")
    wat.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                     help="vLLM's data parallel size: rank r publishes on PORT + r with its "
                     "own cache; each is watched, and a query says which rank hits most")
    wat.add_argument("--query", action="append", metavar="TOKENS",
                     help="token ids of a prompt, e.g. '1 2 3' or '[1, 2, 3]' (repeatable)")
    wat.add_argument("--prompt", action="append", metavar="TEXT",
                     help="a prompt as text, with --tokenizer (repeatable)")
    wat.add_argument("--query-file", metavar="FILE",
                     help="prompts: JSON lines of token-id lists or {\"prompt_token_ids\": "
                     "[...]} or {\"prompt\": TEXT} (an \"id\" names it), or one JSON list")
    wat.add_argument("--tokenizer", metavar="DIR",
                     help="the served model's tokenizer folder (local; needs transformers): "
                     "turns --prompt texts into token ids as vLLM's /v1/completions does (a chat "
                     "request applies its chat template first: give its token ids)")
    wat.add_argument("--lora-name", metavar="NAME",
                     help="ask as requests for this LoRA adapter would (vLLM puts its name in "
                     "every block's hash)")
    wat.add_argument("--cache-salt", metavar="SALT",
                     help="ask as requests with this cache_salt would (vLLM puts it in the "
                     "first block's hash, so without it a salted cache never hits)")
    wat.add_argument("--num-gpu-blocks", type=int, metavar="N",
                     help="the server's pool size (its log: 'GPU KV cache size'), not in any "
                     "event: shows how much of the pool holds cached prefixes")
    wat.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    wat.add_argument("--batches", type=int, metavar="N", help="stop after N event batches")
    wat.add_argument("--json", action="store_true",
                     help="no live view; print the final index and answers as JSON")
    wat.set_defaults(run=cmd_watch)

    from kvref.simulate.command import add_simulate_parser
    add_simulate_parser(sub, UsageError)
    return parser


def main(argv: list[str] | None = None, prog: str = "kvref") -> int:
    from kvref.viz.player import TraceError

    console = Console()
    try:
        parser = build_parser()
        parser.prog = prog
        args = parser.parse_args(argv)
        return args.run(args, console)
    except (UsageError, TraceError) as exc:
        # A trace found malformed midway (viz stepping into a bad op) is bad input too.
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ModuleNotFoundError as exc:
        if not torch_is_missing(exc):
            raise
        # Only the tensor side needs torch; the base install leaves it out.
        print(f"error: this needs torch, which kvref's base install leaves out: "
              f"{TORCH_INSTALL}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
