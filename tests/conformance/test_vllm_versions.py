"""The version adapter of ``tools/vllm_versions.py``, without vLLM.

Each test is one API change between vLLM 0.25.1 and 0.33.0 that the adapter
bridges (the module docstring lists them with vLLM's lines); replaying on the
real releases is ``tools/vllm_changes.py``'s job and needs their environments.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import vllm_versions as adapter  # noqa: E402

HEADER = {"num_blocks": 16, "groups": [{"kind": "full", "block_size": 4}],
          "manager": {"max_model_len": 64, "scheduler_block_size": 4, "hash_block_size": 4,
                      "enable_caching": True, "max_num_batched_tokens": 32,
                      "log_stats": True, "watermark": 0.05},
          "hash": {"algo": "sha256", "none_hash_seed": "1"}}


def test_the_budget_keyword_was_renamed_and_nothing_else_changed():
    old = adapter.manager_kwargs(HEADER, "0.25.1")
    new = adapter.manager_kwargs(HEADER, "0.33.0")
    assert old.pop("max_num_batched_tokens") == new.pop("max_in_flight_tokens") == 32
    assert old == new
    assert "max_num_batched_tokens" not in new and "max_in_flight_tokens" not in old


def test_the_retention_interval_moved_from_the_environment_to_the_config():
    header = {**HEADER, "prefix_cache_retention_interval": 8}
    assert adapter.retention_env(header, "0.25.1") == "8"
    assert adapter.config_kwargs(header, "0.25.1") == {}
    assert adapter.retention_env(header, "0.33.0") is None
    assert adapter.config_kwargs(header, "0.33.0") == {"prefix_cache_retention_interval": 8}


def test_without_a_retention_interval_neither_release_gets_one():
    for version in adapter.VERSIONS:
        assert adapter.retention_env(HEADER, version) is None
        assert adapter.config_kwargs(HEADER, version) == {}


def test_get_computed_blocks_answers_two_values_then_three():
    assert adapter.computed_blocks(("blocks", 8), "0.25.1") == ("blocks", 8)
    assert adapter.computed_blocks(("blocks", 8, 12), "0.33.0") == ("blocks", 8)
    with pytest.raises(TypeError, match="returned 2 values, the adapter expects 3"):
        adapter.computed_blocks(("blocks", 8), "0.33.0")


class _Sink033:
    """The shape of 0.33.0's SinkFullAttentionManager.__init__: no
    needs_kv_cache_zeroing, which its coordinator passes."""

    def __init__(self, kv_cache_spec, block_pool, enable_caching, kv_cache_group_id,
                 scheduler_block_size, dcp_world_size=1, pcp_world_size=1):
        self.spec, self.scheduler_block_size = kv_cache_spec, scheduler_block_size
        self._record_new_block_ids = False


class _Sink0251:
    """The shape of 0.25.1's: no scheduler_block_size."""

    def __init__(self, kv_cache_spec, block_pool, enable_caching, kv_cache_group_id,
                 dcp_world_size=1, pcp_world_size=1):
        self.spec = kv_cache_spec


COORDINATOR_033 = dict(block_pool=None, enable_caching=True, kv_cache_group_id=0,
                       dcp_world_size=1, pcp_world_size=1, scheduler_block_size=4)


def test_the_033_sink_manager_cannot_take_its_coordinators_keyword_until_adapted():
    cls = type("Sink", (_Sink033,), {})
    with pytest.raises(TypeError, match="needs_kv_cache_zeroing"):
        cls("spec", needs_kv_cache_zeroing=False, **COORDINATOR_033)
    adapter.let_sink_manager_take(cls, "0.33.0")
    built = cls("spec", needs_kv_cache_zeroing=False, **COORDINATOR_033)
    assert (built.spec, built.scheduler_block_size, built._record_new_block_ids) == (
        "spec", 4, False)
    assert cls("spec", needs_kv_cache_zeroing=True, **COORDINATOR_033)._record_new_block_ids


def test_the_0251_sink_manager_gets_scheduler_block_size_set_after_its_body():
    cls = type("Sink", (_Sink0251,), {})
    kwargs = {k: v for k, v in COORDINATOR_033.items()}
    with pytest.raises(TypeError, match="scheduler_block_size"):
        cls("spec", **kwargs)
    adapter.let_sink_manager_take(cls, "0.25.1")
    adapter.let_sink_manager_take(cls, "0.25.1")     # twice: wrapped once
    assert cls("spec", **kwargs).scheduler_block_size == 4


def test_an_unlisted_release_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"vLLM '0.30.0' has no adapter here \(listed: "):
        adapter.manager_kwargs(HEADER, "0.30.0")


def test_the_installed_release_is_read_from_the_wheels_version_file(tmp_path):
    (tmp_path / "_version.py").write_text(
        "version: str\n__version__ = version = '0.33.0'\n", encoding="utf-8")
    assert adapter._installed_version(tmp_path) == "0.33.0"
    assert adapter._installed_version(tmp_path / "missing") is None


def test_the_trace_recorder_takes_a_listed_release_only(capsys):
    """``tools/record_vllm_traces.py --vllm-version`` records another release's
    answers through this adapter; a release the adapter does not list is refused
    before any vLLM is imported."""
    import record_vllm_traces as recorder

    with pytest.raises(SystemExit) as exit_info:
        recorder.main(["--vllm-version", "0.30.0", "--rerecord", "unused.json.gz"])
    assert exit_info.value.code == 2
    assert "invalid choice: '0.30.0'" in capsys.readouterr().err
    assert recorder.record_on_vllm.__defaults__ == (adapter.MIRRORED,)
