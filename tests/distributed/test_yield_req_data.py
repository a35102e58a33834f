"""``yield_req_data`` walks a step's requests as vLLM 0.25.1's helper does.

vLLM's third field says whether a request was *preempted* (resumed, its whole
table sent again), and is False for a new request, though a new request's table
is whole too (``vllm/distributed/kv_transfer/kv_connector/utils.py:299-316``).
kvref's helper once said True there, which no real scheduler output could tell
apart (a connector's state for a new request starts empty), but a test that sent
a running request again as a new one could. Here both helpers read the same
outputs; vLLM's runs in the oracle environment where it exists.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvref.distributed.kv_transfer.kv_connector.utils import yield_req_data

ORACLE = Path("/root/.cache/vllm-oracle/bin/python")

# Steps as plain data: new requests (id, table), then cached ones (id, new blocks or
# None, resumed?). Two groups each.
STEPS = [
    {"new": [["a", [[1, 2], [3, 4]]], ["b", [[5], [6]]]], "cached": []},
    {"new": [["c", [[7], [8]]]],
     "cached": [["a", [[9], [10]], False], ["b", None, False]]},
    {"new": [], "cached": [["a", [[1, 2, 9, 11], [3, 4, 10, 12]], True]]},
]

BUILD = """
from types import SimpleNamespace

def output(step):
    new = [SimpleNamespace(req_id=r, block_ids=tuple(ids), num_computed_tokens=0)
           for r, ids in step["new"]]
    cached = step["cached"]
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[None if c[1] is None else tuple(c[1]) for c in cached],
            resumed_req_ids={c[0] for c in cached if c[2]},
            num_computed_tokens=[0 for _ in cached]))
"""


def as_lists(rows) -> list:
    return [[r[0], None if r[1] is None else [list(g) for g in r[1]], r[2]] for r in rows]


def kvref_rows() -> list:
    namespace: dict = {"SimpleNamespace": SimpleNamespace}
    exec(BUILD, namespace)
    return [as_lists(yield_req_data(namespace["output"](step))) for step in STEPS]


def test_new_requests_are_not_preempted_and_resumed_ones_are():
    first, second, third = kvref_rows()
    assert first == [["a", [[1, 2], [3, 4]], False], ["b", [[5], [6]], False]]
    assert second == [["c", [[7], [8]], False], ["a", [[9], [10]], False], ["b", None, False]]
    assert third == [["a", [[1, 2, 9, 11], [3, 4, 10, 12]], True]]


@pytest.mark.skipif(not ORACLE.exists(), reason=f"needs the vLLM 0.25.1 oracle environment "
                    f"({ORACLE}; tools/setup_vllm_venv.py, which .ci/run builds)")
def test_vllms_helper_yields_the_same_on_the_same_outputs():
    script = BUILD + f"""
import json
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
steps = json.loads({json.dumps(json.dumps(STEPS))})
print(json.dumps([[[r, None if ids is None else [list(g) for g in ids], p]
                   for r, ids, p in yield_req_data(output(step))] for step in steps]))
"""
    done = subprocess.run([str(ORACLE), "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    vllm_rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert vllm_rows == kvref_rows()
