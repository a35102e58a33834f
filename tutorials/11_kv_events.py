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
# # Lesson 11: KV events, and a router that follows them
#
# A KV-aware router (llm-d, NVIDIA Dynamo, ...) sends each request to the vLLM
# instance that already caches the longest part of its prompt. It cannot look
# inside the instances; it listens to their **KV events**
# (`vllm/distributed/kv_events.py`), queued by the block pool:
#
# - `BlockStored`: blocks of one request became cached (hashes, parent hash,
#   token ids, block size, LoRA, extra keys, `group_idx`);
# - `BlockRemoved`: cached blocks lost their hash (evicted);
# - `AllBlocksCleared`: `reset_prefix_cache`.
#
# The question router users ask: *does an index rebuilt from the events alone
# answer what the instance would answer?* Part 1: yes, for a full-attention
# model, on a workload with eviction. Part 2: a vLLM 0.25.1 defect (issue
# #44451) that makes the events of Mamba `align` groups ambiguous, a consumer
# that goes wrong on it, and one that copes.

# %%
import random
from collections import Counter, deque

from kvref import (BlockRemoved, BlockStored, FullAttentionSpec, KVCacheConfig,
                   KVCacheGroupSpec, KVCacheManager, MambaSpec, Request,
                   RequestStatus, get_block_hash, get_group_id, get_request_block_hasher,
                   init_none_hash, sha256)
from kvref.core.kv_cache_utils import maybe_convert_block_hash

from _lesson import claim, finish, section, show, start

args = start("KV events: a router's index from the event stream")
init_none_hash(sha256)   # NONE_HASH, the first block's parent; a router needs the
                         # instance's PYTHONHASHSEED to agree on it (lesson 02)
BLOCK_SIZE = 4


def make_manager(*specs, num_blocks=80):
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec([f"layer.{i}"], spec)
                                        for i, spec in enumerate(specs)])
    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK_SIZE,
                          hash_block_size=BLOCK_SIZE, enable_caching=True,
                          enable_kv_cache_events=True)


def request(rid, tokens):
    return Request(rid, tokens, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def pool_index(manager):
    """What the pool caches, as events name it: (group, external hash) -> copies."""
    return Counter((get_group_id(key), maybe_convert_block_hash(get_block_hash(key)))
                   for key, _ in manager.block_pool.cached_block_hash_to_block.items())


# %% [markdown]
# ## The consumers
#
# Both consumers below know the model's groups (events carry `group_idx` and,
# on stores, `kv_cache_spec_kind`) and answer "how many tokens of this prompt
# would hit?" with the same hit rule: the full-attention groups' leading run of
# cached blocks, then, for a Mamba group, back to the rightmost cached state
# within it (lesson 07), never past `num_tokens - 1` (lesson 02). They differ
# only in how they remember what is cached.
#
# Both live in `_routers.py` next to this lesson.
#
# **`HashIndex`** keeps the hashes, keyed exactly as the pool keys them:
# `(group_idx, hash)`. It counts copies, because the pool can cache two blocks
# with the same hash (lesson 02), and one `BlockRemoved` removes one copy. It
# hashes a prompt the way vLLM does (same hash function, same `PYTHONHASHSEED`;
# events carry the low 64 bits of each hash as an int by default).
#
# **`TokenTreeIndex`** keeps, per group, a prefix tree keyed by its *own* hash of
# token slices, as routers do that index tokens rather than vLLM's hashes: it
# pairs `block_hashes[i]` with the `i`-th `block_size` slice of `token_ids`,
# hangs the store under its parent (dropping a store whose parent it never
# saw), and maps vLLM hashes to its own keys to apply `BlockRemoved`. With
# `skip_sparse=True` it refuses stores whose token slices and hashes do not
# pair up one to one, the defence the smg router adopted (its PR #2495).

# %%
from _routers import HashIndex, TokenTreeIndex

# %% [markdown]
# ## A workload with eviction
#
# `serve` is a small scheduler loop over kvref's real `KVCacheManager`: up to 3
# running requests, a budget of 12 tokens per step (chunked prefill), one
# decode token per step, requests freed when done. Prompts share one of four
# "system prompts" (8 to 24 tokens) followed by a random question; the pool is
# small, so cached blocks are evicted. For a Mamba `align` group, prefill chunks
# are cut at block boundaries the way vLLM's scheduler does
# (`_mamba_block_aligned_split`). After every step the consumers read the new
# events, and we compare their answers with the pool's on a set of probe prompts.

# %%
def aligned_chunk(req, computed, n):
    """vLLM's chunk split for Mamba align: end prefill chunks on block
    boundaries, and end one exactly at the last full block."""
    if computed >= max(req.num_prompt_tokens, req.num_tokens - 1):
        return n
    last_cache = req.num_tokens - req.num_tokens % BLOCK_SIZE
    if computed + n < last_cache:
        return n // BLOCK_SIZE * BLOCK_SIZE
    if computed < last_cache < computed + n:
        return last_cache - computed
    return n


def serve(manager, consumers, *, seed, num_requests=60, align=False, budget=12):
    """Run the workload; return per-step checks and every event seen."""
    rng = random.Random(seed)
    systems = [[1000 * s + t for t in range(rng.randrange(8, 25))] for s in range(4)]
    waiting = deque()
    for i in range(num_requests):
        prompt = rng.choice(systems) + [rng.randrange(1, 999) for _ in range(rng.randrange(1, 13))]
        waiting.append((request(f"req-{i}", prompt), rng.randrange(1, 9)))
    running, finished, events, checks = [], [], [], []
    while waiting or running:
        manager.new_step_starts()
        left = budget
        for item in list(running) + list(waiting)[:3 - len(running)]:
            req, max_out = item
            new_request = item not in running
            hit, num_hit = ((manager.get_computed_blocks(req)) if new_request
                            else (None, 0))
            computed = req.num_computed_tokens + num_hit
            n = min(req.num_tokens - computed, left)
            if align and n > 0:
                n = aligned_chunk(req, computed, n)
            if n <= 0:
                continue
            if manager.allocate_slots(req, n, num_hit, hit) is None:
                continue                                # retry next step
            if new_request:
                waiting.remove(item)
                running.append(item)
                req.status = RequestStatus.RUNNING
            req.num_computed_tokens = computed + n
            left -= n
            if req.num_computed_tokens == req.num_tokens:      # the model samples
                req.append_output_token_ids(rng.randrange(1, 999))
                if req.num_tokens - req.num_prompt_tokens == max_out:
                    manager.free(req)
                    running.remove(item)
                    finished.append(req)
        new_events = manager.take_events()
        events.extend(new_events)
        for consumer in consumers:
            for event in new_events:
                consumer.apply(event)
        # Each system prompt with a new question, recent conversations with one
        # more token, and the last one cut after every block (hits that end early).
        probes = [s + [7, 7, 7, 7, 7] for s in systems] + \
                 [list(r.all_token_ids) + [5] for r in finished[-4:]]
        if finished:
            tokens = list(finished[-1].all_token_ids)
            probes += [tokens[:k] + [5] for k in range(BLOCK_SIZE, len(tokens), BLOCK_SIZE)]
        truth = [manager.get_computed_blocks(request("probe", p))[1] for p in probes]
        checks.append({"index_equal": pool_index(manager) == consumers[0].blocks,
                       "truth": truth,
                       "answers": [[c.score(p) for p in probes] for c in consumers]})
    return checks, events


# %% [markdown]
# ## 1. Full attention: the events are enough
#
# Run the workload on a plain full-attention model and feed both consumers.

# %%
section("1. Full attention: rebuild the index from events")
manager = make_manager(FullAttentionSpec(BLOCK_SIZE), num_blocks=40)
hash_index = HashIndex({0: "full_attention"}, BLOCK_SIZE)
tree_index = TokenTreeIndex({0: "full_attention"}, BLOCK_SIZE)
checks, events = serve(manager, [hash_index, tree_index], seed=11)
stored = [e for e in events if isinstance(e, BlockStored)]
removed = [e for e in events if isinstance(e, BlockRemoved)]
truth = [t for c in checks for t in c["truth"]]
show(f"{len(checks)} steps, {len(stored)} BlockStored, {len(removed)} BlockRemoved events; "
     f"{len(truth)} probe answers compared; hit lengths seen (tokens: count): "
     f"{sorted(Counter(truth).items())}")
claim(len(removed) > 0 and any(t > 0 for t in truth) and any(t == 0 for t in truth),
      "the workload evicts blocks, and probes both hit and miss")
claim(all(len(e.token_ids) == e.block_size * len(e.block_hashes) for e in stored),
      "every BlockStored is dense: one block_size slice of token_ids per hash")
claim(all(c["index_equal"] for c in checks),
      "after every step, the index rebuilt from events equals the pool's index, copies counted")
claim(all(c["answers"][0] == c["truth"] for c in checks),
      "after every step, HashIndex answers every probe exactly as get_computed_blocks does")
claim(all(c["answers"][1] == c["truth"] for c in checks),
      "the token-keyed tree answers exactly too: on dense events, pairing by position is right")

# %% [markdown]
# ### Copies: why the index counts
#
# A cached 16-token prompt asked again recomputes its last block (lesson 02),
# and the pool caches the new block under the same hash: two copies, two
# `BlockStored` for one hash. Evicting one copy sends one `BlockRemoved`; the
# other copy still serves hits. An index that kept a *set* would now say "gone".

# %%
manager = make_manager(FullAttentionSpec(BLOCK_SIZE), num_blocks=20)
index = HashIndex({0: "full_attention"}, BLOCK_SIZE)
prompt = list(range(100, 116))
first = request("first", prompt)
manager.allocate_slots(first, 16)
again = request("again", prompt)
hit, num_hit = manager.get_computed_blocks(again)
manager.allocate_slots(again, 16 - num_hit, num_hit, hit)
copy_key = (0, maybe_convert_block_hash(again.block_hashes[3]))
for event in manager.take_events():
    index.apply(event)
copies_before = index.blocks[copy_key]
manager.evict_blocks({manager.get_block_ids("first")[0][3]})
for event in manager.take_events():
    index.apply(event)
claim(copies_before == 2 and index.blocks[copy_key] == 1 and pool_index(manager) == index.blocks,
      "two copies stored, one evicted: the index keeps one, as the pool does")
claim(index.score(prompt + [1]) == manager.get_computed_blocks(request("p", prompt + [1]))[1] == 16,
      "and still answers a 16-token hit, like the pool")

# %% [markdown]
# ## 2. The defect: `BlockStored` over blocks that have no hash
#
# vLLM 0.25.1 caches a range of blocks with one `BlockStored` event. Null blocks
# and masked blocks in the range are skipped when hashes are collected, but
# `token_ids` still spans the whole range, and `parent_block_hash` is the hash of
# the block before the range even if that block was never stored in this group
# (`BlockPool.cache_full_blocks`; upstream issue #44451; PR #44488, open,
# proposes making the event dense again and carrying the skipped span in
# optional extra fields; 0.25.1 has none of that). A Mamba group in `align` mode keeps only the state at the end of
# each chunk, so most of its blocks are null:
#
# - a chunk covering several blocks gives fewer hashes than token slices, and
#   the hash belongs to the *last* slice, not the first;
# - a chunk with no stored state at all gives `block_hashes: []`.
#
# The same happens with sliding-window groups whose scheduler block holds more
# window blocks than a hit needs, and with sliding-window groups behind a KV
# connector. Plain models emit clean events. The pool itself stays right.
#
# Below: a hybrid model (full attention + Mamba `align`), same workload.

# %%
section("2. Full attention + Mamba align")
manager = make_manager(FullAttentionSpec(BLOCK_SIZE),
                       MambaSpec(BLOCK_SIZE, mamba_cache_mode="align"), num_blocks=80)
kinds = {0: "full_attention", 1: "mamba"}
hash_index = HashIndex(kinds, BLOCK_SIZE)
tree_index = TokenTreeIndex(kinds, BLOCK_SIZE)
careful_tree = TokenTreeIndex(kinds, BLOCK_SIZE, skip_sparse=True)
checks, events = serve(manager, [hash_index, tree_index, careful_tree], seed=11, align=True)
mamba_stored = [e for e in events if isinstance(e, BlockStored) and e.group_idx == 1]
sparse = [e for e in mamba_stored if len(e.token_ids) != e.block_size * len(e.block_hashes)]
full_stored = [e for e in events if isinstance(e, BlockStored) and e.group_idx == 0]
example = next(e for e in sparse if e.block_hashes)
show(f"Mamba BlockStored events: {len(mamba_stored)}, of which {len(sparse)} carry more "
     f"token slices than hashes. One of them:", str(example))
claim(len(sparse) > 0,
      "Mamba align events carry token_ids for blocks they have no hash for")
claim(all(len(e.token_ids) == e.block_size * len(e.block_hashes) for e in full_stored),
      "the full-attention group's events in the same model stay dense")

# %% [markdown]
# Where does the example's one hash belong? Hash the token prefix block by block
# and find it: it is the hash of the range's **last** slice. The tree consumer
# pairs it with the first slice.

# %%
# The full-attention group's dense events name every block's own token slice.
slice_of_hash = {}
for e in full_stored:
    for i, h in enumerate(e.block_hashes):
        slice_of_hash[h] = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
slices = [example.token_ids[i:i + BLOCK_SIZE] for i in range(0, len(example.token_ids), BLOCK_SIZE)]
true_slice = slice_of_hash.get(example.block_hashes[0])
show(f"token slices in the event: {slices}; the hash belongs to {true_slice}")
claim(true_slice == slices[-1] and len(slices) > 1,
      "the event's single hash is the last slice's; pairing by position gives it the first")

# %% [markdown]
# **No hash at all.** The manager does not align chunks; vLLM's scheduler does
# (`_mamba_block_aligned_split` ends prefill chunks on block boundaries). Give
# the manager a chunk that ends inside a block, and the range it caches holds
# only null Mamba blocks: the event has token ids and `block_hashes: []`.

# %%
hybrid = make_manager(FullAttentionSpec(BLOCK_SIZE),
                      MambaSpec(BLOCK_SIZE, mamba_cache_mode="align"), num_blocks=20)
odd = request("odd", list(range(200, 218)))
hybrid.allocate_slots(odd, 10)                 # ends at token 10, inside block 2
hashless = [e for e in hybrid.take_events() if e.group_idx == 1]
show(f"Mamba table {hybrid.get_block_ids('odd')[1]}; its event: {hashless}")
claim(len(hashless) == 1 and hashless[0].block_hashes == [] and len(hashless[0].token_ids) == 8,
      "a 10-token chunk: the Mamba event spans 8 tokens with no hash (blocks 0 and 1 are null)")

# %% [markdown]
# Now the answers of the workload, step by step, against the pool.

# %%
truth = [t for c in checks for t in c["truth"]]
tree_answers = [a for c in checks for a in c["answers"][1]]
careful_answers = [a for c in checks for a in c["answers"][2]]
tree_wrong = sum(1 for t, a in zip(truth, tree_answers) if a != t)
tree_over = sum(1 for t, a in zip(truth, tree_answers) if a > t)
careful_short = sum(1 for t, a in zip(truth, careful_answers) if a < t)
show(f"{len(truth)} probe answers, hit lengths seen (tokens: count): "
     f"{sorted(Counter(truth).items())}")
show(f"token tree, pairing by position: wrong on {tree_wrong} "
     f"(over the pool's answer on {tree_over}); "
     f"token tree skipping sparse stores: short on {careful_short}, "
     f"over on {sum(1 for t, a in zip(truth, careful_answers) if a > t)}")
claim(any(t > 0 for t in truth) and tree_over > 0,
      "pairing hashes with slices by position promises hits the pool does not have on some probes")
claim(all(a <= t for t, a in zip(truth, careful_answers)) and careful_short > 0,
      "skipping sparse stores never promises a hit the pool lacks, but misses real ones")
claim(all(c["index_equal"] for c in checks),
      "HashIndex, keyed by (group_idx, hash), equals the pool's index after every step")
claim(all(c["answers"][0] == c["truth"] for c in checks),
      "and answers every probe exactly as the pool does: it never needed the token slices")

# %%
finish()
