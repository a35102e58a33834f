"""Two sides of the KV layer in one process, alternating trace by trace.

No vLLM counterpart (benchmark harness). ``run.py`` gives each side its own
worker process. On a machine whose speed swings (this one's changed by up to
2x from one run to the next), the ratio of the two sides' medians then moves by
several percent between runs. Here both sides live in one process and every
trace is replayed by one side, then by the other (which goes first alternates),
so a swing falls on both. Use it to see whether a change to kvref moved the
ratio; the README's tables come from ``run.py``.

vLLM's python imports this checkout's kvref (the project root goes on
``sys.path``), so it can hold both::

    /root/.cache/vllm-oracle/bin/python benchmarks/one_process.py --classes no_caching,full
    python3 benchmarks/one_process.py --sides kvref,kvref --classes full   # A/A: the noise

Prints, per class and mode: each side's median ms per pass over the class's
traces, the ratio of the medians, and the median of the per-run ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys

# The workers' module: importing it puts the project root on sys.path, and its
# load_class parses and freezes a class's traces as a worker does.
from worker import TRACES, load_class, replay, sides


def compare(side_a, side_b, traces: list[dict], repeats: int, prebuild: bool
            ) -> dict[str, list[float]]:
    """CPU seconds per run for each side (``"a"``, ``"b"``): a run replays every
    trace once on each side, trace by trace, side A first in even runs."""
    runs: dict[str, list[float]] = {"a": [], "b": []}
    for run in range(repeats):
        order = [("a", side_a), ("b", side_b)]
        if run % 2:
            order.reverse()
        totals = {"a": 0.0, "b": 0.0}
        for trace in traces:
            for name, side in order:
                _wall, cpu, _ops, _raised = replay.time_trace(side, trace, prebuild)
                totals[name] += cpu
        for name in runs:
            runs[name].append(totals[name])
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", default="kvref,vllm",
                        help="two of kvref, vllm, comma-separated (default kvref,vllm)")
    parser.add_argument("--classes", default="",
                        help="comma-separated trace classes (default: all)")
    parser.add_argument("--modes", default="prebuilt,calls",
                        help="prebuilt (requests built before the clock), calls, or both")
    parser.add_argument("--repeats", type=int, default=10, help="runs per class and mode")
    args = parser.parse_args(argv)

    names = args.sides.split(",")
    if len(names) != 2:
        parser.error("--sides takes two names, e.g. kvref,vllm")
    modes = args.modes.split(",")
    unknown = set(modes) - {"prebuilt", "calls"}
    if unknown:
        parser.error(f"unknown mode(s) {sorted(unknown)}: use prebuilt, calls")
    classes = (args.classes.split(",") if args.classes
               else sorted(p.name for p in TRACES.iterdir() if p.is_dir()))
    missing = [c for c in classes if not (TRACES / c).is_dir()]
    if missing:
        parser.error(f"no trace class {missing} in {TRACES}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    try:
        side_a, side_b = (sides.get_side(name) for name in names)
    except ImportError as exc:
        print(f"cannot build the sides {names}: {type(exc).__name__}: {exc}\n"
              "(the vLLM side needs vLLM's python, e.g. "
              "/root/.cache/vllm-oracle/bin/python)", file=sys.stderr)
        return 2

    a, b = names
    print(f"{'class':24s} {'mode':8s} {a + ' ms':>10s} {b + ' ms':>10s} "
          f"{'ratio of medians':>17s} {'median ratio':>13s}")
    loaded: dict = {}
    for cls in classes:
        traces = load_class(cls, loaded)
        for mode in modes:
            runs = compare(side_a, side_b, traces, args.repeats, mode == "prebuilt")
            med_a, med_b = statistics.median(runs["a"]), statistics.median(runs["b"])
            paired = statistics.median(x / y for x, y in zip(runs["a"], runs["b"]))
            print(f"{cls:24s} {mode:8s} {med_a * 1e3:10.2f} {med_b * 1e3:10.2f} "
                  f"{med_a / med_b:17.3f} {paired:13.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
