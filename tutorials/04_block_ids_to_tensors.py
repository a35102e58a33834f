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
# # Lesson 04: from block ids to tensors
#
# Lessons 01 to 03 moved block *ids* around. This one follows them to memory.
# The worker keeps each request's ids in a **block table**
# (`vllm/v1/worker/block_table.py`) and turns every token's position into a
# **slot**, its row in the layer's KV cache tensor:
#
# ```
# kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_size]   (2 = key, value)
# slot = block_table[pos // block_size] * block_size + pos % block_size
# ```
#
# The cache write (`reshape_and_cache_flash`) puts each new key and value at its
# slot; the attention kernel (`vllm/v1/attention/backends/flash_attn.py`) reads
# a request's keys back through its table. Paged attention is ordinary softmax
# attention: only the *address* of each key changes. To see which slots a
# kernel reads, the lesson fills the whole cache with NaN first: a read of a
# slot nobody wrote would turn the output into NaN.
#
# Run: `python tutorials/04_block_ids_to_tensors.py [--device cuda]`.

# %%
import torch

from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager,
                   Request, RequestStatus)
from kvref.attention import default_scale, make_kv_cache, paged_attention, write_kv
from kvref.viz import render_pool
from kvref.worker import BlockTable

from _draw import slot_picture
from _lesson import claim, finish, section, show, start
from _reference import dense_attention

args = start("From block ids to tensors", uses_tensors=True)
device = torch.device(args.device)
torch.manual_seed(0)
BLOCK_SIZE, NUM_BLOCKS, KV_HEADS, HEADS, HEAD_SIZE = 4, 8, 2, 4, 8
SCALE = default_scale(HEAD_SIZE)

spec = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                         dtype="float32")
config = KVCacheConfig(NUM_BLOCKS, [KVCacheGroupSpec(["layer.0"], spec)])
manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=BLOCK_SIZE,
                         hash_block_size=BLOCK_SIZE, enable_caching=False)
table = BlockTable(BLOCK_SIZE, max_num_reqs=2, max_num_blocks_per_req=4,
                   max_num_batched_tokens=32, device=device)
# The whole pool starts as NaN: any slot read before it is written poisons the output.
kv_cache = make_kv_cache(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, device=device,
                         fill=float("nan"))

# %% [markdown]
# ## 1. The manager hands out ids, the table holds them
#
# Request `a` has an 8-token prompt, `b` a 6-token one. The manager gives `a`
# blocks 1, 2 and `b` blocks 3, 4 (lesson 01: from the head of the free queue).
# The worker copies each request's ids into one row of its `BlockTable`.

# %%
section("1. Block ids into table rows")
prompts = {"a": torch.randn(8, HEADS * HEAD_SIZE), "b": torch.randn(6, HEADS * HEAD_SIZE)}
requests = {}
for row, rid in enumerate(("a", "b")):
    req = Request(rid, list(range(len(prompts[rid]))))
    manager.allocate_slots(req, req.num_tokens)
    requests[rid] = req
    table.add_row(manager.get_block_ids(rid)[0], row)
show(render_pool(manager))
claim(table.row(0) == [1, 2] and table.row(1) == [3, 4],
      "the table rows are the manager's ids: a -> [1, 2], b -> [3, 4]")

# %% [markdown]
# ## 2. Positions become slots
#
# The step packs both prompts back to back: 14 tokens, `query_start_loc =
# [0, 8, 14]`. `compute_slot_mapping` turns each (row, position) into a slot.
# Position 5 of `a` is in `a`'s block 1 (`5 // 4`), which is block id 2, at
# offset 1: slot `2 * 4 + 1 = 9`.

# %%
section("2. The slot mapping")
query_start_loc = torch.tensor([0, 8, 14], device=device)
positions = torch.cat([torch.arange(8), torch.arange(6)]).to(device)
slot_mapping = table.compute_slot_mapping(2, query_start_loc, positions)
show(f"positions    {positions.tolist()}")
show(f"slot_mapping {slot_mapping.tolist()}")
claim(slot_mapping.tolist() == list(range(4, 12)) + list(range(12, 18)),
      "a's 8 tokens go to slots 4..11 (blocks 1, 2), b's 6 to slots 12..17 (blocks 3, 4)")
claim(int(slot_mapping[5]) == 9, "a's position 5 is slot 2 * 4 + 1 = 9")

# %% [markdown]
# ## 3. Write, then attend: paged equals dense
#
# Random projections stand in for a layer: each token gets a query, key and
# value. `write_kv` stores keys and values at their slots, then
# `paged_attention` reads them through the table. The picture shows which slots
# now hold a key (`a` or `b`) and which are still NaN (`·`): the null block 0,
# the 2 empty slots at the end of `b`'s last block, and the free blocks 5 to 7.

# %%
section("3. Prefill: write_kv, paged_attention")
w_q = torch.randn(HEADS * HEAD_SIZE, HEADS * HEAD_SIZE, device=device) / 4
w_k = torch.randn(HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE, device=device) / 4
w_v = torch.randn(HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE, device=device) / 4


def project(x):
    x = x.to(device)
    return ((x @ w_q).view(-1, HEADS, HEAD_SIZE), (x @ w_k).view(-1, KV_HEADS, HEAD_SIZE),
            (x @ w_v).view(-1, KV_HEADS, HEAD_SIZE))


qkv = {rid: project(x) for rid, x in prompts.items()}
query = torch.cat([qkv["a"][0], qkv["b"][0]])
write_kv(kv_cache, torch.cat([qkv["a"][1], qkv["b"][1]]),
         torch.cat([qkv["a"][2], qkv["b"][2]]), slot_mapping)
owner = {int(s): ("a" if i < 8 else "b") for i, s in enumerate(slot_mapping)}
show(slot_picture(kv_cache, owner, BLOCK_SIZE))
out = paged_attention(query, kv_cache, query_start_loc=query_start_loc,
                      seq_lens=torch.tensor([8, 6]), block_table=table.get_device_tensor(2),
                      scale=SCALE)
dense = torch.cat([dense_attention(*qkv["a"], SCALE), dense_attention(*qkv["b"], SCALE)])
claim(bool(torch.isnan(kv_cache[5:]).all()) and bool(torch.isnan(kv_cache[0]).all()),
      "the null block and the free blocks 5..7 still hold NaN: nothing was written there")
claim(not bool(torch.isnan(out).any()),
      "no output is NaN: attention read only the 14 slots the step wrote")
claim(torch.allclose(out, dense, atol=1e-5),
      "paged attention equals dense causal attention on contiguous keys, for both requests")

# %% [markdown]
# ## 4. A decode step crosses a block boundary
#
# Each request samples one token and the next step computes it. `a` is at
# position 8: its two blocks are full, so `allocate_slots` hands it a new one,
# block 5, from the head of the queue. `b` is at position 6, still inside its
# block 4. The worker appends the new id to `a`'s row; the table stays
# scattered (`[1, 2, 5]`) and nobody cares: only the slots matter.

# %%
section("4. Decode")
new_x = {rid: torch.randn(1, HEADS * HEAD_SIZE) for rid in ("a", "b")}
for row, rid in enumerate(("a", "b")):
    req = requests[rid]
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens
    req.append_output_token_ids(99)
    new = manager.allocate_slots(req, 1)
    table.append_row(new.get_block_ids()[0], row)
decode_positions = torch.tensor([8, 6], device=device)
decode_slots = table.compute_slot_mapping(2, torch.tensor([0, 1, 2], device=device),
                                          decode_positions)
step_qkv = {rid: project(x) for rid, x in new_x.items()}
write_kv(kv_cache, torch.cat([step_qkv["a"][1], step_qkv["b"][1]]),
         torch.cat([step_qkv["a"][2], step_qkv["b"][2]]), decode_slots)
owner.update({int(decode_slots[0]): "a", int(decode_slots[1]): "b"})
show(f"rows: a {table.row(0)}, b {table.row(1)}; decode slots {decode_slots.tolist()}")
show(slot_picture(kv_cache, owner, BLOCK_SIZE))
out = paged_attention(torch.cat([step_qkv["a"][0], step_qkv["b"][0]]), kv_cache,
                      query_start_loc=torch.tensor([0, 1, 2]), seq_lens=torch.tensor([9, 7]),
                      block_table=table.get_device_tensor(2), scale=SCALE)
full = {rid: [torch.cat([qkv[rid][i], step_qkv[rid][i]]) for i in range(3)] for rid in qkv}
dense = torch.cat([dense_attention(full[rid][0][-1:], full[rid][1], full[rid][2], SCALE)
                   for rid in ("a", "b")])
claim(table.row(0) == [1, 2, 5] and table.row(1) == [3, 4],
      "a got block 5 for position 8; b's position 6 stays in block 4")
claim(decode_slots.tolist() == [20, 18], "the decode slots are 5 * 4 + 0 = 20 and 4 * 4 + 2 = 18")
claim(torch.allclose(out, dense, atol=1e-5),
      "the decode reads 9 and 7 keys through the tables and equals dense attention")

# %% [markdown]
# ## 5. Poison one slot: only its owner notices
#
# Now write NaN into one slot of `a` (position 3, slot 7) and run the decode
# again. `a`'s output turns NaN; `b` reads none of `a`'s slots and is untouched.
# This is how kvref's tests prove that attention reads exactly the slots a
# request owns, and nothing of the null block, free blocks or other requests.

# %%
section("5. A NaN in a's slot 7")
poisoned = kv_cache.clone()
poisoned.view(-1, 2, KV_HEADS, HEAD_SIZE)[7] = float("nan")
out_p = paged_attention(torch.cat([step_qkv["a"][0], step_qkv["b"][0]]), poisoned,
                        query_start_loc=torch.tensor([0, 1, 2]), seq_lens=torch.tensor([9, 7]),
                        block_table=table.get_device_tensor(2), scale=SCALE)
claim(bool(torch.isnan(out_p[0]).all()) and not bool(torch.isnan(out_p[1]).any()),
      "a's output is NaN, b's is not: b never reads a's blocks")
claim(torch.equal(out_p[1], out[1]), "b's output is bit for bit what it was")

# %% [markdown]
# ## 6. Kernel blocks: the same memory, smaller pages
#
# An attention kernel may support only some block sizes. vLLM then splits each
# manager block into `k` kernel blocks: manager block `b` becomes kernel blocks
# `b*k .. b*k + k - 1` (`BlockTable.map_to_kernel_blocks`). The memory is the
# same, so every token lands in the same slot.

# %%
section("6. Kernel block size 2")
kernel_table = BlockTable(BLOCK_SIZE, max_num_reqs=2, max_num_blocks_per_req=4,
                          max_num_batched_tokens=32, device=device, kernel_block_size=2)
kernel_table.add_row([1, 2, 5], 0)
kernel_table.add_row([3, 4], 1)
kernel_slots = kernel_table.compute_slot_mapping(
    2, torch.tensor([0, 9, 16], device=device),
    torch.cat([torch.arange(9), torch.arange(7)]).to(device))
manager_slots = table.compute_slot_mapping(
    2, torch.tensor([0, 9, 16], device=device),
    torch.cat([torch.arange(9), torch.arange(7)]).to(device))
show(f"kernel rows: a {kernel_table.row(0)}, b {kernel_table.row(1)}")
claim(kernel_table.row(0) == [2, 3, 4, 5, 10, 11],
      "manager blocks [1, 2, 5] become kernel blocks [2, 3, 4, 5, 10, 11]")
claim(torch.equal(kernel_slots, manager_slots), "every token keeps its slot")

# %%
finish()
