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
# # Lesson 02: block hashes and prefix hits
#
# Prefix caching finds earlier work by **block hash**. Every full block of a
# request gets a hash of `(hash of the previous block, its token ids, extra
# keys)` (`hash_block_tokens` in `vllm/v1/core/kv_cache_utils.py`), so one hash
# stands for the *whole prefix* up to the end of its block. A new request looks
# its hashes up left to right and stops at the first miss.
#
# This lesson builds the chain by hand and checks it equals kvref's, shows the
# extra keys that keep equal tokens apart (LoRA, cache salt, multimodal), why a
# hit never covers the last prompt token, and two multi-turn chats: one that
# hits and one that does not.

# %%
import os

from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager,
                   LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request,
                   RequestStatus, generate_block_hash_extra_keys, get_request_block_hasher,
                   hash_block_tokens, init_none_hash, sha256)

from _draw import hash_table
from _lesson import claim, finish, section, show, start

args = start("Block hashes and prefix hits")
BLOCK_SIZE = 4
hasher = get_request_block_hasher(BLOCK_SIZE, sha256)


def request(rid, tokens, **kw):
    return Request(rid, tokens, block_hasher=hasher, **kw)


def make_manager(num_blocks=64):
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["layer.0"],
                                                         FullAttentionSpec(BLOCK_SIZE))])
    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK_SIZE,
                          hash_block_size=BLOCK_SIZE, enable_caching=True, log_stats=True)


# %% [markdown]
# ## 1. The seed of the chain
#
# The first block's parent is `NONE_HASH`. vLLM derives it from the
# `PYTHONHASHSEED` environment variable, or draws 32 random bytes when it is not
# set (it warns only for the CBOR hash functions; with the default `sha256` it
# is silent): then two processes (two vLLM instances behind one router, or a
# restarted server) hash the same tokens differently. Set it when anything
# outside the process compares hashes (KV events, lesson 11).

# %%
section("1. NONE_HASH comes from PYTHONHASHSEED")
first_block = (1, 2, 3, 4)
saved = os.environ.pop("PYTHONHASHSEED", None)
init_none_hash(sha256)
unseeded_1 = hash_block_tokens(sha256, None, first_block)
init_none_hash(sha256)
unseeded_2 = hash_block_tokens(sha256, None, first_block)
os.environ["PYTHONHASHSEED"] = "0"
init_none_hash(sha256)
seeded = hash_block_tokens(sha256, None, first_block)
claim(unseeded_1 != unseeded_2, "without PYTHONHASHSEED, two starts hash the same block differently")
claim(seeded == sha256((sha256("0"), first_block, None)),
      "with PYTHONHASHSEED=0 the first block's parent is sha256('0'): every process agrees")
if saved is not None:
    os.environ["PYTHONHASHSEED"] = saved
    init_none_hash(sha256)

# %% [markdown]
# ## 2. The chain, by hand
#
# A 10-token request has 2 full blocks, so 2 hashes; the last 2 tokens wait for
# a full block. Each hash is the hash of its parent, its tokens, and no extra
# keys (`None`).

# %%
section("2. Hash the blocks by hand")
tokens = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32]
r = request("r", tokens)
show(hash_table(r, "request r", BLOCK_SIZE))
h0 = hash_block_tokens(sha256, None, tokens[0:4])
h1 = hash_block_tokens(sha256, h0, tokens[4:8])
claim(r.block_hashes == [h0, h1], "r.block_hashes is exactly the hand-built chain [h0, h1]")
claim(len(r.block_hashes) == len(tokens) // BLOCK_SIZE, "the partial last block has no hash yet")
r.append_output_token_ids([33, 34])
claim(len(r.block_hashes) == 3, "two output tokens complete block 2, and it is hashed at once")

# %% [markdown]
# Because each hash includes its parent, changing one token in block 0 changes
# every later hash, and the same four tokens at another position hash
# differently. That is what makes one lookup per block enough: a hash match
# means the whole prefix matches.

# %%
changed = request("changed", [99] + tokens[1:])
moved = request("moved", tokens[4:8] + tokens[0:4])
claim(all(a != b for a, b in zip(changed.block_hashes, r.block_hashes)),
      "one different token in block 0 changes the hash of every block after it")
claim(moved.block_hashes[0] != h1, "tokens 21..24 as block 0 do not hash like tokens 21..24 as block 1")

# %% [markdown]
# ## 3. Extra keys: equal tokens that must not share KV
#
# Some requests have the same token ids but different keys and values:
#
# - **LoRA**: an adapter changes the projections, so its name goes into every block's key;
# - **cache salt** (`cache_salt` in the request): a tenant's secret, in the
#   first block's key only. The chain carries it into every later block, so
#   tenants with different salts never share blocks (and so cannot learn from
#   a fast answer that someone else sent the same prompt);
# - **multimodal items**: an image's placeholder tokens are the same token id
#   repeated, whatever the image. Each block an item overlaps gets
#   `(item identifier, item offset - block start)`.

# %%
section("3. Extra keys")
base = list(range(100, 120))
plain = request("plain", base)
lora_a = request("lora-a", base, lora_request=LoRARequest("sql-adapter", 1))
lora_b = request("lora-b", base, lora_request=LoRARequest("chat-adapter", 2))
salted = request("salted", base, cache_salt="tenant-42")
show(hash_table(lora_a, "with LoRA 'sql-adapter'", BLOCK_SIZE),
     hash_table(salted, "with cache_salt", BLOCK_SIZE))
claim(all(len({p, a, b}) == 3 for p, a, b in
          zip(plain.block_hashes, lora_a.block_hashes, lora_b.block_hashes)),
      "no LoRA, adapter A and adapter B give three different hashes for every block")
claim(generate_block_hash_extra_keys(salted, 4, 8, 0)[0] is None
      and salted.block_hashes[1] != plain.block_hashes[1],
      "the salt is a key of block 0 only, yet block 1's hash differs too (the chain)")

# %% [markdown]
# Now the pool. Cache the plain request, then ask which of the others hit it.

# %%
manager = make_manager()
manager.allocate_slots(plain, plain.num_tokens)
hits = {req.request_id: manager.get_computed_blocks(req)[1]
        for req in (request("plain-again", base), lora_a, salted)}
show(f"hit tokens: {hits}")
claim(hits == {"plain-again": 16, "lora-a": 0, "salted": 0},
      "the same tokens hit 16 tokens without LoRA or salt, 0 with either")

# %% [markdown]
# An image: 8 placeholder tokens (id 7) at positions 6..13 of a 20-token prompt.
# Two prompts with the same token ids but different images share only the
# blocks that end before the image starts.

# %%
PLACEHOLDER = 7
prompt = [1, 2, 3, 4, 5, 6] + [PLACEHOLDER] * 8 + [50, 51, 52, 53, 54, 55]
cat = request("cat", prompt, mm_features=[
    MultiModalFeatureSpec("sha-of-cat.png", PlaceholderRange(offset=6, length=8))])
dog = request("dog", prompt, mm_features=[
    MultiModalFeatureSpec("sha-of-dog.png", PlaceholderRange(offset=6, length=8))])
show(hash_table(cat, "the cat picture at tokens 6..13", BLOCK_SIZE))
keys = [generate_block_hash_extra_keys(cat, i * 4, i * 4 + 4, 0)[0] for i in range(5)]
claim(keys == [None, (("sha-of-cat.png", 2),), (("sha-of-cat.png", -2),),
               (("sha-of-cat.png", -6),), None],
      "blocks 1..3 overlap the image and carry (identifier, offset - block start)")
manager.allocate_slots(cat, cat.num_tokens)
claim(manager.get_computed_blocks(dog)[1] == 4,
      "the dog prompt hits only block 0: from block 1 on, the image differs")

# %% [markdown]
# ## 4. A hit stops at `num_tokens - 1`, and then at a block boundary
#
# The last prompt token must go through the model to produce the logits of the
# first output token. So `get_computed_blocks` looks for at most
# `num_tokens - 1` tokens, and hits are whole blocks. A prompt that is an exact
# multiple of the block size and is *fully* cached still recomputes its whole
# last block (vLLM's own comment in `get_computed_blocks` says so).

# %%
section("4. The last token is always computed")
manager = make_manager()
sixteen = list(range(200, 216))
manager.allocate_slots(request("first", sixteen), 16)
again = request("again", sixteen)
hit, num_hit = manager.get_computed_blocks(again)
longer = request("longer", sixteen + [999])
claim(num_hit == 12, "a cached 16-token prompt asked again hits 12 tokens: block 3 is recomputed whole")
claim(manager.get_computed_blocks(longer)[1] == 16, "one more token and all 16 tokens hit")

# %% [markdown]
# The recomputed block gets a *new* block id, and once full it is cached under
# the same hash as the original: vLLM does not deduplicate, because block ids,
# once in a block table, never change. Both copies sit in the index; a hit takes
# the older one.

# %%
manager.allocate_slots(again, again.num_tokens - num_hit, num_hit, hit)
key_of_block_3 = manager.get_blocks("first").blocks[0][3].block_hash
copies = [b.block_id for k, b in manager.block_pool.cached_block_hash_to_block.items()
          if k == key_of_block_3]
show(f"first: {manager.get_block_ids('first')}  again: {manager.get_block_ids('again')}"
     f"  blocks cached under block 3's hash: {copies}")
claim(len(copies) == 2, "the index now holds two blocks with the same hash")

# %% [markdown]
# ## 5. Multi-turn chat: a hit, and a miss
#
# Turn 2 of a chat re-sends the whole conversation. Whether it hits depends on
# one thing: are the tokens of turn 1 *the same token ids at the same positions*?
#
# `serve` below runs a request like vLLM's scheduler does: prefill (reusing any
# hit), then one decode step per output token. The last sampled token is never
# fed back through the model before the request finishes, so its KV never exists.

# %%
section("5. Multi-turn chat")


def serve(manager, req, outputs):
    """Prefill, decode ``outputs`` one token per step, free; return the prefix hit."""
    hit, num_hit = manager.get_computed_blocks(req)
    manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit)
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens
    for i, token in enumerate(outputs):
        req.append_output_token_ids(token)        # sampled by the step just run
        if i == len(outputs) - 1:
            break                                 # finished: this token is never computed
        manager.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    req.status = RequestStatus.FINISHED_STOPPED
    manager.free(req)
    return num_hit


SYSTEM = list(range(500, 508))           # 8-token system prompt
USER_1 = [601, 602, 603, 604, 605, 606]  # first question
THINK = [701, 702, 703, 704, 705]        # reasoning the model wrote before answering
ANSWER = [801, 802, 803, 804]
USER_2 = [901, 902, 903, 904, 905]

manager = make_manager()
turn_1 = request("turn-1", SYSTEM + USER_1)
serve(manager, turn_1, THINK + ANSWER)
computed_turn_1 = turn_1.num_tokens - 1

# %% [markdown]
# **The chat that hits.** The client sends back exactly what the model produced.
# The hit covers every full block of turn 1's computed tokens.

# %%
same = request("turn-2-same", SYSTEM + USER_1 + THINK + ANSWER + USER_2)
hit_same = serve(manager, same, [1001])
claim(hit_same == computed_turn_1 // BLOCK_SIZE * BLOCK_SIZE == 20,
      "turn 2 hits 20 tokens: every full block of the 22 computed tokens of turn 1")

# %% [markdown]
# **The chat that does not.** Some chat templates (Qwen3's, for one) drop the
# reasoning of earlier turns when they render the history. Turn 2 then holds
# `ANSWER` at position 14, where turn 1 had `THINK`. The hit ends at the last
# block boundary before position 14, and nothing after it can hit, whatever
# tokens follow: a hash means "this whole prefix", not "these four tokens".
# A system prompt that starts with the current time is worse: block 0 already
# differs, and the hit is 0.

# %%
stripped = request("turn-2-stripped", SYSTEM + USER_1 + ANSWER + USER_2)
hit_stripped = serve(manager, stripped, [1001])
dated = request("turn-2-dated", [4242] + SYSTEM[1:] + USER_1 + THINK + ANSWER + USER_2)
hit_dated = serve(manager, dated, [1001])
claim(hit_stripped == 12, "without the reasoning, turn 2 hits only 12 tokens (blocks before position 14)")
claim(hit_dated == 0, "a different first token (a timestamp) and nothing hits")
stats = manager.make_prefix_cache_stats()
show(f"prefix cache: {stats.hits} of {stats.queries} queried tokens hit over {stats.requests} requests")

# %%
finish()
