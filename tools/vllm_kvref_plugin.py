"""pytest plugin for ``tools/vllm_unit_tests.py``: run vLLM's tests with
vLLM's KV layer replaced by kvref's, and record every test's outcome.

Loaded with ``-p vllm_kvref_plugin`` (``tools/`` on ``PYTHONPATH``), in the
vLLM oracle environment's python. Three switches, read from the environment:

- ``KVREF_SWAP=1``: before any test module is imported, the modules of vLLM's
  KV layer (``SWAPPED`` below) are replaced, in ``sys.modules`` and as
  attributes of their packages, by kvref's modules of the same role. Every
  other vLLM module (the scheduler, requests, configs, events, the workers)
  stays vLLM's and imports kvref's classes through vLLM's own module names.
- ``KVREF_CPU_PLATFORM=1``: vLLM's CPU platform is set (see ``_cpu_platform``).
- ``KVREF_OUTCOMES=PATH``: at the end, a JSON object ``{nodeid: outcome}`` is
  written there (``passed``, ``failed``, ``skipped``, ``error``) with the first
  line of each failure's message under ``"messages"``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

# vLLM module -> the kvref module that stands in for it. These are vLLM's KV
# layer: the specs and config (kv_cache_interface), the spec-to-manager
# registry that kv_cache_interface itself consults, and vllm/v1/core's block
# pool, utilities, managers and coordinators. kv_cache_metrics,
# encoder_cache_manager and sched/ are vLLM's and stay so.
SWAPPED = {
    "vllm.v1.kv_cache_spec_registry": "kvref.kv_cache_spec_registry",
    "vllm.v1.kv_cache_interface": "kvref.kv_cache_interface",
    "vllm.v1.core.kv_cache_utils": "kvref.core.kv_cache_utils",
    "vllm.v1.core.block_pool": "kvref.core.block_pool",
    "vllm.v1.core.single_type_kv_cache_manager": "kvref.core.single_type_kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator": "kvref.core.kv_cache_coordinator",
    "vllm.v1.core.kv_cache_manager": "kvref.core.kv_cache_manager",
}


# Names a vLLM KV-layer module imports from a module that is not KV layer
# (``Request`` from vllm.v1.request; the event classes from
# vllm.distributed.kv_events). They stay vLLM's: the swapped module gets
# vLLM's object under that name. kvref's kv_cache_manager names its own Request
# only in annotations and doctests; its block pool then builds vLLM's event
# classes with its own arguments, so vLLM's tests see (and check) events of
# vLLM's types, as a drop-in must emit them.
_EVENTS = "vllm.distributed.kv_events"
REEXPORTED = {
    "vllm.v1.core.kv_cache_manager": {"Request": "vllm.v1.request", "BlockStored": _EVENTS},
    "vllm.v1.core.block_pool": {"BlockStored": _EVENTS, "BlockRemoved": _EVENTS,
                                "AllBlocksCleared": _EVENTS},
}


def _swap() -> None:
    already = [name for name in SWAPPED if name in sys.modules]
    if already:
        raise RuntimeError(f"vLLM's KV layer was imported before the swap: {already}")
    for vllm_name, kvref_name in SWAPPED.items():
        module = importlib.import_module(kvref_name)
        parent_name, _, leaf = vllm_name.rpartition(".")
        parent = importlib.import_module(parent_name)  # vllm.v1, vllm.v1.core
        sys.modules[vllm_name] = module
        setattr(parent, leaf, module)
    for vllm_name, names in REEXPORTED.items():
        for name, source in names.items():
            setattr(sys.modules[vllm_name], name,
                    getattr(importlib.import_module(source), name))


def _cpu_platform() -> None:
    """The oracle is vLLM's Python source without a platform build, so vLLM
    cannot tell it runs on a CPU; the scheduler tests' configs need a device.
    Set vLLM's CPU platform (both runs, vLLM and kvref alike)."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()


if os.environ.get("KVREF_SWAP") == "1":
    _swap()
if os.environ.get("KVREF_CPU_PLATFORM") == "1":
    _cpu_platform()

_outcomes: dict[str, str] = {}
_messages: dict[str, str] = {}


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.splitlines()[0] if crash.message else ""
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""


def pytest_runtest_logreport(report) -> None:
    nodeid = report.nodeid
    if report.when == "call":
        if report.passed:
            _outcomes.setdefault(nodeid, "passed")
        elif report.skipped:
            _outcomes[nodeid] = "skipped"
        else:
            _outcomes[nodeid] = "failed"
            _messages[nodeid] = _first_line(report)
    elif report.failed:  # setup or teardown went wrong
        _outcomes[nodeid] = "error"
        _messages[nodeid] = _first_line(report)
    elif report.skipped and report.when == "setup":
        _outcomes[nodeid] = "skipped"


def pytest_collectreport(report) -> None:
    if report.failed:  # a file that does not import: its tests never run
        _outcomes[report.nodeid] = "error"
        _messages[report.nodeid] = _first_line(report)


def pytest_sessionfinish(session) -> None:
    path = os.environ.get("KVREF_OUTCOMES")
    if not path:
        return
    collected = [item.nodeid for item in session.items]
    with open(path, "w") as f:
        json.dump({"collected": collected, "outcomes": _outcomes,
                   "messages": _messages}, f, indent=1)
