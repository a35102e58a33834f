"""``kvref simulate`` end to end: the JSON scripts read, the report, the recording,
and every bad input as one line on stderr with exit code 2."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvref.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_issues_command_prints_the_json_scripts_use(capsys):
    code, out, err = run(capsys, "simulate", "conversation", "--max-requests", "20",
                         "--arrivals", "order", "--kv-cache-tokens", "inf",
                         "--max-output-tokens", "4", "--json")
    assert code == 0, err
    doc = json.loads(out)
    for key in ("prompt_tokens", "prompt_tokens_computed", "prefix_cache_queries",
                "prefix_cache_hits", "hit_ratio_once", "misses_by_cause"):
        assert key in doc
    assert sum(doc["misses_by_cause"].values()) == doc["prompt_tokens_computed"]
    assert doc["prompt_tokens"] == doc["prompt_tokens_computed"] + doc[
        "prompt_tokens_cached_once"]
    assert doc["hit_ratio_once"] == doc["prompt_tokens_cached_once"] / doc["prompt_tokens"]
    assert doc["num_requests"] == 20 and doc["num_preemptions"] == 0


def test_a_plain_jsonl_on_a_named_model_with_the_human_report(tmp_path, capsys):
    system = list(range(100, 340))                     # a 240-token shared system prompt
    lines = [json.dumps({"prompt_token_ids": system + [1000 + 10 * i + j for j in range(20)],
                         "max_tokens": 8, "arrival_s": 0.5 * i}) for i in range(6)]
    path = tmp_path / "mine.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    code, out, err = run(capsys, "simulate", path, "--model", "llama-3-8b-like", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["num_gpu_blocks"] == 28181 and doc["block_size"] == 16     # 80 GiB x 0.9
    assert doc["prompt_tokens_cached_once"] == 5 * 240
    # The same with a 784-token block (a hybrid's): the 240 tokens never fill one.
    code, out, err = run(capsys, "simulate", path, "--kv-cache-tokens", "100000",
                         "--block-size", "784", "--json")
    doc = json.loads(out)
    assert doc["prefix_cache_hits"] == 0
    assert doc["misses_by_cause"]["shared_prefix_ends_inside_block"] == 5 * 240
    code, out, err = run(capsys, "simulate", path, "--kv-cache-tokens", "100000")
    words = " ".join(out.split())                     # rich wraps at the terminal width
    assert code == 0 and "first_occurrence" in words and "KV usage" in words
    assert "vLLM's hit rate 76.9% (1,200 hits / 1,560 queries" in words


def test_record_writes_a_trace_kvref_viz_reads(tmp_path, capsys):
    from kvref.viz.player import TracePlayer, read_trace

    path = tmp_path / "window.json.gz"
    code, out, err = run(capsys, "simulate", "synthetic", "--max-requests", "3",
                         "--kv-cache-tokens", "60000", "--max-output-tokens", "3",
                         "--record", path, "--record-steps", "6")
    assert code == 0, err
    assert f"wrote {path}: the first 6 steps" in " ".join(out.split())
    player = TracePlayer(read_trace(str(path)))
    assert len(player.steps) >= 6


@pytest.mark.parametrize("args,message", [
    (["nope.jsonl"], "no trace file 'nope.jsonl'"),
    (["conversation", "--max-requests", "0"], "--max-requests must be at least 1"),
    (["conversation", "--kv-cache-tokens", "lots"], "expected a token count or 'inf'"),
    (["conversation", "--model", "gpt-9"], "neither a named shape"),
    (["conversation", "--max-requests", "5", "--kv-cache-tokens", "1000"],
     "cannot hold one request of max_model_len"),
    (["conversation", "--max-requests", "5", "--model", "llama-3-70b-like"],
     "no memory left for the KV cache"),
    (["conversation", "--record", "out.txt"], "must end in .json or .json.gz"),
    (["conversation", "--kv-cache-tokens", "inf", "--num-gpu-blocks-override", "9"],
     "not both"),
    (["conversation", "--arrivals", "later"], "invalid choice"),
])
def test_bad_flags_are_one_line(capsys, args, message):
    code, out, err = run(capsys, "simulate", *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.parametrize("content,message", [
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4}\nnot json\n', ":2: not JSON"),
    ('{"hash_ids": [1, 2], "input_length": 2000}\n', "does not fit 2 blocks"),
    ('{"prompt_token_ids": [], "max_tokens": 4}\n', "non-empty list of integers"),
    ('{"prompt_token_ids": [1], "max_tokens": -1}\n', "'max_tokens' must be an integer"),
    ('{"prompt_token_ids": [1], "arrival_s": "soon"}\n', "'arrival_s' must be a number"),
    ('{"text": "hello"}\n', "neither a Mooncake line"),
    ('[1, 2, 3]\n', "expected a JSON object"),
    ('', "no requests"),
])
def test_bad_traces_are_one_line_with_file_and_line(tmp_path, capsys, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    code, out, err = run(capsys, "simulate", path, "--kv-cache-tokens", "1000")
    assert code == 2
    assert err.count("\n") == 1 and message in err, err


def test_a_gzip_that_is_not_gzip(tmp_path, capsys):
    path = tmp_path / "bad.jsonl.gz"
    path.write_text('{"prompt_token_ids": [1]}\n')
    code, out, err = run(capsys, "simulate", path)
    assert code == 2 and "cannot read it as gzip JSONL" in err and err.count("\n") == 1


def test_progress_lines_on_a_long_run_without_a_terminal(tmp_path):
    """1000 requests or more: a line on stderr every tenth (no terminal here)."""
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": [i, i + 1, i + 2],
                                        "max_tokens": 1}) + "\n" for i in range(1000)))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "kvref", "simulate", str(path),
                             "--kv-cache-tokens", "1000", "--json"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("requests arrived") == 9
    assert json.loads(result.stdout)["num_requests"] == 1000


def test_kvrefs_own_workloads_run_on_their_own_pools(capsys):
    code, out, err = run(capsys, "simulate", "--workload", "multi-turn", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["num_requests"] == 9                   # follow-up turns arrived too
    assert doc["misses_by_cause"]["shared_prefix_ends_inside_block"] > 0   # the time stamp
    code, out, err = run(capsys, "simulate", "--workload", "pressure", "--json")
    doc = json.loads(out)
    assert doc["num_preemptions"] > 0 and doc["misses_by_cause"]["recompute_after_preemption"] > 0
    code, out, err = run(capsys, "simulate", "--workload", "connector")
    assert code == 2 and "needs a remote-prefill KV connector" in err
    code, out, err = run(capsys, "simulate")
    assert code == 2 and "give a TRACE or --workload W" in err


def test_at_80_columns_no_cause_name_is_cut(monkeypatch, capsys):
    """The causes table keeps every cause's name whole (the meaning wraps instead)."""
    from kvref.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["simulate", "--workload", "multi-turn"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and max(map(len, out.splitlines())) <= 80
    assert "shared_prefix_ends_inside_block" in out
