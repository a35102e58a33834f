#!/usr/bin/env python3
"""Seeded bugs in vLLM's own KV layer: which checks catch them?

A catalogue of realistic bugs, each a small text edit of one file of vLLM
0.25.1's KV layer (``vllm/v1/core/``: the manager, the coordinator, the
single-type managers, the block pool, the free queue and the hashing). For
each bug the script copies the ``vllm/`` package the oracle environment imports
to a temporary folder, applies the edit there (vLLM's code never enters this
repository: the catalogue holds only the edits' text) and runs three checks on
that copy, each in the oracle's Python with the copy first on the path:

1. **vLLM's own unit tests**: the KV-layer test files of
   ``tools/vllm_unit_tests.py`` (``KV_LAYER_FILES``), and then its scheduler
   test files (``SCHEDULER_FILES``), from vLLM 0.25.1's source package. Only the
   tests that pass on the unmodified vLLM count; the bug is killed if one of
   them fails.
2. **kvref's state machines** on the vLLM backend (``tests/stateful
   --kv-backend vllm --vllm-src COPY``, the ``ci`` examples without shrinking):
   killed if a machine fails; the report names the invariant.
3. **The recorded traces** (``tests/conformance/traces``, 254 traces recorded
   on vLLM 0.25.1) replayed on the copy: killed at the first trace that
   diverges (or raises).

    python3 tools/vllm_seeded_bugs.py                 # every bug (about 20 minutes on 2 cores)
    python3 tools/vllm_seeded_bugs.py -k swa          # bugs whose id contains "swa"
    python3 tools/vllm_seeded_bugs.py --list          # the catalogue
    python3 tools/vllm_seeded_bugs.py --check         # every edit applies to the oracle's vLLM
    python3 tools/vllm_seeded_bugs.py --markdown docs/seeded_bugs_vllm.md --json out.json

An edit whose text is not found exactly once in its file is an error reported
before anything runs. A check that exceeds ``--timeout`` counts as not killed
(TIMEOUT). Exit status 0 when the machines kill every selected bug or every
survivor is explained in ``SURVIVORS``; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
DEFAULT_PYTHON = os.path.expanduser("~/.cache/vllm-oracle/bin/python")
DEFAULT_CACHE = os.path.expanduser("~/.cache/kvref-vllm-tests")
TRACE_DIR = ROOT / "tests" / "conformance" / "traces"


@dataclass(frozen=True)
class VllmBug:
    bug_id: str
    description: str
    path: str       # relative to the vllm/ package folder
    old: str        # text that must occur exactly once in the file
    new: str


MGR = "v1/core/kv_cache_manager.py"
POOL = "v1/core/block_pool.py"
STM = "v1/core/single_type_kv_cache_manager.py"
COORD = "v1/core/kv_cache_coordinator.py"
UTILS = "v1/core/kv_cache_utils.py"

CATALOGUE: list[VllmBug] = [
    # -- the hit ------------------------------------------------------------------
    VllmBug("hit-cap-off-by-one",
            "the prefix hit may cover the whole prompt (cap num_tokens, not num_tokens - 1)",
            MGR, "        max_cache_hit_length = request.num_tokens - 1\n",
            "        max_cache_hit_length = request.num_tokens\n"),
    VllmBug("eagle-no-drop",
            "with EAGLE, full attention keeps the last hit block",
            STM, "        if drop_eagle_block and computed_blocks[0]:\n"
                 "            # Need to drop the last matched block if eagle is enabled.\n"
                 "            for computed in computed_blocks:\n"
                 "                computed.pop()\n",
            ""),
    VllmBug("hybrid-one-pass",
            "the hybrid fixed point stops after its first pass over the attention types",
            COORD, "            hit_length = curr_hit_length\n"
                   "            if is_simple_hybrid:\n"
                   "                break\n",
            "            hit_length = curr_hit_length\n"
            "            break\n"),
    VllmBug("swa-run-too-short",
            "a sliding-window hit needs one block fewer than the window reads",
            STM, "        blocks = cdiv(window_size - 1, block_size)\n",
            "        blocks = (window_size - 1) // block_size\n"),
    VllmBug("mamba-same-step-hit",
            "a Mamba state cached in this step is not remembered, so it is served as a hit "
            "before the step that computes it has run",
            STM, "                self.cached_blocks_this_step.add(block.block_hash)\n",
            "                pass\n"),
    # -- hashing ------------------------------------------------------------------
    VllmBug("lora-not-hashed", "the LoRA adapter name is left out of the block hash",
            UTILS, "    return [request.lora_request.lora_name]\n", "    return []\n"),
    VllmBug("salt-not-hashed", "the cache salt is left out of the first block's hash",
            UTILS, "[request.cache_salt] if (start_token_idx == 0 and request.cache_salt) else []",
            "[]"),
    VllmBug("salt-every-block", "the cache salt is hashed into every block, not only the first",
            UTILS, "[request.cache_salt] if (start_token_idx == 0 and request.cache_salt) else []",
            "[request.cache_salt] if request.cache_salt else []"),
    VllmBug("mm-not-hashed", "multimodal items are left out of the block hash",
            UTILS, "lora_extra_keys + mm_extra_keys + cache_salt_keys + prompt_embeds_keys",
            "lora_extra_keys + cache_salt_keys + prompt_embeds_keys"),
    # -- caching ------------------------------------------------------------------
    VllmBug("cache-partial-block", "a block is cached before it is full (ceil instead of floor)",
            STM, "        num_full_blocks = num_tokens // self.block_size\n",
            "        num_full_blocks = cdiv(num_tokens, self.block_size)\n"),
    VllmBug("cache-draft-tokens",
            "unverified draft tokens are cached (no cap at request.num_tokens)",
            MGR, "        num_tokens_to_cache = min(\n"
                 "            total_computed_tokens + num_new_tokens,\n"
                 "            request.num_tokens,\n"
                 "        )\n",
            "        num_tokens_to_cache = total_computed_tokens + num_new_tokens\n"),
    VllmBug("delay-cache-ignored",
            "blocks of an asynchronous KV load are cached at allocation, before the load lands",
            MGR, "        if not self.enable_caching or delay_cache_blocks:\n",
            "        if not self.enable_caching:\n"),
    VllmBug("reuse-keeps-hash",
            "a cached block handed out again keeps its old hash and index entry",
            POOL, "                self._maybe_evict_cached_block(block)\n"
                  "                assert block.ref_cnt == 0\n",
            "                assert block.ref_cnt == 0\n"),
    # -- references, the free queue, eviction order -------------------------------
    VllmBug("touch-keeps-free",
            "a prefix-hit block that sat in the free queue is not taken out of it",
            POOL, "            if block.ref_cnt == 0 and not block.is_null:\n"
                  "                self.free_block_queue.remove(block)\n",
            ""),
    VllmBug("no-ref-on-alloc",
            "get_new_blocks does not take a reference on the blocks it hands out (caching on)",
            POOL, "                assert block.ref_cnt == 0\n"
                  "                block.ref_cnt += 1\n"
                  "                if self.metrics_collector:\n"
                  "                    self.metrics_collector.on_block_allocated(block)\n"
                  "        else:\n",
            "                assert block.ref_cnt == 0\n"
            "                if self.metrics_collector:\n"
            "                    self.metrics_collector.on_block_allocated(block)\n"
            "        else:\n"),
    VllmBug("free-forward-order",
            "a request's blocks are freed head first, so its prefix is evicted before its tail",
            STM, "self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))",
            "self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))"),
    VllmBug("free-queues-held-block",
            "freeing a block two requests share queues it while the other still holds it",
            POOL, "            block.ref_cnt -= 1\n"
                  "            if block.ref_cnt == 0 and not block.is_null:\n",
            "            block.ref_cnt -= 1\n"
            "            if not block.is_null:\n"),
    VllmBug("null-block-freed",
            "the null block is put into the free queue when its count drops to 0",
            POOL, "            block.ref_cnt -= 1\n"
                  "            if block.ref_cnt == 0 and not block.is_null:\n",
            "            block.ref_cnt -= 1\n"
            "            if block.ref_cnt == 0:\n"),
    VllmBug("unhashed-to-tail",
            "freed blocks without a hash go to the back of the queue, not the front",
            POOL, "self.free_block_queue.prepend_n(blocks_without_hash)",
            "self.free_block_queue.append_n(blocks_without_hash)"),
    VllmBug("hashed-to-head",
            "freed cached blocks go to the front of the queue (evicted first)",
            POOL, "self.free_block_queue.append_n(blocks_with_hash)",
            "self.free_block_queue.prepend_n(blocks_with_hash)"),
    VllmBug("queue-half-unlinked", "removing from the free queue forgets the backward link",
            UTILS, "        # Link the next block to the previous block.\n"
                   "        block.next_free_block.prev_free_block = block.prev_free_block\n",
            ""),
    VllmBug("queue-count-drift", "removing from the free queue does not update its count",
            UTILS, "        block.prev_free_block = block.next_free_block = None\n"
                   "        self.num_free_blocks -= 1\n",
            "        block.prev_free_block = block.next_free_block = None\n"),
    VllmBug("reset-while-in-use",
            "reset_prefix_cache succeeds while one block is still in use (off by one)",
            POOL, "        if num_used_blocks != 1:  # The null block is always marked as used\n",
            "        if num_used_blocks > 2:  # The null block is always marked as used\n"),
    # -- windows, chunks, Mamba states ---------------------------------------------
    VllmBug("swa-skip-too-many", "the sliding window frees one token (a block) too early",
            STM, "        return max(0, num_computed_tokens - self.sliding_window + 1)\n",
            "        return max(0, num_computed_tokens - self.sliding_window + 2)\n"),
    VllmBug("swa-skip-too-few", "the sliding window frees one token (at a block edge, a block) "
            "too late",
            STM, "        return max(0, num_computed_tokens - self.sliding_window + 1)\n",
            "        return max(0, num_computed_tokens - self.sliding_window)\n"),
    VllmBug("chunk-skip-too-many", "chunked local attention frees the blocks of the current chunk",
            STM, "            num_computed_tokens // self.attention_chunk_size\n",
            "            cdiv(num_computed_tokens, self.attention_chunk_size)\n"),
    VllmBug("chunk-skip-too-few",
            "chunked local attention skips by the last computed token's chunk, not the next "
            "token's (frees nothing exactly at a chunk edge)",
            STM, "            num_computed_tokens // self.attention_chunk_size\n",
            "            max(0, num_computed_tokens - 1) // self.attention_chunk_size\n"),
    VllmBug("mamba-frees-live-state",
            "Mamba frees the state block of the last computed token too (n, not n - 1)",
            STM, "        return num_computed_tokens - 1\n", "        return num_computed_tokens\n"),
    # -- the gates -----------------------------------------------------------------
    VllmBug("watermark-for-running", "the admission watermark is applied to running requests too",
            MGR, "        if has_scheduled_reqs and request.status in (\n"
                 "            RequestStatus.WAITING,\n"
                 "            RequestStatus.PREEMPTED,\n"
                 "        ):\n",
            "        if has_scheduled_reqs:\n"),
    VllmBug("reserved-blocks-ignored",
            "allocate_slots ignores the blocks reserved for in-flight KV loads",
            MGR, "available_blocks = self.block_pool.get_num_free_blocks() - reserved_blocks",
            "available_blocks = self.block_pool.get_num_free_blocks()"),
    VllmBug("full-sequence-no-watermark", "full_sequence_must_fit forgets the watermark",
            MGR, "            required_blocks = num_blocks_to_allocate + watermark_blocks\n"
                 "            if required_blocks > self.block_pool.get_num_free_blocks():\n",
            "            required_blocks = num_blocks_to_allocate\n"
            "            if required_blocks > self.block_pool.get_num_free_blocks():\n"),
    # -- statistics and events -----------------------------------------------------
    VllmBug("stats-ignore-preemption", "prefix-cache stats count preempted requests as new ones",
            MGR, "                preempted=request.num_preemptions > 0,\n",
            "                preempted=False,\n"),
    VllmBug("evict-silently", "evicting a cached block to reuse it emits no BlockRemoved event",
            POOL, "        self._emit_block_removed_events(evicted_hashes)\n        return True\n",
            "        return True\n"),
    VllmBug("reset-silently", "a prefix-cache reset emits no AllBlocksCleared event",
            POOL, "            self.kv_event_queue.append(AllBlocksCleared())\n",
            "            pass\n"),
]

# Every bug the machines survive, with why (the docs' table prints it). The
# script exits 1 on a survivor that is not listed here.
SURVIVORS: dict[str, str] = {}


# --------------------------------------------------------------------------
# the copy of vLLM


def oracle_vllm_dir(python: str) -> Path:
    out = subprocess.run([python, "-c", "import vllm, os; print(os.path.dirname(vllm.__file__))"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    if out.returncode != 0:
        sys.exit(f"vllm_seeded_bugs: vllm does not import in {python}:\n{out.stderr[-2000:]}\n"
                 "build the oracle with  python3 tools/setup_vllm_venv.py ~/.cache/vllm-oracle")
    return Path(out.stdout.strip().splitlines()[-1])


def check_catalogue(vllm_dir: Path, bugs: list[VllmBug]) -> list[str]:
    """Problems: an edit whose text is not found exactly once, a duplicate id."""
    problems, seen = [], set()
    for bug in bugs:
        if bug.bug_id in seen:
            problems.append(f"{bug.bug_id}: duplicate id")
        seen.add(bug.bug_id)
        text = (vllm_dir / bug.path).read_text()
        count = text.count(bug.old)
        if count != 1:
            problems.append(f"{bug.bug_id}: its text occurs {count} times in vllm/{bug.path}")
            continue
        try:
            compile(text.replace(bug.old, bug.new, 1), bug.path, "exec")
        except SyntaxError as exc:
            problems.append(f"{bug.bug_id}: the edited vllm/{bug.path} does not compile ({exc})")
        if bug.old == bug.new:
            problems.append(f"{bug.bug_id}: the edit changes nothing")
    return problems


def seeded_copy(vllm_dir: Path, bug: VllmBug | None, into: Path) -> Path:
    """``into/vllm``: the oracle's vLLM with ``bug`` applied; returns ``into``."""
    shutil.copytree(vllm_dir, into / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    if bug is not None:
        target = into / "vllm" / bug.path
        target.write_text(target.read_text().replace(bug.old, bug.new, 1))
    return into


# --------------------------------------------------------------------------
# the three checks


def _load_unit_tests_tool():
    sys.path.insert(0, str(TOOLS))
    try:
        import vllm_unit_tests
    finally:
        sys.path.remove(str(TOOLS))
    return vllm_unit_tests


def stage_vllm_tests(cache: Path) -> Path:
    tool = _load_unit_tests_tool()
    stage = cache / "stage"
    tool.stage_tests(tool.fetch_sdist(cache), stage)
    tool.offline_hub(cache)
    return stage


def run_vllm_tests(python: str, stage: Path, cache: Path, src: Path | None, tests: list[str],
                   out: Path, timeout: int, stop_at_first: bool = True) -> dict:
    """vLLM's ``tests`` (files or node ids) on the vLLM under ``src`` (None: the
    oracle's own), in the environment ``tools/vllm_unit_tests.py`` runs them in:
    the plugin's outcomes (``{"outcomes": {nodeid: outcome}, "messages": ...}``),
    ``{"timeout": True}`` past ``timeout``, or ``{"error": why}``."""
    env = dict(os.environ)
    paths = ([str(src)] if src else []) + [str(TOOLS), str(ROOT), str(stage)]
    env.update(PYTHONPATH=os.pathsep.join(paths), KVREF_OUTCOMES=str(out), KVREF_SWAP="0",
               PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(cache / "hf"), KVREF_CPU_PLATFORM="1",
               VLLM_LOGGING_LEVEL="ERROR")
    if src is not None:   # the copy, not the oracle's own vLLM, is what the tests import
        where = subprocess.run([python, "-c", "import vllm; print(vllm.__file__)"], cwd=stage,
                               env=env, capture_output=True, text=True, timeout=300)
        if not where.stdout.strip().startswith(str(src / "vllm")):
            return {"error": f"vLLM's tests would import {where.stdout.strip()}, not the copy"}
    out.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", "-q", *(["-x"] if stop_at_first else []), "-p",
           "vllm_kvref_plugin", "-p", "no:cacheprovider", "-W", "ignore", "--rootdir",
           str(stage), *tests]
    try:
        subprocess.run(cmd, cwd=stage, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"timeout": True}
    if not out.exists():
        return {"error": "pytest wrote no outcomes"}
    return json.loads(out.read_text())


def baseline(python: str, stage: Path, cache: Path, timeout: int) -> dict[str, list[str]]:
    """The node ids of vLLM's tests that pass on the unmodified vLLM, per kind."""
    tool = _load_unit_tests_tool()
    passing = {}
    for kind, files in (("kv", tool.KV_LAYER_FILES), ("scheduler", tool.SCHEDULER_FILES)):
        outcomes = run_vllm_tests(python, stage, cache, None, files,
                                  cache / f"baseline_{kind}.json", timeout,
                                  stop_at_first=False)
        if "outcomes" not in outcomes:
            sys.exit(f"vllm_seeded_bugs: vLLM's {kind} tests did not run on the unmodified "
                     f"vLLM: {outcomes}")
        passing[kind] = sorted(n for n, o in outcomes["outcomes"].items() if o == "passed")
    return passing


def vllm_tests_verdict(outcomes: dict) -> tuple[str, str]:
    """("killed" | "survived" | "TIMEOUT" | "ERROR", the first failing test)."""
    if outcomes.get("timeout"):
        return "TIMEOUT", ""
    if "error" in outcomes:
        return "ERROR", outcomes["error"]
    failed = [n for n, o in outcomes["outcomes"].items() if o in ("failed", "error")]
    if failed:
        message = (outcomes.get("messages") or {}).get(failed[0], "")
        return "killed", f"{failed[0].split('/')[-1]}: {message}"[:200]
    return "survived", ""


_INVARIANT = re.compile(r"\b(INV-[A-Z]+-\d+[A-Z/0-9-]*)")


def run_machines(python: str, src: Path, timeout: int) -> tuple[str, str]:
    cmd = [python, "-m", "pytest", "tests/stateful", "--kv-backend", "vllm", "--vllm-src",
           str(src), "-x", "-q", "-p", "no:cacheprovider", "--hypothesis-profile=seeded"]
    try:
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "TIMEOUT", ""
    out = run.stdout + run.stderr
    if "ran on vLLM" not in out or f"imported {src / 'vllm'}" not in out:
        return "ERROR", "the machines did not import the seeded copy: " + out[-300:]
    if run.returncode == 0:
        return "survived", ""
    if run.returncode != 1:
        return "ERROR", out[-300:]
    failed = re.search(r"^FAILED (\S+)", out, re.M)
    test = failed.group(1).split("::")[0].split("/")[-1] if failed else "?"
    # The assertion's own lines (pytest's "E   "), not the source it quotes above them.
    errors = [line[1:].strip() for line in out.splitlines() if line.startswith("E   ")]
    found = _INVARIANT.search("\n".join(errors))
    first_error = errors[0] if errors else ""
    raised_in_vllm = re.search(r"(vllm/v1/[\w/]+\.py):(\d+): (\w+(?:Error|Exception))", out)
    if found:
        what = found.group(1)
    elif raised_in_vllm:   # the machine drove the seeded vLLM into one of its own checks
        what = (f"{raised_in_vllm.group(3)} in {raised_in_vllm.group(1)}:"
                f"{raised_in_vllm.group(2)}")
    else:
        what = first_error[:120]
    return "killed", f"{test}: {what}"


def run_traces(python: str, src: Path, timeout: int) -> tuple[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(src), str(ROOT), str(TOOLS)]),
               VLLM_LOGGING_LEVEL="ERROR", PYTHONHASHSEED="0")
    try:
        run = subprocess.run([python, str(Path(__file__).resolve()), "--replay-worker",
                              str(src)], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return "TIMEOUT", ""
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        return "ERROR", (run.stdout + run.stderr)[-300:]
    result = json.loads(lines[-1])
    if result["diverged"]:
        return "killed", f"{result['trace']}: {result['where']}"[:200]
    return "survived", f"{result['traces']} traces identical"


def replay_worker(src: str) -> int:
    """(In the oracle's Python.) Replay every trace on the vLLM under ``src``;
    print one JSON line: the first divergence, or how many were identical."""
    import vllm
    if not str(Path(vllm.__file__).resolve()).startswith(str(Path(src).resolve()) + os.sep):
        print(json.dumps({"error": f"vllm imported from {vllm.__file__}, not {src}"}))
        return 2
    from kvref.verify.trace_replay import find_traces, load_trace
    from vllm_versions import replay_on
    traces = list(find_traces([TRACE_DIR]))
    for path in traces:
        name = f"{path.parent.name}/{path.name.removesuffix('.json.gz').removesuffix('.json')}"
        try:
            result = replay_on(load_trace(path), "0.25.1")
        except Exception as exc:  # noqa: BLE001 - the seeded vLLM raised: a divergence
            print(json.dumps({"diverged": True, "trace": name,
                              "where": f"raised {type(exc).__name__}: {exc}"[:160]}))
            return 0
        if result.divergence is not None:
            d = result.divergence
            op = f"{d.op['op']} of {d.op.get('req', '?')}" if d.op else "construction"
            print(json.dumps({"diverged": True, "trace": name,
                              "where": f"op {d.index} ({op}): {d.path}"[:160]}))
            return 0
    print(json.dumps({"diverged": False, "traces": len(traces)}))
    return 0


# --------------------------------------------------------------------------
# the run


def run_bug(bug: VllmBug, args, vllm_dir: Path, stage: Path, cache: Path,
            passing: dict[str, list[str]]) -> dict:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"vllm-bug-{bug.bug_id}-") as tmp:
        src = seeded_copy(vllm_dir, bug, Path(tmp) / "src")
        row = {"bug": bug.bug_id, "file": bug.path, "description": bug.description}
        for kind in ("kv", "scheduler"):
            outcomes = run_vllm_tests(args.python, stage, cache, src, passing[kind],
                                      Path(tmp) / f"{kind}.json", args.timeout)
            row[f"vllm_{kind}_tests"] = vllm_tests_verdict(outcomes)
        row["machines"] = run_machines(args.python, src, args.timeout)
        row["traces"] = run_traces(args.python, src, args.timeout)
    row["seconds"] = round(time.monotonic() - started)
    return row


COLUMNS = (("vllm_kv_tests", "vLLM's KV-layer tests"),
           ("vllm_scheduler_tests", "vLLM's scheduler tests"),
           ("machines", "kvref's machines on vLLM"),
           ("traces", "recorded traces"))


def killed_by_vllm_tests(row: dict) -> bool:
    return "killed" in (row["vllm_kv_tests"][0], row["vllm_scheduler_tests"][0])


def summary(rows: list[dict]) -> dict:
    n = len(rows)
    counts = {key: sum(r[key][0] == "killed" for r in rows) for key, _ in COLUMNS}
    counts["vllm_tests"] = sum(killed_by_vllm_tests(r) for r in rows)
    counts["bugs"] = n
    return counts


def render_markdown(rows: list[dict]) -> str:
    counts = summary(rows)
    n = counts["bugs"]

    def cell(verdict):
        status, detail = verdict
        if status == "killed":
            return f"killed ({detail.replace('|', '/')})" if detail else "killed"
        return f"**{status}**"

    lines = [
        "| bug | vLLM file | vLLM's KV-layer tests | vLLM's scheduler tests | "
        "kvref's machines on vLLM | recorded traces |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| `{r['bug']}`: {r['description']} | `{r['file']}` | "
                     f"{cell(r['vllm_kv_tests'])} | {cell(r['vllm_scheduler_tests'])} | "
                     f"{cell(r['machines'])} | {cell(r['traces'])} |")
    lines += ["", f"Killed, of {n}: vLLM's KV-layer tests {counts['vllm_kv_tests']}, "
              f"vLLM's KV-layer and scheduler tests together {counts['vllm_tests']}, "
              f"kvref's machines on vLLM {counts['machines']}, "
              f"the recorded traces {counts['traces']}."]
    survivors = [r for r in rows if r["machines"][0] != "killed"]
    if survivors:
        lines += ["", "Survivors of the machines:", ""]
        lines += [f"- `{r['bug']}`: {SURVIVORS.get(r['bug'], 'NOT EXPLAINED')}"
                  for r in survivors]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=DEFAULT_PYTHON,
                        help="the oracle's Python, where vLLM 0.25.1 imports")
    parser.add_argument("--cache", default=DEFAULT_CACHE, type=Path,
                        help="where vLLM's test files are staged (tools/vllm_unit_tests.py's)")
    parser.add_argument("-k", dest="select", help="only bugs whose id contains this")
    parser.add_argument("-j", dest="jobs", type=int, default=2, help="bugs run at once")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per check")
    parser.add_argument("--list", action="store_true", help="print the catalogue and stop")
    parser.add_argument("--check", action="store_true",
                        help="check that every edit applies, run nothing")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument("--replay-worker", metavar="SRC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replay_worker:
        return replay_worker(args.replay_worker)
    bugs = [b for b in CATALOGUE if not args.select or args.select in b.bug_id]
    if args.list:
        for b in bugs:
            print(f"{b.bug_id:28} vllm/{b.path:42} {b.description}")
        return 0
    if not Path(args.python).exists():
        sys.exit(f"vllm_seeded_bugs: no Python at {args.python}; build the oracle with  "
                 "python3 tools/setup_vllm_venv.py ~/.cache/vllm-oracle")
    vllm_dir = oracle_vllm_dir(args.python)
    problems = check_catalogue(vllm_dir, bugs)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    if args.check:
        print(f"{len(bugs)} edits apply to {vllm_dir}")
        return 0
    sys.path.insert(0, str(TOOLS))
    from vllm_machines import ensure_test_packages
    _unit = _load_unit_tests_tool()
    ensure_test_packages(args.python)
    _unit.ensure_pytest(args.python)
    cache = Path(args.cache)
    stage = stage_vllm_tests(cache)
    passing = baseline(args.python, stage, cache, args.timeout)
    print(f"vLLM's tests passing on the unmodified vLLM: {len(passing['kv'])} KV-layer, "
          f"{len(passing['scheduler'])} scheduler", flush=True)
    rows: list[dict] = []

    def one(bug):
        row = run_bug(bug, args, vllm_dir, stage, cache, passing)
        short = {"vllm_kv_tests": "vllm-kv-tests", "vllm_scheduler_tests": "vllm-sched-tests",
                 "machines": "machines", "traces": "traces"}
        print(f"{bug.bug_id:28} " + "  ".join(f"{short[key]}={row[key][0]}" for key, _ in COLUMNS)
              + f"  ({row['seconds']} s)", flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(one, bugs))
    counts = summary(rows)
    print(f"\nkilled, of {counts['bugs']}: vLLM's KV-layer tests {counts['vllm_kv_tests']}, "
          f"with its scheduler tests {counts['vllm_tests']}, kvref's machines "
          f"{counts['machines']}, recorded traces {counts['traces']}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": counts}, indent=1) + "\n")
    table = render_markdown(rows)
    if args.markdown:
        args.markdown.write_text(table)
    else:
        print(table)
    unexplained = [r["bug"] for r in rows
                   if r["machines"][0] != "killed" and r["bug"] not in SURVIVORS]
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
