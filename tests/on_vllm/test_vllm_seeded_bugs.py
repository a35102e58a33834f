"""The catalogue of bugs seeded into vLLM 0.25.1's own KV layer (tools/vllm_seeded_bugs.py).

The whole table takes its own command (about half an hour); here every edit
must still apply to the vLLM the oracle imports, the table must say what the
docs say, and one bug runs end to end through all four checks.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import vllm_seeded_bugs as tool  # noqa: E402

DOC = ROOT / "docs" / "seeded_bugs_vllm.md"


def test_every_edit_applies_exactly_once_to_vllm_0_25_1(oracle_vllm_dir):
    assert tool.check_catalogue(oracle_vllm_dir, tool.CATALOGUE) == []
    assert len(tool.CATALOGUE) >= 20


def test_the_catalogue_edits_only_vllms_kv_layer():
    for bug in tool.CATALOGUE:
        assert bug.path.startswith("v1/core/") and not bug.path.startswith("v1/core/sched/"), \
            bug.bug_id


def test_a_bug_runs_through_all_four_checks(oracle_python, tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "vllm_seeded_bugs.py"),
                          "--python", oracle_python, "-k", "hit-cap-off-by-one", "-j", "1",
                          "--json", str(out), "--markdown", str(tmp_path / "t.md")],
                         cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    row, = json.loads(out.read_text())["rows"]
    assert row["machines"][0] == "killed" and "INV-HIT-1" in row["machines"][1], row
    assert row["traces"][0] == "killed", row
    assert row["vllm_kv_tests"][0] == "killed", row


def test_the_docs_table_is_the_catalogue_and_explains_every_survivor():
    """docs/seeded_bugs_vllm.md holds one row per bug of the catalogue (as the
    last full run wrote it) and a reason for every bug the machines survived."""
    text = DOC.read_text()
    rows = re.findall(r"^\| `([a-z0-9-]+)`:", text, re.M)
    assert rows == [bug.bug_id for bug in tool.CATALOGUE]
    for bug_id, why in tool.SURVIVORS.items():
        assert f"`{bug_id}`: {why}" in text
    assert "NOT EXPLAINED" not in text


def test_summary_counts_each_column():
    rows = [{"vllm_kv_tests": ("killed", ""), "vllm_scheduler_tests": ("survived", ""),
             "machines": ("killed", ""), "traces": ("survived", "")},
            {"vllm_kv_tests": ("survived", ""), "vllm_scheduler_tests": ("killed", ""),
             "machines": ("TIMEOUT", ""), "traces": ("killed", "")}]
    assert tool.summary(rows) == {"vllm_kv_tests": 1, "vllm_scheduler_tests": 1,
                                  "machines": 1, "traces": 1, "vllm_tests": 2, "bugs": 2}


def test_an_edit_that_no_longer_applies_is_reported(tmp_path):
    (tmp_path / "v1" / "core").mkdir(parents=True)
    (tmp_path / "v1" / "core" / "kv_cache_manager.py").write_text("nothing here\n")
    bug = tool.CATALOGUE[0]
    assert tool.check_catalogue(tmp_path, [bug]) == [
        f"{bug.bug_id}: its text occurs 0 times in vllm/{bug.path}"]
