"""The vLLM 0.33.0 change report and the answers lesson 16 shows agree, and the
report's bookkeeping (``tools/vllm_changes.py``) counts what it says, without vLLM.

Regenerating the report needs both vLLM environments
(``python3 tools/vllm_changes.py``); these tests read what it committed.
"""

import gzip
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import vllm_changes  # noqa: E402

REPORT = json.loads((REPO / "docs" / "vllm_0.33_changes.json").read_text(encoding="utf-8"))
ANSWERS = json.loads(vllm_changes.ANSWERS.read_text(encoding="utf-8"))
TRACE_DIR = REPO / "tests" / "conformance" / "traces"


def test_the_answers_file_is_what_the_report_gives_the_lesson():
    assert ANSWERS == json.loads(json.dumps(vllm_changes.lesson_answers(REPORT)))


def test_the_markdown_report_is_rendered_from_the_json_one():
    text = (REPO / "docs" / "vllm_0.33_changes.md").read_text(encoding="utf-8")
    assert text == vllm_changes.render(REPORT)


def test_the_report_counts_every_vendored_trace_once():
    traces = sorted(TRACE_DIR.rglob("*.json.gz"))
    per_class = {d.name: len(list(d.glob("*.json.gz"))) for d in TRACE_DIR.iterdir()
                 if d.is_dir()}
    assert {k: row["traces"] for k, row in REPORT["classes"].items()} == per_class
    total = REPORT["total"]
    assert total["traces"] == len(traces) == 254
    assert total["identical_0.25.1"] == 254
    for row in REPORT["classes"].values():
        assert row["identical_as_is"] <= row["accounted"] <= row["traces"]
    not_accounted = total["traces"] - total["accounted"]
    assert not_accounted == sum(r["traces"] for r in REPORT["residuals"].values()) + len(
        REPORT["unexplained"])


def test_every_change_in_the_tool_is_in_the_report_and_the_lesson():
    assert list(REPORT["changes"]) == vllm_changes.CHANGE_KEYS
    assert set(ANSWERS["answers"]) == set(vllm_changes.CHANGE_KEYS) | {
        r.key for r in vllm_changes.RESIDUALS}


@pytest.mark.parametrize("key", sorted(ANSWERS["answers"]))
def test_each_recorded_0251_answer_is_the_vendored_traces_own(key):
    """The 0.25.1 side of every answer is what the vendored trace recorded at that op,
    and the 0.33.0 side differs from it."""
    entry = ANSWERS["answers"][key]
    with gzip.open(TRACE_DIR / entry["trace"], "rt", encoding="utf-8") as f:
        trace = json.load(f)
    if entry["index"] < 0:
        assert entry["0.25.1"] == trace["expect_init"]
    else:
        op = trace["ops"][entry["index"]]
        assert op["op"] == entry["op"]
        assert {k: v for k, v in entry["0.25.1"].items() if k != "state"} == {
            k: v for k, v in op["expect"].items() if k != "state"}
    assert entry["0.25.1"] != entry[ANSWERS["new"]]


def _entry(name, cls, as_is=True, all_undone=None, shows=None):
    entry = {"trace": name, "class": cls, "ops": 3, "as_is": {"identical": as_is}}
    if all_undone is not None:
        entry["all_undone"] = all_undone
    if shows is not None:
        entry["shows"] = shows
    return entry


def _found(index, op="take_new_block_ids"):
    return {"identical": False, "index": index, "op": op, "path": "ret", "expected": [1],
            "actual": [], "answers": {"0.25.1": {"ret": [1]}, "new": {"ret": []}}}


def test_summarise_counts_accounted_traces_and_keeps_each_changes_earliest_op():
    key = "new_block_ids_for_zeroing_only"
    old = {"version": "0.25.1", "traces": [_entry(n, "full") for n in ("a", "b", "c", "d")]}
    new = {"version": "0.33.0", "traces": [
        _entry("a", "full"),
        _entry("b", "full", False, {"identical": True}, {key: _found(9)}),
        _entry("c", "full", False, {"identical": True}, {key: _found(4)}),
        _entry("d", "full", False, {"identical": False, "index": -1, "op": "construction",
                                    "path": "construction", "expected": "a manager",
                                    "actual": "AssertionError: mamba_cache_mode='align'",
                                    "answers": {"0.25.1": {}, "new": {}}})]}
    summary = vllm_changes.summarise(old, new)
    assert summary["total"] == {"traces": 4, "identical_0.25.1": 4, "identical_as_is": 1,
                                "accounted": 3}
    assert summary["changes"][key]["traces"] == 2
    assert (summary["changes"][key]["first"]["trace"],
            summary["changes"][key]["first"]["index"]) == ("c", 4)
    assert summary["residuals"]["mamba_all_removed"]["traces"] == 1
    assert summary["unexplained"] == []


def test_untag_gives_back_the_keys_0251_hashed():
    tagged = (("lora", "chat", "/loras/chat"), ("mm", "img-1", 3), ("cache_salt", "s"),
              ("prompt_embeds", b"\x01"))
    assert vllm_changes.untag(tagged) == ("chat", ("img-1", 3), "s", b"\x01")
    assert vllm_changes.untag(None) is None


def test_code_lines_leave_out_blanks_comments_and_docstrings():
    source = '"""Module doc."""\n\n# a comment\ndef f(x):\n    """Doc\n    more."""\n' \
             '    return (x +\n            1)  # why\n'
    assert vllm_changes.code_lines(source) == 3      # def, and the two lines of the return


def test_a_function_with_only_its_docstring_changed_counts_as_unchanged():
    old = vllm_changes.functions('class A:\n    def f(self):\n        """Old."""\n        return 1\n')
    new = vllm_changes.functions('class A:\n    def f(self):\n        """New."""\n        return 1\n'
                                 '    def g(self):\n        return 2\n')
    assert list(old) == ["A.f"] and list(new) == ["A.f", "A.g"]
    assert old["A.f"] == new["A.f"]
