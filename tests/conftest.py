"""Hypothesis profiles for the whole test suite.

    pytest tests/stateful                              # "ci": the default, ~3 minutes on 2 cores
    pytest tests/stateful --hypothesis-profile=deep    # many more and longer runs

Hypothesis' pytest plugin provides ``--hypothesis-profile`` and loads the named
profile in its ``pytest_configure``, which runs after this file is imported; so
this file only registers the profiles and makes "ci" the default. The "ci"
profile is derandomized: the same examples every run, so a failure in CI is a
failure on a laptop too, and a seeded bug is either caught or not, never by luck.
"""

from __future__ import annotations

import importlib.util

import pytest

# The suite needs the ``test`` extra (pyproject.toml). Run from an interpreter without
# it, every module would fail to import, each with its own traceback: say it once.
_NEEDED = {"cbor2": "cbor2", "rich": "rich", "textual": "textual", "torch": "torch",
           "transformers": "transformers", "hypothesis": "hypothesis",
           "jupytext": "jupytext", "matplotlib": "matplotlib", "IPython": "ipython",
           "selenium": "selenium", "zmq": "pyzmq", "msgspec": "msgspec", "ray": "ray"}
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
