"""The model runner: one ``SchedulerOutput`` in, one sampled token per request out.

Mirrors ``vllm/v1/worker/gpu_model_runner.py`` (``_update_states``,
``_prepare_inputs``, ``execute_model``, ``initialize_kv_cache``) and the
KV-cache layout of ``vllm/v1/core/kv_cache_utils.py::get_kv_cache_config_from_groups``.
A step, for a batch of requests packed back to back:

    request      a (prefill chunk)     b (decode)   c (new, 8-token prefix hit)
    positions    0 1 2 3 4 5           17           8 9 10
    input_ids    a0 .. a5              b17          c8 c9 c10
    query_start_loc  [0, 6, 7, 10]     seq_lens [6, 18, 11]
    slot_mapping     block_table[r][pos // block_size] * block_size + pos % block_size
                     (one per KV cache group: each group has its own blocks)

then the model writes the new keys/values at ``slot_mapping`` and attends over
each request's blocks; the logits of each request's last scheduled token are
sampled, unless the step ended inside its prompt (a cut prefill).

Unlike vLLM, the batch is not persistent: requests take table rows in the
scheduler's order every step. A row that holds the same request as last step
only gets the request's new blocks appended, as in vLLM's persistent batch;
any other row is rewritten from the block ids the runner keeps per request
(``RunnerRequestStates``, ``gpu_input_batch.py``).

KV cache layout: one ``[num_blocks, 2, block_size, num_kv_heads, head_size]``
tensor per layer position, shared by the ``j``-th layer of every KV cache group
(vLLM's ``KVCacheTensor.shared_by``). It works because a block id belongs to
one group at a time: the pool never hands one block to two groups.

    >>> config = ModelConfig(architecture="qwen3", vocab_size=32, hidden_size=16,
    ...     intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
    ...     num_key_value_heads=1, head_dim=8, sliding_window=6,
    ...     layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    >>> kv_config = make_kv_cache_config(config, block_size=4, num_blocks=20,
    ...                                  dtype=torch.float32)
    >>> [(type(g.kv_cache_spec).__name__, g.layer_names) for g in kv_config.kv_cache_groups]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('FullAttentionSpec', ['model.layers.1.self_attn.attn']),
     ('SlidingWindowSpec', ['model.layers.0.self_attn.attn', 'model.layers.2.self_attn.attn'])]
    >>> runner = GPUModelRunner(TransformerForCausalLM(config), kv_config, max_model_len=32,
    ...                         max_num_batched_tokens=16, max_num_reqs=4)
    >>> runner.kv_caches[0] is runner.kv_caches[1]      # tensor 0: layer 0 and layer 1
    True
    >>> runner.kv_caches[2].shape                        # [num_blocks, 2, block, KV, D]
    torch.Size([20, 2, 4, 1, 8])

The assembled engine is ``kvref.entrypoints.llm.LLM``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from kvref.core.kv_cache_utils import capacity_config, get_kv_cache_groups
from kvref.attention import PagedAttentionPlan, make_kv_cache
from kvref.distributed.kv_transfer.kv_connector.factory import (
    KVConnectorFactory, resolve_disable_hybrid_kv_cache_manager)
from kvref.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvref.worker.kv_connector_model_runner_mixin import execute_with_connector
from kvref.model_executor.model import AttentionMetadata, TransformerForCausalLM
from kvref.config.model import ModelConfig
from kvref.worker.gpu_input_batch import CachedRequestState, RunnerRequestStates
from kvref.spec_decode.ngram_proposer import NgramProposer
from kvref.outputs import Logprob, ModelRunnerOutput
from kvref.sched.output import SchedulerOutput
from kvref.worker import MultiGroupBlockTable

__all__ = ["GPUModelRunner", "layer_name", "make_kv_cache_config"]


def layer_name(layer_idx: int) -> str:
    """The attention layer's name in KV cache groups (vLLM's naming)."""
    return f"model.layers.{layer_idx}.self_attn.attn"


def make_kv_cache_config(config: ModelConfig, block_size: int, num_blocks: int,
                         dtype: torch.dtype, *,
                         disable_hybrid_kv_cache_manager: bool = False) -> KVCacheConfig:
    """One KV cache group per layer type: full attention first, then sliding window.

    (vLLM also splits a type into several equal-size groups so that every
    group has the same number of layers; one group per type is the same idea
    with fewer moving parts.)

    With the hybrid manager off (``disable_hybrid_kv_cache_manager``, what the
    engine picks for a connector without ``SupportsHMA``) the layers' specs go
    through vLLM's path instead (``get_kv_cache_groups``, which first runs
    ``unify_hybrid_kv_cache_specs``): window layers become
    ``FullAttentionSpec(sliding_window=W)`` and all layers share one group,
    whose blocks are kept for every token.

        >>> config = ModelConfig(architecture="qwen3", vocab_size=32, hidden_size=16,
        ...     intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        ...     num_key_value_heads=1, head_dim=8, sliding_window=6,
        ...     layer_types=("sliding_attention", "full_attention"))
        >>> (group,) = make_kv_cache_config(config, 4, 20, torch.float32,
        ...     disable_hybrid_kv_cache_manager=True).kv_cache_groups
        >>> type(group.kv_cache_spec).__name__, group.kv_cache_spec.sliding_window
        ('FullAttentionSpec', 6)
    """
    dtype_name = str(dtype).removeprefix("torch.")
    heads = dict(num_kv_heads=config.num_key_value_heads, head_size=config.head_dim,
                 dtype=dtype_name)
    if disable_hybrid_kv_cache_manager:
        specs = {layer_name(i): FullAttentionSpec(block_size, **heads) if t == "full_attention"
                 else SlidingWindowSpec(block_size, config.sliding_window, **heads)
                 for i, t in enumerate(config.layer_types)}
        groups = get_kv_cache_groups(
            capacity_config(1, disable_hybrid_kv_cache_manager=True), specs)
        return KVCacheConfig(num_blocks, groups)
    full = [layer_name(i) for i, t in enumerate(config.layer_types) if t == "full_attention"]
    window = [layer_name(i) for i, t in enumerate(config.layer_types)
              if t == "sliding_attention"]
    groups = []
    if full:
        groups.append(KVCacheGroupSpec(full, FullAttentionSpec(block_size, **heads)))
    if window:
        groups.append(KVCacheGroupSpec(
            window, SlidingWindowSpec(block_size, config.sliding_window, **heads)))
    return KVCacheConfig(num_blocks, groups)


@dataclass(slots=True)
class _Batch:
    """The packed inputs of one step."""

    input_ids: torch.Tensor            # [num_tokens]
    positions: torch.Tensor            # [num_tokens]
    logits_indices: torch.Tensor | None  # [num_logits]: rows whose next token is sampled
                                         # (None: all of them, in order)
    # Per request that samples: its state, its draft, and its rows of logits_indices
    # (the last known token, then each draft token: len(draft) + 1 rows).
    sampling: list[tuple[CachedRequestState, list[int], slice]]
    attn_metadata: list[AttentionMetadata]   # per layer
    query_start_loc: list[int]               # row r's tokens: [qsl[r], qsl[r + 1])


class GPUModelRunner(RunnerRequestStates):
    """Runs ``model`` on the scheduled batch over a paged KV cache.

    Args:
        model: the network (weights already loaded).
        kv_cache_config: the pool the scheduler's manager allocates from.
        max_model_len, max_num_batched_tokens, max_num_reqs: size the block
            table and its slot-mapping buffer.
        device, dtype: where and in what the KV cache lives.
        keep_logits: return each sampled token's logits (float32, CPU) in
            ``ModelRunnerOutput.logits`` (tests compare them with transformers).
        drafter: an ``NgramProposer`` for speculative decoding, or None.
        async_scheduling: the scheduler is an ``AsyncScheduler`` (see
            ``gpu_input_batch.RunnerRequestStates``).
        kv_transfer_config: a ``KVTransferConfig``: the runner builds the
            connector's WORKER half (``self.kv_connector``) and registers its KV
            caches with it; every step then loads before the forward, saves
            layer by layer and reports finished transfers in
            ``ModelRunnerOutput.kv_connector_output`` (vLLM's
            ``KVConnectorModelRunnerMixin``).
        disable_hybrid_kv_cache_manager: as in the ``Scheduler`` (None: decided
            as vLLM does).
    """

    def __init__(self, model: TransformerForCausalLM, kv_cache_config: KVCacheConfig, *,
                 max_model_len: int, max_num_batched_tokens: int, max_num_reqs: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 keep_logits: bool = False, drafter: NgramProposer | None = None,
                 async_scheduling: bool = False,
                 kv_transfer_config=None,
                 disable_hybrid_kv_cache_manager: bool | None = None) -> None:
        super().__init__(drafter, async_scheduling)
        self.model = model
        self.kv_cache_config = kv_cache_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.keep_logits = keep_logits
        # prompt_logprobs: how many top tokens each request still computing its prompt
        # wants, and the positions it has so far (vLLM's num_prompt_logprobs,
        # gpu_model_runner.py:1266-1271, and in_progress_prompt_logprobs_cpu).
        self.num_prompt_logprobs: dict[str, int] = {}
        self._prompt_logprobs_so_far: dict[str, dict[int, dict[int, Logprob]]] = {}
        groups = kv_cache_config.kv_cache_groups
        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        num_layers = model.config.num_hidden_layers
        missing = [layer_name(i) for i in range(num_layers) if layer_name(i) not in group_of]
        if missing:
            raise ValueError(f"layers {missing} are in no KV cache group")
        self.layer_to_group = [group_of[layer_name(i)] for i in range(num_layers)]
        # Each layer attends over its own window, whatever its group keeps: with
        # the hybrid manager off, window layers share the full-attention group
        # (and its blocks) but still attend over the window only.
        self.layer_windows = [model.config.layer_sliding_window(i) for i in range(num_layers)]
        for i, g in enumerate(self.layer_to_group):
            spec = groups[g].kv_cache_spec
            if isinstance(spec, SlidingWindowSpec) and spec.sliding_window != \
                    self.layer_windows[i]:
                raise ValueError(f"layer {i} has window {self.layer_windows[i]}, but its KV "
                                 f"cache group keeps window {spec.sliding_window}")
        self.kv_caches = self._initialize_kv_cache()
        self.block_table = MultiGroupBlockTable(
            max_num_reqs=max_num_reqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, device=self.device,
            block_sizes=[g.kv_cache_spec.block_size for g in groups])
        # Per table row: the block-id lists it was filled from, and their lengths then.
        self._row_contents: list[tuple[tuple[list[int], ...], list[int]] | None] = \
            [None] * max_num_reqs
        self.kv_connector = None
        if kv_transfer_config is not None:
            self.kv_connector = KVConnectorFactory.create_connector(
                kv_transfer_config, KVConnectorRole.WORKER, kv_cache_config,
                disable_hybrid_kv_cache_manager=resolve_disable_hybrid_kv_cache_manager(
                    kv_transfer_config, disable_hybrid_kv_cache_manager))
            self.kv_connector.register_kv_caches(
                {layer_name(i): cache for i, cache in enumerate(self.kv_caches)})

    def _initialize_kv_cache(self) -> list[torch.Tensor]:
        """Layer ``j`` of each group shares the ``j``-th tensor; returns one view per layer."""
        config = self.model.config
        groups = self.kv_cache_config.kv_cache_groups
        num_tensors = max(len(g.layer_names) for g in groups)
        block_size = groups[0].kv_cache_spec.block_size
        if any(g.kv_cache_spec.block_size != block_size for g in groups):
            raise ValueError("shared KV cache tensors need one block size for all groups, got "
                             f"{[g.kv_cache_spec.block_size for g in groups]}")
        tensors = [make_kv_cache(self.kv_cache_config.num_blocks, block_size,
                                 config.num_key_value_heads, config.head_dim,
                                 dtype=self.dtype, device=self.device)
                   for _ in range(num_tensors)]
        by_name = {name: tensors[j] for g in groups for j, name in enumerate(g.layer_names)}
        return [by_name[layer_name(i)] for i in range(config.num_hidden_layers)]

    def on_new_request(self, state: CachedRequestState) -> None:
        params = state.sampling_params
        if params is not None and params.prompt_logprobs is not None:
            self.num_prompt_logprobs[state.req_id] = (
                self.model.config.vocab_size if params.prompt_logprobs == -1
                else params.prompt_logprobs)
        if params is not None and params.temperature > 0.0:
            state.generator = torch.Generator(device=self.device)
            if params.seed is not None:
                state.generator.manual_seed(params.seed)
            else:
                state.generator.seed()

    # -- one step ---------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # KV connector seam: load before the forward, save after, report what ended.
        return execute_with_connector(self.kv_connector, scheduler_output, self._execute_model)

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids:      # (vLLM: aborted mid-prompt)
            self.num_prompt_logprobs.pop(req_id, None)
            self._prompt_logprobs_so_far.pop(req_id, None)
        states = self.update_states(scheduler_output)
        req_ids = [s.req_id for s in states]
        output = ModelRunnerOutput(req_ids=req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=[[] for _ in states])
        if not states:
            return output
        num_scheduled = scheduler_output.num_scheduled_tokens
        drafts = self.scheduled_drafts(scheduler_output)
        batch = self._prepare_inputs(states, num_scheduled, drafts)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches,
                            batch.attn_metadata)
        if self.num_prompt_logprobs:
            output.prompt_logprobs = self._prompt_logprobs(hidden, states, num_scheduled,
                                                           batch.query_start_loc)
        logits = None
        if batch.sampling:
            sampled_hidden = hidden if batch.logits_indices is None else \
                hidden[batch.logits_indices]
            logits = self.model.compute_logits(sampled_hidden).float()
        sampled: dict[str, list[int]] = {}
        # Greedy rows: one argmax and one copy to Python for the whole batch (per
        # request, two small ops each: ~16 requests x 2 per step on the toy).
        argmax = logits.argmax(dim=-1).tolist() if logits is not None else []
        for state, draft, rows in batch.sampling:
            targets = self._sample(logits, rows, state, argmax[rows])
            sampled[state.req_id] = self.accept_draft(draft, targets)
            if self.keep_logits:
                output.logits[state.req_id] = logits[rows][:len(sampled[state.req_id])].cpu()
        for state in states:
            tokens = sampled.get(state.req_id, [])
            output.sampled_token_ids[output.req_id_to_index[state.req_id]] = tokens
            self.finish_step(state, num_scheduled[state.req_id], drafts.get(state.req_id, []),
                             tokens)
        return output

    def _prepare_inputs(self, states: list[CachedRequestState],
                        num_scheduled_tokens: dict[str, int],
                        drafts: dict[str, list[int]]) -> _Batch:
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling: list[tuple[CachedRequestState, list[int], slice]] = []
        for row, state in enumerate(states):
            n = num_scheduled_tokens[state.req_id]
            draft = drafts.get(state.req_id, [])
            start = state.num_computed_tokens
            # A -1 draft (a padding slot) goes in as token 0, as vLLM clamps it; no
            # model token equals -1, so it is rejected and its slot overwritten later.
            input_ids.extend(max(t, 0) for t in self.scheduled_token_ids(state, n, draft))
            positions.extend(range(start, start + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            self._fill_row(state, row)
            if self.samples(state, n):
                # Rows of the last known token and of each draft token.
                first = len(logits_indices)
                end = query_start_loc[-1]
                logits_indices.extend(range(end - len(draft) - 1, end))
                sampling.append((state, draft, slice(first, len(logits_indices))))

        device = self.device
        positions_t = torch.tensor(positions, dtype=torch.int64, device=device)
        query_start_loc_t = torch.tensor(query_start_loc, dtype=torch.int32, device=device)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        num_reqs = len(states)
        slot_mappings = self.block_table.compute_slot_mapping(num_reqs, query_start_loc_t,
                                                              positions_t)
        per_group_window: dict[tuple[int, int | None], AttentionMetadata] = {}
        max_query_len = max(num_scheduled_tokens[s.req_id] for s in states)
        tables = list(self.block_table)
        device_tables: dict[int, torch.Tensor] = {}
        for g, window in zip(self.layer_to_group, self.layer_windows):
            if (g, window) in per_group_window:
                continue
            table = tables[g]
            if g not in device_tables:
                device_tables[g] = table.get_device_tensor(num_reqs)
            block_table = device_tables[g]
            # The attention plan is built here once per group and window, not in
            # every layer: the batch, table and window are the same for those layers.
            plan = PagedAttentionPlan(query_start_loc, seq_lens, block_table,
                                      block_size=table.block_size, sliding_window=window,
                                      num_blocks=self.kv_cache_config.num_blocks,
                                      slot_mapping=slot_mappings[g], device=device)
            per_group_window[g, window] = AttentionMetadata(
                query_start_loc=query_start_loc_t, seq_lens=seq_lens_t,
                block_table=block_table, slot_mapping=slot_mappings[g],
                max_query_len=max_query_len, max_seq_len=max(seq_lens), plan=plan,
                kv_connector=self.kv_connector)
        return _Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=positions_t,
            # None: every row samples, in order (a step of plain decodes); the index
            # tensor and the gather of hidden rows are skipped (~20 us a step).
            logits_indices=None if logits_indices == list(range(len(input_ids))) else
            torch.tensor(logits_indices, dtype=torch.int64, device=device),
            sampling=sampling,
            attn_metadata=[per_group_window[g, w]
                           for g, w in zip(self.layer_to_group, self.layer_windows)],
            query_start_loc=query_start_loc)

    def _prompt_logprobs(self, hidden: torch.Tensor, states: list[CachedRequestState],
                         num_scheduled: dict[str, int], query_start_loc: list[int]
                         ) -> dict[str, list[dict[int, Logprob]]]:
        """The prompt logprobs of this step's prompt tokens (vLLM's
        ``_get_prompt_logprobs_dict``, ``gpu_model_runner.py:5520-5630``); a
        request's whole list once its prompt is done.

        Position ``p``'s logits score prompt token ``p + 1``: its logprob and rank
        (how many tokens score at least as high, ``sample/ops/logprobs.py:11-27``),
        then the top tokens ranked 1, 2, ... A chunk that ends exactly at the
        prompt's last token waits for the next step, as in vLLM; a request
        preempted mid-prompt computes the positions again.
        """
        done: dict[str, list[dict[int, Logprob]]] = {}
        for row, state in enumerate(states):
            top = self.num_prompt_logprobs.get(state.req_id)
            if top is None:
                continue
            start, n = state.num_computed_tokens, num_scheduled[state.req_id]
            remaining = state.num_prompt_tokens - (start + 1)
            num_logits = min(n, remaining)
            so_far = self._prompt_logprobs_so_far.setdefault(state.req_id, {})
            if num_logits > 0:
                first = query_start_loc[row]
                logits = self.model.compute_logits(hidden[first:first + num_logits])
                logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
                targets = torch.tensor(state.token_ids[start + 1:start + 1 + num_logits],
                                       dtype=torch.int64, device=logprobs.device)
                target_logprobs = logprobs.gather(-1, targets[:, None])
                ranks = (logprobs >= target_logprobs).sum(-1).tolist()
                top_logprobs, top_ids = logprobs.topk(top, dim=-1)
                for i, (token, logprob) in enumerate(zip(targets.tolist(),
                                                         target_logprobs[:, 0].tolist())):
                    entry = {token: Logprob(logprob, ranks[i])}
                    for rank, (other, other_logprob) in enumerate(
                            zip(top_ids[i].tolist(), top_logprobs[i].tolist()), start=1):
                        entry[other] = Logprob(other_logprob, rank)
                    so_far[start + i] = entry
            if n > remaining:                     # the prompt's last token was computed
                done[state.req_id] = [so_far[p] for p in range(state.num_prompt_tokens - 1)]
                del self.num_prompt_logprobs[state.req_id]
                del self._prompt_logprobs_so_far[state.req_id]
        return done

    def _fill_row(self, state: CachedRequestState, row: int) -> None:
        """Make table row ``row`` hold ``state``'s blocks. A row that held the same
        request last step only gets its new blocks (a request's block lists only
        grow; a resumed one gets new lists): rewriting every row every step cost a
        tensor build per request per step, ~10% of a toy-model step."""
        held = self._row_contents[row]
        if held is not None and held[0] is state.block_ids:
            new = [ids[n:] for ids, n in zip(state.block_ids, held[1])]
            if any(new):
                self.block_table.append_row(new, row)
        else:
            self.block_table.add_row(state.block_ids, row)
        # The tuple is kept alive here, so ``is`` cannot mistake a new one for it.
        self._row_contents[row] = (state.block_ids, [len(ids) for ids in state.block_ids])

    def _sample(self, logits: torch.Tensor, rows: slice, state: CachedRequestState,
                argmax: list[int]) -> list[int]:
        """One token per row ``rows`` of ``logits [num_logits, vocab]``: argmax at
        temperature 0 (``argmax``: those rows' argmax, computed for the batch), else
        softmax sampling with the request's own RNG. (The rows are cut out only for
        sampling: a view per greedy request cost ~45 us per 16-request step.)"""
        params = state.sampling_params
        if params is None or params.temperature == 0.0:
            return argmax
        probs = torch.softmax(logits[rows] / params.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=state.generator).squeeze(-1).tolist()
