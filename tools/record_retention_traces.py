#!/usr/bin/env python3
"""Record kvtrace/1 traces on the real vLLM 0.25.1 with a prefix-cache retention interval.

The traces under ``tests/conformance/traces/retention/`` come from here. It
runs the workplace's trace generator (``gen.py`` of the conformance tools:
a model of vLLM's scheduler driving vLLM's real ``KVCacheManager``, each op
recorded with vLLM's answer) unchanged, with one addition: just after a
trace's config is drawn, and before vLLM's manager is built from it, an
interval is drawn for it (``k * scheduler_block_size`` tokens, ``k`` in
0, 3, 4), written into the header as ``prefix_cache_retention_interval``
and set as ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``, which is how vLLM reads
it. kvref's replayer passes the header key as ``retention_interval=``.
The tools' vLLM backend refuses to start with that variable set (their
traces are all recorded without it); this tool lifts that one guard by
handing the backend's check a view of ``vllm.envs`` that reports it unset,
while vLLM's coordinator reads the real variable.

This is a recording tool, run by hand in the oracle environment; nothing in
the project imports it, and a clone without the conformance tools cannot run
it (as for the other recorded traces, see ``tests/conformance/README.md``).
The project's own recorder checks them without those tools: ``PYTHONPATH=$PWD
$PY tools/record_vllm_traces.py --rerecord tests/conformance/traces/retention``
runs their ops on vLLM again (the header key set as the variable) and finds
the same answers::

    /root/.cache/vllm-oracle/bin/python tools/record_retention_traces.py \\
        --conformance-tools ../shared/conformance --out tests/conformance/traces/retention
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
HEADER_KEY = "prefix_cache_retention_interval"
# Bigger pools and more repeated prompts than the public profile: more
# blocks outlive their request, so more hits land on retained tails.
KNOBS = {"num_blocks": (24, 64), "p_repeat": 0.35, "p_multiturn": 0.4}
# The seeds (7000-7008 tried) whose interval changes what vLLM caches; on the
# others every window block is some tail anyway (window >= interval).
# tests/conformance requires each vendored trace to diverge when replayed dense.
SEEDS = {"hybrid_full_swa": [7001, 7003, 7004, 7005, 7007],
         "hybrid_full_mamba": [7000, 7002, 7004, 7005, 7006]}


class _EnvsWithoutRetention:
    """``vllm.envs`` as the backend's startup check should see it: the
    retention variable unset, everything else as it is."""

    def __init__(self, envs) -> None:
        self._envs = envs

    def __getattr__(self, name: str):
        return None if name == ENV else getattr(self._envs, name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conformance-tools", required=True,
                        help="folder holding gen.py, kvtrace.py and backend_vllm.py")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", help="comma-separated seeds for both classes "
                        "(default: the vendored traces' SEEDS)")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(args.conformance_tools).resolve()))
    import gen  # noqa: E402  (the workplace's generator, on the path just set)
    import kvtrace  # noqa: E402

    draw_config = gen.make_config

    def make_config_with_interval(cls, rng, knobs):
        header, sim = draw_config(cls, rng, knobs)
        step = header["manager"]["scheduler_block_size"]
        # Its own generator: the trace's other draws stay those of gen.py's seed.
        k = random.Random(f"retention:{cls}:{header['hash']['none_hash_seed']}").choice(
            [0, 3, 4])
        header[HEADER_KEY] = k * step
        os.environ[ENV] = str(k * step)
        return header, sim

    gen.make_config = make_config_with_interval
    backend = kvtrace.load_backend("vllm")
    backend.envs = _EnvsWithoutRetention(backend.envs)
    out = Path(args.out)
    for cls in SEEDS:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else SEEDS[cls]
        for seed in seeds:
            target = random.Random(f"len:{cls}:{seed}").randint(190, 400)
            name = f"retention-{cls}-{seed:05d}"
            trace = gen.generate(cls, seed, target, name, "public", KNOBS)
            kvtrace.save_trace(trace, out / f"{name}.json.gz")
            print(f"{name}: {len(trace['ops'])} ops, "
                  f"interval {trace['header'][HEADER_KEY]}")
    os.environ.pop(ENV, None)


if __name__ == "__main__":
    main()
