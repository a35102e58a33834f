# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 06: sliding window and chunked-local attention
#
# Some layers never look far back. A **sliding window** of `W` lets the token
# at position `p` attend to positions `p - W + 1 .. p` (Mistral, Gemma 2/3,
# gpt-oss). **Chunked-local** attention of chunk `C` lets it attend only inside
# its own chunk `p // C * C .. p` (Llama 4). Keys no later token reads are
# garbage, so vLLM frees their blocks while the request runs:
# `SlidingWindowManager` and `ChunkedLocalAttentionManager`
# (`vllm/v1/core/single_type_kv_cache_manager.py`) count the *skipped* tokens
# (`get_num_skipped_tokens`) and `remove_skipped_blocks` puts the null block in
# their place, at the start of every `allocate_slots`.
#
# The table keeps its length, so positions still map to slots (lesson 04); the
# attention kernel never reads a null entry. This lesson decodes on real
# tensors with the freed blocks filled with NaN and checks the output against
# attention computed from scratch; then runs a Qwen3-style model with window
# layers through kvref's engine.
#
# Run: `python tutorials/06_sliding_window_and_chunked_local.py [--device cuda]`.

# %%
import torch

from kvref import (ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                   KVCacheManager, Request, RequestStatus, SlidingWindowSpec)
from kvref.attention import default_scale, make_kv_cache, paged_attention, write_kv
from kvref.engine import LLM, SamplingParams
from kvref.worker import BlockTable

from _draw import window_timeline
from _lesson import claim, finish, section, show, start
from _reference import dense_attention

import transformers  # noqa: E402  after _lesson, which silences tqdm's notebook warning

args = start("Sliding window and chunked-local attention", uses_tensors=True)
device = torch.device(args.device)
B, W, C, HEAD = 4, 6, 8, 8
NUM_BLOCKS = 12
SCALE = default_scale(HEAD)
torch.manual_seed(0)

# %% [markdown]
# ## 1. A sliding window of 6
#
# Block size 4, window 6: the token at position `p` reads `p - 5 .. p`. Before
# computing position `p` (that is, with `p` tokens computed) the manager skips
# `p - 6 + 1` tokens; every block entirely inside them becomes the null block.
# Watch the `∅` entries appear from the left as the window moves, while the
# number of real blocks never exceeds 3 (`ceil((W - 1) / B) + 1`: the window's
# `W - 1` older tokens may straddle one more block than they fill).
#
# `decode_run` prefills 6 tokens, then decodes with the real manager and the
# reference paged attention, one token per step, and checks every step's output
# against attention computed from scratch (`_reference.py`).

# %%
def decode_run(spec, num_prompt=6, num_steps=14):
    """Prefill ``num_prompt`` tokens, then decode one token per step with the
    real manager and the reference paged attention. Blocks the manager frees
    are filled with NaN at once (as if another request reused them). Returns
    one row per step: (position, table, paged output, keys/values so far)."""
    config = KVCacheConfig(NUM_BLOCKS, [KVCacheGroupSpec(["layer.0"], spec)])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=B,
                             hash_block_size=B, enable_caching=False)
    kv_cache = make_kv_cache(NUM_BLOCKS, B, 1, HEAD, device=device, fill=float("nan"))
    req = Request("r", list(range(num_prompt)))
    q_all, k_all, v_all = (torch.randn(num_prompt + num_steps, 1, HEAD, device=device)
                           for _ in range(3))
    rows, start, n = [], 0, num_prompt
    window = dict(sliding_window=getattr(spec, "sliding_window", None),
                  attention_chunk_size=getattr(spec, "attention_chunk_size", None))
    for step in range(num_steps + 1):
        held_before = {b.block_id for b in manager.get_blocks("r").blocks[0]}
        manager.allocate_slots(req, n)
        table = manager.get_block_ids("r")[0]
        for freed in held_before - set(table):
            kv_cache[freed] = float("nan")              # freed: someone else's now
        bt = BlockTable(B, 1, 16, 32, device=device)
        bt.add_row(table, 0)
        positions = torch.arange(start, start + n, device=device)
        slots = bt.compute_slot_mapping(1, torch.tensor([0, n]), positions)
        write_kv(kv_cache, k_all[start:start + n], v_all[start:start + n], slots)
        out = paged_attention(q_all[start:start + n], kv_cache, query_start_loc=[0, n],
                              seq_lens=[start + n], block_table=bt.get_device_tensor(1),
                              scale=SCALE, **window)
        rows.append((start + n - 1, table, out,
                     dense_attention(q_all[start:start + n], k_all[:start + n],
                                     v_all[:start + n], SCALE, **window)))
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = start + n
        req.append_output_token_ids(100 + step)
        start, n = start + n, 1
    return rows


section("1. Sliding window, decode")
rows = decode_run(SlidingWindowSpec(B, sliding_window=W, num_kv_heads=1, head_size=HEAD,
                                    dtype="float32"))
show(window_timeline(rows, "sliding window 6, block size 4"))
held = [sum(b != 0 for b in ids) for _, ids, _, _ in rows]
claim(rows[-1][1][:3] == [0, 0, 0] and len(rows[-1][1]) == 5,
      "after 20 tokens the table still has 5 entries, the first 3 are the null block")
claim(max(held[1:]) == 3, "while decoding, the request never holds more than 3 real blocks")
claim(all(torch.allclose(out, ref, atol=1e-5) for _, _, out, ref in rows),
      "every step's paged output equals windowed attention computed from scratch")
claim(not any(bool(torch.isnan(out).any()) for _, _, out, _ in rows),
      "no output is NaN: the freed (NaN-filled) blocks and the null block are never read")

# %% [markdown]
# ## 2. Chunked-local attention, chunk 8
#
# A token reads only its own chunk of 8. When the request *enters* a new chunk
# (8 or 16 tokens computed) every block of the previous chunks is skipped at
# once: 2 blocks turn null together.

# %%
section("2. Chunked local, decode")
rows = decode_run(ChunkedLocalAttentionSpec(B, attention_chunk_size=C, num_kv_heads=1,
                                            head_size=HEAD, dtype="float32"))
show(window_timeline(rows, "chunked local 8, block size 4"))
tables = {last: ids for last, ids, _, _ in rows}
claim(0 not in tables[7] and tables[8][:2] == [0, 0] and tables[16][:4] == [0, 0, 0, 0],
      "computing position 8 nulls blocks 0-1 together, position 16 blocks 2-3")
claim(all(torch.allclose(out, ref, atol=1e-5) for _, _, out, ref in rows)
      and not any(bool(torch.isnan(out).any()) for _, _, out, _ in rows),
      "every step equals chunked attention from scratch, and reads no freed block")

# %% [markdown]
# ## 3. A real model: memory saved, same tokens
#
# A tiny Qwen3 with one full-attention layer and two sliding-window layers
# (window 5), random weights. kvref's engine gives each layer type its own KV
# cache group (full attention, then sliding window), both drawing blocks from
# one pool. A hook after every step counts the real blocks each group holds for
# the request (after the last step it has finished and holds none). The window
# group holds 3 after the 10-token prefill and 2 from then on: a window of 5
# reads the 4 tokens before the new one, at most 2 blocks of 4. The greedy
# tokens are compared with `transformers`' own `generate()`, which keeps every
# key of every layer.

# %%
section("3. Qwen3 with window layers, through the engine")
config = transformers.Qwen3Config(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    use_sliding_window=True, sliding_window=5,
    layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    initializer_range=0.3, attn_implementation="eager",
    bos_token_id=None, eos_token_id=None, pad_token_id=None)
torch.manual_seed(0)
model = transformers.Qwen3ForCausalLM(config).eval()
llm = LLM(model, block_size=B, num_gpu_blocks=40, max_model_len=64, device=args.device)
groups = [type(g.kv_cache_spec).__name__ for g in llm.kv_cache_config.kv_cache_groups]
held_per_step = []
llm.after_step.append(lambda engine: held_per_step.append(tuple(
    sum(not b.is_null for b in blocks)
    for blocks in engine.kv_cache_manager.get_blocks("0").blocks)))
prompt = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(3)).tolist()
out = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
with torch.no_grad():
    expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 10).long(),
                              max_new_tokens=20, min_new_tokens=20, do_sample=False,
                              pad_token_id=0)[0, 10:].tolist()
show(f"groups: {groups}")
# After the last token the request is freed, and the engine steps once more, empty, to
# report it (vLLM's has_requests): keep the steps in which the request held blocks.
held_per_step = [held for held in held_per_step if held != (0, 0)]
show(f"real blocks held (full, window) after each step: {held_per_step}")
show(f"engine:       {out.outputs[0].token_ids}\ntransformers: {expected}")
claim(groups == ["FullAttentionSpec", "SlidingWindowSpec"],
      "two KV cache groups: full attention and the sliding window")
claim(out.outputs[0].token_ids == expected,
      "the engine, freeing window blocks as it goes, generates exactly transformers' 20 tokens")
claim(held_per_step[-1] == (7, 2) and max(w for _, w in held_per_step[1:]) == 2,
      "with 28 tokens computed the full-attention group holds 7 blocks, the window group "
      "2, as it did on every decode step")

# %%
finish()
