"""``kvref watch`` beside vLLM 0.25.1's real OpenAI server
(``tools/watch_on_vllm_server.py``, about 3 minutes: two server starts). Before
each request a watcher predicts its hit, and the server's ``cached_tokens``
must equal it, evictions and ``cache_salt`` included; a second watcher, stopped
(SIGSTOP) while the server restarts and serves requests it never sees, must
report the restart, rebuild the new server's index from the replay socket and
predict the next probes exactly."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import ROOT


def test_watch_predicts_a_real_servers_hits_and_follows_it_through_a_restart(
        engine_python, tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "watch_on_vllm_server.py"),
                           "--engine-python", engine_python, "--json-out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["before"] + result["after"]
    assert result["probes"] == len(rows) == 19
    assert all(r["predicted"] == r["cached_tokens"] for r in rows), rows
    # not trivial: hits of several lengths, an eviction, a salted hit
    assert len({r["cached_tokens"] for r in rows}) >= 4 and result["evictions_seen"]
    assert any(r["probe"] == "salted again" and r["cached_tokens"] > 0 for r in rows)
    paused = result["paused_watcher"]
    assert paused["restarts"] == 1 and paused["index_exact"] and paused["first_seq"] == 0
    assert all(r["paused_watcher_predicted"] == r["cached_tokens"] for r in result["after"]
               if "paused_watcher_predicted" in r)
    assert result["watcher"] == {"restarts": 1, "index_exact": True}
