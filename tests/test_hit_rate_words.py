"""One vocabulary for hit rates: ``kvref demo``, ``kvref simulate``, lesson 15 and the docs
print the same three figures under the same names (``kvref.stats``), and for one
workload the demo and the simulation give the same numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvref.cli import main
from kvref.simulate.engine import StepTime, simulate
from kvref.simulate.sizing import PoolSize
from kvref.simulate.traces import workload_trace
from kvref.stats import HIT_RATE, PREEMPTED_APART, RETRIES_ARE_QUERIES, SERVED_ONCE
from kvref.viz.player import summarize
from kvref.viz.workloads import PRESETS, record_workload

ROOT = Path(__file__).resolve().parents[1]
WORDS = (HIT_RATE, PREEMPTED_APART, SERVED_ONCE)
# The labels these replaced, which must not come back anywhere.
OLD = ("per lookup, as vLLM counts", "served once from the cache", "prompt tokens saved",
       "preempted requests apart:")


def flat(text: str) -> str:
    return " ".join(text.split()).lower()


@pytest.mark.parametrize("name", [n for n in PRESETS if not PRESETS[n]().remote])
def test_the_demo_and_the_simulation_count_a_workload_alike(name):
    requests, preset = workload_trace(name, 0.01)
    demo = summarize(record_workload(name))
    sim = simulate(requests, PoolSize(preset.config, preset.block_size, name),
                   max_model_len=preset.max_model_len,
                   max_num_batched_tokens=preset.max_num_batched_tokens,
                   max_num_seqs=preset.max_num_seqs, watermark=preset.watermark,
                   long_prefill_token_threshold=preset.long_prefill_token_threshold,
                   arrivals="timestamps", step_time=StepTime())
    assert (demo.queries, demo.hits, demo.preempted_queries, demo.preempted_hits,
            demo.served_once, demo.prompt_tokens) == (
        sim.prefix_cache_queries, sim.prefix_cache_hits, sim.preempted_prefix_cache_queries,
        sim.preempted_prefix_cache_hits, sim.prompt_tokens_cached_once, sim.prompt_tokens)


def test_demo_and_simulate_print_the_same_names_and_figures(capsys):
    assert main(["demo", "--workload", "pressure", "--no-animate"]) == 0
    demo = flat(capsys.readouterr().out)
    assert main(["simulate", "--workload", "pressure"]) == 0
    sim = flat(capsys.readouterr().out)
    for words in WORDS + (RETRIES_ARE_QUERIES,):
        assert words.lower() in demo and words.lower() in sim, words
    # pressure: vLLM's counters see 0 of 571; the resumed requests 300 of 400.
    assert re.search(r"vllm's hit rate \(hits / queries\) │ 0\.0% \(0 of 571 tokens\)", demo)
    assert "vllm's hit rate 0.0% (0 hits / 571 queries, in tokens)" in sim
    assert "preempted requests, counted apart │ 300 of 400 tokens" in demo
    assert "preempted requests, counted apart: 300 hits / 400 queries" in sim
    assert "served from the cache, once per request │ 0.0% (0 of 193 prompt tokens)" in demo
    assert "served from the cache, once per request: 0.0% of prompt tokens (0)" in sim


@pytest.mark.parametrize("page", ["tutorials/15_real_traffic.py", "docs/simulate.md",
                                  "specs/simulate.md"])
def test_the_lesson_and_the_pages_use_the_names(page):
    text = (ROOT / page).read_text()
    if page.endswith(".py"):           # the lesson's prose is comments: read it without "# "
        text = re.sub(r"(?m)^\s*# ?", "", text)
    text = flat(text)
    for words in WORDS:
        assert words.lower() in text.replace("*", ""), (page, words)


def test_the_old_labels_are_gone():
    files = [p for folder in ("kvref", "docs", "tutorials", "specs") for p in
             (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    files.append(ROOT / "README.md")
    stale = [(str(p.relative_to(ROOT)), old) for p in files for old in OLD
             if old in flat(p.read_text())]
    assert not stale, stale
