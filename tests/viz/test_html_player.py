"""The HTML player's data: every op's state, as deltas, equal to the replayed manager's.

The page's script rebuilds a state by applying these deltas; ``decode`` does the
same in Python, so what the page can show is checked op by op here, and the
page itself in a real browser (``test_browser_player.py``).
"""

import gzip
import json
import re
from pathlib import Path

import pytest

from kvref.core.kv_cache_utils import get_block_hash
from kvref.verify.trace_replay import TraceReplayer
from kvref.viz.html_player import (
    Player,
    apply_queue_delta,
    player_data,
    queue_delta,
    render_html,
)
from kvref.viz.player import read_trace

TRACES = Path(__file__).parent / "traces"


def decode(data):
    """Yield (op, blocks, queue, requests) after every op, as the page's script does."""
    blocks = [list(b) for b in data["initial"]["blocks"]]
    queue = list(data["initial"]["queue"])
    requests = {}
    for k, frame in enumerate(data["frames"]):
        for id_, *record in frame.get("b", []):
            blocks[id_] = record
        if "q" in frame:
            queue = apply_queue_delta(queue, frame["q"])
        requests.update(frame.get("r", {}))
        yield k, blocks, queue, requests


@pytest.mark.parametrize("name", ["hybrid", "pressure"])
def test_every_op_decodes_to_the_managers_state(name):
    trace = read_trace(TRACES / f"kvref-{name}.json.gz")
    data = player_data(trace)
    assert len(data["frames"]) == len(trace["ops"])
    replayer = TraceReplayer(trace["header"])
    for (k, blocks, queue, requests), op in zip(decode(data), trace["ops"]):
        replayer.run(op)
        pool = replayer.manager.block_pool
        # The null block's ref count is not kept (vLLM does not either): not shown.
        assert [b[0] for b in blocks[1:]] == [b.ref_cnt for b in pool.blocks[1:]], k
        hashes = [None if b[1] < 0 else data["hashes"][b[1]] for b in blocks]
        assert hashes == [None if b.block_hash is None else
                          get_block_hash(b.block_hash).hex()[:16] for b in pool.blocks], k
        assert queue == [b.block_id for b in pool.free_block_queue.get_all_free_blocks()], k
        for rid, req in replayer.requests.items():
            status, computed, tokens, num_hashes, tables = requests[rid]
            assert (status, computed, tokens, num_hashes) == (
                req.status.name, req.num_computed_tokens, req.num_tokens,
                len(req.block_hashes)), (k, rid)
            assert tables == [list(ids) for ids in replayer.manager.get_block_ids(rid)]
        assert data["usage"][k] == round(pool.get_usage(), 4)


def test_queue_deltas_round_trip_and_fall_back_to_the_whole_queue():
    cases = [([1, 2, 3, 4], [3, 4, 9]), ([1, 2, 3], [7, 1, 2, 3, 8]), ([1, 2, 3], [3, 2, 1]),
             ([], [5, 6]), ([5, 6], []), ([1, 2, 3, 4, 5], [1, 2, 4, 5])]
    for old, new in cases:
        delta = queue_delta(old, new)
        assert apply_queue_delta(old, delta) == new
    assert queue_delta([1, 2, 3], [3, 2, 1]) == {"all": [3, 2, 1]}
    assert queue_delta([1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 9]) == {"rm": [1, 2], "t": [9]}
    assert queue_delta([1, 2, 3, 4], [3, 4, 9]) == {"all": [3, 4, 9]}     # no shorter
    assert queue_delta([4], [4]) == {}


def test_the_page_is_self_contained():
    trace = read_trace(TRACES / "kvref-hybrid.json.gz")
    page = render_html(trace)
    # No external resource of any kind, and a policy that forbids loading one.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page
    assert "default-src 'none'" in page
    data = json.loads(re.search(r'<script id="kvdata" type="application/json">(.*?)</script>',
                                page, re.S).group(1))
    assert data["name"] == "kvref-hybrid" and len(data["ops"]) == len(trace["ops"])
    assert data["start"] == data["steps"][0][1] - 1
    # The legend's colours are the terminal's.
    from kvref.viz.pool import STYLE
    for state, _, colour, _ in data["legend"]:
        assert colour in STYLE[state] and f"--{state}: {colour};" in page


def test_a_request_id_cannot_end_the_script_early(tmp_path):
    trace = read_trace(TRACES / "kvref-prefix-caching.json.gz")
    text = json.dumps(trace).replace('"A"', '"</script><b>A"')
    page = render_html(json.loads(text))
    assert page.count("</script>") == 2


def test_the_notebook_player_is_the_page_in_an_iframe():
    trace = json.load(gzip.open(TRACES / "kvref-sliding-window.json.gz"))
    player = Player(trace, start_op=3)
    out = player._repr_html_()
    assert out.startswith("<iframe srcdoc=\"") and "&lt;script" in out
    assert 'sandbox="allow-scripts"' in out
    assert '"start":3' in player.html
    with pytest.raises(IndexError):
        render_html(trace, start_op=len(trace["ops"]))
