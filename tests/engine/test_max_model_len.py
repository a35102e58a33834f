"""Generation that runs into ``max_model_len``, with odd sizes.

Every request here asks for more tokens than fit, so each one ends at
exactly ``max_model_len`` tokens (finish reason "length"), with its last
positions, its last block and its last drafts at the edge. ``max_model_len``
is not a multiple of the block size, and is chosen so that a block table
one column short (``max_model_len // block_size`` instead of vLLM's
``cdiv``) cannot hold the longest request: its computed positions
``0 .. max_model_len - 2`` need ``cdiv(max_model_len - 1, block_size)``
blocks, more than the floor. Every step's output is checked against every
scheduler limit (``limits.py``).
"""

from __future__ import annotations

import pytest

from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager
from kvref.engine import LLM, ModelFreeRunner, NgramProposer, SamplingParams, Scheduler
from kvref.engine import engine_step
from kvref.math_utils import cdiv
from kvref.verify.invariants import check_kv_cache_manager

from .hf_models import hybrid, llama, reference
from .limits import Limits, watch_limits

# (block_size, max_model_len): max_model_len % block_size is 3, 3 and 2.
SIZES = [(4, 31), (5, 23), (3, 20)]


def run_guarded(llm: LLM, prompts, params, max_steps: int = 400):
    """``generate``, with a step limit: an engine that stops making progress fails."""
    ids = [llm.add_request(p, params).request_id for p in prompts]
    done = {}
    for _ in range(max_steps):
        if not llm.scheduler.has_unfinished_requests():
            break
        for output in llm.step():
            done[output.request_id] = output
    else:
        raise AssertionError(f"unfinished after {max_steps} steps")
    return [done[i] for i in ids]


def edge_prompts(vocab: int, max_model_len: int) -> list[list[int]]:
    """Lengths from 1 to max_model_len - 1 (the longest prompt allowed: one token out)."""
    lengths = sorted({1, 4, max_model_len // 2, max_model_len - 6, max_model_len - 2,
                      max_model_len - 1})
    return [[(7 * i + 3 * n) % vocab for i in range(n)] for n in lengths]


MODELS = {"llama": llama(seed=31, vocab_size=40),
          "hybrid": hybrid(seed=31, window=5, vocab_size=40),
          "llama-v16": llama(seed=2, vocab_size=16)}
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
             prompt_lookup_max=3)


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "ngram"])
@pytest.mark.parametrize("kind", ["llama", "hybrid"])
@pytest.mark.parametrize("block_size,max_model_len", SIZES)
def test_generation_stops_at_max_model_len_with_transformers_tokens(block_size, max_model_len,
                                                                   kind, speculate):
    model = MODELS["llama-v16" if speculate and kind == "llama" else kind]
    budget = 7
    llm = LLM(model, block_size=block_size, max_model_len=max_model_len,
              max_num_batched_tokens=budget, num_gpu_blocks=3 * cdiv(max_model_len, block_size),
              keep_logits=True, speculative_config=NGRAM if speculate else None)
    limits = watch_limits(llm.scheduler, Limits(budget=budget, max_model_len=max_model_len,
                                                max_num_seqs=llm.max_num_seqs,
                                                num_speculative_tokens=3))
    width = cdiv(max_model_len, block_size)
    assert all(t.max_num_blocks_per_req == width for t in llm.model_runner.block_table)
    prompts = edge_prompts(model.config.vocab_size, max_model_len)
    outputs = run_guarded(llm, prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert len(prompt) + len(completion.token_ids) == max_model_len
        assert completion.finish_reason == "length"
        tokens, logits = reference(model, prompt, max_model_len - len(prompt))
        assert completion.token_ids == tokens, f"prompt of {len(prompt)}"
        assert len(completion.logits) == len(tokens)
        for got, want in zip(completion.logits, logits):
            assert (got - want).abs().max() <= 1e-4
    # The longest requests computed position max_model_len - 2, in the last column.
    assert limits.max_position_reached == max_model_len - 1
    assert cdiv(max_model_len - 1, block_size) > max_model_len // block_size
    assert limits.chunks_checked > 0
    if speculate:
        assert llm.stats.num_draft_tokens > 0
    assert llm.kv_cache_manager.block_pool.get_num_free_blocks() == llm.kv_cache_config.num_blocks - 1


@pytest.mark.parametrize("block_size,max_model_len", SIZES)
def test_model_free_requests_with_drafts_stop_at_max_model_len(block_size, max_model_len):
    """The scheduler and proposer alone: a 3-token vocabulary makes drafts
    frequent right up to the edge, where they must be cut."""
    config = KVCacheConfig(4 * cdiv(max_model_len, block_size),
                           [KVCacheGroupSpec(["l0"], FullAttentionSpec(block_size))])
    manager = KVCacheManager(config, max_model_len=max_model_len,
                             scheduler_block_size=block_size, hash_block_size=block_size)
    scheduler = Scheduler(manager, max_num_batched_tokens=9, max_num_seqs=3)
    limits = watch_limits(scheduler, Limits(budget=9, max_model_len=max_model_len,
                                            max_num_seqs=3, num_speculative_tokens=4))
    runner = ModelFreeRunner(vocab_size=3,
                             drafter=NgramProposer(1, 3, 4, max_model_len=max_model_len))
    prompts = edge_prompts(3, max_model_len)
    requests = [scheduler.new_request(f"r{i}", p, SamplingParams(max_tokens=99,
                                                                 ignore_eos=True))
                for i, p in enumerate(prompts)]
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        engine_step(scheduler, runner)
        check_kv_cache_manager(manager)
    assert not scheduler.has_unfinished_requests()
    for prompt, request in zip(prompts, requests):
        assert request.num_tokens == max_model_len
        assert request.output_token_ids == runner.reference_output(
            prompt, max_model_len - len(prompt))
    assert limits.max_position_reached == max_model_len - 1
    assert scheduler.stats.num_accepted_tokens > 0
