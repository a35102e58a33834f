"""The simulate benchmarks' kvref side runs (no timing is checked; the numbers live in
benchmarks/README.md)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import simulate_vs_vllm  # noqa: E402


def test_the_vllm_comparison_runs_kvrefs_side(capsys):
    assert simulate_vs_vllm.main(["--max-requests", "4", "--max-output-tokens", "2",
                                  "--kvref-only"]) == 0
    out = capsys.readouterr().out
    assert "kvref simulate :" in out and "4 requests" in out


def test_the_vllm_side_reads_the_trace_as_kvref_does():
    """The vLLM side rewrites the token rule (it imports nothing of kvref): same prompts."""
    from kvref.simulate import load_trace

    args = simulate_vs_vllm.arguments(["--max-requests", "5", "--trace", "synthetic"])
    rows = simulate_vs_vllm.read_trace(args)
    for row, request in zip(rows, load_trace("synthetic", max_requests=5)):
        assert simulate_vs_vllm.prompt(row) == request.prompt_token_ids()
        assert row["id"] == request.request_id and row["out"] == request.max_tokens
