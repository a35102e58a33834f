"""kvref's engine against the two ways ``transformers`` batches generation, side by side.

No vLLM counterpart (benchmark harness). Three engines decode greedily from
the same random Llama (built in memory: nothing is downloaded), the same
prompts, ``max_tokens`` new tokens each (no early stop):

- ``kvref``: ``kvref.engine.LLM.generate``, continuous batching over kvref's
  paged KV cache and ``KVCacheManager`` (prefix caching on);
- ``generate``: ``transformers`` ``model.generate`` on the whole batch at once,
  left-padded, with a dense static cache allocated once for the batch;
- ``generate_batch``: ``transformers``' own continuous batching
  (``transformers.generation.continuous_batching``), a paged cache with block
  sharing, given kvref's KV cache size (the same number of blocks of the same
  number of tokens) and kvref's token budget per step, so that it does not
  size its cache for the whole machine.

Two model shapes (the 4-layer toy of the tests, and 12 layers x hidden 768,
where the model's arithmetic dominates) and two prompt sets (every prompt
opens with the same 48-token system prompt, or none does). The engines take
turns (kvref, generate, generate_batch, kvref, ...) and each figure is the
median of the turns. Reported: generated tokens per second of process CPU
time (one torch thread; the wall clock on a shared machine also times the
other jobs, it is kept in the JSON), the mean time to first token (wall
clock: ``generate_batch`` stamps its tokens with it), how many requests gave
the same tokens as kvref, and kvref's step split: the model's forward pass
(embedding to logits, paged attention included) against everything else in
a step (scheduler, KV cache manager, block table, input and metadata
preparation, sampling, output bookkeeping).

    python benchmarks/engine.py
    python benchmarks/engine.py --models toy --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# name: (layers, hidden, heads, KV heads, intermediate, vocab)
MODELS = {
    "toy": (4, 256, 8, 4, 512, 512),
    "12L": (12, 768, 12, 4, 2048, 2048),
}
PROMPT_SETS = ("shared prefix", "no shared prefix")
SYSTEM_PROMPT_TOKENS = 48
BLOCK_SIZE = 16
NUM_BLOCKS = 256
MAX_BATCHED_TOKENS = 2048
ENGINES = ("kvref", "generate", "generate_batch")


def make_model(name: str, seed: int = 0):
    import torch
    import transformers
    layers, hidden, heads, kv_heads, inter, vocab = MODELS[name]
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=1024, initializer_range=0.3 if name == "toy" else 0.05,
        attn_implementation="sdpa", eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()




def make_prompts(n: int, vocab: int, shared: bool, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(SYSTEM_PROMPT_TOKENS)]
    return [(system if shared else [rng.randrange(vocab) for _ in range(SYSTEM_PROMPT_TOKENS)])
            + [rng.randrange(vocab) for _ in range(rng.randrange(8, 56))] for _ in range(n)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


class _Clock:
    """Wall and process CPU time since it was made."""

    def __init__(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    def now(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall0, time.process_time() - self.cpu0


# -- the three engines ---------------------------------------------------------


class KvrefEngine:
    """``LLM.generate``, with timers around the parts of each step."""

    def __init__(self, model, device: str) -> None:
        from kvref.engine import LLM, SamplingParams
        self.llm = LLM(model, device=device, block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
                       max_num_batched_tokens=MAX_BATCHED_TOKENS)
        self.params = SamplingParams
        self.device = device
        self.split = {"step": 0.0, "forward": 0.0}
        self.first_token: dict[str, float] = {}
        core, runner = self.llm.engine_core, self.llm.model_runner
        net = runner.model
        step, compute_logits = core.step, net.compute_logits

        def timed_step():
            c0 = time.process_time()
            out = step()
            self.split["step"] += time.process_time() - c0
            now = time.perf_counter()
            for req_id, tokens in zip(out.model_runner_output.req_ids,
                                      out.model_runner_output.sampled_token_ids):
                if tokens:
                    self.first_token.setdefault(req_id, now)
            return out

        def timed_logits(hidden):
            c0 = time.process_time()
            logits = compute_logits(hidden)
            self.split["forward"] += time.process_time() - c0
            return logits

        start = {}
        net.register_forward_pre_hook(lambda *_: start.__setitem__("cpu", time.process_time()))
        net.register_forward_hook(lambda *_: self.split.__setitem__(
            "forward", self.split["forward"] + time.process_time() - start["cpu"]))
        core.step = timed_step
        net.compute_logits = timed_logits

    def run(self, prompts, max_tokens: int) -> tuple[list[list[int]], list[float]]:
        # A fresh prefix cache per run: a repeat must not hit the previous one's blocks.
        assert self.llm.kv_cache_manager.reset_prefix_cache()
        self.first_token.clear()
        params = self.params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        _sync(self.device)
        ttft = [self.first_token[o.request_id] - t0 for o in outs]
        return [list(o.outputs[0].token_ids) for o in outs], ttft


class GenerateEngine:
    """``model.generate`` on the left-padded batch (dense static cache)."""

    def __init__(self, model, device: str) -> None:
        self.model, self.device = model, device

    def run(self, prompts, max_tokens: int) -> tuple[list[list[int]], list[float]]:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        mask = torch.zeros(len(prompts), width, dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        first = []

        class FirstCall(LogitsProcessor):
            def __call__(self, input_ids, scores):
                if not first:
                    first.append(time.perf_counter())
                return scores

        t0 = time.perf_counter()
        with torch.no_grad():
            # A static cache, allocated once for the padded batch and its new tokens
            # (the default dynamic cache grows step by step; measured no faster).
            out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                      do_sample=False, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, pad_token_id=0,
                                      cache_implementation="static",
                                      logits_processor=LogitsProcessorList([FirstCall()]))
        _sync(self.device)
        # One batch: every request's first token comes with the first forward pass.
        return out[:, width:].tolist(), [first[0] - t0] * len(prompts)


class GenerateBatchEngine:
    """``model.generate_batch``: transformers' continuous batching, kvref's cache size."""

    def __init__(self, model, device: str) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        self.model, self.device = model, device
        self.GenerationConfig = GenerationConfig
        self.cb_config = ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                                                  max_batch_tokens=MAX_BATCHED_TOKENS)
        # It logs that psutil is missing (memory breakdown, offload cap) on every call.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)

    def run(self, prompts, max_tokens: int) -> tuple[list[list[int]], list[float]]:
        config = self.GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                       do_sample=False, eos_token_id=-1, pad_token_id=0)
        out = self.model.generate_batch(prompts, generation_config=config,
                                        continuous_batching_config=self.cb_config,
                                        record_timestamps=True)
        _sync(self.device)
        results = list(out.values())             # in prompt order
        return ([list(r.generated_tokens) for r in results],
                [r.timestamps[0] - r.created_time for r in results])


# -- one case --------------------------------------------------------------------


def turn_order(names: list[str], repeat: int) -> list[str]:
    """The engines in the order run ``repeat`` times them: it starts with engine
    ``repeat mod 3``, so each goes first as often as the others. (In the traces
    section, a fixed order made identical code up to 15% slower in second place.)"""
    k = repeat % len(names)
    return names[k:] + names[:k]


def run_case(model_name: str, shared: bool, num_prompts: int, max_tokens: int, device: str,
             repeats: int) -> dict:
    import torch
    model = make_model(model_name).to(device)
    prompts = make_prompts(num_prompts, MODELS[model_name][5], shared)
    engines = {"kvref": KvrefEngine(model, device), "generate": GenerateEngine(model, device),
               "generate_batch": GenerateBatchEngine(model, device)}
    samples = {name: {"wall": [], "cpu": [], "ttft": []} for name in engines}
    tokens = {}
    split = {"step": [], "forward": []}
    with torch.no_grad():
        for engine in engines.values():                 # warm-up: two prompts each
            engine.run(prompts[:2], 2)
        for repeat in range(repeats):
            for name in turn_order(list(engines), repeat):
                engine = engines[name]
                if name == "kvref":
                    engine.split.update(step=0.0, forward=0.0)
                clock = _Clock()
                tokens[name], ttft = engine.run(prompts, max_tokens)
                wall, cpu = clock.now()
                samples[name]["wall"].append(wall)
                samples[name]["cpu"].append(cpu)
                samples[name]["ttft"].append(statistics.mean(ttft))
                if name == "kvref":
                    for part in split:
                        split[part].append(engine.split[part])
    generated = num_prompts * max_tokens
    row = {"model": model_name, "prompts": "shared prefix" if shared else "no shared prefix",
           "device": device, "num_prompts": num_prompts, "max_tokens": max_tokens,
           "prompt_tokens": sum(map(len, prompts)), "runs": samples}
    for name in engines:
        s = samples[name]
        row[name] = {"tokens_per_s_cpu": generated / statistics.median(s["cpu"]),
                     "tokens_per_s_wall": generated / statistics.median(s["wall"]),
                     "ttft_ms": statistics.median(s["ttft"]) * 1e3,
                     "same_tokens_as_kvref": sum(a == b for a, b in
                                                 zip(tokens[name], tokens["kvref"]))}
    steps = [s for s in split["step"]]
    row["kvref_split"] = {
        "bookkeeping_share": statistics.median(1 - f / s for f, s in
                                               zip(split["forward"], steps)),
        "step_cpu_s": statistics.median(steps), "forward_cpu_s": statistics.median(
            split["forward"])}
    return row


def use_threads(n: int) -> None:
    # One thread by default: on a small or shared machine torch's OpenMP threads
    # wait milliseconds on each other per small op, which times the waiting.
    import torch
    torch.set_num_threads(n)


def devices() -> list[str]:
    import torch
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def table(rows: list[dict], repeats: int) -> str:
    import torch
    shapes = "; ".join(f"{n}: {m[0]} layers x hidden {m[1]}, {m[2]} heads / {m[3]} KV heads, "
                       f"vocab {m[5]}" for n, m in MODELS.items())
    lines = [f"Random Llamas ({shapes}); greedy; blocks of {BLOCK_SIZE} tokens, {NUM_BLOCKS} "
             f"blocks for kvref and generate_batch, {MAX_BATCHED_TOKENS} tokens per step; "
             f"median of {repeats} runs, the engines taking turns to go first; tokens/s of "
             f"process CPU time; TTFT: mean over requests, wall clock; CPU threads: "
             f"{torch.get_num_threads()}.", "",
             "| model | prompts | device | prompts x new | kvref tok/s | generate tok/s | "
             "generate_batch tok/s | **kvref / generate** | **kvref / generate_batch** | "
             "TTFT ms kvref / generate / generate_batch | same tokens as kvref (generate, "
             "generate_batch) | kvref bookkeeping share of step |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        k, g, b = r["kvref"], r["generate"], r["generate_batch"]
        lines.append(
            f"| {r['model']} | {r['prompts']} | {r['device']} | {r['num_prompts']} x "
            f"{r['max_tokens']} | {k['tokens_per_s_cpu']:.0f} | {g['tokens_per_s_cpu']:.0f} | "
            f"{b['tokens_per_s_cpu']:.0f} | **{k['tokens_per_s_cpu'] / g['tokens_per_s_cpu']:.2f}"
            f"** | **{k['tokens_per_s_cpu'] / b['tokens_per_s_cpu']:.2f}** | "
            f"{k['ttft_ms']:.0f} / {g['ttft_ms']:.0f} / {b['ttft_ms']:.0f} | "
            f"{g['same_tokens_as_kvref']}/{r['num_prompts']}, "
            f"{b['same_tokens_as_kvref']}/{r['num_prompts']} | "
            f"{r['kvref_split']['bookkeeping_share']:.1%} |")
    if not any(r["device"].startswith("cuda") for r in rows):
        lines.append("| (every case) | | cuda | skipped: no GPU present | | | | | | | | |")
    return "\n".join(lines)


def run_all(model_names, device_list, num_prompts: int, max_tokens: int,
            repeats: int, progress=print) -> list[dict]:
    rows = []
    for device in device_list:
        for name in model_names:
            for shared in (True, False):
                rows.append(run_case(name, shared, num_prompts, max_tokens, device, repeats))
                r = rows[-1]
                progress(f"  {name} {r['prompts']:16s} {device}: " + ", ".join(
                    f"{e} {r[e]['tokens_per_s_cpu']:.0f} tok/s" for e in ENGINES)
                    + f", kvref bookkeeping {r['kvref_split']['bookkeeping_share']:.1%}")
    return rows


def run_for_report(num_prompts: int = 16, max_tokens: int = 32, threads: int = 1,
                   repeats: int = 6) -> tuple[str, list[dict]]:
    """``(Markdown table, rows)``; ImportError when kvref.engine or transformers is missing."""
    import transformers  # noqa: F401
    from transformers.generation import continuous_batching  # noqa: F401
    import kvref.engine  # noqa: F401
    use_threads(threads)
    rows = run_all(list(MODELS), devices(), num_prompts, max_tokens, repeats)
    return table(rows, repeats), rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=6,
                        help="runs per case; each engine goes first in every third run")
    parser.add_argument("--device", action="append", help="cpu, cuda (default: all present)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for every engine (default: %(default)s)")
    args = parser.parse_args(argv)
    use_threads(args.threads)
    rows = run_all([m for m in args.models.split(",") if m], args.device or devices(),
                   args.prompts, args.max_tokens, args.repeats)
    print(table(rows, args.repeats))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
