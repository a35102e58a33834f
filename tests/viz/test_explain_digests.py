"""``kvref explain`` gives the same answer for every op of every vendored viz trace.

The digests in ``explain_digests.json`` were taken before allocate_slots' gate
record left ``kvref/core`` for ``kvref/viz/gates.py`` (issue 34) and have held
since: moving a kvref-only record out of the core changed no explanation. A
deliberate change to what ``kvref explain`` says updates them with
``python3 tests/viz/test_explain_digests.py --update`` (and says why in its
commit).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
DIGESTS = HERE / "explain_digests.json"
TRACES = sorted((HERE / "traces").glob("*.json.gz"))


def explain_digest(path: pathlib.Path) -> list:
    """``[number of ops, sha256 of every op's explanation in order]``."""
    from kvref.viz.player import read_trace
    from kvref.viz.explain import explain

    trace = read_trace(str(path))
    digest = hashlib.sha256()
    for op in range(len(trace["ops"])):
        digest.update(("\n".join(explain(trace, op)) + "\n\f\n").encode())
    return [len(trace["ops"]), digest.hexdigest()]


def test_every_vendored_trace_has_a_digest():
    recorded = json.loads(DIGESTS.read_text())["traces"]
    assert sorted(recorded) == [p.name for p in TRACES]


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_explain_answers_every_op_as_recorded(path):
    recorded = json.loads(DIGESTS.read_text())["traces"][path.name]
    assert explain_digest(path) == recorded, (
        f"kvref explain now says something else for some op of {path.name}; if that is "
        "meant, run python3 tests/viz/test_explain_digests.py --update")


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    data = json.loads(DIGESTS.read_text())
    data["traces"] = {p.name: explain_digest(p) for p in TRACES}
    DIGESTS.write_text(json.dumps(data, indent=1) + "\n")
