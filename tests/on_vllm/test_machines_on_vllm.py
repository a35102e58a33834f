"""kvref's state machines on vLLM 0.25.1's own KV layer (``--kv-backend vllm``).

``tools/vllm_machines.py`` runs ``tests/stateful`` in the oracle environment with
the backend of ``tests/stateful/backend.py`` switched to vLLM: every machine,
every config class, the ``ci`` profile. Then a copy of vLLM's source with one
seeded bug, given with ``--vllm-src``, must fail, naming the invariant and the
files it imported from.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT

TOOL = ROOT / "tools" / "vllm_machines.py"


def _run(args, timeout):
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_the_machines_pass_on_vllm_0_25_1(oracle_python, oracle_vllm_dir):
    run = _run(["--python", oracle_python, "--", "-q"], timeout=1500)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 30 and "failed" not in out.splitlines()[-1], \
        out[-2000:]
    # The machines drove vLLM's own files, not kvref's.
    for module in ("v1/core/kv_cache_manager.py", "v1/core/block_pool.py",
                   "v1/core/single_type_kv_cache_manager.py", "v1/core/kv_cache_coordinator.py"):
        assert f"imported {oracle_vllm_dir / module}" in out, out[-2000:]
    assert f"the state machines ran on vLLM 0.25.1 from {oracle_vllm_dir}" in out


HIT_CAP = ("        max_cache_hit_length = request.num_tokens - 1\n",
           "        max_cache_hit_length = request.num_tokens\n")


def test_a_copy_with_a_seeded_bug_fails_naming_the_invariant_and_its_files(
        oracle_python, oracle_vllm_dir, tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(oracle_vllm_dir, copy / "vllm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    target = copy / "vllm" / "v1" / "core" / "kv_cache_manager.py"
    text = target.read_text()
    assert text.count(HIT_CAP[0]) == 1, "vLLM's hit cap line moved: update HIT_CAP"
    target.write_text(text.replace(*HIT_CAP))
    run = _run(["--python", oracle_python, "--vllm-src", str(copy), "--",
                "-x", "-q", "tests/stateful/test_kv_cache_manager_machine.py",
                "-k", "TestFullAttention"], timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-4000:]
    assert "INV-HIT-1" in out, out[-4000:]
    assert f"imported {target}" in out, out[-2000:]
    assert f"ran on vLLM 0.25.1 from {copy / 'vllm'}" in out


def test_vllm_src_needs_the_vllm_backend_and_a_vllm_package(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pytest", "tests/stateful", "--vllm-src",
                          str(tmp_path), "-q"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 4 and "--vllm-src is for --kv-backend vllm" in run.stderr
    run = _run(["--python", sys.executable, "--vllm-src", str(tmp_path)], timeout=60)
    assert run.returncode == 2 and "there is no vllm/__init__.py under it" in run.stderr


def test_every_check_left_out_on_vllm_says_why():
    """A check skipped on vLLM is named, with the vLLM file and line that make it
    impossible; none is skipped on kvref."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from stateful import backend
    finally:
        sys.path.remove(str(ROOT / "tests"))
    assert backend.BACKEND == "kvref"
    for name, why in backend.UNCHECKABLE_ON_VLLM.items():
        assert re.search(r"vLLM 0\.25\.1's .* \(v1/core/[a-z_]+\.py:\d+", why), (name, why)
        assert backend.checks(name)
    with pytest.raises(KeyError):
        backend.checks("a check nobody listed")


# What a machine may take from kvref itself: the spec classes that describe a
# config (turned into vLLM's by the backend), arithmetic, and kvref's snapshot
# checker (which reads only what kvref and vLLM share). Everything it drives
# comes from tests/stateful/backend.py.
DESCRIPTIONS = {"ChunkedLocalAttentionSpec", "CrossAttentionSpec", "FullAttentionSpec",
                "KVCacheSpec", "MambaSpec", "SlidingWindowSpec"}
HELPERS = {"kvref.math_utils": {"cdiv"}, "kvref.verify.invariants": {"check"}}


def test_the_machines_take_what_they_drive_from_the_backend():
    import ast
    stateful = ROOT / "tests" / "stateful"
    for path in sorted(stateful.glob("*.py")):
        if path.name == "backend.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("kvref") for a in node.names), \
                    f"{path.name} imports a kvref module whole: take it from backend.py"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvref"):
                names = {a.name for a in node.names}
                allowed = DESCRIPTIONS if node.module == "kvref" else HELPERS.get(node.module, set())
                assert names <= allowed, (
                    f"{path.name} takes {sorted(names - allowed)} from {node.module}: what a "
                    "machine drives comes from tests/stateful/backend.py")


def test_files_given_to_the_tool_replace_the_whole_folder():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import vllm_machines
    finally:
        sys.path.remove(str(ROOT / "tools"))
    whole = vllm_machines.machines_command("py", None, ["-q"])
    assert whole[:4] == ["py", "-m", "pytest", "tests/stateful"]
    one = vllm_machines.machines_command("py", "/src", ["tests/stateful/test_free_queue_machine.py"])
    assert "tests/stateful" not in one and one[-1] == "tests/stateful/test_free_queue_machine.py"
    assert one[one.index("--vllm-src") + 1] == "/src"
