"""vLLM 0.25.1's KV layer for tests/on_vllm: the oracle environment the project builds.

``tools/setup_vllm_venv.py`` makes it (about a minute and a half); CI calls it
before the suite, so here it is normally found. If it is absent these tests
build it rather than skip: a run of the machines on vLLM that silently did not
happen would be a test that cannot fail. ``KVREF_VLLM_ORACLE_PYTHON`` names
another environment's python.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORACLE = Path(os.path.expanduser("~/.cache/vllm-oracle"))


@pytest.fixture(scope="session")
def oracle_python() -> str:
    override = os.environ.get("KVREF_VLLM_ORACLE_PYTHON")
    if override:
        return override
    python = ORACLE / "bin" / "python"
    if not python.exists():
        built = subprocess.run([sys.executable, str(ROOT / "tools" / "setup_vllm_venv.py"),
                                str(ORACLE)], capture_output=True, text=True, timeout=1800)
        assert built.returncode == 0, (
            f"tools/setup_vllm_venv.py {ORACLE} failed:\n{built.stdout[-2000:]}"
            f"{built.stderr[-2000:]}")
    return str(python)


@pytest.fixture(scope="session")
def oracle_vllm_dir(oracle_python) -> Path:
    """The vllm/ package directory the oracle imports."""
    out = subprocess.run([oracle_python, "-c", "import vllm, os; print(os.path.dirname("
                          "vllm.__file__))"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert out.returncode == 0, out.stderr[-2000:]
    return Path(out.stdout.strip().splitlines()[-1])
