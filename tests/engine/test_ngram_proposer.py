"""The n-gram proposer against vLLM 0.25.1's rule (specs/ngram_proposer.md).

``spec_draft`` below is the rule of the spec written out as plainly as
possible (every length, every start, then the choice), independently of
``kvref.spec_decode.ngram_proposer``. Both are checked against answers recorded
from vLLM's own search function (``tools/record_ngram_cases.py``), and
against each other on drawn token lists with tiny vocabularies, where most
lists hold several earlier copies of their suffix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.engine import NgramProposer

CASES = json.loads((Path(__file__).parent / "traces" / "ngram_proposer_vllm.json").read_text())


def spec_draft(tokens: list[int], min_n: int, max_n: int, k: int,
               max_model_len: int) -> list[int]:
    """specs/ngram_proposer.md, steps 1-5."""
    total = len(tokens)
    if total < min_n:
        return []
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    matches = [(n, s) for n in range(min_n, max_n + 1) for s in range(total)
               if s + n <= total - 1 and tokens[s:s + n] == tokens[total - n:]]
    if not matches:
        return []
    longest = max(n for n, _ in matches)
    earliest = min(s for n, s in matches if n == longest)
    return tokens[earliest + longest:earliest + longest + k]


def kvref_draft(tokens, min_n, max_n, k, max_model_len) -> list[int]:
    return NgramProposer(min_n, max_n, k, max_model_len).propose(tokens)


def test_vllm_recorded_cases_are_what_the_spec_and_kvref_propose():
    assert CASES["vllm_version"] == "0.25.1"
    for case in CASES["cases"]:
        args = (case["tokens"], case["min_n"], case["max_n"], case["k"],
                case["max_model_len"])
        assert spec_draft(*args) == case["draft"], case
        assert kvref_draft(*args) == case["draft"], case


def _latest_of_longest(tokens, min_n, max_n, k, max_model_len):
    """A plausible misreading of the rule: the latest copy of the longest n-gram."""
    total = len(tokens)
    k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        for s in range(total - n - 1, -1, -1):
            if tokens[s:s + n] == tokens[total - n:]:
                return tokens[s + n:s + n + k]
    return []


def _earliest_of_shortest(tokens, min_n, max_n, k, max_model_len):
    """Another: the first length that matches, counting up from min_n."""
    total = len(tokens)
    k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return []
    for n in range(min_n, max_n + 1):
        for s in range(total - n):
            if tokens[s:s + n] == tokens[total - n:]:
                return tokens[s + n:s + n + k]
    return []


@pytest.mark.parametrize("misreading", [_latest_of_longest, _earliest_of_shortest])
def test_the_recorded_cases_tell_the_choices_apart(misreading):
    """Guards the test above: vLLM's answers rule out each plausible misreading
    many times over (so the cases really contain several earlier matches)."""
    differ = sum(misreading(c["tokens"], c["min_n"], c["max_n"], c["k"], c["max_model_len"])
                 != c["draft"] for c in CASES["cases"])
    assert differ >= 20


def test_the_earliest_of_several_copies_is_used():
    tokens = [3, 7, 8, 1, 9, 7, 8, 2, 4, 7, 8]          # [7 8] at 1 and at 5
    assert kvref_draft(tokens, 1, 3, 2, 64) == [1, 9]


def test_a_longer_copy_beats_an_earlier_or_later_shorter_one():
    tokens = [2, 3, 5, 1, 2, 3, 9, 2, 3, 8, 1, 2, 3]   # [1 2 3] at 3; [2 3] at 0, 4, 7
    assert kvref_draft(tokens, 2, 3, 2, 64) == [9, 2]
    assert kvref_draft(tokens, 2, 2, 2, 64) == [5, 1]   # max_n 2: the earliest [2 3]


def test_a_copy_may_overlap_the_suffix():
    assert kvref_draft([4, 4, 4, 4, 4], 2, 4, 3, 64) == [4]


def test_the_draft_stops_at_max_model_len():
    tokens = [1, 2, 1, 2, 1, 2]
    assert kvref_draft(tokens, 1, 4, 5, 64) == [1, 2]     # only 2 tokens follow the copy
    assert kvref_draft(tokens + [1, 2, 1, 2], 2, 2, 5, 64) == [1, 2, 1, 2, 1]
    assert kvref_draft(tokens + [1, 2, 1, 2], 2, 2, 5, 12) == [1, 2]
    assert kvref_draft(tokens, 1, 4, 5, 6) == []


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(tokens=st.integers(1, 4).flatmap(
           lambda vocab: st.lists(st.integers(0, vocab - 1), max_size=30)),
       min_n=st.integers(1, 4), extra=st.integers(0, 3), k=st.integers(1, 6),
       room=st.integers(-1, 8))
def test_drawn_token_lists_follow_the_spec(tokens, min_n, extra, k, room):
    max_model_len = len(tokens) + room if room < 8 else 256
    max_n = min_n + extra
    assert kvref_draft(tokens, min_n, max_n, k, max_model_len) == spec_draft(
        tokens, min_n, max_n, k, max_model_len)
