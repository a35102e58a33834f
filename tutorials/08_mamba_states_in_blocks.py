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
# # Lesson 08: Mamba states in blocks
#
# A Mamba layer (and other linear-attention layers: GDN, linear attention in
# Qwen3-Next, NemotronH, Jamba) keeps no keys and values per token. It keeps one
# **state** that each token updates. vLLM still hands out its memory in blocks
# from the same pool, with a twist: one block holds one whole state, the state
# after some token. `MambaManager` (`vllm/v1/core/single_type_kv_cache_manager.py`)
# decides which states are kept, by `mamba_cache_mode`:
#
# - `none`: only the running state; nothing is cached (prefix caching off);
# - `all`: a state at every block boundary, each cached: a later request can
#   resume from any of them;
# - `align`: the running state and the last state on a block boundary; a
#   prefill chunk writes only its final state, so vLLM's scheduler ends chunks
#   on block boundaries.
#
# The layer here is the recurrence of `kvref.attention.mamba_state`,
# `h_t = decay * h_(t-1) + x_t`, small enough to check by hand, with states
# read from and written to the blocks the real `MambaManager` hands out. Every
# state block starts as NaN: a read of a state nobody wrote would show.

# %%
import torch
from rich.table import Table
from rich.text import Text

from kvref import (KVCacheConfig, KVCacheGroupSpec, KVCacheManager, MambaSpec, Request,
                   RequestStatus, get_request_block_hasher, init_none_hash, sha256)
from kvref.attention import make_state_cache, mamba_step, recurrence_reference

from _draw import table_row
from _lesson import claim, finish, section, show, start

args = start("Mamba states in blocks", uses_tensors=True)
device = torch.device(args.device)
init_none_hash(sha256)   # NONE_HASH, the first block's parent hash (lesson 02)
B, S, NUM_BLOCKS = 4, 2, 24
decay = torch.tensor([0.5, 0.9], device=device)
torch.manual_seed(0)
inputs = torch.randn(200, S, device=device)          # x_t of token id t
PROMPT = list(range(10))

# %% [markdown]
# ## 1. `none`: only the running state
#
# A 10-token prompt in chunks of 8 and 2, then 6 decode steps. Each step reads
# the state from the block of the last computed token and writes the new state
# into the block of the new last token; the manager then turns every older entry
# into the null block. The request never holds more than 2 real blocks, and
# nothing is cached. (vLLM gives a `none` group a block that holds the whole
# sequence, so there the table is one block updated in place; block size 4
# here makes the moving state visible.)

# %%
class Run:
    """One manager, one state cache (NaN-filled), requests stepped by hand."""

    def __init__(self, mode):
        self.mode = mode
        spec = MambaSpec(B, mamba_cache_mode=mode)
        self.manager = KVCacheManager(
            KVCacheConfig(NUM_BLOCKS, [KVCacheGroupSpec(["mamba.0"], spec)]),
            max_model_len=64, scheduler_block_size=B, hash_block_size=B,
            enable_caching=mode != "none")
        self.cache = make_state_cache(NUM_BLOCKS, S, device=device, fill=float("nan"))
        self.all_match = True

    def request(self, rid, tokens):
        req = Request(rid, list(tokens), block_hasher=get_request_block_hasher(B, sha256))
        self.manager.new_step_starts()
        hit, num_hit = self.manager.get_computed_blocks(req)
        req.hit_blocks, req.num_computed_tokens = hit, 0
        return req, num_hit

    def step(self, req, n):
        """Compute ``n`` tokens of ``req``; the kernel reads and writes the states
        through the request's table. Checks ``y`` against the recurrence from scratch."""
        self.manager.new_step_starts()
        if req.hit_blocks is not None:                 # the request's first step
            num_hit = len(req.hit_blocks.blocks[0]) * B if req.hit_blocks.blocks[0] else 0
            self.manager.allocate_slots(req, n, num_hit, req.hit_blocks)
            req.num_computed_tokens, req.hit_blocks = num_hit, None
        else:
            self.manager.allocate_slots(req, n)
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        x = inputs[torch.tensor(req.all_token_ids[:end], device=device)]
        table = torch.tensor([self.manager.get_block_ids(req.request_id)[0]], device=device)
        # "none" and "align" write only the running state: the same rule for the kernel.
        y = mamba_step(x[start:end], self.cache, decay=decay, query_start_loc=[0, n],
                       seq_lens=[end], block_table=table, block_size=B,
                       mamba_cache_mode="all" if self.mode == "all" else "align")
        self.all_match &= torch.allclose(y, recurrence_reference(x, decay)[start:end], atol=1e-5)
        req.num_computed_tokens = end
        req.status = RequestStatus.RUNNING
        return self.manager.get_block_ids(req.request_id)[0]

    def picture(self, tokens):
        """Blocks 1..8: the state each holds, as `@n` (the state after the first
        n of ``tokens``), `?` another sequence's state, `·` never written (NaN);
        `○` marks a cached block."""
        ref = recurrence_reference(inputs[torch.tensor(tokens, device=device)], decay)
        text = Text()
        for block in self.manager.block_pool.blocks[1:9]:      # the first 8 suffice here
            value = self.cache[block.block_id]
            if torch.isnan(value).any():
                label = "·"
            else:
                match = [i + 1 for i in range(len(tokens)) if torch.allclose(value, ref[i])]
                label = f"@{match[0]}" if match else "?"
            text.append(f"{block.block_id}:{label}{'○' if block.block_hash else ''} ",
                        style="bold" if label != "·" else "dim")
        return text


section("1. mode none")
run = Run("none")
a, _ = run.request("a", PROMPT)
timeline = Table("tokens computed", "table", box=None, header_style="bold")
real_held = []
for n in [8, 2] + [1] * 6:
    if a.num_computed_tokens >= len(PROMPT):
        a.append_output_token_ids(100 + a.num_computed_tokens)
    ids = run.step(a, n)
    real_held.append(sum(i != 0 for i in ids))
    timeline.add_row(str(a.num_computed_tokens), table_row(ids))
show(timeline)
claim(max(real_held) == 2 and real_held[-1] == 1,
      "the request holds at most 2 real blocks (the state read and the state written)")
claim(run.all_match, "every step's output equals the recurrence computed from scratch")
claim(all(b.block_hash is None for b in run.manager.block_pool.blocks),
      "mode none caches nothing: no block carries a hash")

# %% [markdown]
# ## 2. `all`: a cached state at every block boundary
#
# The same prompt, prefilled in one step of 10 tokens. The kernel writes the
# state after token 4 into the table's block 0, after 8 into block 1, and the
# running state after 10 into block 2. The two boundary states are cached.
# Then request `b` shares the first 8 tokens: its hit is **one block**, the
# state at 8, behind null entries; it computes only from token 8 on.

# %%
section("2. mode all")
run = Run("all")
a, _ = run.request("a", PROMPT)
ids_a = run.step(a, 10)
show(f"a's table {table_row(ids_a)}")
show(run.picture(PROMPT))
b_tokens = PROMPT[:8] + [50, 51, 52]
b, num_hit = run.request("b", b_tokens)
hit_ids = b.hit_blocks.get_block_ids()[0]
ids_b = run.step(b, len(b_tokens) - num_hit)
show(f"b's hit {table_row(hit_ids)} ({num_hit} tokens); b's table {table_row(ids_b)}")
show(run.picture(b_tokens))
claim([run.manager.block_pool.blocks[i].block_hash is not None for i in ids_a] ==
      [True, True, False], "a's states at 4 and 8 are cached; the running state at 10 is not")
claim(num_hit == 8 and hit_ids == [0, ids_a[1]],
      "b's hit is 8 tokens: the null block, then a's state at 8")
claim(run.all_match, "b, resuming from a's state, computes exactly the recurrence from scratch")

# %% [markdown]
# ## 3. `align`: the running state and the last aligned one
#
# Same prompt, chunks of 8 and 2 (the first ends on a block boundary, as vLLM's
# scheduler makes sure). A chunk writes only its final state, so there never is
# a state at 4: block 0 of the table is null from the start. After 10 tokens the
# table holds the aligned state at 8 and the running state at 10.

# %%
section("3. mode align")
run = Run("align")
a, _ = run.request("a", PROMPT)
run.step(a, 8)
ids_a = run.step(a, 2)
show(f"a's table {table_row(ids_a)}")
show(run.picture(PROMPT))
b, num_hit = run.request("b", PROMPT[:8] + [50, 51, 52])
c, num_hit_c = run.request("c", PROMPT[:4] + [60, 61, 62, 63, 64])
claim(ids_a[0] == 0 and sum(i != 0 for i in ids_a) == 2,
      "a holds 2 real blocks: the state at 8 and the running state at 10")
claim(num_hit == 8 and num_hit_c == 0,
      "a request sharing 8 tokens hits the state at 8; one sharing only 4 finds no state at 4")
run.step(b, 3)
claim(run.all_match, "every step, b's included, equals the recurrence from scratch")

# %% [markdown]
# **Why chunks must end on a boundary in `align` mode.** Feed the same prompt
# as 6 + 4 tokens instead. The first step leaves the state at 6 in the block for
# tokens 4..7; the second writes the state at 10 into a new block and leaves the
# old one as it was, and that block is what a later hit on "8 tokens" would
# read. Here the kernel is driven on a table by hand (the manager would not be
# asked for such a chunk by vLLM's scheduler).

# %%
cache = make_state_cache(4, S, device=device, fill=float("nan"))
x = inputs[torch.tensor(PROMPT, device=device)]
ref = recurrence_reference(x, decay)
table = torch.tensor([[0, 1, 2]], device=device)
mamba_step(x[:6], cache, decay=decay, query_start_loc=[0, 6], seq_lens=[6],
           block_table=table, block_size=B, mamba_cache_mode="align")
mamba_step(x[6:], cache, decay=decay, query_start_loc=[0, 4], seq_lens=[10],
           block_table=table, block_size=B, mamba_cache_mode="align")
claim(torch.allclose(cache[1], ref[5]) and not torch.allclose(cache[1], ref[7]),
      "after chunks 6 + 4 the block for tokens 4..7 holds the state at 6, not at 8")

# %% [markdown]
# ## 4. What each mode costs
#
# A request's peak blocks in the group, as vLLM sizes it in
# `MambaSpec.max_memory_usage_bytes` (kvref's `max_num_blocks_per_request` is
# that count before it is multiplied by the page size; lesson 12 builds on it):
# `all` reserves a block per block of the longest sequence, `align` 2 and
# `none` 1 (each plus `num_speculative_blocks` for speculative decoding). The
# cached states of `all` stay in the pool after the request frees them, until
# evicted: that is what makes every boundary hittable.

# %%
section("4. Blocks per request, max_model_len 64")
peaks = {mode: MambaSpec(B, mamba_cache_mode=mode).max_num_blocks_per_request(max_model_len=64)
         for mode in ("none", "all", "align")}
show(str(peaks))
claim(peaks == {"none": 1, "all": 16, "align": 2},
      "peak blocks per request: none 1, all 16 (64 / 4), align 2")

# %%
finish()
