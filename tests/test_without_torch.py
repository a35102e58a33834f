"""Every ``kvref`` command that computes nothing on tensors runs without torch.

The README's first command (``pip install -e . && kvref demo``) installs no torch,
so each command below runs twice in a subprocess: once where ``import torch``
fails (as in a base install), and once where torch is installed, to check that no
torch module was loaded by the time it finished. A command that does need torch
(a trace with prompt embeddings) says so in one line and exits 2.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "tests" / "conformance" / "traces" / "full"
FIRST_TRACE = sorted(TRACES.glob("*.json.gz"))[0]

# Runs kvref's CLI in-process, after (with BLOCK) a finder that refuses torch the
# way a missing package does, then reports the exit status and the torch modules
# that got loaded.
RUNNER = textwrap.dedent("""
    import json, sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    block, report, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    if block == "1":
        sys.meta_path.insert(0, NoTorch())
    from kvref.cli import main
    try:
        status = main(argv)
    except SystemExit as exc:            # argparse's --help and --version
        status = exc.code
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    with open(report, "w") as f:
        json.dump({"status": status, "torch_modules": loaded[:5]}, f)
""")


def commands(tmp: Path) -> dict[str, list[str]]:
    port = 40000 + (hash(str(tmp)) % 20000)
    return {
        "version": ["--version"],
        "help": ["--help"],
        "demo": ["demo", "--no-animate", "--steps", "3"],
        "viz-text": ["viz", "--workload", "prefix-caching", "--no-interactive", "--step", "1"],
        "viz-svg": ["viz", "--workload", "prefix-caching", "--export", str(tmp / "f.svg")],
        "viz-html": ["viz", "--workload", "prefix-caching", "--export", str(tmp / "p.html")],
        "record": ["record", "--workload", "prefix-caching", "-o", str(tmp / "t.json")],
        "explain": ["explain", str(FIRST_TRACE), "--op", "3"],
        "replay": ["replay", str(TRACES)],
        "simulate": ["simulate", "--workload", "multi-turn", "--json"],
        "simulate-host-tier": ["simulate", "synthetic", "--max-requests", "20",
                               "--kv-offloading-size", "0.5", "--json"],
        "watch": ["watch", f"tcp://127.0.0.1:{port}", "--duration", "0.3", "--json"],
    }


def run_cli(argv: list[str], tmp: Path, *, block: bool) -> dict:
    report = tmp / "report.json"
    proc = subprocess.run([sys.executable, "-c", RUNNER, "1" if block else "0", str(report),
                           *argv], cwd=tmp, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                               "HOME": str(tmp), "COLUMNS": "100"})
    assert report.exists(), f"kvref {' '.join(argv)} died:\n{proc.stderr[-3000:]}"
    result = json.loads(report.read_text())
    result["stdout"], result["stderr"] = proc.stdout, proc.stderr
    return result


NAMES = list(commands(Path("/x")))


@pytest.mark.parametrize("name", NAMES)
def test_runs_where_torch_cannot_be_imported(name, tmp_path):
    result = run_cli(commands(tmp_path)[name], tmp_path, block=True)
    assert result["status"] in (0, None), result["stderr"][-3000:]
    assert "torch" not in result["stderr"], result["stderr"][-3000:]


@pytest.mark.parametrize("name", NAMES)
def test_loads_no_torch_where_torch_is_installed(name, tmp_path):
    pytest.importorskip("torch", reason="this half checks an install that has torch")
    result = run_cli(commands(tmp_path)[name], tmp_path, block=False)
    assert result["status"] in (0, None), result["stderr"][-3000:]
    assert result["torch_modules"] == [], f"kvref {name} loaded {result['torch_modules']}"


def test_a_trace_that_needs_torch_says_so_in_one_line(tmp_path):
    """A trace whose requests carry prompt embeddings needs torch to build them."""
    doc = json.loads(gzip.decompress(FIRST_TRACE.read_bytes()))
    add = next(op for op in doc["ops"] if op.get("op") == "add_request")
    add["prompt_embeds"] = {"dtype": "float32", "rows": [[0.0, 1.0]] * len(add["prompt"])}
    path = tmp_path / "embeds.json"
    path.write_text(json.dumps(doc))
    result = run_cli(["replay", str(path)], tmp_path, block=True)
    assert result["status"] == 2
    lines = [line for line in result["stderr"].splitlines() if "torch" in line]
    assert len(lines) == 1 and "pip install" in lines[0], result["stderr"]


def test_a_folder_replays_what_needs_no_torch_and_notes_the_rest(tmp_path):
    """Without torch, the traces with prompt embeddings are skipped with one note; the
    others replay, and the exit status is theirs."""
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "plain.json.gz").write_bytes(FIRST_TRACE.read_bytes())
    embeds = next((REPO / "tests" / "conformance" / "traces" / "prompt_embeds").glob("*.json.gz"))
    (folder / "embeds.json.gz").write_bytes(embeds.read_bytes())
    result = run_cli(["replay", str(folder)], tmp_path, block=True)
    assert result["status"] == 0, result["stderr"]
    assert "1 trace replayed" in " ".join(result["stdout"].split())
    assert result["stderr"].strip() == ("note: skipped 1 trace with prompt embeddings, which "
                                        "needs torch: python3 -m pip install -e '.[torch]'")
