"""kvref's engine against ``transformers`` generating the same prompts one by one.

No vLLM counterpart (benchmark harness). ``kvref.engine.LLM`` batches every
request through one paged KV cache managed by kvref's ``KVCacheManager``
(continuous batching, prefix caching); ``transformers`` ``model.generate``
runs each prompt alone with its own dense cache. Both decode greedily from the
same small random Llama built in memory (nothing is downloaded), the same
prompts (half of them sharing a system prompt, so prefix caching has something
to find), ``max_tokens`` new tokens each. Reported: generated tokens per
second of each, and how many requests produced the same tokens (a benchmark,
not a test: random weights make near-ties, where float rounding may pick a
different argmax).

    python benchmarks/engine.py
    python benchmarks/engine.py --prompts 16 --max-tokens 32 --device cuda
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 512, 256, 4, 8, 4


def tiny_llama(seed: int = 0):
    import torch
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=1024, initializer_range=0.3, attn_implementation="sdpa",
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(64)]
    return [(system if i % 2 == 0 else []) +
            [rng.randrange(VOCAB) for _ in range(rng.randrange(16, 96))] for i in range(n)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def run(num_prompts: int, max_tokens: int, device: str) -> dict:
    import torch
    from kvref.engine import LLM, SamplingParams

    model = tiny_llama().to(device)
    prompts = make_prompts(num_prompts)
    with torch.no_grad():
        _sync(device)
        start = time.perf_counter()
        expected = []
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt], device=device), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens)
            expected.append(out[0, len(prompt):].tolist())
        _sync(device)
        t_hf = time.perf_counter() - start

    llm = LLM(model, device=device)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params)            # warm-up, as transformers warmed up above
    _sync(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    _sync(device)
    t_kvref = time.perf_counter() - start
    got = [o.outputs[0].token_ids for o in outputs]
    tokens = num_prompts * max_tokens
    return {"device": device, "prompts": num_prompts, "max_tokens": max_tokens,
            "kvref_s": t_kvref, "transformers_s": t_hf,
            "kvref_tokens_per_s": tokens / t_kvref, "transformers_tokens_per_s": tokens / t_hf,
            "same_tokens": sum(list(g) == e for g, e in zip(got, expected))}


def use_threads(n: int) -> None:
    # One thread by default: on a small or shared machine torch's OpenMP threads
    # wait milliseconds on each other per small op, which times the waiting.
    import torch
    torch.set_num_threads(n)


def devices() -> list[str]:
    import torch
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def table(rows: list[dict]) -> str:
    import torch
    lines = [f"Random Llama ({LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {KV_HEADS} KV "
             f"heads, vocab {VOCAB}), greedy, CPU threads: {torch.get_num_threads()}.", "",
             "| device | prompts x new tokens | kvref engine tok/s | transformers one by one "
             "tok/s | speed-up | same tokens |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['device']} | {r['prompts']} x {r['max_tokens']} | "
                     f"{r['kvref_tokens_per_s']:.0f} | {r['transformers_tokens_per_s']:.0f} | "
                     f"{r['transformers_s'] / r['kvref_s']:.1f}x | "
                     f"{r['same_tokens']}/{r['prompts']} |")
    return "\n".join(lines)


def run_for_report(num_prompts: int = 16, max_tokens: int = 32,
                   threads: int = 1) -> tuple[str, list[dict]]:
    """``(Markdown table, rows)``; ImportError when kvref.engine or transformers is missing."""
    import transformers  # noqa: F401
    import kvref.engine  # noqa: F401
    use_threads(threads)
    rows = [run(num_prompts, max_tokens, d) for d in devices()]
    return table(rows), rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", action="append", help="cpu, cuda (default: all present)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both sides (default: %(default)s)")
    args = parser.parse_args(argv)
    use_threads(args.threads)
    print(table([run(args.prompts, args.max_tokens, d) for d in args.device or devices()]))


if __name__ == "__main__":
    main()
