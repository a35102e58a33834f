"""The seeded-bug catalogues follow the code: every bug's edit still applies.

``tools/seeded_bugs.py`` refuses to run a bug whose text no longer occurs
exactly once, but that tool is too slow for CI; this test catches the drift
when the code moves (a rename in the hybrid fixed point once left a core bug
unappliable for a whole afternoon).
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import seeded_bugs  # noqa: E402

BUGS = [*seeded_bugs.CATALOGUE, *seeded_bugs.TENSOR_ENGINE_CATALOGUE,
        *seeded_bugs.CONNECTOR_CATALOGUE]


@pytest.mark.parametrize("bug", BUGS, ids=[bug.bug_id for bug in BUGS])
def test_the_edit_applies_exactly_once(bug):
    text = (ROOT / bug.path).read_text()
    assert text.count(bug.old) == 1, f"{bug.bug_id}: its text occurs {text.count(bug.old)} " \
                                     f"times in {bug.path}; update tools/seeded_bugs.py"
    assert bug.old != bug.new


def test_bug_ids_are_unique():
    ids = [bug.bug_id for bug in BUGS]
    assert len(ids) == len(set(ids))
