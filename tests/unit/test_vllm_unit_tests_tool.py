"""The report of ``tools/vllm_unit_tests.py`` (no vLLM needed: outcomes are given)."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("vllm_unit_tests",
                                              ROOT / "tools" / "vllm_unit_tests.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

F = "tests/v1/core/test_kv_cache_utils.py"
EXPECTED = next(iter(tool.EXPECTED_KVREF_FAILURES))
# The other listed tests, failing on kvref as expected.
SIBLINGS = [n for n in tool.EXPECTED_KVREF_FAILURES if n != EXPECTED]
FILES = sorted({F, *map(tool.file_of, tool.EXPECTED_KVREF_FAILURES)})


def _runs(kvref_outcomes):
    ids = [f"{F}::a", f"{F}::b", EXPECTED, *SIBLINGS]
    on_vllm = {"collected": ids, "outcomes": {i: "passed" for i in ids}, "messages": {}}
    on_kvref = {"collected": ids, "outcomes": kvref_outcomes, "messages": {}}
    return on_vllm, on_kvref


def test_an_unlisted_kvref_failure_fails_the_tool(capsys):
    on_vllm, on_kvref = _runs({f"{F}::a": "passed", f"{F}::b": "failed"})
    assert tool.report(FILES, on_vllm, on_kvref, False) == 1
    assert f"{F}::b" in capsys.readouterr().out


def test_only_listed_failures_pass_and_a_stale_entry_fails():
    on_vllm, on_kvref = _runs({f"{F}::a": "passed", f"{F}::b": "passed"})
    assert tool.report(FILES, on_vllm, on_kvref, True) == 0
    on_vllm, on_kvref = _runs({f"{F}::a": "passed", f"{F}::b": "passed",
                               EXPECTED: "passed"})
    assert tool.report(FILES, on_vllm, on_kvref, True) == 1


def test_not_modelled_features_exit_2(monkeypatch):
    # A made-up entry: the real list shrinks as features come in.
    monkeypatch.setattr(tool, "NOT_MODELLED", {"test_feature_x.py": "feature x, kept out"})
    nodeid = "tests/v1/core/test_feature_x.py::t"
    on_vllm = {"collected": [nodeid], "outcomes": {nodeid: "passed"}, "messages": {}}
    on_kvref = {"collected": [], "outcomes": {}, "messages": {}}
    assert tool.report([tool.file_of(nodeid)], on_vllm, on_kvref, False) == 2
