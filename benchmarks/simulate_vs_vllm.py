"""A trace through ``kvref simulate`` and through vLLM 0.25.1's own Scheduler.

The trace is Mooncake's (the vendored ``conversation`` by default) or a plain
JSONL of ``prompt_token_ids`` with, if the user has them, the replies the
server gave (``output_token_ids``). Both sides run the same loop with no model:
the same arrivals (trace timestamps on the same step-time model, or order
only), the same "model" (a request that reaches its last token samples the
next token of its reply, or else the stand-in ``2**30 + position``), and the
same pool. vLLM's side is its real ``vllm.v1.core.sched.scheduler.Scheduler``,
built as ``tools/record_vllm_scheduler.py`` builds it (the project's recorder),
driven in the oracle interpreter and importing nothing of kvref (the trace's
token rule is written out again below). The benchmark requires identical
first-admission hits for every request, identical prefix-cache counters,
steps and preemptions, and prints both times and their ratio::

    python benchmarks/simulate_vs_vllm.py --max-requests 300          # a slice
    python benchmarks/simulate_vs_vllm.py                             # the whole trace
    python benchmarks/simulate_vs_vllm.py --kvref-only                # no vLLM needed

Pool: ``--kv-cache-tokens`` (default 450,880: kvref's sizing of a
Llama-3-8B-shaped model on one 80 GiB GPU at utilization 0.9, block 16).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ORACLE_PYTHON = Path("/root/.cache/vllm-oracle/bin/python")
OUTPUT_TOKEN_BASE = 1 << 30          # kvref.simulate.engine.OUTPUT_TOKEN_BASE
TRACES = {"conversation": REPO / "kvref/data/mooncake/conversation_trace.jsonl.gz",
          "synthetic": REPO / "kvref/data/mooncake/synthetic_trace.jsonl.gz"}


def arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="conversation")
    p.add_argument("--max-requests", type=int)
    p.add_argument("--arrivals", choices=["timestamps", "order"], default="timestamps")
    p.add_argument("--kv-cache-tokens", type=int, default=450_880)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-output-tokens", type=int)
    p.add_argument("--step-base-ms", type=float, default=10.0)
    p.add_argument("--step-ms-per-token", type=float, default=0.04)
    p.add_argument("--kvref-only", action="store_true")
    p.add_argument("--vllm-side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", type=Path, help="write both sides' summaries here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------
# The trace, read without kvref (the vLLM side must not import it).


def read_trace(args) -> list[dict]:
    path = TRACES.get(args.trace, Path(args.trace))
    opener = gzip.open if str(path).endswith(".gz") else open
    rows = []
    with opener(path, "rt") as f:
        for i, line in enumerate(f):
            if args.max_requests is not None and len(rows) >= args.max_requests:
                break
            if not line.strip():
                continue
            obj = json.loads(line)
            if "prompt_token_ids" in obj:           # a plain line (kvref.simulate.traces)
                reply = obj.get("output_token_ids")
                out = len(reply) if reply else obj.get("max_tokens", 1)
                arrival = obj.get("arrival_s", obj.get("timestamp", 0) / 1000.0)
                row = {"id": str(obj.get("request_id", f"r{i}")),
                       "tokens": obj["prompt_token_ids"],
                       "P": len(obj["prompt_token_ids"]), "reply": reply, "t": arrival}
            else:
                out = max(obj.get("output_length", 1), 1)
                row = {"id": f"r{i}", "ids": obj["hash_ids"], "P": obj["input_length"],
                       "reply": None, "t": obj.get("timestamp", 0) / 1000.0}
            if args.max_output_tokens is not None:
                out = min(out, args.max_output_tokens)
            rows.append(row | {"out": out})
    return rows


def prompt(row) -> list[int]:
    """kvref.simulate.traces.mooncake_prompt, written out again (a plain line: its own)."""
    if "tokens" in row:
        return list(row["tokens"])
    tokens: list[int] = []
    for b in row["ids"]:
        tokens.extend(range(1000 + 512 * b, 1000 + 512 * b + 512))
    return tokens[:row["P"]]


# ---------------------------------------------------------------------------
# vLLM's side (run in the oracle interpreter).


def vllm_side(args) -> dict:
    sys.path.insert(0, str(REPO / "tools"))
    import record_vllm_scheduler as rec
    rec.load_vllm(rec.DEFAULT_SRC)
    from vllm.utils.math_utils import cdiv
    from vllm.v1.outputs import ModelRunnerOutput

    rows = read_trace(args)
    max_model_len = max(r["P"] + r["out"] for r in rows)
    num_blocks = cdiv(args.kv_cache_tokens, args.block_size) + 1
    with tempfile.TemporaryDirectory() as model_dir:
        # A config only (no weights): vLLM's ModelConfig reads it; the scheduler needs
        # max_position_embeddings >= max_model_len.
        Path(model_dir, "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
            "num_hidden_layers": 2, "vocab_size": 1024,
            "max_position_embeddings": max(max_model_len, 4096), "rms_norm_eps": 1e-5,
            "torch_dtype": "float16", "eos_token_id": 2}))
        config = dict(block_size=args.block_size, num_blocks=num_blocks,
                      groups=[{"kind": "full"}], max_model_len=max_model_len,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs, long_prefill_token_threshold=0,
                      watermark=0.0, enable_prefix_caching=True,
                      scheduler_reserve_full_isl=True, async_scheduling=False,
                      speculative=None, vocab_size=1024, eos_token_id=None)
        run = rec.VllmRun(config, Path(model_dir))
    sched = run.scheduler
    started = time.perf_counter()
    pending = deque(sorted(rows, key=lambda r: r["t"]) if args.arrivals == "timestamps"
                    else rows)
    hits: dict[str, int] = {}
    replies = {r["id"]: r["reply"] for r in rows if r["reply"]}
    totals = dict(queries=0, prefix_hits=0, preempted_queries=0, preempted_hits=0)
    clock = 0.0
    steps = 0

    prompt_tokens = 0

    def add(r):
        nonlocal prompt_tokens
        if r["P"] >= max_model_len:
            return
        prompt_tokens += r["P"]
        run.add_request(r["id"], prompt(r), {"max_tokens": r["out"], "ignore_eos": True})

    while pending or sched.has_requests():
        if args.arrivals == "order":
            while pending and not sched.has_unfinished_requests():
                add(pending.popleft())
        else:
            if pending and not sched.has_requests():
                clock = max(clock, pending[0]["t"])
            while pending and pending[0]["t"] <= clock:
                add(pending.popleft())
        if not sched.has_requests():
            continue
        out = sched.schedule()
        for new in out.scheduled_new_reqs:
            hits[new.req_id] = new.num_computed_tokens
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = sched.requests[rid]
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])
                continue
            reply = replies.get(rid)
            position = request.num_tokens - request.num_prompt_tokens
            sampled.append([reply[position]] if reply and position < len(reply)
                           else [OUTPUT_TOKEN_BASE + request.num_tokens])
        engine_outputs = sched.update_from_output(out, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled))
        # vLLM hands its counters out each step (make_stats, scheduler.py:1840-1849,
        # restarting them: make_prefix_cache_stats); the Prometheus counters add them up.
        for eco in engine_outputs.values():
            if eco.scheduler_stats is not None:
                p = eco.scheduler_stats.prefix_cache_stats
                totals["queries"] += p.queries
                totals["prefix_hits"] += p.hits
                totals["preempted_queries"] += p.preempted_queries
                totals["preempted_hits"] += p.preempted_hits
        clock += (args.step_base_ms + args.step_ms_per_token
                  * out.total_num_scheduled_tokens) / 1000.0
        steps += 1
    return {"seconds": time.perf_counter() - started, "hits": hits, "steps": steps,
            "hit_ratio_once": sum(hits.values()) / prompt_tokens if prompt_tokens else 0.0,
            **totals}


# ---------------------------------------------------------------------------
# kvref's side.


def kvref_side(args) -> dict:
    sys.path.insert(0, str(REPO))
    from kvref.simulate import StepTime, load_trace, pool_from_tokens, simulate
    from kvref.math_utils import cdiv

    requests = load_trace(args.trace, max_requests=args.max_requests)
    pool = pool_from_tokens(cdiv(args.kv_cache_tokens, args.block_size) + 1,
                            block_size=args.block_size)
    started = time.perf_counter()
    result = simulate(requests, pool, arrivals=args.arrivals,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs, max_output_tokens=args.max_output_tokens,
                      step_time=StepTime(args.step_base_ms, args.step_ms_per_token))
    return {"seconds": time.perf_counter() - started, "hits": result.per_request_hits,
            "steps": result.num_steps, "queries": result.prefix_cache_queries,
            "prefix_hits": result.prefix_cache_hits,
            "preempted_queries": result.preempted_prefix_cache_queries,
            "preempted_hits": result.preempted_prefix_cache_hits,
            "summary": {k: v for k, v in result.to_json().items() if k != "pool"}}


def main(argv=None) -> int:
    args = arguments(argv)
    if args.vllm_side:
        json.dump(vllm_side(args), sys.stdout)
        return 0
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])
                 if a not in ("--kvref-only",)]
    n = args.max_requests or "all"
    print(f"{args.trace} trace, {n} requests, arrivals {args.arrivals}, "
          f"{args.kv_cache_tokens:,} tokens of KV cache (block {args.block_size})", flush=True)
    k = kvref_side(args)
    s = k["summary"]
    print(f"kvref simulate : {k['seconds']:7.1f} s  ({k['steps']:,} steps, "
          f"{s['num_preemptions']:,} preemptions, hit ratio once {s['hit_ratio_once']:.3f}, "
          f"vLLM's hit rate {s['prefix_cache_hit_rate']:.3f})", flush=True)
    if args.kvref_only:
        return 0
    if not ORACLE_PYTHON.exists():
        print(f"no vLLM oracle at {ORACLE_PYTHON} (tools/setup_vllm_venv.py); "
              "ran kvref only", file=sys.stderr)
        return 1
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run([str(ORACLE_PYTHON), __file__, "--vllm-side", *forwarded],
                          capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    v = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"vLLM Scheduler : {v['seconds']:7.1f} s  ({v['steps']:,} steps)")
    print(f"vLLM Scheduler hit ratio once {v['hit_ratio_once']:.3f} (kvref "
          f"{s['hit_ratio_once']:.3f})")
    print(f"kvref / vLLM   : {k['seconds'] / v['seconds']:.2f}x the time")
    same = {key: k[key] == v[key] for key in ("hits", "steps", "queries", "prefix_hits",
                                                "preempted_queries", "preempted_hits")}
    differing = [r for r in k["hits"] if k["hits"][r] != v["hits"].get(r)]
    print(f"per-request first-admission hits identical: {same['hits']} "
          f"({len(k['hits']):,} requests, {len(differing)} differ)")
    for key in ("steps", "queries", "prefix_hits", "preempted_queries", "preempted_hits"):
        print(f"{key:>17}: kvref {k[key]:>12,}  vLLM {v[key]:>12,}  "
              f"{'identical' if same[key] else 'DIFFERENT'}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": vars(args) | {"json_out": None},
                                             "kvref": k, "vllm": v}, default=str))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
