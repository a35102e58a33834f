"""Sampling at a temperature draws from ``softmax(logits / temperature)``.

The other engine tests decode greedily; the seeded-sampling test only checks
that a seed reproduces its tokens. Here 1500 requests with seeds 0..1499 sample
one token each after the same prompt, and the frequencies are compared with
the distribution transformers' logits give (total variation distance; for
1500 draws over a 12-token vocabulary the expected distance of a correct
sampler is about 0.03, and each temperature's distribution is at least 0.2
away from the other temperature's, so a sampler that scaled the logits the
wrong way, or ignored the temperature, lands far outside the bound).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvref.engine import LLM, SamplingParams

from .hf_models import llama, reference

NUM_DRAWS = 1500
PROMPT = [3, 1, 4, 1, 5, 9, 2]


def total_variation(counts: Counter, probs: torch.Tensor) -> float:
    freq = torch.tensor([counts.get(v, 0) / NUM_DRAWS for v in range(probs.shape[0])])
    return 0.5 * float((freq - probs).abs().sum())


@pytest.fixture(scope="module")
def model_and_logits():
    model = llama(seed=51, vocab_size=12, layers=1)
    _, logits = reference(model, PROMPT, 1)
    return model, logits[0]


@pytest.mark.parametrize("temperature", [0.6, 2.0])
def test_sampled_frequencies_follow_softmax_over_temperature(model_and_logits, temperature):
    model, logits = model_and_logits
    expected = torch.softmax(logits / temperature, dim=-1)
    others = [torch.softmax(logits * temperature, dim=-1), torch.softmax(logits, dim=-1),
              torch.softmax(logits / (2.6 - temperature), dim=-1)]
    assert all(0.5 * float((expected - p).abs().sum()) > 0.2 for p in others)
    llm = LLM(model, block_size=4, max_model_len=16, max_num_seqs=256,
              max_num_batched_tokens=2048)
    params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=1)
              for seed in range(NUM_DRAWS)]
    outputs = llm.generate([PROMPT] * NUM_DRAWS, params)
    counts = Counter(o.outputs[0].token_ids[0] for o in outputs)
    assert total_variation(counts, expected) < 0.07, (counts, expected)
