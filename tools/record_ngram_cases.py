#!/usr/bin/env python3
"""Record what vLLM 0.25.1's n-gram proposer drafts, for tests/engine/test_ngram_proposer.py.

Runs under the python of a vLLM 0.25.1 install (it imports vLLM; kvref is not
needed) and writes ``tests/engine/traces/ngram_proposer_vllm.json``: a list of
cases ``{"tokens", "min_n", "max_n", "k", "max_model_len", "draft"}``, where
``draft`` is the answer of vLLM's search function for one request's tokens.

    /root/.cache/vllm-oracle/bin/python tools/record_ngram_cases.py

The cases are drawn with a fixed seed from small vocabularies (many repeated
n-grams, so the choice among several earlier matches matters), plus a few
hand-made edges: a sequence shorter than ``min_n``, one token from
``max_model_len``, a match that overlaps the suffix, ties between lengths.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests/engine/traces/ngram_proposer_vllm.json"

HAND_MADE = [
    # (tokens, min_n, max_n, k, max_model_len)
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, 64),            # the docstring's example
    ([1, 1, 1, 1], 2, 3, 4, 64),                  # the match overlaps the suffix
    ([5], 1, 1, 3, 64),                           # nothing before the last token
    ([5, 6], 3, 4, 3, 64),                        # shorter than min_n
    ([1, 2, 1, 2, 1, 2], 1, 4, 5, 7),             # one draft token left before max_model_len
    ([1, 2, 1, 2, 1, 2], 1, 4, 5, 6),             # none left
    ([7, 8, 9, 1, 7, 8, 2, 7, 8], 2, 2, 3, 64),   # two earlier matches of [7, 8]
    ([3, 7, 8, 1, 9, 7, 8, 2, 4, 7, 8], 1, 3, 2, 64),
    ([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 2, 3, 4, 64),  # the longer match is the earlier one
    ([2, 3, 9, 1, 2, 3, 8, 2, 3], 2, 3, 4, 64),     # only the shorter one exists
]


def draw_cases(rng: random.Random, count: int) -> list[tuple[list[int], int, int, int, int]]:
    cases = []
    for _ in range(count):
        vocab = rng.choice([1, 2, 2, 3, 3, 4, 6, 10])
        length = rng.randint(1, 48)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 6)
        max_model_len = rng.choice([64, 64, length + rng.randint(0, 4)])
        cases.append((tokens, min_n, max_n, k, max_model_len))
    return cases


def main() -> int:
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as vllm_search,
    )
    import vllm

    rng = random.Random(20261201)
    records = []
    for tokens, min_n, max_n, k, max_model_len in HAND_MADE + draw_cases(rng, 600):
        draft = vllm_search(np.array(tokens, dtype=np.int32), min_n, max_n, max_model_len, k)
        records.append({"tokens": tokens, "min_n": min_n, "max_n": max_n, "k": k,
                        "max_model_len": max_model_len,
                        "draft": [int(t) for t in draft]})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    payload = {"vllm_version": vllm.__version__,
               "source": "vllm/v1/spec_decode/ngram_proposer.py, "
                         "_find_longest_matched_ngram_and_propose_tokens",
               "cases": records}
    OUT.write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    print(f"{len(records)} cases from vLLM {vllm.__version__} -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
