"""Steps per second of the main Hypothesis state machine (the manager driven like vLLM's scheduler).

No vLLM counterpart (benchmark harness). ``tests/stateful`` explores the
manager one scheduler step at a time and checks every invariant after each
step; how far a campaign gets in a given time is this rate. A step here is one
rule (arrive, prefill, decode, preempt, evict, reset, ...) plus the invariant
checks after it, plus Hypothesis' own work of drawing it; the rate is counted
with an extra ``@invariant`` (Hypothesis runs invariants once after the
machine starts and once after every step).

    python benchmarks/statemachine.py               # every config class
    python benchmarks/statemachine.py full mamba_align --examples 10
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def machines() -> dict[str, type]:
    """Config name -> machine class, for every config the suite runs."""
    from tests.stateful import test_kv_cache_manager_machine as module
    found = {}
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, module.SchedulerDrivesManager) \
                and value is not module.SchedulerDrivesManager:
            found[value.config.name if hasattr(value.config, "name") else value.__name__] = value
    return found


def steps_per_second(machine: type, examples: int, steps: int) -> tuple[int, float, float]:
    """``(steps run, wall seconds, process CPU seconds)`` of ``examples`` runs of
    ``machine``, each at most ``steps`` steps, derandomized (the same runs every time)."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import invariant, run_state_machine_as_test

    counts = {"checks": 0, "starts": 0}

    class Counted(machine):
        def __init__(self) -> None:
            super().__init__()
            counts["starts"] += 1

        @invariant()
        def count_step(self) -> None:
            counts["checks"] += 1

    Counted.__name__ = machine.__name__
    config = settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                      derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
    wall0, cpu0 = time.perf_counter(), time.process_time()
    run_state_machine_as_test(Counted, settings=config)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return counts["checks"] - counts["starts"], wall, cpu


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", help="config names (default: all)")
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    available = machines()
    names = args.configs or sorted(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {sorted(available)}")
    print(f"{'config':40s} {'steps':>6s} {'steps/s (wall)':>15s} {'steps/s (cpu)':>14s}")
    for name in names:
        n, wall, cpu = steps_per_second(available[name], args.examples, args.steps)
        print(f"{name:40s} {n:6d} {n / wall:15.0f} {n / cpu:14.0f}")


if __name__ == "__main__":
    main()
