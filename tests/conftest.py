"""Hypothesis profiles for the whole test suite.

    pytest tests/stateful                              # "ci": the default, ~3 minutes on 2 cores
    pytest tests/stateful --hypothesis-profile=deep    # many more and longer runs
    pytest tests/stateful --kv-backend vllm            # the machines on vLLM's KV layer
                                                       # (in a Python where vLLM imports;
                                                       # --vllm-src PATH: that vllm/ package)

Hypothesis' pytest plugin provides ``--hypothesis-profile`` and loads the named
profile in its ``pytest_configure``, which runs after this file is imported; so
this file only registers the profiles and makes "ci" the default. The "ci"
profile is derandomized: the same examples every run, so a failure in CI is a
failure on a laptop too, and a seeded bug is either caught or not, never by luck.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# ``--kv-backend vllm`` runs the state machines alone (tests/stateful) on vLLM's KV
# layer, in a Python where vLLM imports (the oracle environment): that needs only
# pytest and Hypothesis. Known from the command line here, before options are parsed,
# so that the check below does not ask such a Python for the whole test extra.
_MACHINES_ON_VLLM = any(arg in ("--kv-backend=vllm",) or
                        (arg == "--kv-backend" and sys.argv[i + 1:i + 2] == ["vllm"])
                        for i, arg in enumerate(sys.argv))

# The suite needs the ``test`` extra (pyproject.toml). Run from an interpreter without
# it, every module would fail to import, each with its own traceback: say it once.
_NEEDED = {"cbor2": "cbor2", "rich": "rich", "textual": "textual", "torch": "torch",
           "transformers": "transformers", "hypothesis": "hypothesis",
           "jupytext": "jupytext", "matplotlib": "matplotlib", "IPython": "ipython",
           "selenium": "selenium", "zmq": "pyzmq", "msgspec": "msgspec", "ray": "ray"}
if _MACHINES_ON_VLLM:
    _NEEDED = {"hypothesis": "hypothesis"}
_MISSING = sorted(pkg for mod, pkg in _NEEDED.items() if importlib.util.find_spec(mod) is None)
if _MISSING:
    pytest.exit(f"kvref's test dependencies are not installed in this Python "
                f"({', '.join(_MISSING)} missing): run  python3 -m pip install -e '.[test]'  first (the README's test "
                "command does both)", returncode=4)

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=150,
    stateful_step_count=50,
    deadline=None,               # a step may build a manager and walk every block
    derandomize=True,
    database=None,               # derandomized runs have nothing to replay
    report_multiple_bugs=False,  # stop at the first failure: seeded-bug runs stay short
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "deep",
    max_examples=1000,
    stateful_step_count=150,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# tools/seeded_bugs.py --catalogue tensor-engine: the "ci" examples, without
# shrinking a failure (a seeded bug is killed by the first failing example;
# shrinking it would cost minutes per bug and say nothing more).
settings.register_profile(
    "seeded",
    parent=settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)

# Only when nothing chose a profile yet: never undo an explicit --hypothesis-profile.
if settings.get_current_profile_name() == "default":
    settings.load_profile("ci")


# --------------------------------------------------------------------------
# The KV layer under the state machines (tests/stateful/backend.py).

_STATEFUL = Path(__file__).resolve().parent / "stateful"


def pytest_addoption(parser):
    group = parser.getgroup("kvref")
    group.addoption("--kv-backend", choices=("kvref", "vllm"), default="kvref",
                    help="the KV layer tests/stateful drives: kvref (default) or vllm, the vLLM "
                         "that imports in this Python; other tests are not collected with vllm")
    group.addoption("--vllm-src", metavar="PATH", default=None,
                    help="with --kv-backend vllm: import the vllm/ package under PATH (a "
                         "checkout, or a copy with a change in it) instead of the installed one")


def pytest_configure(config):
    backend = config.getoption("--kv-backend")
    src = config.getoption("--vllm-src")
    if src and backend != "vllm":
        raise pytest.UsageError("--vllm-src is for --kv-backend vllm")
    if src and not (Path(src) / "vllm" / "__init__.py").is_file():
        raise pytest.UsageError(f"--vllm-src {src}: there is no vllm/__init__.py under it")
    # Read by tests/stateful/backend.py when the machines import it.
    os.environ["KVREF_KV_BACKEND"] = backend
    if src:
        os.environ["KVREF_VLLM_SRC"] = str(Path(src).resolve())
    else:
        os.environ.pop("KVREF_VLLM_SRC", None)


def pytest_ignore_collect(collection_path, config):
    """On vLLM only the state machines run: nothing else has a backend to switch."""
    if config.getoption("--kv-backend") != "vllm":
        return None
    path = Path(collection_path).resolve()
    inside = path == _STATEFUL or _STATEFUL in path.parents or path in _STATEFUL.parents
    return None if inside else True


def pytest_report_header(config):
    if config.getoption("--kv-backend") != "vllm":
        return None
    sys.path.insert(0, str(_STATEFUL.parent))
    try:
        from stateful import backend
    finally:
        sys.path.remove(str(_STATEFUL.parent))
    return [f"kv backend: {backend.DESCRIPTION} (tests/stateful only)"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.getoption("--kv-backend") != "vllm":
        return
    backend = sys.modules.get("stateful.backend")
    if backend is None:
        return
    terminalreporter.write_sep("-", f"the state machines ran on {backend.DESCRIPTION}")
    for path in backend.imported_files():
        terminalreporter.write_line(f"  imported {path}")
