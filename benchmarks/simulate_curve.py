"""The capacity curve of a Mooncake trace through ``kvref simulate`` (docs/simulate.md).

Hit ratio (prompt tokens served from the cache, each request once) against KV
cache capacity, order-only arrivals as the paper's Figure 9, outputs capped at
one token (a Mooncake trace has no output tokens, so they never hit), and the
maximum (a pool that never evicts) dashed. Writes ``simulate_curve.json`` and
``simulate_curve.png`` beside this file::

    python benchmarks/simulate_curve.py                       # whole conversation trace
    python benchmarks/simulate_curve.py --max-requests 2000 --workers 2
    python benchmarks/simulate_curve.py --ray-address auto    # on a Ray cluster
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kvref.simulate.sweep import (capacity_curve, is_whole_conversation_trace,  # noqa: E402
                                  plot_capacity_curve)

CAPACITIES = [2e5, 5e5, 1e6, 3e6, 1e7, 3e7, 5e7, 1e8]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="conversation")
    parser.add_argument("--max-requests", type=int)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ray-address")
    parser.add_argument("--out", type=Path, default=HERE / "simulate_curve")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def done(p):
        c = p["point"]["kv_cache_tokens"]
        shown = p.get("error") or f"hit ratio {p['hit_ratio_once']:.3f} ({p['wall_seconds']:.0f} s)"
        print(f"  {c:>12,.0f} tokens: {shown}", flush=True)
    curve = capacity_curve(args.trace, CAPACITIES, block_size=args.block_size,
                           max_requests=args.max_requests, workers=args.workers,
                           ray_address=args.ray_address, on_done=done)
    label = f"{args.trace} (block {args.block_size})"
    doc = {"trace": args.trace, "max_requests": args.max_requests,
           "block_size": args.block_size, "wall_seconds": time.perf_counter() - started,
           "points": [{k: v for k, v in p.items() if k != "pool"} for p in curve]}
    for p in doc["points"]:                     # strict JSON: no Infinity
        if p["point"]["kv_cache_tokens"] == float("inf"):
            p["point"]["kv_cache_tokens"] = "inf"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    plot_capacity_curve({label: curve}, str(args.out.with_suffix(".png")),
                        title=f"Mooncake {args.trace} trace through kvref simulate",
                        paper_claims=is_whole_conversation_trace(args.trace, args.max_requests))
    print(f"wrote {args.out.with_suffix('.json')} and .png in {doc['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
