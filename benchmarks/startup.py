"""How long ``kvref --version`` and ``kvref --help`` take to start, beside the floors.

Each command runs ``--repeats`` times in a fresh process, the commands taking turns
(so a slow spell of the machine hits them all); the median and the fastest are
printed, with two floors measured the same way: an empty Python, and ``import torch``
where torch is installed (what every command paid before it imported torch only
where the tensors are). ``--no-torch`` runs kvref with ``import torch`` refused, as
in a base install. Nothing here asserts a time.

    python3 benchmarks/startup.py                 # --repeats 15
    python3 benchmarks/startup.py --json benchmarks/out/startup.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Refuses torch the way a missing package does, then runs kvref's CLI.
NO_TORCH = ("import sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "from kvref.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")


def commands(no_torch: bool) -> dict[str, list[str]]:
    kvref = [sys.executable, "-c", NO_TORCH] if no_torch else [sys.executable, "-m", "kvref"]
    runs = {"python -c pass (floor)": [sys.executable, "-c", "pass"],
            "kvref --version": [*kvref, "--version"],
            "kvref --help": [*kvref, "--help"]}
    if importlib.util.find_spec("torch") is not None:
        runs["python -c 'import torch'"] = [sys.executable, "-c", "import torch"]
    return runs


def measure(runs: dict[str, list[str]], repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, argv in runs.items():
            start = time.perf_counter()
            subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-torch", action="store_true",
                        help="refuse `import torch` in kvref's process, as a base install does")
    parser.add_argument("--json", metavar="FILE", help="also write the times here")
    args = parser.parse_args(argv)
    times = measure(commands(args.no_torch), args.repeats)
    print(f"{'command':<28} {'median':>8} {'fastest':>8}   ({args.repeats} runs each, "
          f"{'torch refused' if args.no_torch else 'torch as installed'})")
    for name, samples in times.items():
        print(f"{name:<28} {statistics.median(samples):>7.3f}s {min(samples):>7.3f}s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"python": sys.version.split()[0],
                                               "no_torch": args.no_torch,
                                               "seconds": times}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
