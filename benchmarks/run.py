"""Run kvref's benchmarks, side by side with vLLM v0.25.1 when one is importable.

No vLLM counterpart (benchmark harness). One command::

    python benchmarks/run.py                        # everything, vLLM if found
    python benchmarks/run.py traces --repeats 10    # one section
    python benchmarks/run.py --no-vllm              # kvref alone

Sections:

- ``traces``: the 254 recorded operation streams of ``tests/conformance``,
  replayed as bare API calls (``replay.py``) per model class, kvref and vLLM
  alternating (A B A B ...), each run ``--passes`` replays of the class's
  traces; min/median/max per side, wall and process CPU time, and the ratio of
  the medians (kvref / vLLM: below 1.0 means kvref is faster).
- ``scaling``: per-call cost of ``get_computed_blocks``, ``allocate_slots``,
  ``free`` at pools of 1e3..1e6 blocks, pool build time, bytes per block
  (``scaling.py``); plotted to ``--plot``.
- ``statemachine``: steps per second of the manager state machine (``statemachine.py``).
- ``attention``, ``engine``: paged attention against dense SDPA, the engine
  against ``transformers`` (``attention.py``, ``engine.py``; kvref only).

vLLM runs in a worker process started with ``--vllm-python`` (default: the venv
``/root/.cache/vllm-oracle/bin/python`` that ``tools/setup_vllm_venv.py``
makes, if it exists); kvref runs in a worker started with this python.
Both workers stay alive for the whole run, so imports are paid once, and only
one of them works at any moment. Results are printed, and written as JSON
(``--json``) and as a Markdown table (``--markdown``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

DEFAULT_VLLM_PYTHON = "/root/.cache/vllm-oracle/bin/python"
# Untracked by default (benchmarks/out/ is in .gitignore): a run rewrites nothing
# tracked unless asked; the README's figure is refreshed with --plot benchmarks/scaling.png.
DEFAULT_PLOT = HERE / "out" / "scaling.png"
TRACES = ROOT / "tests" / "conformance" / "traces"
SECTIONS = ("traces", "scaling", "statemachine", "attention", "engine")
EXTRA_SECTIONS = ("ops",)  # run only when named
POOL_SIZES = (1_000, 10_000, 100_000, 1_000_000)


class Worker:
    """A ``worker.py`` process for one side; ``ask`` sends a request, returns the answer."""

    def __init__(self, side: str, python: str) -> None:
        self.side = side
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([python, str(HERE / "worker.py"), side],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=str(ROOT))
        hello = self._read()
        self.ready = bool(hello and hello.get("ready"))
        self.error = None if self.ready else (hello or {}).get("error", "worker did not start")
        self.python = python

    def _read(self) -> dict | None:
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        if answer is None:
            raise RuntimeError(f"{self.side} worker died (request {request})")
        if "error" in answer:
            raise RuntimeError(f"{self.side} worker failed on {request}:\n{answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def start_workers(args) -> dict[str, Worker]:
    workers = {"kvref": Worker("kvref", sys.executable)}
    if not workers["kvref"].ready:
        raise RuntimeError(f"kvref worker failed to start: {workers['kvref'].error}")
    if args.no_vllm:
        print("vLLM: not run (--no-vllm); kvref only")
        return workers
    python = args.vllm_python
    if not python or not Path(python).exists():
        print(f"vLLM: NOT AVAILABLE (no python at {python!r}; make one with "
              "python3 tools/setup_vllm_venv.py /root/.cache/vllm-oracle or pass --vllm-python); "
              "kvref only")
        return workers
    vllm = Worker("vllm", python)
    if not vllm.ready:
        print(f"vLLM: NOT AVAILABLE under {python} ({vllm.error}); kvref only")
        vllm.close()
        return workers
    print(f"vLLM: {python}")
    workers["vllm"] = vllm
    return workers


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "runs": values}


# -- traces ------------------------------------------------------------------------


TRACE_MODES = {
    "calls": "every recorded call timed, Request(...) construction included",
    "prebuilt": "requests built before the clock starts: the manager's calls alone",
}


# Many short runs, not a few long ones: this shared machine's speed changed by up
# to 2x from one run to the next (30 runs of 2 passes against 6 of 10, the same
# replays in all: the 30 ratios of one run 0.82-1.14 -> 0.84-0.96).
TRACE_REPEATS = 30
SCALING_REPEATS = 6


def in_turn(workers: dict[str, Worker], repeat: int) -> list[tuple[str, Worker]]:
    """The sides in run order for this repeat: kvref first on even repeats, last
    on odd ones (A B B A ...), so that going first or second, right after the
    other side's run, weighs the same on both (identical kvref code on both
    sides, always in one order: the second was slower in 5 of 6 classes, by up
    to 15%)."""
    sides = list(workers.items())
    return sides if repeat % 2 == 0 else sides[::-1]


def run_traces(workers: dict[str, Worker], classes: list[str], repeats: int,
               passes: int, modes: list[str]) -> dict:
    samples = {(mode, cls): {side: {"wall": [], "cpu": []} for side in workers}
               for mode in modes for cls in classes}
    ops = {}
    for r in range(repeats):
        for cls in classes:
            for mode in modes:
                for side, worker in in_turn(workers, r):   # kvref, vLLM, vLLM, kvref, ...
                    answer = worker.ask(cmd="traces", cls=cls, passes=passes,
                                        prebuild=mode == "prebuilt")
                    samples[mode, cls][side]["wall"].append(answer["wall"] / passes)
                    samples[mode, cls][side]["cpu"].append(answer["cpu"] / passes)
                    ops[cls] = answer["ops"] // passes
                print(f"  repeat {r + 1}/{repeats} {cls:24s} {mode:8s} " + "  ".join(
                    f"{side} {samples[mode, cls][side]['cpu'][-1] * 1e3:6.2f} ms CPU"
                    for side in workers), flush=True)
    result = {}
    for mode in modes:
        result[mode] = {}
        for cls in classes:
            entry = {"ops": ops[cls]}
            for side in workers:
                entry[side] = {kind: spread(samples[mode, cls][side][kind])
                               for kind in ("wall", "cpu")}
            if "vllm" in workers:
                entry["ratio"] = {kind: entry["kvref"][kind]["median"]
                                  / entry["vllm"][kind]["median"] for kind in ("wall", "cpu")}
            result[mode][cls] = entry
    return result


def traces_table(result: dict, with_vllm: bool) -> str:
    """One row per class: min / median / max per side, wall and CPU, and the ratios."""
    head = "| class | ops | kvref wall ms | kvref CPU ms |"
    rule = "|---|---:|---:|---:|"
    if with_vllm:
        head += " vLLM wall ms | vLLM CPU ms | ratio wall | ratio CPU |"
        rule += "---:|---:|---:|---:|"
    lines = [head, rule]

    def cell(s):
        return f"{s['min'] * 1e3:.2f} / **{s['median'] * 1e3:.2f}** / {s['max'] * 1e3:.2f}"

    for cls, entry in result.items():
        row = f"| {cls} | {entry['ops']} | {cell(entry['kvref']['wall'])} | " \
              f"{cell(entry['kvref']['cpu'])} |"
        if with_vllm:
            row += (f" {cell(entry['vllm']['wall'])} | {cell(entry['vllm']['cpu'])} |"
                    f" {entry['ratio']['wall']:.2f} | {entry['ratio']['cpu']:.2f} |")
        lines.append(row)
    return "\n".join(lines)


def ops_table(cls: str, by_side: dict) -> str:
    """Per op name: calls, CPU µs per call per side, and the share of kvref's time."""
    kvref = by_side["kvref"]
    total = sum(t for _, t in kvref.values())
    lines = [f"{cls}: kvref {total * 1e3:.1f} ms"
             + "".join(f", {s} {sum(t for _, t in d.values()) * 1e3:.1f} ms"
                       for s, d in by_side.items() if s != "kvref")]
    for op, (n, t) in sorted(kvref.items(), key=lambda kv: -kv[1][1]):
        row = f"  {op:34s} {n:6d} calls  {t / n * 1e6:7.2f} µs ({t / total:4.0%})"
        for side, data in by_side.items():
            if side != "kvref" and op in data:
                row += f"  {side} {data[op][1] / data[op][0] * 1e6:7.2f} µs" \
                       f"  ratio {t / data[op][1]:.2f}"
        lines.append(row)
    return "\n".join(lines)


# -- scaling -----------------------------------------------------------------------


def run_scaling(workers: dict[str, Worker], sizes: list[int], repeats: int,
                num_requests: int) -> dict:
    runs = {side: {n: [] for n in sizes} for side in workers}
    memory = {side: {} for side in workers}
    for r in range(repeats):
        for n in sizes:
            for side, worker in in_turn(workers, r):
                runs[side][n].append(worker.ask(cmd="scaling", num_blocks=n,
                                                num_requests=num_requests))
            print(f"  repeat {r + 1}/{repeats} {n:>9,d} blocks  " + "  ".join(
                f"{side} alloc {runs[side][n][-1]['per_call']['allocate_slots'][0]:6.0f} ns"
                for side in workers), flush=True)
    for n in sizes:
        for side, worker in workers.items():
            memory[side][n] = worker.ask(cmd="memory", num_blocks=n)["bytes_per_block"]
    result = {}
    for side in workers:
        result[side] = {}
        for n in sizes:
            samples = runs[side][n]
            calls = samples[0]["per_call"]
            result[side][n] = {
                "per_call": {call: {"wall_ns": statistics.median(s["per_call"][call][0]
                                                                 for s in samples),
                                    "cpu_ns": statistics.median(s["per_call"][call][1]
                                                                for s in samples)}
                             for call in calls},
                "build_wall_s": statistics.median(s["build_wall"] for s in samples),
                "build_cpu_s": statistics.median(s["build_cpu"] for s in samples),
                "bytes_per_block": memory[side][n],
            }
    return result


def scaling_table(result: dict, sizes: list[int]) -> str:
    sides = list(result)
    calls = list(result[sides[0]][sizes[0]]["per_call"])
    lines = ["| blocks | side | " + " | ".join(f"{c} ns (wall / CPU)" for c in calls)
             + " | pool build ms | bytes/block |",
             "|---:|---|" + "---:|" * (len(calls) + 2)]
    for n in sizes:
        for side in sides:
            e = result[side][n]
            lines.append(f"| {n:,d} | {side} | " + " | ".join(
                f"{e['per_call'][c]['wall_ns']:.0f} / {e['per_call'][c]['cpu_ns']:.0f}"
                for c in calls)
                + f" | {e['build_wall_s'] * 1e3:.1f} | {e['bytes_per_block']:.0f} |")
    for side in sides:
        first, last = result[side][sizes[0]]["per_call"], result[side][sizes[-1]]["per_call"]
        growth = ", ".join(f"{c} {last[c]['wall_ns'] / first[c]['wall_ns']:.2f}x wall / "
                           f"{last[c]['cpu_ns'] / first[c]['cpu_ns']:.2f}x CPU" for c in calls)
        lines.append(f"\n{side}: per-call cost at {sizes[-1]:,d} vs {sizes[0]:,d} blocks: "
                     f"{growth}")
    return "\n".join(lines)


def plot(result: dict, sizes: list[int], traces: dict | None, path: Path) -> None:
    """Per-call cost and pool build time against pool size (CPU time: wall time
    measures the other processes too); with vLLM, the per-class ratios as well."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_ratios = bool(traces) and all("ratio" in e for m in traces.values() for e in m.values())
    panels = 3 if with_ratios else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8))
    styles = {"kvref": "-", "vllm": "--"}
    markers = {"get_computed_blocks": "o", "allocate_slots": "s", "free": "^"}
    ax = axes[0]
    for side, by_size in result.items():
        for call, marker in markers.items():
            ax.plot(sizes, [by_size[n]["per_call"][call]["cpu_ns"] / 1e3 for n in sizes],
                    styles.get(side, ":"), marker=marker, label=f"{side} {call}")
    ax.set(xscale="log", xlabel="pool size (blocks)", ylabel="µs per call (CPU)",
           title="Per-call cost vs pool size")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.45)   # room for the legend above the lines
    ax.legend(fontsize=7, ncol=2, loc="upper center")
    ax = axes[1]
    for side, by_size in result.items():
        ax.plot(sizes, [by_size[n]["build_cpu_s"] for n in sizes], styles.get(side, ":"),
                marker="o", label=f"{side} pool build")
    ax.set(xscale="log", yscale="log", xlabel="pool size (blocks)", ylabel="seconds (CPU)",
           title="Pool build time")
    ax.legend(fontsize=7)
    if with_ratios:
        ax = axes[2]
        classes = list(next(iter(traces.values())))
        height = 0.8 / len(traces)
        for i, (mode, by_class) in enumerate(traces.items()):
            ratios = [by_class[c]["ratio"]["cpu"] for c in classes]
            ax.barh([k + i * height for k in range(len(classes))], ratios, height=height,
                    label=f"mode {mode}")
        ax.set_yticks([k + height * (len(traces) - 1) / 2 for k in range(len(classes))],
                      classes, fontsize=7)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.invert_yaxis()   # classes read top to bottom, as in the table
        ax.set(xlabel="kvref / vLLM, median CPU time (< 1: kvref faster)",
               title="Recorded traces, per model class")
        top = max(e["ratio"]["cpu"] for m in traces.values() for e in m.values())
        ax.set_xlim(0, max(1.45, top + 0.45))   # the legend sits right of the 1.0 line
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="kvref benchmarks (see benchmarks/README.md)")
    parser.add_argument("sections", nargs="*",
                        help=f"any of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON,
                        help="python that can import vllm 0.25.1 (default: %(default)s)")
    parser.add_argument("--no-vllm", action="store_true", help="run kvref alone")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"alternated runs per side (default: {TRACE_REPEATS} for "
                             f"traces, {SCALING_REPEATS} for scaling; keep it even, so that "
                             "each side goes first as often)")
    parser.add_argument("--passes", type=int, default=2,
                        help="replays of a class's traces per run (traces section; "
                             "default: %(default)s)")
    parser.add_argument("--classes", default="", help="comma-separated trace classes")
    parser.add_argument("--modes", default="calls,prebuilt",
                        help=f"trace modes: {', '.join(TRACE_MODES)}")
    parser.add_argument("--sizes", default=",".join(map(str, POOL_SIZES)),
                        help="pool sizes for the scaling section")
    parser.add_argument("--requests", type=int, default=4000,
                        help="requests per scaling run")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch CPU threads in the attention and engine sections")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables here")
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT,
                        help="where the scaling figure goes (default: %(default)s, ignored "
                             "by git; the README's figure is benchmarks/scaling.png)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sections = args.sections or list(SECTIONS)
    unknown = sorted(set(sections) - set(SECTIONS) - set(EXTRA_SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")

    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"kvref benchmarks, {started:%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, python {platform.python_version()}")
    results: dict = {"started": started.isoformat(), "command": " ".join(sys.argv)}
    markdown = [f"Command: `python {' '.join(sys.argv)}`, started {started:%Y-%m-%d %H:%M} UTC, "
                f"{os.cpu_count()} CPUs."]
    outcome: dict[str, str] = {}          # section -> "ok", "skipped: ...", "failed: ..."

    def section(name: str, body) -> None:
        """Run one section; a missing dependency or an error is reported, and the
        other sections still run."""
        try:
            body()
            outcome[name] = "ok"
        except ModuleNotFoundError as error:
            outcome[name] = (f"skipped: needs the {error.name!r} module "
                             "(pip install -e '.[test]' brings every benchmark dependency)")
        except Exception as error:                      # noqa: BLE001 (reported, not hidden)
            traceback.print_exc()
            outcome[name] = f"failed: {type(error).__name__}: {error}"
        if outcome[name] != "ok":
            print(f"\n== {name}: {outcome[name]}", flush=True)
            markdown.extend(["", f"### {name}", "", outcome[name]])

    needs_workers = {"traces", "scaling", "ops"} & set(sections)
    workers: dict[str, Worker] = {}
    if needs_workers:
        section("workers", lambda: workers.update(start_workers(args)))
    if needs_workers and not workers:
        for name in sorted(needs_workers):
            outcome[name] = "skipped: no worker process (see workers)"
    try:
        if workers:
            if "traces" in sections:
                section("traces", lambda: run_traces_section(args, workers, results, markdown))
            if "ops" in sections:
                section("ops", lambda: run_ops_section(args, workers))
            if "scaling" in sections:
                section("scaling", lambda: run_scaling_section(args, workers, results,
                                                               markdown))
    finally:
        for worker in workers.values():
            worker.close()
    if "statemachine" in sections:
        section("statemachine", lambda: run_statemachine_section(results, markdown))
    for name in ("attention", "engine"):
        if name in sections:
            section(name, lambda name=name: run_tensor_section(name, args, results, markdown))

    results["sections"] = outcome
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"results: {args.json}")
    if args.markdown:
        args.markdown.write_text("\n".join(markdown) + "\n")
        print(f"tables: {args.markdown}")
    print("\nsections: " + ", ".join(f"{name} {state}" for name, state in outcome.items()))
    return 1 if any(state.startswith("failed") for state in outcome.values()) else 0


def run_traces_section(args, workers, results: dict, markdown: list[str]) -> None:
    classes = ([c for c in args.classes.split(",") if c] or
               sorted(p.name for p in TRACES.iterdir() if p.is_dir()))
    modes = [m for m in args.modes.split(",") if m]
    repeats = args.repeats or TRACE_REPEATS
    print(f"\n== traces: {len(classes)} classes, {repeats} alternated runs of "
          f"{args.passes} passes, modes {modes}")
    results["traces"] = run_traces(workers, classes, repeats, args.passes, modes)
    for mode in modes:
        table = traces_table(results["traces"][mode], "vllm" in workers)
        title = (f"Recorded traces, mode `{mode}` ({TRACE_MODES[mode]}); ms per pass "
                 "over a class's traces, min / **median** / max; ratio = kvref "
                 "median / vLLM median")
        print(f"\n{title}\n{table}")
        markdown += ["", f"### {title}", "", table]


def run_ops_section(args, workers) -> None:
    classes = ([c for c in args.classes.split(",") if c] or
               sorted(p.name for p in TRACES.iterdir() if p.is_dir()))
    print(f"\n== ops: per-op time (each call timed alone), {args.passes} passes")
    for cls in classes:
        print(ops_table(cls, {side: w.ask(cmd="by_op", cls=cls, passes=args.passes)
                              for side, w in workers.items()}))


def run_scaling_section(args, workers, results: dict, markdown: list[str]) -> None:
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    print(f"\n== scaling: pools of {sizes} blocks, {args.requests} requests per run")
    results["scaling"] = run_scaling(workers, sizes, args.repeats or SCALING_REPEATS,
                                     args.requests)
    table = scaling_table(results["scaling"], sizes)
    print(table)
    markdown += ["", "### Per-call cost vs pool size (median of runs)", "", table]
    try:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(results["scaling"], sizes, results.get("traces"), args.plot)
        print(f"plot: {args.plot}")
    except ModuleNotFoundError as error:      # the tables above still stand
        print(f"plot: not drawn, {error.name} is not installed "
              "(pip install -e '.[tutorials]' brings it)")


def run_statemachine_section(results: dict, markdown: list[str]) -> None:
    import statemachine
    statemachine.machines()          # ModuleNotFoundError here when hypothesis is missing
    print("\n== statemachine: steps per second of the manager machine")
    rows = []
    for name, machine in sorted(statemachine.machines().items()):
        n, wall, cpu = statemachine.steps_per_second(machine, examples=20, steps=50)
        rows.append((name, n, n / wall, n / cpu))
        print(f"  {name:40s} {n:5d} steps {n / wall:7.0f}/s wall {n / cpu:7.0f}/s CPU",
              flush=True)
    results["statemachine"] = {name: {"steps": n, "per_s_wall": w, "per_s_cpu": c}
                               for name, n, w, c in rows}
    total = sum(r[1] for r in rows) / sum(r[1] / r[2] for r in rows)
    markdown += ["", "### State machine throughput", "",
                 f"{sum(r[1] for r in rows)} steps over {len(rows)} configs: "
                 f"**{total:.0f} steps/s** (wall), from "
                 f"{min(r[2] for r in rows):.0f} ({min(rows, key=lambda r: r[2])[0]}) to "
                 f"{max(r[2] for r in rows):.0f} ({max(rows, key=lambda r: r[2])[0]})."]


def run_tensor_section(name: str, args, results: dict, markdown: list[str]) -> None:
    print(f"\n== {name}", flush=True)
    module = __import__(name)
    text, data = module.run_for_report(threads=args.torch_threads)
    print(text)
    results[name] = data
    markdown += ["", f"### {name.capitalize()}", "", text]


if __name__ == "__main__":
    sys.exit(main())
