"""``kvref simulate`` on a log taken from vLLM 0.25.1's real OpenAI server
(``tools/simulate_on_vllm_server.py``, about a minute): kvref tokenizes every
chat and completion prompt to the server's own token ids, and predicts every
request's cached tokens from the log of token ids, evictions included."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import ROOT


def test_simulate_predicts_a_real_servers_cached_tokens(engine_python, tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "simulate_on_vllm_server.py"),
                           "--engine-python", engine_python, "--json-out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    n = result["requests"]
    assert n == 12 and result["prompts_equal"] == n and result["ids_equal"] == n
    # Not a trivial prediction: the server's hits are not all zero, and without the
    # replies (stand-in tokens) kvref would miss some of them.
    assert result["server_cached_total"] > 0
    assert result["without_replies_equal"] < n
    assert f"cached tokens predicted exactly: {n} of {n} from the token-id log" in proc.stdout
