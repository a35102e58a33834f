"""The vendored Mooncake traces through ``kvref simulate``: the reusable fraction at
infinite capacity, computed straight from the block ids, and reproduced by the engine.

The README beside the traces (``kvref/data/mooncake/README.md``) states 37.4 %
(conversation) and 65.1 % (synthetic) of prompt tokens reusable, counting the
leading ids a request shares with earlier ones, 512 tokens each, capped at
``input_length - 1``. kvref's engine caches 16-token blocks of the tokens those
ids stand for; on a slice of each trace (order-only arrivals, a pool that never
evicts) each request's hit must be exactly the shared tokens rounded down to
whole blocks and capped at ``num_tokens - 1`` (specs/simulate.md), and each cause
exactly what the ids predict.
"""

from __future__ import annotations

import gzip
import json

import pytest

from kvref.data import MOONCAKE_TRACES
from kvref.simulate import load_trace, pool_from_tokens, simulate
from kvref.simulate.sizing import blocks_never_evicting

BLOCK = 16
SLICE = {"conversation": 120, "synthetic": 120}
MIN_SHARED = {"conversation": 0.03, "synthetic": 0.04}    # these slices share 3.4 % and 5.1 %


def lines(name):
    with gzip.open(MOONCAKE_TRACES[name], "rt") as f:
        return [json.loads(line) for line in f]


def readme_reusable_fraction(rows) -> float:
    """The README's rule: leading ids seen before, 512 tokens each, capped at P - 1."""
    seen: set[int] = set()
    reusable = total = 0
    for r in rows:
        ids, P = r["hash_ids"], r["input_length"]
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        reusable += min(k * 512, P - 1) if k else 0
        total += P
        seen.update(ids)
    return reusable / total


def shared_tokens(rows):
    """Per request: the prompt tokens an earlier request had (to the token), and P."""
    known: dict[int, int] = {}          # id -> longest run of it any request had
    out = []
    for r in rows:
        ids, P = r["hash_ids"], r["input_length"]
        shared = 0
        for k, b in enumerate(ids):
            own = min(512, P - 512 * k)
            if b not in known:
                break
            shared += min(known[b], own)
            if known[b] < own:
                break
        out.append((shared, P))
        for k, b in enumerate(ids):
            known[b] = max(known.get(b, 0), min(512, P - 512 * k))
    return out


@pytest.mark.parametrize("name,expected", [("conversation", 0.374), ("synthetic", 0.651)])
def test_the_readme_fractions_hold_for_the_whole_traces(name, expected):
    rows = lines(name)
    assert len(rows) == {"conversation": 12031, "synthetic": 3993}[name]
    assert readme_reusable_fraction(rows) == pytest.approx(expected, abs=0.0005)


@pytest.mark.parametrize("name", sorted(SLICE))
def test_simulate_reproduces_the_reusable_tokens_of_a_slice(name):
    n = SLICE[name]
    rows = lines(name)[:n]
    requests = load_trace(name, max_requests=n)
    pool = pool_from_tokens(blocks_never_evicting(requests, BLOCK, max_output_tokens=1))
    result = simulate(requests, pool, arrivals="order", max_output_tokens=1)

    expected_hits, inside, cap, first = {}, 0, 0, 0
    for i, (shared, P) in enumerate(shared_tokens(rows)):
        shared = min(shared, P)
        aligned = shared // BLOCK * BLOCK                  # whole shared blocks (uncapped)
        hit = min(aligned, (P - 1) // BLOCK * BLOCK)       # the num_tokens - 1 cap
        expected_hits[f"r{i}"] = hit
        cap += aligned - hit
        inside += shared - aligned
        first += P - shared
    assert result.per_request_hits == expected_hits
    assert result.misses_by_cause == {
        "last_token_cap": cap, "window_or_mamba_limit": 0, "evicted_before_reuse": 0,
        "shared_prefix_ends_inside_block": inside, "first_occurrence": first,
        "recompute_after_preemption": 0, "prefix_caching_disabled": 0}
    # One lookup per request (nothing waits in order mode), none after a preemption.
    assert result.prefix_cache_queries == result.prompt_tokens
    assert result.prefix_cache_hits == result.prompt_tokens_cached_once
    # Against the README's rule on the same slice: kvref serves at most B - 1 tokens
    # less per request (the shared partial block), never more.
    readme = readme_reusable_fraction(rows) * result.prompt_tokens
    assert readme - n * (BLOCK - 1) <= result.prompt_tokens_cached_once <= readme
    assert result.prompt_tokens_cached_once > MIN_SHARED[name] * result.prompt_tokens


def test_the_prompt_is_cut_at_input_length_and_equal_ids_give_equal_tokens():
    requests = load_trace("conversation", max_requests=12)
    rows = lines("conversation")[:12]
    for r, row in zip(requests, rows):
        tokens = r.prompt_token_ids()
        assert len(tokens) == row["input_length"]
        for k, b in enumerate(row["hash_ids"]):
            assert tokens[512 * k] == 1000 + 512 * b
