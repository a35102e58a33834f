"""The engine environment for tests/vllm_engine: built by the project's own tool.

``tools/setup_vllm_engine_venv.py`` makes (or reuses, by its stamp) the venv in
which vLLM 0.25.1's real engine runs; CI calls it before the suite, so here it
is normally found complete. If it is absent these tests build it (4 to 17
minutes, 680 MB from the package registry) rather than skip: a comparison that
silently did not run would be a test that cannot fail.
``KVREF_VLLM_ENGINE_PYTHON=/path/to/python`` names another environment's python.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_TOOL = ROOT / "tools" / "vllm_engine_run.py"


def load_tool(name: str):
    """A module of tools/ loaded by path (tools/ is not a package)."""
    module_name = f"_kvref_tool_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module        # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def engine_python() -> str:
    override = os.environ.get("KVREF_VLLM_ENGINE_PYTHON")
    if override:
        return override
    setup = load_tool("setup_vllm_engine_venv")
    target = setup.DEFAULT_TARGET
    if not setup.is_complete(target):
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "setup_vllm_engine_venv.py"),
                               str(target)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.fail(f"building vLLM's engine environment at {target} failed "
                        f"(exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return str(target / "bin" / "python")


def run_engine(python: str, *args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    """tools/vllm_engine_run.py in the engine environment, from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([python, str(RUN_TOOL), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
