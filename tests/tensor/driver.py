"""A tiny scheduler and model that run the real KVCacheManager and write real tensors.

The tests of ``kvref.worker`` and ``kvref.attention`` use it so that every block
table comes from ``KVCacheManager`` (prefix hits, windows, null blocks,
preemption), never from a hand-written list only.

``TinyLayer`` makes queries, keys and values from (token, position) alone, as
a real layer's would be a function of the prefix: so a prefix-cache hit reads
exactly the keys a full recomputation would write. ``dense_reference`` computes
the same attention with ``torch.nn.functional.scaled_dot_product_attention`` on
keys laid out densely, with a mask written here from the definitions (not from
kvref's helpers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from kvref import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    MambaSpec,
    Request,
    RequestStatus,
    SlidingWindowSpec,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)
from kvref.attention import make_kv_cache, paged_attention, write_kv
from kvref.attention.mamba_state import make_state_cache, mamba_step, recurrence_reference
from kvref.worker import PAD_SLOT_ID, MultiGroupBlockTable

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no GPU is present")),
]


def window_of(spec) -> int | None:
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def chunk_of(spec) -> int | None:
    return spec.attention_chunk_size if isinstance(spec, ChunkedLocalAttentionSpec) else None


def may_see(q: int, k: int, window: int | None, chunk: int | None) -> bool:
    """The visibility rule, from its definition: causal, then window, then chunk."""
    if k > q:
        return False
    if window is not None and k < q - window + 1:
        return False
    if chunk is not None and k // chunk != q // chunk:
        return False
    return True


class TinyLayer:
    """q, k, v of a token as a function of (token id, position) only."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, seed: int,
                 device: str, dtype: torch.dtype = torch.float32, vocab: int = 50,
                 max_pos: int = 256) -> None:
        g = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.tok = torch.randn(vocab, (num_heads + 2 * num_kv_heads) * head_size, generator=g)
        self.pos = torch.randn(max_pos, (num_heads + 2 * num_kv_heads) * head_size,
                               generator=g)
        self.device, self.dtype = device, dtype

    def qkv(self, tokens: list[int], positions: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [n, H, D]``, ``k [n, Hk, D]``, ``v [n, Hk, D]``."""
        x = self.tok[tokens] + self.pos[positions]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_size
        q, k, v = x.split([h * d, hk * d, hk * d], dim=1)
        n = len(tokens)
        return tuple(t.reshape(n, -1, d).to(self.device, self.dtype) for t in (q, k, v))


class TinyMambaLayer:
    """x of a token from its id alone; the recurrence carries the position."""

    def __init__(self, state_size: int, seed: int, device: str, vocab: int = 50) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tok = torch.randn(vocab, state_size, generator=g).to(device)
        self.decay = (0.5 + 0.5 * torch.rand(state_size, generator=g)).to(device)

    def x(self, tokens: list[int]) -> torch.Tensor:
        return self.tok[tokens]


def dense_reference(layer: TinyLayer, tokens: list[int], query_len: int, scale: float,
                    window: int | None, chunk: int | None) -> torch.Tensor:
    """SDPA over the whole sequence laid out densely: ``[query_len, H, D]``."""
    seq_len = len(tokens)
    # float32 from the (possibly half-precision) inputs: the exact answer for them.
    q, k, v = (t.float() for t in layer.qkv(tokens, list(range(seq_len))))
    q_pos = range(seq_len - query_len, seq_len)
    mask = torch.tensor([[may_see(p, j, window, chunk) for j in range(seq_len)]
                         for p in q_pos], device=layer.device)
    out = F.scaled_dot_product_attention(
        q[-query_len:].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


@dataclass
class GroupBatch:
    """One KV cache group's view of a step: what the attention kernel gets."""

    group: int
    query: torch.Tensor                  # [num_tokens, H, D]
    output: torch.Tensor                 # [num_tokens, H, D]
    block_table: torch.Tensor            # [num_reqs, max_blocks] from the worker's table
    manager_table: torch.Tensor          # same shape, from manager.get_block_ids() now
    slot_mapping: torch.Tensor           # [num_tokens]
    state_before: torch.Tensor | None = None   # Mamba groups: the state cache before the step


@dataclass
class Step:
    """A step's packed batch: one row per running request (query_len may be 0)."""

    req_ids: list[str]
    query_start_loc: list[int]
    seq_lens: list[int]
    positions: list[int]
    groups: list[GroupBatch] = field(default_factory=list)

    def query_len(self, r: int) -> int:
        return self.query_start_loc[r + 1] - self.query_start_loc[r]


class Run:
    """A KVCacheManager, a MultiGroupBlockTable and one KV cache per group, driven
    like vLLM's scheduler and model runner drive them (attention groups only).

    Args:
        specs: one attention spec per group (a hybrid model has several).
        kernel_block_sizes: per group; splits manager blocks when smaller.
        fill: initial value of every cache slot (NaN: unread slots show).
    """

    def __init__(self, specs, num_blocks: int, *, max_model_len: int = 96,
                 max_num_reqs: int = 6, max_num_batched_tokens: int = 128,
                 enable_caching: bool = True, kernel_block_sizes=None,
                 num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 8,
                 device: str = "cpu", dtype: torch.dtype = torch.float32,
                 fill: float = float("nan"), seed: int = 0) -> None:
        init_none_hash(sha256)
        self.specs = list(specs)
        block_sizes = [s.block_size for s in self.specs]
        self.hash_block_size = math.gcd(*block_sizes)
        config = KVCacheConfig(num_blocks, [KVCacheGroupSpec([f"layer.{i}"], s)
                                            for i, s in enumerate(self.specs)])
        self.manager = KVCacheManager(
            config, max_model_len=max_model_len, scheduler_block_size=math.lcm(*block_sizes),
            hash_block_size=self.hash_block_size, max_num_batched_tokens=max_num_batched_tokens,
            enable_caching=enable_caching)
        self.kernel_block_sizes = list(kernel_block_sizes or block_sizes)
        self.table = MultiGroupBlockTable(max_num_reqs, max_model_len, max_num_batched_tokens,
                                          device, block_sizes, self.kernel_block_sizes)
        self.layers = [TinyMambaLayer(head_size, seed + i, device) if isinstance(s, MambaSpec)
                       else TinyLayer(num_heads, num_kv_heads, head_size, seed + i, device, dtype)
                       for i, s in enumerate(self.specs)]
        self.caches = [make_state_cache(num_blocks, head_size, torch.float32, device, fill)
                       if isinstance(s, MambaSpec) else
                       make_kv_cache(num_blocks * (bs // kbs), kbs, num_kv_heads, head_size,
                                     dtype, device, fill)
                       for s, bs, kbs in zip(self.specs, block_sizes, self.kernel_block_sizes)]
        self.scale = head_size ** -0.5
        self.device = device
        self.requests: dict[str, Request] = {}
        self.rows: list[str] = []         # row r of the block table holds rows[r]
        self.admissions: list[tuple[str, int]] = []   # (request, prefix-hit tokens)

    # -- requests -----------------------------------------------------------

    def add_request(self, req_id: str, tokens: list[int]) -> Request:
        req = Request(req_id, tokens,
                      block_hasher=get_request_block_hasher(self.hash_block_size, sha256))
        self.requests[req_id] = req
        return req

    def append_token(self, req_id: str, token: int) -> None:
        """A sampled token: the next decode step computes it."""
        self.requests[req_id].append_output_token_ids(token)

    def _remove_row(self, req_id: str) -> None:
        r = self.rows.index(req_id)
        last = len(self.rows) - 1
        self.table.clear_row(r)
        if r != last:
            # Condense the batch as vLLM does: the last row fills the hole.
            self.table.move_row(last, r)
            self.table.clear_row(last)
            self.rows[r] = self.rows[last]
        self.rows.pop()

    def finish(self, req_id: str) -> None:
        req = self.requests[req_id]
        self.manager.free(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self._remove_row(req_id)

    def preempt(self, req_id: str) -> None:
        """vLLM's preemption: free everything; the request recomputes from scratch
        (or from whatever of its prefix is still cached) when admitted again."""
        req = self.requests[req_id]
        self.manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self._remove_row(req_id)

    def swap(self, i: int, j: int) -> None:
        """Reorder the batch (rows i and j trade places)."""
        self.table.swap_row(i, j)
        self.rows[i], self.rows[j] = self.rows[j], self.rows[i]

    # -- one step -------------------------------------------------------------

    def step(self, schedule: dict[str, int]) -> Step:
        """Schedule ``schedule[req_id]`` new tokens (at most what is left) for each
        listed request, write their keys and values, run paged attention."""
        self.manager.new_step_starts()
        num_new: dict[str, int] = {}
        for req_id, want in schedule.items():
            req = self.requests[req_id]
            if req_id not in self.rows:
                hit, num_hit = self.manager.get_computed_blocks(req)
                n = min(want, req.num_tokens - num_hit)
                if self.manager.allocate_slots(req, n, num_hit, hit) is None:
                    raise RuntimeError(f"no room to admit {req_id}")
                req.num_computed_tokens = num_hit
                self.admissions.append((req_id, num_hit))
                req.status = RequestStatus.RUNNING
                self.rows.append(req_id)
                self.table.add_row(self.manager.get_block_ids(req_id), len(self.rows) - 1)
            else:
                n = min(want, req.num_tokens - req.num_computed_tokens)
                if n == 0:
                    continue                      # nothing left to compute this step
                new = self.manager.allocate_slots(req, n)
                if new is None:
                    raise RuntimeError(f"no room for {req_id}")
                self.table.append_row(new.get_block_ids(), self.rows.index(req_id))
            num_new[req_id] = n

        step = Step(list(self.rows), [0], [], [])
        tokens: list[int] = []
        for req_id in self.rows:
            req = self.requests[req_id]
            n = num_new.get(req_id, 0)
            start = req.num_computed_tokens
            step.positions.extend(range(start, start + n))
            tokens.extend(req.all_token_ids[start:start + n])
            step.query_start_loc.append(step.query_start_loc[-1] + n)
            step.seq_lens.append(start + n)
        if not tokens:
            raise ValueError(f"nothing to compute in step {schedule}")
        num_reqs = len(self.rows)
        qsl = torch.tensor(step.query_start_loc)
        slot_mappings = self.table.compute_slot_mapping(num_reqs, qsl,
                                                        torch.tensor(step.positions))
        for g, (spec, layer, cache) in enumerate(zip(self.specs, self.layers, self.caches)):
            block_table = self.table[g].get_device_tensor(num_reqs)
            if isinstance(spec, MambaSpec):
                x = layer.x(tokens)
                before = cache.clone()
                y = mamba_step(x, cache, decay=layer.decay, query_start_loc=qsl,
                               seq_lens=step.seq_lens, block_table=block_table,
                               block_size=spec.block_size,
                               mamba_cache_mode=spec.mamba_cache_mode)
                step.groups.append(GroupBatch(g, x, y, block_table,
                                              self.manager_table(g, block_table.shape[1]),
                                              slot_mappings[g], before))
                continue
            q, k, v = layer.qkv(tokens, step.positions)
            write_kv(cache, k, v, slot_mappings[g])
            out = paged_attention(q, cache, query_start_loc=qsl, seq_lens=step.seq_lens,
                                  block_table=block_table, scale=self.scale,
                                  sliding_window=window_of(spec),
                                  attention_chunk_size=chunk_of(spec))
            step.groups.append(GroupBatch(g, q, out, block_table,
                                          self.manager_table(g, block_table.shape[1]),
                                          slot_mappings[g]))
        for req_id, n in num_new.items():
            self.requests[req_id].num_computed_tokens += n
        return step

    def manager_table(self, group: int, width: int) -> torch.Tensor:
        """The manager's block ids for each row now (nulls included), split into
        kernel blocks like the worker's table, padded with 0 to ``width``."""
        k = self.specs[group].block_size // self.kernel_block_sizes[group]
        rows = torch.zeros(len(self.rows), width, dtype=torch.int32)
        for r, req_id in enumerate(self.rows):
            ids = [b * k + j for b in self.manager.get_block_ids(req_id)[group]
                   for j in range(k)]
            rows[r, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return rows.to(self.device)

    def reference(self, step: Step, group: int) -> torch.Tensor:
        """Dense SDPA outputs for the step's query rows of one group."""
        spec = self.specs[group]
        outs = []
        for r, req_id in enumerate(step.req_ids):
            q_len = step.query_len(r)
            if q_len and isinstance(spec, MambaSpec):
                tokens = list(self.requests[req_id].all_token_ids[:step.seq_lens[r]])
                layer = self.layers[group]
                outs.append(recurrence_reference(layer.x(tokens), layer.decay)[-q_len:])
            elif q_len:
                tokens = list(self.requests[req_id].all_token_ids[:step.seq_lens[r]])
                outs.append(dense_reference(self.layers[group], tokens, q_len, self.scale,
                                            window_of(spec), chunk_of(spec)))
        return torch.cat(outs)

    def readable_slots(self, step: Step, group: int) -> set[int]:
        """Every slot some query of the step may read, by the definition (brute force),
        addressed through the manager's current table."""
        spec = self.specs[group]
        bs = self.kernel_block_sizes[group]
        table = self.manager_table(group, self.table[group].max_num_blocks_per_req).tolist()
        slots = set()
        for r in range(len(step.req_ids)):
            seq_len, q_len = step.seq_lens[r], step.query_len(r)
            for p in range(seq_len - q_len, seq_len):
                for k in range(seq_len):
                    if may_see(p, k, window_of(spec), chunk_of(spec)):
                        slots.add(table[r][k // bs] * bs + k % bs)
        return slots


def poison_row_tails(run: Run, group: int, block_table: torch.Tensor) -> torch.Tensor:
    """A copy of a step's block table whose columns past each row's used part
    hold a block id outside the cache: reading one fails loudly."""
    poisoned = block_table.clone()
    bad = run.caches[group].shape[0] + 7
    for r in range(poisoned.shape[0]):
        poisoned[r, run.table[group].num_blocks_per_row[r]:] = bad
    return poisoned


def nan_outside(cache: torch.Tensor, readable: set[int]) -> torch.Tensor:
    """A copy of ``cache`` with every slot not in ``readable`` set to NaN."""
    num_blocks, _, bs = cache.shape[:3]
    keep = torch.zeros(num_blocks * bs, dtype=torch.bool)
    keep[list(readable)] = True
    keep = keep.reshape(num_blocks, 1, bs, 1, 1).to(cache.device)
    return torch.where(keep, cache, torch.full_like(cache, float("nan")))


def check_step(run: Run, step: Step, atol: float = 1e-5, rtol: float = 0.0) -> None:
    """What every step must satisfy, for every group:

    - the output equals dense SDPA in float32 (``atol``, ``rtol``) and is finite;
    - it is unchanged when every slot no query may read is NaN;
    - the worker's table (rows appended step by step) and the manager's current
      table give the same output: they agree wherever attention reads, and
      attention reads no column past a row's used part (those hold an
      out-of-range id in the check);
    - the worker's slot-mapping buffer is padding (-1) after the step's tokens;
    - no readable slot is in the null block, and in window and chunk groups the
      manager's null blocks are exactly the blocks left of the first query's
      first visible key.
    """
    for gb in step.groups:
        g = gb.group
        spec = run.specs[g]
        out = gb.output
        assert torch.isfinite(out[:step.query_start_loc[-1]]).all()
        tail = run.table[g].slot_mapping[step.query_start_loc[-1]:]
        assert (tail == PAD_SLOT_ID).all(), "the slot-mapping buffer keeps an earlier tail"
        if step.query_start_loc[-1]:
            torch.testing.assert_close(out.float(), run.reference(step, g), atol=atol,
                                       rtol=rtol)
        if isinstance(spec, MambaSpec):
            check_mamba_step(run, step, gb)
            continue
        readable = run.readable_slots(step, g)
        kbs = run.kernel_block_sizes[g]
        k = spec.block_size // kbs
        assert not any(s // kbs < k for s in readable), "a query reads the null block"
        common = dict(query_start_loc=step.query_start_loc, seq_lens=step.seq_lens,
                      scale=run.scale, sliding_window=window_of(spec),
                      attention_chunk_size=chunk_of(spec))
        poisoned = nan_outside(run.caches[g], readable)
        assert torch.equal(paged_attention(gb.query, poisoned,
                                           block_table=poison_row_tails(run, g, gb.block_table),
                                           **common), out)
        assert torch.equal(paged_attention(gb.query, poisoned, block_table=gb.manager_table,
                                           **common), out)
        window, chunk = window_of(spec), chunk_of(spec)
        if window is None and chunk is None:
            continue
        for r, req_id in enumerate(step.req_ids):
            if step.query_len(r) == 0:
                continue
            first_query = step.seq_lens[r] - step.query_len(r)
            lo = (max(0, first_query - window + 1) if window is not None
                  else first_query // chunk * chunk)
            ids = run.manager.get_block_ids(req_id)[g]
            nulls = [i for i, b in enumerate(ids) if b == 0]
            assert nulls == list(range(lo // spec.block_size)), (
                f"{req_id}: first query at {first_query} sees keys from {lo}; "
                f"null blocks at {nulls} in {ids}")


def check_mamba_step(run: Run, step: Step, gb: GroupBatch) -> None:
    """A Mamba group reads one state block per request, never the null block:
    with every other block NaN (before the step) the outputs and the written
    states are the same."""
    spec = run.specs[gb.group]
    bs = spec.block_size
    read = set()
    for r in range(len(step.req_ids)):
        context_len = step.seq_lens[r] - step.query_len(r)
        if step.query_len(r) and context_len:
            block = int(gb.manager_table[r, (context_len - 1) // bs])
            assert block != 0, f"row {r} would read its state from the null block"
            read.add(block)
    poisoned = torch.full_like(gb.state_before, float("nan"))
    for block in read:
        poisoned[block] = gb.state_before[block]
    y = mamba_step(gb.query, poisoned, decay=run.layers[gb.group].decay,
                   query_start_loc=step.query_start_loc, seq_lens=step.seq_lens,
                   block_table=gb.manager_table, block_size=bs,
                   mamba_cache_mode=spec.mamba_cache_mode)
    assert torch.equal(y, gb.output)
    written = ~torch.isnan(poisoned).any(dim=1)
    assert torch.equal(poisoned[written], run.caches[gb.group][written])
