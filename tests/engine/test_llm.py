"""The engine generates exactly what ``transformers`` generates, through kvref's blocks.

Each workload batches 8+ prompts of different lengths that share prefixes, on a
token budget that cuts prefills into chunks and a pool small enough to preempt
running requests and evict cached blocks. After every step the manager's
invariants hold; at the end every prompt's greedy tokens equal
``model.generate(do_sample=False)`` run on that prompt alone, and the logits of
every generated position are within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref import BlockRemoved
from kvref.engine import LLM, SamplingParams
from kvref.math_utils import cdiv
from kvref.verify.invariants import check_kv_cache_manager

from .hf_models import DEVICES, assert_matches_transformers, hybrid, llama, reference
from .limits import Limits, watch_limits

MAX_TOKENS = 8


def shared_prefix_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """10 prompts of lengths 3..30; groups of them share 8- and 12-token prefixes."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=g).tolist()

    system, other = rand(12), rand(8)
    return [system + rand(5), system + rand(9), system[:8] + rand(3), rand(3),
            other + rand(14), other + rand(1), system + rand(18), rand(11),
            other + rand(6), system + rand(2)]


class StepWatcher:
    """An ``after_step`` hook: invariants, and what the pool did during the run."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.evicted_blocks = 0
        self.block_owners: dict[int, set[str]] = {}
        self.null_window_blocks = 0

    def __call__(self, llm: LLM) -> None:
        manager = llm.kv_cache_manager
        check_kv_cache_manager(manager)
        self.num_steps += 1
        self.evicted_blocks += sum(len(e.block_hashes) for e in llm.scheduler.take_events()
                                   if isinstance(e, BlockRemoved))
        window_groups = [g for g, group in enumerate(llm.kv_cache_config.kv_cache_groups)
                         if type(group.kv_cache_spec).__name__ == "SlidingWindowSpec"]
        for request in llm.scheduler.running:
            blocks = manager.get_blocks(request.request_id).blocks
            for group in blocks:
                for block in group:
                    if not block.is_null:
                        self.block_owners.setdefault(block.block_id, set()).add(
                            request.request_id)
            for g in window_groups:
                self.null_window_blocks += sum(b.is_null for b in blocks[g])

    @property
    def reused_blocks(self) -> int:
        """Blocks that held KV of more than one request over the run."""
        return sum(len(owners) > 1 for owners in self.block_owners.values())


def make_llm(model, device: str, **kwargs) -> tuple[LLM, StepWatcher]:
    options = dict(block_size=4, max_model_len=64, max_num_batched_tokens=24,
                   keep_logits=True, enable_kv_cache_events=True, device=device)
    options.update(kwargs)
    llm = LLM(model, **options)
    watcher = StepWatcher()
    llm.after_step.append(watcher)
    return llm, watcher


LLAMA_SHAPES = {
    "2-layers-gqa": dict(layers=2, heads=4, kv_heads=2, hidden_size=32, vocab_size=96),
    "3-layers-mha-tied": dict(layers=3, heads=2, kv_heads=2, hidden_size=32, vocab_size=80,
                              tie=True),
    "1-layer-mqa-wide-heads-llama3-rope": dict(
        layers=1, heads=4, kv_heads=1, hidden_size=32, head_dim=16, vocab_size=120,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=16)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", list(LLAMA_SHAPES))
def test_llama_batch_with_prefix_hits_chunks_and_preemption_matches_transformers(
        shape, device):
    model = llama(**LLAMA_SHAPES[shape])
    prompts = shared_prefix_prompts(model.config.vocab_size)
    # 30 blocks of 4 tokens for 10 prompts of up to 38 tokens: requests must wait,
    # get preempted, and cached blocks must be evicted to make room.
    llm, watcher = make_llm(model, device, num_gpu_blocks=30)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert_matches_transformers(model, prompts, outputs, MAX_TOKENS)

    stats = llm.stats
    assert stats.prompt_tokens_cached > 0                   # shared prefixes were hits
    assert stats.prompt_tokens_computed < sum(map(len, prompts)) + 16 * stats.num_preemptions
    assert stats.num_preemptions > 0
    assert watcher.evicted_blocks > 0 and watcher.reused_blocks > 0
    # Some prefill was cut: a request was scheduled but sampled nothing that step.
    assert any(rid not in record.sampled for record in llm.scheduler.step_records
               for rid in record.num_scheduled_tokens)
    assert max(len(r.num_scheduled_tokens) for r in llm.scheduler.step_records) >= 3
    assert llm.kv_cache_manager.block_pool.get_num_free_blocks() == 29


@pytest.mark.parametrize("device", DEVICES)
def test_attention_gathered_one_request_at_a_time_gives_the_same_tokens(device):
    """The fast path's chunking (``KVGatherBuffer.max_bytes``) changes no token:
    here every layer gathers and attends one request at a time."""
    model = llama(**LLAMA_SHAPES["2-layers-gqa"])
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=2)
    llm, _ = make_llm(model, device, num_gpu_blocks=30)
    buffers = {id(m.gather_buffer): m.gather_buffer for m in llm.model.modules()
               if hasattr(m, "gather_buffer")}
    assert len(buffers) == 1                                # the layers share one
    for buffer in buffers.values():
        buffer.max_bytes = 1
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert_matches_transformers(model, prompts, outputs, MAX_TOKENS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_sliding_window_hybrid_model_matches_transformers(arch, device):
    model = hybrid(arch=arch, window=5)
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=1)
    # 32 blocks: tight enough that requests admitted whole still preempt each other
    # as they grow (with 40 the full-sequence admission gate leaves no preemption).
    llm, watcher = make_llm(model, device, num_gpu_blocks=32)
    groups = llm.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["FullAttentionSpec",
                                                                "SlidingWindowSpec"]
    assert type(llm.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert_matches_transformers(model, prompts, outputs, MAX_TOKENS)
    assert watcher.null_window_blocks > 0          # blocks left behind the window
    assert llm.stats.prompt_tokens_cached > 0
    assert llm.stats.num_preemptions > 0


def test_the_window_matters_for_these_prompts():
    """Guards the test above: without the window transformers answers differently."""
    prompt = shared_prefix_prompts(96, seed=1)[6]
    with_window, _ = reference(hybrid(window=5), prompt, MAX_TOKENS)
    full_only, _ = reference(hybrid(window=5, layer_types=("full_attention",) * 3),
                             prompt, MAX_TOKENS)
    assert with_window != full_only


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_caching_computes_fewer_prompt_tokens_and_changes_nothing(device):
    model = llama(seed=3)
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        llm, _ = make_llm(model, device, num_gpu_blocks=200, enable_prefix_caching=caching,
                          max_num_batched_tokens=64)
        runs[caching] = (llm.generate(prompts, params), llm.stats)
    (plain, plain_stats), (cached, cached_stats) = runs[False], runs[True]
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in cached]
    assert plain_stats.prompt_tokens_computed == sum(map(len, prompts))
    assert plain_stats.prompt_tokens_cached == 0
    assert cached_stats.prompt_tokens_cached > 0
    assert (cached_stats.prompt_tokens_computed + cached_stats.prompt_tokens_cached
            == sum(map(len, prompts)))
    assert sum(o.num_cached_tokens for o in cached) == cached_stats.prompt_tokens_cached


@pytest.mark.parametrize("device", DEVICES)
def test_loads_a_local_checkpoint_folder(tmp_path, device):
    model = hybrid(arch="qwen3", window=6, tie=False)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=4)[:4]
    llm, _ = make_llm(str(tmp_path), device, num_gpu_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert_matches_transformers(model, prompts, outputs, 5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_attention_biases_load_from_a_checkpoint(tmp_path, arch):
    """Llama's and Qwen3's ``attention_bias`` puts a bias on q, k, v and the
    output projection; Qwen2 has q, k, v biases and no output bias."""
    model = llama(attention_bias=True) if arch == "llama" else hybrid(
        arch=arch, attention_bias=True)
    o_proj_bias = model.model.layers[0].self_attn.o_proj.bias
    assert (o_proj_bias is None) == (arch == "qwen2")
    model.save_pretrained(tmp_path)
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=5)[:4]
    llm, _ = make_llm(str(tmp_path), "cpu", num_gpu_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert_matches_transformers(model, prompts, outputs, 5)


def test_a_pool_that_cannot_hold_one_full_request_is_refused():
    with pytest.raises(ValueError, match="cannot hold one request"):
        LLM(llama(), block_size=4, max_model_len=64, num_gpu_blocks=10)


def test_the_start_check_counts_a_window_group_as_vllm_does():
    # max_model_len 64, block 4, window 8, the default 2048-token budget: the
    # full group needs cdiv(64, 4) = 16 blocks, the window group 17 (the window
    # need not start on a block boundary: one block more than the whole sequence).
    model = hybrid(window=8)
    with pytest.raises(ValueError, match="it needs 33 blocks plus the null block"):
        LLM(model, block_size=4, max_model_len=64, num_gpu_blocks=33)
    assert LLM(model, block_size=4, max_model_len=64, num_gpu_blocks=34).kv_cache_config \
        .num_blocks == 34


def test_a_stop_token_ends_the_output_and_is_reported_as_the_stop_reason():
    model = llama(seed=3)
    prompt = [5, 6, 7, 8]
    llm = LLM(model, block_size=4, max_model_len=64, num_gpu_blocks=24)
    free_run = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    tokens = free_run.outputs[0].token_ids
    assert free_run.outputs[0].finish_reason == "length"
    assert free_run.outputs[0].stop_reason is None
    stop = tokens[2]
    cut = tokens.index(stop) + 1                    # the stop token is kept, as in vLLM
    out = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True,
                                                stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == tokens[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_seeded_sampling_is_reproducible():
    model = llama(seed=5)
    prompt = [[1, 2, 3, 4, 5]]
    outs = []
    for seed in (7, 7, 8):
        llm = LLM(model, block_size=4, max_model_len=64, num_gpu_blocks=40)
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
        outs.append(llm.generate(prompt, params)[0].outputs[0].token_ids)
    assert outs[0] == outs[1] != outs[2]


@pytest.mark.parametrize("given, expected", [
    ({}, (5, 5)),                                   # vLLM's defaults
    ({"prompt_lookup_max": 3}, (3, 3)),             # the one given, for both
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": 4}, (2, 4)),
])
def test_ngram_lookup_lengths_default_as_in_vllm(given, expected):
    config = dict(method="ngram", num_speculative_tokens=2, **given)
    llm = LLM(llama(), block_size=4, max_model_len=64, num_gpu_blocks=40,
              speculative_config=config)
    drafter = llm.model_runner.drafter
    assert (drafter.min_n, drafter.max_n) == expected


def test_ngram_lookup_min_above_max_is_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        LLM(llama(), block_size=4, max_model_len=64, num_gpu_blocks=40,
            speculative_config=dict(method="ngram", num_speculative_tokens=2,
                                    prompt_lookup_min=4, prompt_lookup_max=2))


NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
             prompt_lookup_max=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_ngram_speculative_decoding_matches_transformers(kind, device):
    # A 16-token vocabulary: tiny random models fall into loops that n-grams predict.
    model = llama(seed=2, vocab_size=16) if kind == "llama" else hybrid(seed=2, vocab_size=16,
                                                                          window=4)
    prompts = shared_prefix_prompts(16, seed=2)
    llm, watcher = make_llm(model, device, num_gpu_blocks=40, speculative_config=NGRAM)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert_matches_transformers(model, prompts, outputs, 16)
    stats = llm.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_preemptions > 0


HYPOTHESIS_MODELS = {
    "llama-untied": llama(seed=11, layers=1, vocab_size=24),
    "llama-tied-all-biases": llama(seed=12, layers=2, vocab_size=24, tie=True,
                                   attention_bias=True, mlp_bias=True),
    "qwen3-window-tied": hybrid(seed=11, window=4, vocab_size=24),
    "qwen2-window-untied": hybrid(seed=13, arch="qwen2", window=3, vocab_size=24, tie=False,
                                  layer_types=("sliding_attention", "full_attention")),
}


def check_runner_buffers(llm: LLM) -> None:
    """Wrap the runner's ``execute_model``: after each step the worker's block
    table rows (batch order) are the manager's blocks of the scheduled requests
    (wherever the manager holds a real block), and each slot-mapping buffer is
    padding after the step's tokens."""
    runner, manager = llm.model_runner, llm.kv_cache_manager
    execute_model = runner.execute_model

    def checked(scheduler_output):
        output = execute_model(scheduler_output)
        num_tokens = scheduler_output.total_num_scheduled_tokens
        for row, req_id in enumerate(scheduler_output.num_scheduled_tokens):
            for g, table in enumerate(runner.block_table):
                k = table.blocks_per_kv_block
                ids = [b * k + j for b in manager.get_block_ids(req_id)[g] for j in range(k)]
                worker = table.row(row)
                # Blocks the manager has since replaced by the null block (left of a
                # window) keep their old id in the worker's table, as in vLLM: only
                # the scheduler's new blocks are sent, and attention never reads there.
                assert len(worker) == len(ids) and all(
                    w == m for w, m in zip(worker, ids) if m >= k), (
                    f"row {row} ({req_id}), group {g}: worker {worker}, manager {ids}")
        for table in runner.block_table:
            assert (table.slot_mapping[num_tokens:] == -1).all()
        return output

    runner.execute_model = checked


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(data=st.data(),
       model_name=st.sampled_from(sorted(HYPOTHESIS_MODELS)),
       block_size=st.sampled_from([2, 3, 4, 5]),
       max_model_len=st.integers(12, 40),
       extra_blocks=st.integers(0, 24),
       budget=st.integers(4, 32),
       chunked=st.sampled_from([True, True, True, False]),
       threshold=st.sampled_from([0, 0, 3, 7]),
       max_num_seqs=st.integers(1, 6),
       speculate=st.booleans())
def test_drawn_workloads_match_transformers(data, model_name, block_size, max_model_len,
                                            extra_blocks, budget, chunked, threshold,
                                            max_num_seqs, speculate):
    """Whole workloads, every knob drawn: block size and max_model_len (rarely
    multiples of each other), pool size just above one full request upwards,
    budget, chunked prefill on or off, long_prefill_token_threshold,
    max_num_seqs, n-gram drafts; prompts from 1 token to max_model_len - 1 and
    max_tokens that often run into max_model_len. Every step is checked against
    every scheduler limit and the runner's buffers; every request's tokens are
    transformers' own."""
    model = HYPOTHESIS_MODELS[model_name]
    vocab = model.config.vocab_size
    if not chunked:
        budget = max(budget, max_model_len)
        threshold = 0
    # The smallest pool the engine accepts (vLLM's start-up check), plus the null
    # block: every block of the full-attention group, and a window group's
    # admission cap, cdiv(min(window - 1 + budget, max_model_len), block) + 1.
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    per_request = cdiv(max_model_len, block_size) if "full_attention" in layer_types else 0
    if "sliding_attention" in layer_types:
        window = model.config.sliding_window
        per_request += cdiv(min(window - 1 + budget, max_model_len), block_size) + 1
    num_gpu_blocks = 1 + per_request + extra_blocks
    llm, _ = make_llm(model, "cpu", block_size=block_size, max_model_len=max_model_len,
                      num_gpu_blocks=num_gpu_blocks, max_num_batched_tokens=budget,
                      enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold,
                      max_num_seqs=max_num_seqs,
                      speculative_config=NGRAM if speculate else None)
    limits = watch_limits(llm.scheduler, Limits(
        budget=budget, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold, enable_chunked_prefill=chunked,
        num_speculative_tokens=NGRAM["num_speculative_tokens"]))
    check_runner_buffers(llm)
    prefixes = [[], [7, 1, 8, 2, 8, 1, 8, 2], [3] * 5 + [4] * 5]
    arrivals: dict[int, list[tuple[list[int], int]]] = {}
    for _ in range(data.draw(st.integers(2, 8), label="num_requests")):
        prefix = data.draw(st.sampled_from(prefixes), label="shared_prefix")
        tail = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=16),
                         label="tail")
        prompt = (prefix + tail)[:max_model_len - 1]
        max_tokens = data.draw(st.integers(1, max_model_len), label="max_tokens")
        step = data.draw(st.integers(0, 5), label="arrival_step")
        arrivals.setdefault(step, []).append((prompt, max_tokens))

    requests = []
    step = 0
    while llm.scheduler.has_unfinished_requests() or any(s >= step for s in arrivals):
        for prompt, max_tokens in arrivals.get(step, []):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            requests.append((llm.add_request(prompt, params), prompt, max_tokens))
        if llm.scheduler.has_unfinished_requests():
            llm.step()
        step += 1
        assert step < 500
    assert llm.kv_cache_manager.block_pool.get_num_free_blocks() == num_gpu_blocks - 1
    for request, prompt, max_tokens in requests:
        expected = min(max_tokens, max_model_len - len(prompt))
        assert request.output_token_ids == reference(model, prompt, expected)[0]
    EXERCISED["max_model_len"] += any(len(p) + len(r.output_token_ids) == max_model_len
                                      for r, p, _ in requests)
    EXERCISED["later_chunks"] += limits.chunks_checked
    EXERCISED["preemptions"] += llm.stats.num_preemptions
    EXERCISED["drafts"] += llm.stats.num_accepted_tokens


EXERCISED = {"max_model_len": 0, "later_chunks": 0, "preemptions": 0, "drafts": 0}


def test_the_drawn_workloads_reach_every_edge():
    """Runs after the property above (file order): its workloads ran into
    max_model_len, cut later prefill chunks, preempted, and accepted drafts."""
    if not all(EXERCISED.values()):
        test_drawn_workloads_match_transformers()
    assert all(count > 0 for count in EXERCISED.values()), EXERCISED
