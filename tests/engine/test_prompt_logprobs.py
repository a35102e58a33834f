"""``SamplingParams(prompt_logprobs=k)``, as vLLM 0.25.1 gives them.

Each prompt token after the first gets its log probability, its rank and the
``k`` most likely tokens (``vllm/v1/worker/gpu_model_runner.py:5520-5630``,
``vllm/logprobs.py:175-200``), and the request reads nothing from the prefix
cache, since a cached prefix has no logits (``vllm/sampling_params.py:500-504``).
The numbers are checked against ``transformers`` on the same weights, whole
prompts and prompts cut into chunks by the token budget.
"""

from __future__ import annotations

import pytest
import torch

from kvref.engine import LLM, SamplingParams

from .hf_models import llama
from .test_llm import shared_prefix_prompts

OPTIONS = dict(block_size=4, max_model_len=64, num_gpu_blocks=80, device="cpu")


@pytest.fixture(scope="module")
def model():
    return llama(seed=7)


def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, vocab]``: position p's log probabilities, which score token p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


@pytest.mark.parametrize("budget", [64, 5], ids=["whole-prompt", "chunks-of-5"])
@pytest.mark.parametrize("top", [0, 3, -1])
def test_prompt_logprobs_are_the_models(model, budget, top):
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=7)[:3]
    llm = LLM(model, max_num_batched_tokens=budget, **OPTIONS)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True,
                                                   prompt_logprobs=top))
    vocab = model.config.vocab_size
    for prompt, output in zip(prompts, outputs):
        got = output.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        expected = reference_logprobs(model, prompt)
        for p, entry in enumerate(got[1:]):
            token = prompt[p + 1]
            row = expected[p]
            assert abs(entry[token].logprob - row[token].item()) < 1e-4
            assert entry[token].rank == int((row >= row[token]).sum())
            k = vocab if top == -1 else top
            best = row.topk(k).indices.tolist()
            assert set(entry) == {token, *best}
            assert [entry[t].rank for t in best] == list(range(1, k + 1))


def test_prompt_logprobs_skip_the_prefix_cache_as_vllm_does(model):
    prompt = shared_prefix_prompts(model.config.vocab_size, seed=7)[0]
    llm = LLM(model, max_num_batched_tokens=64, **OPTIONS)
    plain = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate([prompt], plain)
    again = llm.generate([prompt, prompt], [plain, SamplingParams(
        max_tokens=2, ignore_eos=True, prompt_logprobs=1)])
    assert again[0].num_cached_tokens > 0 and again[0].prompt_logprobs is None
    assert again[1].num_cached_tokens == 0 and len(again[1].prompt_logprobs) == len(prompt)
    # The same tokens either way.
    assert again[0].outputs[0].token_ids == again[1].outputs[0].token_ids
    # vLLM's default follows prompt_logprobs; an explicit value wins.
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache is True
    assert SamplingParams().skip_reading_prefix_cache is False
    assert SamplingParams(prompt_logprobs=2,
                          skip_reading_prefix_cache=False).skip_reading_prefix_cache is False
    assert SamplingParams(skip_reading_prefix_cache=True).skip_reading_prefix_cache is True


@pytest.mark.parametrize("bad", [-2, 1.5, True, "3"])
def test_a_bad_prompt_logprobs_is_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=bad)


def test_a_request_aborted_mid_prompt_leaves_nothing_behind(model):
    prompt = shared_prefix_prompts(model.config.vocab_size, seed=7)[0]
    llm = LLM(model, max_num_batched_tokens=4, **OPTIONS)
    request = llm.add_request(prompt, SamplingParams(max_tokens=2, prompt_logprobs=2))
    llm.step()                                    # 4 of its prompt tokens computed
    runner = llm.model_runner
    assert runner._prompt_logprobs_so_far[request.request_id]
    llm.scheduler.finish_requests(request.request_id)
    llm.step()                                    # the runner hears of the abort
    assert runner.num_prompt_logprobs == {} and runner._prompt_logprobs_so_far == {}
