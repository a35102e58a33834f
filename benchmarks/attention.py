"""kvref's reference paged attention against dense SDPA on the same shapes.

No vLLM counterpart (benchmark harness). ``kvref.attention.paged_attention``
is written to be read: per request it gathers the keys and values named by
the block table and runs softmax attention. This measures what that clarity
costs against ``torch.nn.functional.scaled_dot_product_attention`` on the same
queries, keys and values laid out densely (one contiguous ``[batch, heads,
seq, head_size]`` tensor, no paging), for a decode batch and a prefill batch,
on the CPU and on CUDA when present. Each case also reports the largest
difference between the two outputs (it is a benchmark, not a test; the tests
are in ``tests/``).

    python benchmarks/attention.py                   # every case, every device
    python benchmarks/attention.py --device cpu --repeats 5
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


def _median_seconds(fn, device: str, repeats: int) -> float:
    fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    from kvref.attention import paged_attention

    dtype = torch.float32
    paged, dense = build_case(num_reqs, context, query_len, device, dtype)

    def run_paged():
        return paged_attention(**paged)

    def run_dense():
        return F.scaled_dot_product_attention(dense["query"], dense["key"], dense["value"],
                                              attn_mask=dense["attn_mask"],
                                              scale=paged["scale"])

    with torch.no_grad():
        t_paged = _median_seconds(run_paged, device, repeats)
        t_dense = _median_seconds(run_dense, device, repeats)
        want = run_dense().transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_SIZE)
        diff = (run_paged() - want).abs().max().item()
    tokens = num_reqs * query_len
    return {"case": name, "device": device, "paged_ms": t_paged * 1e3,
            "sdpa_ms": t_dense * 1e3, "ratio": t_paged / t_dense,
            "paged_tokens_per_s": tokens / t_paged, "max_abs_diff": diff}


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


def table(rows: list[dict]) -> str:
    import torch
    lines = [f"Heads {NUM_HEADS} (KV heads {NUM_KV_HEADS}), head size {HEAD_SIZE}, block size "
             f"{BLOCK_SIZE}, float32, median of runs, CPU threads: {torch.get_num_threads()}.",
             "",
             "| case | device | kvref paged ms | SDPA dense ms | paged / SDPA | max abs diff |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['device']} | {r['paged_ms']:.2f} | {r['sdpa_ms']:.2f}"
                     f" | {r['ratio']:.1f} | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def run_for_report(repeats: int = 5, threads: int = 1) -> tuple[str, list[dict]]:
    """``(Markdown table, rows)``; ImportError when torch or kvref.attention is missing."""
    import kvref.attention  # noqa: F401  (ImportError: the tensor side is not installed)
    use_threads(threads)
    rows = run_all(devices(), repeats)
    return table(rows), rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", action="append", help="cpu, cuda (default: all present)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both sides (default: %(default)s)")
    args = parser.parse_args(argv)
    use_threads(args.threads)
    print(table(run_all(args.device or devices(), args.repeats)))


if __name__ == "__main__":
    main()
