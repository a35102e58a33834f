"""Sweeps over capacity, block size and scheduler knobs: local processes, Ray, the curve."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvref.cli import main
from kvref.simulate.sweep import capacity_curve, expand_grid, plot_capacity_curve, run_sweep

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chat_trace(tmp_path_factory) -> str:
    """40 requests: 4 system prompts of 64 tokens, each with its own 30-token question."""
    path = tmp_path_factory.mktemp("sweep") / "chat.jsonl"
    lines = []
    for i in range(40):
        system = list(range(1000 * (i % 4 + 1), 1000 * (i % 4 + 1) + 64))
        lines.append(json.dumps({"prompt_token_ids": system + [50000 + 100 * i + j
                                                               for j in range(30)],
                                 "max_tokens": 4, "arrival_s": 0.05 * i}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_grid_is_every_combination():
    points = expand_grid({"block_size": [16, 32], "max_num_seqs": [1, 8, 64]})
    assert len(points) == 6 and {"block_size": 32, "max_num_seqs": 8} in points
    with pytest.raises(ValueError, match="cannot sweep 'model'"):
        expand_grid({"model": ["x"]})


def test_local_processes_give_what_one_process_gives(chat_trace):
    points = expand_grid({"kv_cache_tokens": [200.0, 2000.0, float("inf")],
                          "block_size": [16, 64]})
    base = {"arrivals": "timestamps"}
    parallel = run_sweep(chat_trace, points, base=base, workers=2)
    serial = run_sweep(chat_trace, points, base=base, workers=1)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rs]  # noqa
    assert strip(parallel) == strip(serial)
    by = {(r["point"]["kv_cache_tokens"], r["point"]["block_size"]): r for r in serial}
    # Block 64 caches only the 64-token system prompts; at block 16 also nothing more
    # (the questions differ), so both reach 36 x 64 hits once nothing is evicted.
    assert by[(float("inf"), 16)]["prompt_tokens_cached_once"] == 36 * 64
    assert by[(float("inf"), 64)]["prompt_tokens_cached_once"] == 36 * 64
    assert by[(200.0, 16)]["hit_ratio_once"] < by[(float("inf"), 16)]["hit_ratio_once"]


def test_the_capacity_curve_rises_to_its_maximum_and_is_drawn(chat_trace, tmp_path):
    """Order-only: 10 blocks hold the last request only (its system prompt never comes
    next), 2000 tokens hold all four system prompts; 50 tokens cannot start."""
    curve = capacity_curve(chat_trace, [50, 150, 400, 2000], block_size=16, workers=2)
    assert len(curve) == 5 and curve[-1]["point"]["kv_cache_tokens"] == float("inf")
    assert "cannot hold one request of max_model_len" in curve[0]["error"]
    ratios = [p["hit_ratio_once"] for p in curve[1:]]
    assert ratios == sorted(ratios) and ratios[0] == 0.0
    assert ratios[-2] == ratios[-1] == 36 * 64 / (40 * 94)
    path = tmp_path / "curve.png"
    plot_capacity_curve({"synthetic, 40 requests": curve}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sweep_flag(chat_trace, tmp_path, capsys):
    png = tmp_path / "c.png"
    code = main(["simulate", chat_trace, "--sweep", "kv-cache-tokens=300,inf",
                 "--sweep", "max-num-seqs=1,16", "--workers", "2", "--plot", str(png),
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    results = json.loads(out)
    assert len(results) == 4 and png.exists()
    code = main(["simulate", chat_trace, "--sweep", "colour=red"])
    out, err = capsys.readouterr()
    assert code == 2 and "expected NAME=V1,V2" in err and err.count("\n") == 1
    code = main(["simulate", chat_trace, "--sweep", "block-size=big"])
    out, err = capsys.readouterr()
    assert code == 2 and "'big' is not an integer" in err


def test_a_sweep_on_a_local_ray_instance(chat_trace):
    """Ray is optional (pip install 'kvref[ray]'); the test starts a local instance."""
    ray = pytest.importorskip("ray", reason="Ray is an optional extra, not installed here")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        points = expand_grid({"kv_cache_tokens": [300.0, float("inf")]})
        on_ray = run_sweep(chat_trace, points, ray_address="auto")
    finally:
        ray.shutdown()
    local = run_sweep(chat_trace, points, workers=1)
    assert [r["prompt_tokens_cached_once"] for r in on_ray] == \
        [r["prompt_tokens_cached_once"] for r in local]


def test_without_ray_the_address_is_one_clear_line(chat_trace, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("no ray")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_ray)
    code = main(["simulate", chat_trace, "--sweep", "kv-cache-tokens=300",
                 "--ray-address", "auto"])
    out, err = capsys.readouterr()
    assert code == 2 and "needs Ray: pip install 'kvref[ray]'" in err


def test_the_sweep_table_fits_80_columns_in_the_single_runs_units(chat_trace, monkeypatch,
                                                                 capsys):
    """The sweep names and prints its hit rates as a single run does (a percentage
    with one decimal), cuts no header at 80 columns, and lists a point's error below
    the table in full."""
    monkeypatch.setenv("COLUMNS", "80")
    code = main(["simulate", chat_trace, "--sweep", "kv-cache-tokens=50,inf",
                 "--sweep", "block-size=16,32", "--sweep", "max-num-seqs=8,16",
                 "--workers", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "…" not in out and max(map(len, out.splitlines())) <= 80
    hit = 36 * 64 / (40 * 94)
    assert f"{hit:.1%}" in out and f"{hit:.3f}" not in out
    assert "served" in out and "vLLM's" in out and "preemp-" in out
    assert "error 1: kv_cache_tokens=50.0 block_size=16 max_num_seqs=8: the KV cache" in out


def test_the_papers_claims_are_drawn_only_for_the_whole_conversation_trace(chat_trace,
                                                                          tmp_path,
                                                                          monkeypatch):
    """The Mooncake paper's two capacities are about its whole conversation trace; on
    any other trace, or a slice of that one, --plot leaves them out."""
    from kvref.simulate import sweep

    assert sweep.is_whole_conversation_trace("conversation", None)
    assert not sweep.is_whole_conversation_trace("conversation", 200)
    assert not sweep.is_whole_conversation_trace("conversation", None, skip=10)
    assert not sweep.is_whole_conversation_trace("synthetic", None)
    drawn = []
    monkeypatch.setattr(sweep, "plot_capacity_curve",
                        lambda curves, path, **kw: drawn.append(kw.get("paper_claims")))
    assert main(["simulate", chat_trace, "--sweep", "kv-cache-tokens=300,inf", "--workers",
                 "1", "--plot", str(tmp_path / "c.png"), "--json"]) == 0
    assert drawn == [False]
