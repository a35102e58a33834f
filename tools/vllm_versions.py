"""Replay kvref's traces on a named vLLM release's KV layer: the version switch.

No vLLM counterpart. kvref mirrors vLLM 0.25.1 and has no version switch
(``kvref/core/`` never asks which release it is); comparing with a newer
release is a matter for the tools alone. This module holds the switch: the
small adapter each listed release needs so that one trace's ops reach its
``KVCacheManager`` as vLLM's own scheduler would send them.

Every difference the adapter bridges is an API change, not a behaviour change
(those are what ``tools/vllm_changes.py`` reports). From 0.25.1 to 0.33.0:

1. ``KVCacheManager(max_num_batched_tokens=)`` is ``max_in_flight_tokens=``
   (0.33.0 ``vllm/v1/core/kv_cache_manager.py:138``);
2. ``get_computed_blocks`` returns a third value, the shared-prefix boundary
   (``kv_cache_manager.py:266-328``);
3. the prefix-cache stats are no longer recorded inside
   ``get_computed_blocks`` but by ``record_prefix_cache_stats``
   (``kv_cache_manager.py:255``), which 0.33.0's scheduler calls when it admits
   the request (``vllm/v1/core/sched/scheduler.py:1508-1512``); a trace's
   lookups are admissions, so the adapter records right after the lookup, as
   0.25.1 did;
4. the prefix-cache retention interval is a field of ``KVCacheConfig``
   (``vllm/v1/kv_cache_interface.py:1541``), not the environment variable
   ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``;
5. neither release's coordinator can build a ``SinkFullAttentionManager``:
   0.25.1's ``__init__`` lacks ``scheduler_block_size=`` (see
   ``tools/record_vllm_traces.py``), 0.33.0's lacks ``needs_kv_cache_zeroing=``
   that its coordinator passes to every manager (``kv_cache_coordinator.py:173``
   against ``single_type_kv_cache_manager.py:2200-2208``). The adapter takes
   the keyword and runs vLLM's own body.

The pure functions below (``manager_kwargs``, ``config_kwargs``,
``retention_env``, ``computed_blocks``, ``let_sink_manager_take``) are the
adapter; they are tested without vLLM (``tests/conformance/test_vllm_versions.py``).
``replay_on(trace, version)`` needs that release importable: run it with the
interpreter ``python3 tools/setup_vllm_venv.py --vllm-version V DIR`` makes.
From the command line, the first divergence of each trace on a named release::

    PYTHONPATH=$PWD /root/.cache/vllm-oracle-0.33.0/bin/python tools/vllm_versions.py \\
        --vllm-version 0.33.0 tests/conformance/traces/sink
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))

from kvref.verify.trace_replay import ReplayResult, TraceReplayer, replay  # noqa: E402

VERSIONS = ("0.25.1", "0.33.0")
MIRRORED = "0.25.1"                       # the release kvref mirrors
RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
# The keyword each release's coordinator passes that its SinkFullAttentionManager lacks.
SINK_MISSING_KEYWORD = {"0.25.1": "scheduler_block_size", "0.33.0": "needs_kv_cache_zeroing"}


def check_version(version: str) -> str:
    if version not in VERSIONS:
        raise ValueError(f"vLLM {version!r} has no adapter here (listed: {', '.join(VERSIONS)})")
    return version


def manager_kwargs(header: dict, version: str) -> dict:
    """``KVCacheManager`` keyword arguments (besides the config) of a trace header."""
    m = header["manager"]
    budget_keyword = ("max_num_batched_tokens" if check_version(version) == "0.25.1"
                      else "max_in_flight_tokens")
    return {"max_model_len": m["max_model_len"],
            "scheduler_block_size": m["scheduler_block_size"],
            "hash_block_size": m["hash_block_size"],
            budget_keyword: m.get("max_num_batched_tokens"),
            "enable_caching": m["enable_caching"], "use_eagle": m.get("use_eagle", False),
            "log_stats": m.get("log_stats", False),
            "enable_kv_cache_events": m.get("enable_kv_cache_events", False),
            "watermark": m.get("watermark", 0.0)}


def config_kwargs(header: dict, version: str) -> dict:
    """``KVCacheConfig`` keyword arguments besides blocks, tensors and groups."""
    retention = header.get("prefix_cache_retention_interval")
    if check_version(version) == "0.25.1" or retention is None:
        return {}
    return {"prefix_cache_retention_interval": retention}


def retention_env(header: dict, version: str) -> str | None:
    """What ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` must be while the manager
    is built (None: unset). 0.33.0 reads the config field instead."""
    retention = header.get("prefix_cache_retention_interval")
    if check_version(version) != "0.25.1" or retention is None:
        return None
    return str(retention)


def computed_blocks(result: tuple, version: str) -> tuple:
    """``(blocks, num_computed_tokens)`` of ``get_computed_blocks``'s answer."""
    expected = 2 if check_version(version) == "0.25.1" else 3
    if len(result) != expected:
        raise TypeError(f"vLLM {version}'s get_computed_blocks returned {len(result)} "
                        f"values, the adapter expects {expected}")
    return result[0], result[1]


def let_sink_manager_take(manager_class, version: str) -> None:
    """Let ``SinkFullAttentionManager.__init__`` accept the one keyword its
    coordinator passes and it lacks (module docstring, 5), then run vLLM's body.

    0.25.1: ``scheduler_block_size`` is set on the manager afterwards.
    0.33.0: ``needs_kv_cache_zeroing`` decides the base class's
    ``_record_new_block_ids`` (``single_type_kv_cache_manager.py:116-120``;
    a sink spec is an attention spec, never a circular buffer).
    """
    keyword = SINK_MISSING_KEYWORD[check_version(version)]
    vllm_init = manager_class.__init__
    if getattr(vllm_init, "_takes", None) == keyword or (
            keyword == "scheduler_block_size"
            and getattr(vllm_init, "_takes_scheduler_block_size", False)):
        return          # wrapped already (here, or by tools/record_vllm_traces.py)

    def init(self, kv_cache_spec, **kwargs) -> None:
        value = kwargs.pop(keyword, None)
        vllm_init(self, kv_cache_spec, **kwargs)
        if keyword == "scheduler_block_size":
            self.scheduler_block_size = value
        elif value:
            self._record_new_block_ids = True

    init._takes = keyword
    manager_class.__init__ = init


# --------------------------------------------------------------------------
# the replayer (needs the release importable)


def import_vllm(version: str) -> dict:
    """The KV-layer objects of the vLLM on this interpreter's path; exits with one
    clear line when it is missing or another release."""
    check_version(version)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import torch
        import vllm
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256, sha256_cbor
        from vllm.v1 import kv_cache_interface as spec
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.single_type_kv_cache_manager import SinkFullAttentionManager
        from vllm.v1.request import Request
    except ImportError as exc:
        sys.exit(f"vllm_versions: vLLM {version} does not import here ({exc}); run with the "
                 f"python of `python3 tools/setup_vllm_venv.py --vllm-version {version} DIR`")
    found = _installed_version(Path(vllm.__file__).parent)
    if found not in (None, version):
        sys.exit(f"vllm_versions: this interpreter has vLLM {found}, not {version}")
    let_sink_manager_take(SinkFullAttentionManager, version)
    return dict(torch=torch, LoRARequest=LoRARequest, MultiModalFeatureSpec=MultiModalFeatureSpec,
                PlaceholderRange=PlaceholderRange, SamplingParams=SamplingParams,
                hash_functions={"sha256": sha256, "sha256_cbor": sha256_cbor}, spec=spec,
                kv_cache_utils=kv_cache_utils, KVCacheManager=KVCacheManager, Request=Request)


def _installed_version(package: Path) -> str | None:
    """The release of an unpacked wheel (``vllm/_version.py``), if it says."""
    path = package / "_version.py"
    found = re.search(r"^__version__\s*=[^'\"]*['\"]([^'\"+]+)", path.read_text(
        encoding="utf-8"), re.MULTILINE) if path.exists() else None
    return found.group(1) if found else None


@functools.cache
def replayer_class(version: str):
    """A ``TraceReplayer`` whose objects are vLLM ``version``'s."""
    from record_vllm_traces import VllmReplayer   # tools/: kvref's replayer on vLLM

    check_version(version)

    class ReleaseReplayer(VllmReplayer):
        vllm_version = version

        def __init__(self, header: dict) -> None:
            self.v = import_vllm(version)
            self.utils = self.v["kv_cache_utils"]
            self.hash_functions = self.v["hash_functions"]
            TraceReplayer.__init__(self, header)

        def build_manager(self, header: dict):
            spec = self.v["spec"]
            groups = [spec.KVCacheGroupSpec(g.get("layer_names", [f"layer.{i}"]),
                                            self._spec(g),
                                            is_eagle_group=g.get("is_eagle_group", False))
                      for i, g in enumerate(header["groups"])]
            config = spec.KVCacheConfig(num_blocks=header["num_blocks"], kv_cache_tensors=[],
                                        kv_cache_groups=groups,
                                        **config_kwargs(header, version))
            saved = os.environ.pop(RETENTION_ENV, None)
            value = retention_env(header, version)
            if value is not None:
                os.environ[RETENTION_ENV] = value
            try:
                return self.v["KVCacheManager"](config, **manager_kwargs(header, version))
            finally:
                os.environ.pop(RETENTION_ENV, None)
                if saved is not None:
                    os.environ[RETENTION_ENV] = saved

        def _op_get_computed_blocks(self, op):
            request = self._request(op)
            blocks, num_tokens = computed_blocks(self.manager.get_computed_blocks(request),
                                                 version)
            if version != "0.25.1":
                self.manager.record_prefix_cache_stats(request, num_tokens)
            self.last_hit[op["req"]] = blocks
            return {"blocks": [[b.block_id for b in group] for group in blocks.blocks],
                    "num_computed_tokens": num_tokens}

    ReleaseReplayer.__name__ = f"Vllm{version.replace('.', '')}Replayer"
    return ReleaseReplayer


def replay_on(trace: dict, version: str) -> ReplayResult:
    """Replay one trace on vLLM ``version``; the first divergence or none."""
    return replay(trace, replayer_class=replayer_class(version))


def main(argv: list[str] | None = None) -> int:
    import argparse

    from kvref.verify.trace_replay import find_traces, load_trace

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-version", required=True, choices=VERSIONS)
    parser.add_argument("traces", nargs="+", type=Path, help="trace files or folders")
    args = parser.parse_args(argv)
    paths = list(find_traces(args.traces))
    if not paths:
        parser.error(f"no .json or .json.gz traces under {', '.join(map(str, args.traces))}")
    divergent = 0
    for path in paths:
        result = replay_on(load_trace(path), args.vllm_version)
        divergent += result.divergence is not None
        print(f"{path.name}: {result.divergence or 'identical'}", flush=True)
    print(f"{len(paths)} traces on vLLM {args.vllm_version}, {divergent} divergent")
    return 1 if divergent else 0


if __name__ == "__main__":
    sys.exit(main())
