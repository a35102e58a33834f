#!/usr/bin/env python3
"""Run kvref's state machines on vLLM's own KV layer.

    python3 tools/vllm_machines.py                          # vLLM 0.25.1, the oracle environment
    python3 tools/vllm_machines.py --vllm-src ~/src/vllm    # a checkout, or a copy with a change
    python3 tools/vllm_machines.py -- -k FullAttention      # pytest arguments after --

The machines (``tests/stateful``: the block pool, the free queue, the hit search,
the manager for every config class, the scheduler's paths) drive the backend of
``tests/stateful/backend.py``; this script runs them with ``--kv-backend vllm`` in
the Python of ``--python`` (default: the oracle environment that
``tools/setup_vllm_venv.py`` builds, where vLLM 0.25.1's KV layer imports), after
installing pytest and Hypothesis there if they are missing (the versions of this
Python's, so both backends run the same examples). It is the same as::

    ~/.cache/vllm-oracle/bin/python -m pytest tests/stateful --kv-backend vllm

Exit status: pytest's. The run's last lines name the vLLM files it imported.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PYTHON = os.path.expanduser("~/.cache/vllm-oracle/bin/python")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_test_packages(python: str) -> None:
    """pytest and Hypothesis in ``python``: this interpreter's versions when it has them."""
    have = subprocess.run([python, "-c", "import pytest, hypothesis"],
                          capture_output=True).returncode == 0
    if have:
        return
    wanted = [f"{p}=={v}" if (v := _version(p)) else p for p in ("pytest", "hypothesis")]
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    *wanted], check=True)


def machines_command(python: str, vllm_src: str | None, pytest_args: list[str]) -> list[str]:
    # Test files or node ids among the arguments replace the whole folder.
    chosen = any(arg.startswith("tests/stateful") for arg in pytest_args)
    cmd = [python, "-m", "pytest", *([] if chosen else ["tests/stateful"]),
           "--kv-backend", "vllm", "-p", "no:cacheprovider"]
    if vllm_src:
        cmd += ["--vllm-src", vllm_src]
    return cmd + pytest_args


def check_python(python: str) -> None:
    if not Path(python).exists():
        sys.exit(f"vllm_machines: no Python at {python}; build vLLM 0.25.1's KV layer "
                 "environment with  python3 tools/setup_vllm_venv.py "
                 f"{os.path.dirname(os.path.dirname(python))}  or give --python")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=DEFAULT_PYTHON,
                        help="a Python where vLLM imports (default: %(default)s)")
    parser.add_argument("--vllm-src", metavar="PATH",
                        help="import the vllm/ package under PATH instead of the installed one")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    check_python(args.python)
    if args.vllm_src and not (Path(args.vllm_src) / "vllm" / "__init__.py").is_file():
        parser.error(f"--vllm-src {args.vllm_src}: there is no vllm/__init__.py under it")
    ensure_test_packages(args.python)
    cmd = machines_command(args.python, args.vllm_src, args.pytest_args)
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
