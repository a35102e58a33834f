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
# # Lesson 16: What changed in vLLM's KV cache since 0.25.1
#
# kvref mirrors one release, vLLM 0.25.1, and stays pinned to it: a reference
# that branched on versions would double what a reader holds. But a reader
# today may run a newer vLLM and ask: *is this still how it works?* This lesson
# answers for vLLM 0.33.0, with proof rather than release notes.
#
# kvref's conformance traces are exact, op-by-op records of what vLLM 0.25.1
# answers. `tools/vllm_changes.py` replays all 254 of them on vLLM 0.25.1 and
# on 0.33.0 (through a small adapter for the API changes, `tools/vllm_versions.py`)
# and puts every divergence down to a behaviour change by *undoing* that change
# with one small patch; `docs/vllm_0.33_changes.md` is its report. For each
# change it kept the first op where the change shows, with 0.25.1's answer and
# 0.33.0's: `tutorials/data/vllm_0.33_answers.json`. This lesson needs no vLLM.
# For each change it replays that trace on **kvref** up to that op, shows
# kvref's answer next to 0.33.0's recorded one, and checks what it says about
# the difference. (0.33.0's answer was recorded with the *other* changes undone,
# so that each shows alone.) Line numbers below are vLLM 0.33.0's (`vllm/v1/core/...`).

# %%
import json
from pathlib import Path

from rich.table import Table

from kvref import FullAttentionSpec
from kvref.core.kv_cache_utils import hash_block_tokens, init_none_hash
from kvref.hashing import sha256
from kvref.verify.trace_replay import TraceReplayer, load_trace, seeded_none_hash
from kvref.core import kv_cache_utils

from _lesson import claim, finish, section, show, start

args = start("What changed in vLLM's KV cache since 0.25.1")
REPO = Path(__file__).resolve().parent.parent if "__file__" in globals() else Path.cwd().parent
TRACES = REPO / "tests" / "conformance" / "traces"
ANSWERS = json.loads((REPO / "tutorials" / "data" / "vllm_0.33_answers.json")
                     .read_text(encoding="utf-8"))
NEW = ANSWERS["new"]


def on_kvref(key):
    """Replay the trace of change ``key`` on kvref up to its first op: the trace,
    kvref's replayer, and kvref's observation of that op (construction: -1)."""
    entry = ANSWERS["answers"][key]
    trace = load_trace(TRACES / entry["trace"])
    replayer = TraceReplayer(trace["header"])
    if entry["index"] < 0:
        return entry, trace, replayer, replayer.initial_observation()
    for op in trace["ops"][:entry["index"]]:
        replayer.run(op)
    return entry, trace, replayer, replayer.run(trace["ops"][entry["index"]])


def side_by_side(entry, mine, new, label="ret"):
    table = Table(title=f"{entry['trace']} op #{entry['index']} {entry['op']}")
    table.add_column("")
    table.add_column(label, overflow="fold")
    table.add_row("kvref", json.dumps(mine))
    table.add_row("vLLM 0.25.1 (recorded)", json.dumps(entry["0.25.1"].get(label, entry["0.25.1"])))
    table.add_row(f"vLLM {NEW} (recorded)", json.dumps(new))
    show(table)


# %% [markdown]
# ## 0. The numbers
#
# Every trace replays identically on 0.25.1 through the same adapter (the
# harness is sound). On 0.33.0 only a few replay identically as they are; with
# each behaviour change below undone, all do but those with Mamba mode `all`,
# which 0.33.0 no longer has (section 8): nothing undoes a removed mode.

# %%
section("0. 254 traces on two releases")
total = ANSWERS["total"]
show(f"{total['traces']} traces: {total['identical_0.25.1']} identical on 0.25.1, "
     f"{total['identical_as_is']} on {NEW} as they are, {total['accounted']} after accounting")
claim(total["identical_0.25.1"] == total["traces"] == 254,
      "all 254 vendored traces replay identically on vLLM 0.25.1 through the adapter")
claim(total["identical_as_is"] < total["accounted"] < total["traces"],
      f"on {NEW}: {total['identical_as_is']} identical as they are, "
      f"{total['accounted']} once the changes below are undone")

# %% [markdown]
# ## 1. Extra keys in block hashes are tagged
#
# A block's hash covers its tokens, its parent's hash and its *extra keys*:
# the LoRA, the images in the block, the cache salt, the prompt embeddings
# (lesson 02). 0.25.1 hashed the bare values; 0.33.0 tags each with its kind:
# `("lora", name, path)` (`kv_cache_utils.py:590-607`), `("mm", id, offset)`
# (`:574`), `("cache_salt", salt)` (`:659-661`), `("prompt_embeds", digest)`
# (`:610-634`). The LoRA key gains the adapter's path "so that re-pointing a
# LoRA name at a different adapter does not reuse KV computed with the previous
# one" (`:593-594`). So every request with extra keys hashes differently from
# 0.25.1, while a plain request (no extra keys) hashes exactly as before.
# Events still publish the untagged keys, for routers (`:680-705`).
#
# The first op where it shows: a LoRA request of 352 tokens. Its last block
# hash, recomputed here with kvref's own hash function and the tagged key
# (the replay harness gives every adapter the path `/loras/<name>`), is
# 0.33.0's, byte for byte.

# %%
section("1. Tagged extra keys")
entry, trace, replayer, observed = on_kvref("tagged_extra_keys")
new = entry[NEW]["ret"]
side_by_side(entry, observed["ret"], new)
op = trace["ops"][entry["index"]]
claim(observed["ret"] == entry["0.25.1"]["ret"], "kvref answers what vLLM 0.25.1 answered")
request = replayer.requests[op["req"]]
block_size = trace["header"]["manager"]["hash_block_size"]
lora = op["lora"]["name"]


def chain(keys):
    parent = None
    for start_token in range(0, len(request.all_token_ids) // block_size * block_size,
                             block_size):
        parent = hash_block_tokens(sha256, parent,
                                   request.all_token_ids[start_token:start_token + block_size],
                                   keys)
    return bytes(parent).hex()


kv_cache_utils.NONE_HASH = seeded_none_hash(kv_cache_utils, sha256,
                                            trace["header"]["hash"]["none_hash_seed"])
claim(chain((lora,)) == observed["ret"]["last_block_hash"] != new["last_block_hash"],
      f"untagged key ({lora!r},): kvref's hash, not {NEW}'s")
claim(chain((("lora", lora, f"/loras/{lora}"),)) == new["last_block_hash"],
      f"tagged key ('lora', {lora!r}, '/loras/{lora}'): exactly {NEW}'s hash")
claim(new["num_block_hashes"] == observed["ret"]["num_block_hashes"],
      "the same number of hashes: only their values moved")
claim(entry["traces"] > total["identical_as_is"],
      f"it shows in {entry['traces']} of 254 traces (every one with LoRA, images, a salt "
      "or embeddings)")
init_none_hash(sha256)

# %% [markdown]
# ## 2. `get_num_common_prefix_blocks` always answers 0
#
# 0.25.1 counted the blocks every running request shares, for cascade
# attention (kvref's `kvref.attention.cascade` shows what it bought). 0.33.0
# removed cascade attention; the method stays for out-of-tree schedulers and
# returns `[0] * num_groups` (`kv_cache_manager.py:700-703`).

# %%
section("2. No cascade prefix")
entry, trace, replayer, observed = on_kvref("no_cascade_prefix")
side_by_side(entry, observed["ret"], entry[NEW]["ret"])
claim(observed["ret"] == entry["0.25.1"]["ret"] and max(observed["ret"]) > 0,
      f"kvref, as 0.25.1: {observed['ret']} common blocks")
claim(entry[NEW]["ret"] == [0] * len(observed["ret"]), f"{NEW}: 0 for every group")

# %% [markdown]
# ## 3. `take_new_block_ids` answers only when blocks need zeroing
#
# 0.25.1 handed the worker the ids of every new full-attention block. In
# 0.33.0 the ids exist for *zeroing* new blocks on the worker, needed only for
# Mamba layers (whose state is read before it is written) or mixed KV
# precisions (`kv_cache_interface.py:1651-1660`); each manager records them
# only then (`single_type_kv_cache_manager.py:114-120`).

# %%
section("3. New block ids only for zeroing")
entry, trace, replayer, observed = on_kvref("new_block_ids_for_zeroing_only")
side_by_side(entry, observed["ret"], entry[NEW]["ret"])
kinds = {group["kind"] for group in trace["header"]["groups"]}
claim(observed["ret"] == entry["0.25.1"]["ret"] and len(observed["ret"]) > 0,
      f"kvref, as 0.25.1: {len(observed['ret'])} new block ids")
claim(entry[NEW]["ret"] == [] and "mamba" not in kinds,
      f"{NEW}: none, on a model without Mamba layers")

# %% [markdown]
# ## 4. `pop_blocks_for_free` leaves out leading null blocks
#
# A sliding-window table starts with null blocks where the window moved on
# (lesson 06). 0.25.1 returned them with the request's blocks; 0.33.0 trims
# each group's leading nulls (`single_type_kv_cache_manager.py:571-589`,
# `kv_cache_utils.py:247-250`): the caller would only hand them back to the pool.

# %%
section("4. Popped blocks without the null head")
entry, trace, replayer, observed = on_kvref("pop_drops_null_head")
side_by_side(entry, observed["ret"], entry[NEW]["ret"])
claim(observed["ret"] == entry["0.25.1"]["ret"] and 0 in observed["ret"],
      "kvref, as 0.25.1: null blocks (id 0) among the popped blocks")
claim(entry[NEW]["ret"] == [b for b in observed["ret"] if b != 0],
      f"{NEW}: the same blocks in the same order, without the nulls")

# %% [markdown]
# ## 5. Sink attention no longer reserves its sink blocks
#
# In 0.25.1 a sink-attention group took `sink_len / block_size` blocks off the
# free queue when it was built (kvref does the same). 0.33.0's manager only
# checks that the sink length is whole blocks
# (`single_type_kv_cache_manager.py:2199-2220`), so the pool starts with those
# blocks free.

# %%
section("5. Sink blocks")
entry, trace, replayer, observed = on_kvref("sink_blocks_not_reserved")
group = trace["header"]["groups"][0]
sink_blocks = group["sink_len"] // group["block_size"]
side_by_side(entry, observed["num_free_blocks"], entry[NEW]["num_free_blocks"],
             label="num_free_blocks")
claim(observed["num_free_blocks"] == entry["0.25.1"]["num_free_blocks"],
      "kvref, as 0.25.1, holds the sink blocks from the start")
claim(entry[NEW]["num_free_blocks"] - observed["num_free_blocks"] == sink_blocks,
      f"{NEW}: {sink_blocks} more free blocks, sink_len {group['sink_len']} / "
      f"block size {group['block_size']}")

# %% [markdown]
# ## 6. With EAGLE on a hybrid model, the peek may pass `num_tokens - 1`
#
# With EAGLE, the hit search matches one block more than the candidate and
# then drops it (the draft model must recompute the last block, lesson 10).
# 0.25.1 capped that peek at `max_cache_hit_length = num_tokens - 1`; 0.33.0
# caps it at the request's hashed length (`kv_cache_coordinator.py:870-884`,
# margin from `eagle_proof_margin`, `kv_cache_utils.py:804-813`). A prompt of
# whole blocks can then keep one block more.

# %%
section("6. The EAGLE peek")
entry, trace, replayer, observed = on_kvref("eagle_peek_past_max_hit")
side_by_side(entry, observed["ret"], entry[NEW]["ret"])
op = trace["ops"][entry["index"]]
request = replayer.requests[op["req"]]
block_size = trace["header"]["groups"][0]["block_size"]
mine, theirs = observed["ret"]["num_computed_tokens"], entry[NEW]["ret"]["num_computed_tokens"]
claim(observed["ret"] == entry["0.25.1"]["ret"], f"kvref, as 0.25.1: a hit of {mine} tokens")
claim(theirs == mine + block_size and request.num_tokens % block_size == 0,
      f"{NEW}: {theirs}, one block more, on a prompt of {request.num_tokens} tokens "
      f"(whole blocks of {block_size})")
claim(mine + 2 * block_size > request.num_tokens - 1,
      f"the peek that found it reached token {mine + 2 * block_size}, past "
      f"num_tokens - 1 = {request.num_tokens - 1}")

# %% [markdown]
# ## 7. A partial-tail cache entry when blocks are larger than hash blocks
#
# When a full-attention group's block is larger than the hash block, 0.33.0
# also caches the prompt's last hash boundary *inside* a block
# (`single_type_kv_cache_manager.py:840-896`, `block_pool.py:486`). A resend
# can hit part of that block (and copy it before writing, copy-on-write) only
# where 0.33.0 turns on fine-grained partial hash hits: beside a Mamba `align`
# group whose block is larger than the hash block
# (`kv_cache_utils.py:762-801`, `kv_cache_coordinator.py:694-718`). The traces
# where the change shows (`hybrid_diff_block_sizes`) have no Mamba group, so
# there it is only one more `BlockStored`, with one hash and `block_size` equal
# to the hash block size.

# %%
section("7. Partial-tail entries")
entry, trace, replayer, observed = on_kvref("partial_tail_cache_entry")
mine, theirs = observed["ret"], entry[NEW]["ret"]
extra = [i for i in range(len(theirs)) if theirs[:i] + theirs[i + 1:] == mine]
hash_block_size = trace["header"]["manager"]["hash_block_size"]
show(f"kvref: {len(mine)} events; {NEW}: {len(theirs)}")
claim(mine == entry["0.25.1"]["ret"], "kvref's events are 0.25.1's")
claim(len(extra) == 1, f"{NEW} has exactly one event more, and the others are kvref's")
event = theirs[extra[0]]
show(json.dumps({k: event[k] for k in ("type", "block_hashes", "block_size", "group_idx")}))
full_block = trace["header"]["groups"][event["group_idx"]]["block_size"]
claim(event["type"] == "BlockStored" and len(event["block_hashes"]) == 1
      and event["block_size"] == hash_block_size < full_block,
      f"the extra one stores one hash of {hash_block_size} tokens in a group of "
      f"{full_block}-token blocks")

# %% [markdown]
# ## 8. Mamba mode `all` is gone
#
# 0.25.1 offered three Mamba modes (lesson 08). 0.33.0 keeps two, `align` and
# `none` (`vllm/config/cache.py:176`), requires `align` for a Mamba group with
# prefix caching, and asserts it when the manager is built
# (`single_type_kv_cache_manager.py:1442-1444`). Every trace with mode `all`
# stops there; there is nothing to undo.

# %%
section("8. Mamba 'all'")
entry, trace, replayer, observed = on_kvref("mamba_all_removed")
modes = [g.get("mamba_cache_mode") for g in trace["header"]["groups"] if g["kind"] == "mamba"]
show(f"kvref builds it: {observed['num_free_blocks']} free blocks; {NEW}: "
     f"{entry[NEW]['raises']}")
claim(set(modes) == {"all"} and observed["num_free_blocks"] == entry["0.25.1"]["num_free_blocks"],
      "kvref builds a mode-'all' manager as 0.25.1 did")
claim(entry[NEW]["raises"].startswith("AssertionError") and "'align'" in entry[NEW]["raises"],
      f"{NEW} refuses it; {entry['traces']} traces stop at construction")

# %% [markdown]
# ## 9. Mamba with EAGLE: the defect kvref teaches is fixed
#
# Lesson 10 shows vLLM 0.25.1's EAGLE + Mamba defect (INV-HIT-2): the Mamba
# group takes the EAGLE peek margin but never drops a block, so a hit can run
# one block past the full-attention blocks. 0.33.0 gives Mamba no margin: "its
# finder never drops (draft models have no mamba layers)"
# (`kv_cache_coordinator.py:870-875`).

# %%
section("9. Mamba + EAGLE hits")
entry, trace, replayer, observed = on_kvref("mamba_eagle_no_margin")
side_by_side(entry, observed["ret"], entry[NEW]["ret"])
full, mamba = (trace["header"]["groups"][0]["block_size"], observed["ret"]["blocks"][0])
mine = observed["ret"]["num_computed_tokens"]
theirs = entry[NEW]["ret"]["num_computed_tokens"]
claim(observed["ret"] == entry["0.25.1"]["ret"] and mine > len(mamba) * full,
      f"kvref, as 0.25.1: a hit of {mine} tokens over {len(mamba)} full-attention blocks "
      f"of {full} (INV-HIT-2)")
claim(theirs == len(entry[NEW]["ret"]["blocks"][0]) * full < mine,
      f"{NEW}: {theirs} tokens, exactly its full-attention blocks")

# %% [markdown]
# ## 10. Mamba frees on processed tokens, without its own margin
#
# 0.25.1's Mamba manager took `num_speculative_blocks` off the computed tokens
# before freeing the blocks a hit no longer needs, in case draft tokens were
# rejected. 0.33.0 dropped that margin (`single_type_kv_cache_manager.py:1629-1657`)
# because `allocate_slots` now frees every group "on the processed-token
# basis": the computed tokens less the request's tokens in flight
# (`kv_cache_manager.py:561-567`). With EAGLE, a Mamba block goes back to the
# pool a step earlier.

# %%
section("10. Mamba's freeing margin")
entry, trace, replayer, observed = on_kvref("mamba_frees_without_margin")
op = trace["ops"][entry["index"]]
groups = trace["header"]["groups"]
mamba_group = next(i for i, g in enumerate(groups) if g["kind"] == "mamba")
held = {b.block_id for b in replayer.manager.coordinator.single_type_managers[mamba_group]
        .req_to_blocks[op["req"]]}
mine_ref = {block for block, _ in observed["state"]["ref"]}
their_ref = {block for block, _ in entry[NEW]["state"]["ref"]}
show(f"free blocks after op #{entry['index']} {op['op']}: kvref "
     f"{observed['state']['nfree']}, {NEW} {entry[NEW]['state']['nfree']}; "
     f"blocks kvref holds and {NEW} freed: {sorted(mine_ref - their_ref)}")
claim(observed["state"] == entry["0.25.1"]["state"], "kvref's pool is 0.25.1's")
claim(entry[NEW]["state"]["nfree"] > observed["state"]["nfree"]
      and bool(mine_ref - their_ref) and (mine_ref - their_ref) <= held,
      f"{NEW} has more free blocks, and the ones it freed are this request's Mamba blocks "
      f"(num_speculative_blocks {groups[mamba_group]['num_speculative_blocks']})")

# %% [markdown]
# ## What kvref does not model
#
# 0.33.0's KV layer also grew mechanisms none of kvref's traces reach, and
# kvref (pinned to 0.25.1) does not have:
#
# - partial hash hits with copy-on-write of the shared tail block
#   (`single_type_kv_cache_manager.py:389-398`, `:455`);
# - Mamba prefill checkpoints (`vllm/v1/kv_cache_interface.py:1101-1102`);
# - shared-prefix junction retention: `get_computed_blocks` answers a third
#   value, the boundary to pin (`kv_cache_manager.py:266-328`);
# - lookahead hashing (`num_hash_lookahead_tokens`, `kv_cache_manager.py:141`);
# - a recycling-aware admission cap for window groups from
#   `max_in_flight_tokens` (`single_type_kv_cache_manager.py:2636-2651`);
# - a host tier with its own block pool (HiSparse,
#   `single_type_kv_cache_manager.py:2223-2240`);
# - circular-buffer KV cache specs (`vllm/v1/kv_cache_interface.py:968`).
#
# The API changed too, in five places the adapter bridges (`tools/vllm_versions.py`):
# `max_num_batched_tokens=` is `max_in_flight_tokens=`; `get_computed_blocks`
# returns three values; prefix-cache stats are recorded at admission by
# `record_prefix_cache_stats`; the retention interval is a `KVCacheConfig`
# field; and the sink manager takes the coordinator's keywords in neither release.

# %%
section("What the recorded answers cover")
covered = sorted(ANSWERS["answers"])
show(", ".join(covered))
claim(len(covered) == 10 and all(ANSWERS["answers"][k]["traces"] > 0 for k in covered),
      "ten changes, each seen in at least one vendored trace")
finish()
