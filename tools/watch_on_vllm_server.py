"""``kvref watch`` beside vLLM 0.25.1's real OpenAI server: predicted hits, a restart.

No vLLM counterpart. The check an operator would make, on this machine: vLLM's
OpenAI server (``python -m vllm.entrypoints.openai.api_server`` in the engine
environment ``tools/setup_vllm_engine_venv.py`` builds, on the tiny random Llama
of ``tools/simulate_on_vllm_server.py``) with KV events on a ZMQ PUB socket and
a replay socket, both bound by vLLM (``tcp://*:PORT``), no ``PYTHONHASHSEED``
(the server seeds its hashes at random), a pool of 16 blocks of 16 tokens:

1. A watcher in this process (``kvref.watch.Watcher``) follows the events. Before
   each completion it predicts the prompt's hit; the server's
   ``usage.prompt_tokens_details.cached_tokens`` must equal it. The probes share
   a system prompt, repeat, end on a block boundary (the ``num_tokens - 1`` cap)
   and fill the pool so that blocks are evicted; some carry a ``cache_salt``,
   asked about with the same salt (``--cache-salt``).
2. A second watcher, ``kvref watch --replay ... --json`` in its own process, is
   stopped (SIGSTOP) while the server restarts and the new server serves
   requests it never sees; then continued. It must say the server restarted,
   rebuild the new server's index from the replay socket, and predict the next
   probes' hits exactly. The first watcher, polled throughout, must too.

::

    python3 tools/watch_on_vllm_server.py                  # prints each probe
    python3 tools/watch_on_vllm_server.py --json-out build/watch_check.json

Exit 0 when every prediction equals the server's cached tokens and both
watchers report the restart with an exact index. Every process is stopped by
its PID; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from simulate_on_vllm_server import (ENGINE_PYTHON, free_port, make_model, post,  # noqa: E402
                                     wait_healthy)

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 16                # 15 usable: three 7-block prompts cannot all stay
MAX_MODEL_LEN = 256
VOCAB_LOW, VOCAB_HIGH = 10, 89     # the example tokenizer's ordinary words


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def probes_before() -> list[tuple[str, list[int]]]:
    rng = random.Random(0)
    system, other = tokens(rng, 48), tokens(rng, 64)
    a, b = system + tokens(rng, 20), system + tokens(rng, 21)
    c, d = tokens(rng, 110), tokens(rng, 110)
    salted = tokens(rng, 40)
    return [("a, cold", a), ("a, again", a), ("b, same system prompt", b),
            ("64 tokens", other), ("64 tokens again: hit capped at 63 -> 48", other),
            ("c, 110 tokens", c), ("d, 110 tokens: evicts", d), ("a after evictions", a),
            ("c again", c), ("system prompt alone", system),
            ("salted, cold", salted, "s1"), ("salted again", salted, "s1"),
            ("salted prompt, no salt", salted), ("salted prompt, another salt", salted, "s2")]


def probes_after() -> tuple[list, list]:
    """(served by the new server: all but the last while the second watcher is
    stopped, the last after it continued; asked about after that)."""
    rng = random.Random(1)
    e, f, g = tokens(rng, 60), tokens(rng, 40), tokens(rng, 50)
    return ([("e on the new server", e), ("f on the new server", f), ("e again", e),
             ("g, after the stopped watcher continued", g)],
            [("e after the restart", e), ("f after the restart", f),
             ("e prefix", e[:33]), ("g again", g)])


class Server:
    def __init__(self, model: Path, python: Path, events: int, replay: int, limit_s: float):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1")
        env.pop("PYTHONHASHSEED", None)
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}"}
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                   str(model), "--served-model-name", "m", "--host", "127.0.0.1",
                   "--port", str(self.port), "--enforce-eager", "--dtype", "float32",
                   "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
                   "--num-gpu-blocks-override", str(NUM_GPU_BLOCKS),
                   "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(config)]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(command, env=env, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(self.base, self.process, limit_s)
        except Exception:
            self.stop()
            raise

    def complete(self, prompt: list[int], salt: str | None = None) -> int:
        body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        answer = post(self.base + "/v1/completions", body)
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"] or 0

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)


def settle(watcher, quiet_s: float = 0.6, limit_s: float = 10.0) -> None:
    """Poll until no event has come for ``quiet_s`` (the step's batch follows the
    response by a few milliseconds)."""
    deadline = time.monotonic() + limit_s
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        if watcher.poll(0.1):
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return


def probe(server: Server, watcher, name: str, prompt: list[int], rows: list,
          salt: str | None = None) -> None:
    settle(watcher)
    predicted = watcher.index.query(prompt, cache_salt=salt).hit_tokens
    cached = server.complete(prompt, salt)
    rows.append({"probe": name, "tokens": len(prompt), "predicted": predicted,
                 "cached_tokens": cached, "exact": watcher.unknown_since is None})
    print(f"  {name:44} {len(prompt):4} tokens  predicted {predicted:4}  "
          f"server {cached:4}  {'ok' if predicted == cached else 'DIFFERENT'}", flush=True)


def run(python: Path, limit_s: float) -> dict:
    from kvref.watch import Watcher

    events, replay = free_port(), free_port()
    work = Path(tempfile.mkdtemp(prefix="kvref-watch-live-"))
    make_model(work / "model", python)
    before, (during, after) = probes_before(), probes_after()
    queries = work / "after.jsonl"
    queries.write_text("".join(json.dumps({"id": name, "prompt_token_ids": p}) + "\n"
                               for name, p in after))
    result = {"before": [], "after": [], "paused_watcher": None}
    print(f"starting vLLM's OpenAI server (events tcp://*:{events}, replay tcp://*:{replay})",
          flush=True)
    server = Server(work / "model", python, events, replay, limit_s)
    paused = None
    watcher = Watcher(f"tcp://*:{events}", replay_endpoint=f"tcp://*:{replay}")
    try:
        paused = subprocess.Popen(
            [sys.executable, "-m", "kvref.cli", "watch", f"tcp://*:{events}", "--replay",
             f"tcp://*:{replay}", "--json", "--duration", str(limit_s * 3),
             "--query-file", str(queries)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)                        # the second watcher subscribes
        print("probes (a watcher predicts, then the server answers):", flush=True)
        for name, prompt, *salt in before:
            probe(server, watcher, name, prompt, result["before"], *salt)
        settle(watcher)
        os.kill(paused.pid, signal.SIGSTOP)
        print("second watcher stopped; restarting the server", flush=True)
        server.stop()
        server = Server(work / "model", python, events, replay, limit_s)
        for name, prompt in during[:-1]:
            server.complete(prompt)          # batches the stopped watcher never receives
        os.kill(paused.pid, signal.SIGCONT)
        print("second watcher continued; probes on the new server:", flush=True)
        time.sleep(2)                        # it reconnects and subscribes
        for name, prompt in during[-1:]:     # a live batch after the gap
            probe(server, watcher, name, prompt, result["after"])
        settle(watcher)
        time.sleep(2)
        paused.send_signal(signal.SIGTERM)   # its report, with its predictions for `after`
        out, err = paused.communicate(timeout=60)
        if paused.returncode != 0:
            raise RuntimeError(f"the second watcher exited {paused.returncode}: {err[-2000:]}")
        report = json.loads(out)
        predictions = {q["query"]: q["hit_tokens"] for q in report["queries"]}
        checked = []
        for name, prompt in after:           # disjoint prompts: one's request leaves
            settle(watcher)                  # the others' hits as they were
            predicted = watcher.index.query(prompt).hit_tokens
            cached = server.complete(prompt)
            checked.append({"probe": name, "tokens": len(prompt), "predicted": predicted,
                            "paused_watcher_predicted": predictions[name],
                            "cached_tokens": cached})
            print(f"  {name:44} {len(prompt):4} tokens  predicted {predicted:4} (stopped "
                  f"watcher {predictions[name]:4})  server {cached:4}", flush=True)
        result["after"] += checked
        result["paused_watcher"] = {k: report[k] for k in (
            "restarts", "restarts_seen", "index_exact", "unknown_because", "server_batches",
            "first_seq", "next_seq", "missed_batches", "connection")}
        result["watcher"] = {"restarts": len(watcher.restarts),
                             "index_exact": watcher.unknown_since is None}
    except Exception:
        sys.stderr.write(server.tail())
        raise
    finally:
        watcher.close()
        server.stop()
        if paused is not None and paused.poll() is None:
            os.kill(paused.pid, signal.SIGCONT)
            paused.kill()
            paused.wait(timeout=30)
    rows = result["before"] + result["after"]
    result["probes"] = len(rows)
    result["predicted_exactly"] = sum(r["predicted"] == r["cached_tokens"] for r in rows)
    result["paused_predicted_exactly"] = sum(
        r["paused_watcher_predicted"] == r["cached_tokens"] for r in result["after"]
        if "paused_watcher_predicted" in r)
    result["evictions_seen"] = any(
        r["probe"] == "a after evictions" and r["cached_tokens"] < 64 for r in rows)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-python", type=Path, default=ENGINE_PYTHON)
    p.add_argument("--start-limit-s", type=float, default=300)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    if not args.engine_python.exists():
        print(f"error: no engine environment at {args.engine_python} "
              "(python3 tools/setup_vllm_engine_venv.py builds it)", file=sys.stderr)
        return 2
    result = run(args.engine_python, args.start_limit_s)
    paused = result["paused_watcher"]
    ok = (result["predicted_exactly"] == result["probes"] and
          result["paused_predicted_exactly"] == len(probes_after()[1]) and
          paused["restarts"] == 1 and paused["index_exact"] and
          result["watcher"]["restarts"] == 1 and result["watcher"]["index_exact"])
    print(f"predicted exactly: {result['predicted_exactly']} of {result['probes']} probes; "
          f"the stopped watcher: restarts {paused['restarts']}, index "
          f"{'exact' if paused['index_exact'] else 'UNKNOWN'}, "
          f"{result['paused_predicted_exactly']} of {len(probes_after()[1])} after it")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
