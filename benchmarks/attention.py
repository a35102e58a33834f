"""Paged attention, both kvref paths, against dense SDPA on the same data.

No vLLM counterpart (benchmark harness). kvref has two paged attentions:
``paged_attention``, the per-request reference written to be read, and
``fast_paged_attention``, what the engine runs (per batch of equal query
lengths, a gather through the block table and ``scaled_dot_product_attention``,
as many requests at a time as fit in the CPU's cache; planning included).
Both are timed against ``torch.nn.functional.scaled_dot_product_attention`` on
the same queries, keys and values laid out densely (one contiguous ``[batch,
heads, seq, head_size]`` tensor, no paging), in two forms: keys repeated per
query head with a boolean mask (what ``transformers``' SDPA attention does
when a mask is given, ``repeat_kv``), and keys not repeated (``enable_gqa``).
The runs alternate (reference, fast, dense, dense GQA, dense GQA, dense, ...);
medians of process CPU time on the CPU (the wall clock also times the other
jobs of a shared machine; both are kept in the JSON), wall time with a
synchronise on CUDA. Each row also reports the largest difference from dense
(a benchmark, not a test: the tests are in ``tests/tensor``).

    python benchmarks/attention.py                   # every case, every device
    python benchmarks/attention.py --device cpu --repeats 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (name, requests, context tokens already cached, new query tokens per request)
CASES = (
    ("decode  32 x 1 over 1024", 32, 1024, 1),
    ("decode   8 x 1 over 4096", 8, 4096, 1),
    ("prefill  4 x 512", 4, 0, 512),
    ("chunked  4 x 128 over 512", 4, 512, 128),
)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 16, 4, 64, 16


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def _clock(device: str) -> tuple[float, float]:
    _sync(device)
    return time.perf_counter(), time.process_time()


def time_alternated(fns: dict, device: str, repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds of each function, run in turn ``repeats`` times
    after one warm-up each, the order reversed every other time (a, b, c, c, b,
    a, ...: no function always runs right after the same other one)."""
    for fn in fns.values():
        fn()
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for r in range(repeats):
        order = list(fns.items())
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            w0, c0 = _clock(device)
            fn()
            w1, c1 = _clock(device)
            wall[name].append(w1 - w0)
            cpu[name].append(c1 - c0)
    return {name: {"wall": statistics.median(wall[name]), "cpu": statistics.median(cpu[name])}
            for name in fns}


def build_case(num_reqs: int, context: int, query_len: int, device: str, dtype):
    """The paged inputs and the same data dense; blocks are handed out shuffled,
    as a pool that has been in use a while would hand them out."""
    import torch
    from kvref.attention import write_kv
    from kvref.math_utils import cdiv

    gen = torch.Generator().manual_seed(0)
    seq_len = context + query_len
    blocks_per_req = cdiv(seq_len, BLOCK_SIZE)
    num_blocks = num_reqs * blocks_per_req + 1            # + the null block
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    block_table = perm.reshape(num_reqs, blocks_per_req).to(device)
    keys = torch.randn(num_reqs, seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(device, dtype)
    values = torch.randn(num_reqs, seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(device, dtype)
    query = torch.randn(num_reqs * query_len, NUM_HEADS, HEAD_SIZE, generator=gen).to(device, dtype)
    kv_cache = torch.zeros(num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE,
                           device=device, dtype=dtype)
    pos = torch.arange(seq_len, device=device)
    slots = (block_table[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    write_kv(kv_cache, keys.reshape(-1, NUM_KV_HEADS, HEAD_SIZE),
             values.reshape(-1, NUM_KV_HEADS, HEAD_SIZE), slots)
    paged = dict(query=query, kv_cache=kv_cache,
                 query_start_loc=torch.arange(0, (num_reqs + 1) * query_len, query_len,
                                              device=device),
                 seq_lens=torch.full((num_reqs,), seq_len, device=device),
                 block_table=block_table, scale=HEAD_SIZE ** -0.5)
    # Dense: [batch, heads, tokens, head_size], kv heads repeated for GQA.
    group = NUM_HEADS // NUM_KV_HEADS
    dense = dict(
        query=query.reshape(num_reqs, query_len, NUM_HEADS, HEAD_SIZE).transpose(1, 2),
        key=keys.repeat_interleave(group, dim=2).transpose(1, 2).contiguous(),
        value=values.repeat_interleave(group, dim=2).transpose(1, 2).contiguous())
    # The queries are the last positions: causal with an offset, as a boolean mask.
    q_pos = torch.arange(context, seq_len, device=device)
    dense["attn_mask"] = pos[None, :] <= q_pos[:, None]
    return paged, dense


def run_case(name, num_reqs, context, query_len, device, repeats) -> dict:
    import torch
    import torch.nn.functional as F
    from kvref.attention import KVGatherBuffer, fast_paged_attention, paged_attention

    dtype = torch.float32
    paged, dense = build_case(num_reqs, context, query_len, device, dtype)
    group = NUM_HEADS // NUM_KV_HEADS
    # The same keys once per KV head, for SDPA's own grouped-query path.
    key_gqa = dense["key"][:, ::group].contiguous()
    value_gqa = dense["value"][:, ::group].contiguous()
    buffer = KVGatherBuffer()

    fns = {
        "reference": lambda: paged_attention(**paged),
        "fast": lambda: fast_paged_attention(**paged, buffer=buffer),
        "dense": lambda: F.scaled_dot_product_attention(
            dense["query"], dense["key"], dense["value"], attn_mask=dense["attn_mask"],
            scale=paged["scale"]),
        "dense_gqa": lambda: F.scaled_dot_product_attention(
            dense["query"], key_gqa, value_gqa, attn_mask=dense["attn_mask"],
            scale=paged["scale"], enable_gqa=True),
    }
    with torch.no_grad():
        times = time_alternated(fns, device, repeats)
        want = fns["dense"]().transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_SIZE)
        diff = {name: (fns[name]() - want).abs().max().item() for name in ("reference", "fast")}
    kind = "wall" if device.startswith("cuda") else "cpu"
    ms = {name: t[kind] * 1e3 for name, t in times.items()}
    return {"case": name, "device": device, "clock": kind, "ms": ms, "times_s": times,
            "fast_over_dense": ms["fast"] / ms["dense"],
            "fast_over_dense_gqa": ms["fast"] / ms["dense_gqa"],
            "reference_over_dense": ms["reference"] / ms["dense"],
            "max_abs_diff": diff}


def use_threads(n: int) -> None:
    # One thread by default: on a small or shared machine torch's OpenMP threads
    # wait milliseconds on each other per small op, which times the waiting.
    import torch
    torch.set_num_threads(n)


def devices() -> list[str]:
    import torch
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run_all(device_list, repeats: int) -> list[dict]:
    return [run_case(*case, device, repeats) for device in device_list for case in CASES]


def table(rows: list[dict], repeats: int) -> str:
    import torch
    lines = [f"Heads {NUM_HEADS} (KV heads {NUM_KV_HEADS}), head size {HEAD_SIZE}, block size "
             f"{BLOCK_SIZE}, float32, blocks handed out shuffled; median of {repeats} "
             f"alternated runs (process CPU time on the CPU); CPU threads: "
             f"{torch.get_num_threads()}. Dense: SDPA on contiguous keys, repeated per query "
             "head (`repeat_kv`, as transformers does with a mask); dense GQA: not repeated "
             "(`enable_gqa`).",
             "",
             "| case | device | reference ms | fast ms | dense ms | dense GQA ms "
             "| **fast / dense** | fast / dense GQA | reference / dense | max abs diff |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["ms"]
        lines.append(f"| {r['case']} | {r['device']} | {m['reference']:.1f} | {m['fast']:.1f} | "
                     f"{m['dense']:.1f} | {m['dense_gqa']:.1f} | **{r['fast_over_dense']:.2f}** | "
                     f"{r['fast_over_dense_gqa']:.2f} | {r['reference_over_dense']:.1f} | "
                     f"{max(r['max_abs_diff'].values()):.1e} |")
    if not any(r["device"].startswith("cuda") for r in rows):
        lines.append("| (every case) | cuda | skipped: no GPU present | | | | | | | |")
    return "\n".join(lines)


def run_for_report(repeats: int = 6, threads: int = 1) -> tuple[str, list[dict]]:
    """``(Markdown table, rows)``; ImportError when torch or kvref.attention is missing."""
    import kvref.attention  # noqa: F401  (ImportError: the tensor side is not installed)
    use_threads(threads)
    rows = run_all(devices(), repeats)
    return table(rows, repeats), rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", action="append", help="cpu, cuda (default: all present)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both sides (default: %(default)s)")
    args = parser.parse_args(argv)
    use_threads(args.threads)
    print(table(run_all(args.device or devices(), args.repeats), args.repeats))


if __name__ == "__main__":
    main()
