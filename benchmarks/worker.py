"""One benchmark side in its own process, answering timing requests on stdin.

No vLLM counterpart (benchmark harness). ``run.py`` starts one worker per
side (kvref under any python; vLLM under a python where ``import vllm`` works),
keeps both alive, and alternates requests between them, so neither side pays
for imports and both run in the same kind of process. Protocol: one JSON
object per line in, one per line out::

    {"cmd": "traces", "cls": "full", "passes": 5, "prebuild": false}
      -> {"wall": s, "cpu": s, "ops": n, "raised": n}
    {"cmd": "scaling", "num_blocks": 100000, "num_requests": 2000}
      -> {"build_wall": s, ..., "per_call": {"allocate_slots": [wall ns, cpu ns], ...}}
    {"cmd": "memory", "num_blocks": 100000} -> {"bytes_per_block": b}
    {"cmd": "by_op", "cls": "full", "passes": 3} -> {"free": [calls, wall s], ...}

    python benchmarks/worker.py kvref      # then type a request line

The project root goes on ``sys.path`` here, so the vLLM venv's python imports
this checkout's kvref (for trace loading) without installing it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import replay  # noqa: E402
import scaling  # noqa: E402
import sides  # noqa: E402

TRACES = ROOT / "tests" / "conformance" / "traces"


def main() -> None:
    side_name = sys.argv[1]
    # Answers go to the real stdout; anything the libraries print goes to stderr.
    out, sys.stdout = sys.stdout, sys.stderr
    try:
        side = sides.get_side(side_name)
    except ImportError as exc:
        print(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}),
              file=out, flush=True)
        return
    # Imports are done: move everything alive now (vLLM's worker holds torch and
    # much more) out of the collector's reach, so collections cost the same on both sides.
    gc.collect()
    gc.freeze()
    print(json.dumps({"ready": True, "side": side_name, "python": sys.executable}),
          file=out, flush=True)
    loaded: dict[str, list] = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = handle(side, request, loaded)
        except Exception:  # noqa: BLE001 - reported to run.py, which prints it
            answer = {"error": traceback.format_exc()}
        print(json.dumps(answer), file=out, flush=True)
    # Skip interpreter teardown: with the heap frozen, vLLM's native extensions
    # would report every object still alive as a leak.
    sys.stderr.flush()
    os._exit(0)


def load_class(cls: str, loaded: dict) -> list[dict]:
    """The class's traces, parsed once; then frozen like the imports, so that the
    collections before each replay do not walk a million parsed JSON objects."""
    if cls not in loaded:
        loaded[cls] = [replay.load_trace(p) for p in sorted((TRACES / cls).glob("*.json*"))]
        gc.collect()
        gc.freeze()
    return loaded[cls]


def handle(side, request: dict, loaded: dict) -> dict:
    cmd = request["cmd"]
    if cmd == "traces":
        cls = request["cls"]
        traces = load_class(cls, loaded)
        wall, cpu, ops, raised = replay.time_traces(side, traces, request["passes"],
                                                    request.get("prebuild", False))
        return {"wall": wall, "cpu": cpu, "ops": ops, "raised": raised}
    if cmd == "by_op":
        return replay.time_by_op(side, load_class(request["cls"], loaded), request["passes"])
    if cmd == "scaling":
        return scaling.per_call_cost(side, request["num_blocks"], request["num_requests"])
    if cmd == "memory":
        return {"bytes_per_block": scaling.bytes_per_block(side, request["num_blocks"])}
    raise ValueError(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main()
