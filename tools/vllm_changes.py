#!/usr/bin/env python3
"""What changed in vLLM's KV layer since 0.25.1: kvref's traces replayed on a newer release.

No vLLM counterpart. kvref's vendored traces (``tests/conformance/traces/``)
are exact, op-by-op records of what vLLM 0.25.1 answers. This tool replays
each one on vLLM 0.25.1 and on a newer release through the adapter of
``tools/vllm_versions.py`` and writes, for each config class, how many replay
identically, and for each behaviour change the first op where it shows
(the 0.25.1 answer, the newer one) and the newer vLLM's lines that cause it::

    python3 tools/vllm_changes.py     # ~6 minutes on 2 busy cores (1.5 min of CPU)

It runs itself under each release's interpreter (``--python-0.25.1``,
``--python-0.33.0``: by default ``/root/.cache/vllm-oracle/bin/python`` and
``/root/.cache/vllm-oracle-0.33.0/bin/python``, which
``python3 tools/setup_vllm_venv.py [--vllm-version 0.33.0] DIR`` makes) and
writes ``docs/vllm_0.33_changes.md``, ``docs/vllm_0.33_changes.json`` and the
recorded answers lesson 16 shows (``tutorials/data/vllm_0.33_answers.json``).

How a divergence is put down to a change ("after accounting"): each change
listed in ``CHANGES`` comes with an *undo*, the smallest edit that gives the
newer release 0.25.1's behaviour back on that one point (a patch of a vLLM
function, or, for an answer the newer release no longer computes, not
comparing that op's return value). A trace is identical after accounting
when it replays identically with every undo applied; a change *shows* in a
trace when leaving its undo out (all the others applied) makes the trace
diverge, and the op where it then diverges is where it shows first. A trace
that still diverges with every undo applied is listed with its first
divergence: a change this tool does not undo.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import subprocess
import sys
import time
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))

TRACE_DIR = REPO / "tests" / "conformance" / "traces"
OUT = REPO / "docs" / "vllm_0.33_changes"
ANSWERS = REPO / "tutorials" / "data" / "vllm_0.33_answers.json"
NEW = "0.33.0"
DEFAULT_PYTHON = {"0.25.1": "/root/.cache/vllm-oracle/bin/python",
                  "0.33.0": "/root/.cache/vllm-oracle-0.33.0/bin/python"}
SRC = "vllm/v1/core/"


@dataclass
class Change:
    """One behaviour change of the newer release, and how to undo it."""

    key: str
    title: str                       # what changed, one line
    cause: list[str]                 # the newer release's file:line(s) that do it
    why: str                         # the reason, as the newer code states it
    undo: str                        # how the accounting replay gives 0.25.1's behaviour back
    unobserved_op: str | None = None  # undo by not comparing this op's return value
    patches: list = field(default_factory=list)   # (module, attribute, make(original))
    after_build: object = None       # fn(manager) run on each newly built manager


# --------------------------------------------------------------------------
# the undos (they run inside the newer release's interpreter)


def untag(keys):
    """0.33.0's tagged extra keys as 0.25.1 hashed them: the bare values, and an
    image as ``(identifier, offset)`` (what 0.33.0's events still publish,
    kv_cache_utils.py:680-705)."""
    if keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)


def _hash_untagged(original):
    def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids,
                          extra_keys=None):
        return original(hash_function, parent_block_hash, curr_block_token_ids,
                        untag(extra_keys))
    return hash_block_tokens


def _keep_null_head(original):
    return lambda blocks: blocks


# 0.25.1 recorded the new blocks of these spec types exactly (0.25.1
# single_type_kv_cache_manager.py:271-277 and 303-310).
RECORDED_IN_0251 = {"FullAttentionSpec", "TQFullAttentionSpec", "MLAAttentionSpec",
                    "HiddenStateCacheSpec"}


def _record_new_blocks_as_0251(manager):
    for single in manager.coordinator.single_type_managers:
        single._record_new_block_ids = type(single.kv_cache_spec).__name__ in RECORDED_IN_0251


def _reserve_sink_blocks(manager):
    """0.25.1's sink manager took sink_len // block_size blocks off the free
    queue at construction (0.25.1 single_type_kv_cache_manager.py:1451-1452)."""
    for single in manager.coordinator.single_type_managers:
        sink_len = getattr(single.kv_cache_spec, "sink_len", None)
        if sink_len and type(single).__name__ == "SinkFullAttentionManager":
            single.sink_blocks = single.block_pool.free_block_queue.popleft_n(
                sink_len // single.block_size)


def _peek_within_max_hit(original):
    """0.25.1 capped the EAGLE peek at ``max_cache_hit_length`` (0.25.1
    kv_cache_coordinator.py:695-699); 0.33.0 caps it at the request's hashed
    length (kv_cache_coordinator.py:875-884). Hashes past the cap are what the
    peek reaches, so the undo hides them."""
    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        return original(self, block_hashes[:max_cache_hit_length // self.hash_block_size],
                        max_cache_hit_length)
    return find_longest_cache_hit


UTILS = "vllm.v1.core.kv_cache_utils"
SINGLE = "vllm.v1.core.single_type_kv_cache_manager"
COORD = "vllm.v1.core.kv_cache_coordinator"

CHANGES = [
    Change("tagged_extra_keys",
           "extra keys in block hashes are tagged with their kind (`(\"lora\", name, path)`, "
           "`(\"mm\", id, offset)`, `(\"cache_salt\", salt)`, `(\"prompt_embeds\", digest)`): "
           "every request with LoRA, images, a cache salt or prompt embeddings hashes "
           "differently; plain requests hash identically",
           [SRC + "kv_cache_utils.py:574", SRC + "kv_cache_utils.py:590-607",
            SRC + "kv_cache_utils.py:610-634", SRC + "kv_cache_utils.py:659-661"],
           "the LoRA key carries the adapter path \"so that re-pointing a LoRA name at a "
           "different adapter does not reuse KV computed with the previous one\" "
           "(kv_cache_utils.py:593-594); events keep the untagged shapes for external "
           "consumers (kv_cache_utils.py:680-705)",
           "hash the untagged keys, as events still publish them",
           patches=[(UTILS, "hash_block_tokens", _hash_untagged)]),
    Change("no_cascade_prefix",
           "`get_num_common_prefix_blocks` always answers 0 per group",
           [SRC + "kv_cache_manager.py:700-703"],
           "cascade attention was removed; the method stays for out-of-tree schedulers "
           "(its docstring)",
           "its return value is not compared (the op changes nothing)",
           unobserved_op="get_num_common_prefix_blocks"),
    Change("new_block_ids_for_zeroing_only",
           "`take_new_block_ids` answers only when the worker must zero new blocks "
           "(Mamba layers or mixed KV precisions)",
           [SRC + "single_type_kv_cache_manager.py:114-120",
            "vllm/v1/kv_cache_interface.py:1651-1660"],
           "the ids exist for worker-side zeroing; a uniform-precision attention cache "
           "skips zeroing (kv_cache_interface.py:1653-1659)",
           "record the new blocks of the spec types 0.25.1 recorded (full attention, "
           "MLA, ...: the exact type), and only those",
           after_build=_record_new_blocks_as_0251),
    Change("pop_drops_null_head",
           "`pop_blocks_for_free` leaves out each group's leading null blocks",
           [SRC + "single_type_kv_cache_manager.py:571-589", SRC + "kv_cache_utils.py:247-250"],
           "a sliding-window table's skipped prefix is null blocks, which the caller "
           "would only hand back to the pool (docstring, :581-582)",
           "`trim_null_head` returns the blocks unchanged",
           patches=[(SINGLE, "trim_null_head", _keep_null_head)]),
    Change("sink_blocks_not_reserved",
           "a sink-attention group no longer takes `sink_len / block_size` blocks off the "
           "free queue when it is built",
           [SRC + "single_type_kv_cache_manager.py:2199-2220"],
           "the manager only checks that the sink length is whole blocks",
           "take the sink blocks off the free queue after building, as 0.25.1 did",
           after_build=_reserve_sink_blocks),
]
CHANGES.append(
    Change("eagle_peek_past_max_hit",
           "with EAGLE on a hybrid model, the one-block peek past a candidate hit is capped "
           "by the request's hashed length, not by `max_cache_hit_length` (`num_tokens - 1`): "
           "longer hits",
           [SRC + "kv_cache_coordinator.py:870-884", SRC + "kv_cache_utils.py:804-813"],
           "the margin is one hash unit for fine-grained lookups, else one block "
           "(`eagle_proof_margin`)",
           "the hybrid search sees only the hashes within `max_cache_hit_length`",
           patches=[(COORD, "HybridKVCacheCoordinator.find_longest_cache_hit",
                     _peek_within_max_hit)]))
CHANGES.append(
    Change("partial_tail_cache_entry",
           "a full-attention group whose block is larger than the hash block also caches "
           "the prompt's last hash boundary inside a block: an extra `BlockStored` "
           "(one hash, `block_size` = the hash block size). A later request can hit inside "
           "that block only with fine-grained partial hash hits, which 0.33.0 turns on only "
           "beside a Mamba `align` group whose block is larger than the hash block "
           "(`kv_cache_utils.py:762-801`, `kv_cache_coordinator.py:694-718`, "
           "`single_type_kv_cache_manager.py:775-826`); in the traces where the change "
           "shows, none has such a group, so the entry only adds the event",
           [SRC + "single_type_kv_cache_manager.py:840-896", SRC + "block_pool.py:486"],
           "so that a resend can hit the prompt up to its last hash boundary, not only up "
           "to its last whole block: \"only the final prompt hash boundary is registered as a "
           "partial prefix-cache entry\" (:864-868); where fine-grained hits are on, such "
           "a hit then copies the block (copy-on-write, :389-398)",
           "`FullAttentionManager._cache_partial_tail_block` does nothing",
           patches=[(SINGLE, "FullAttentionManager._cache_partial_tail_block",
                     lambda original: lambda self, request, num_tokens: None)]))
class _NotASpec:
    """Matches no spec: ``isinstance(spec, _NotASpec)`` is always False."""


CHANGES.append(
    Change("mamba_eagle_no_margin",
           "with EAGLE, a Mamba group no longer gets the one-block peek margin: 0.25.1's "
           "Mamba hit ran one block past its full-attention blocks (INV-HIT-2); 0.33.0's "
           "is exactly as long (shorter hits)",
           [SRC + "kv_cache_coordinator.py:870-875"],
           "\"no margin for mamba: its finder never drops (draft models have no mamba "
           "layers), so the hit would grow past the candidate\" (kv_cache_coordinator.py:871-874)",
           "the coordinator's `isinstance(spec, MambaSpec)` tests see no Mamba spec, so the "
           "margin applies to Mamba too, as in 0.25.1",
           patches=[(COORD, "MambaSpec", lambda original: _NotASpec)]))
def _keep_speculative_margin(original):
    """0.25.1 subtracted ``num_speculative_blocks`` from the computed tokens before
    freeing a Mamba group's skipped blocks (0.25.1 single_type_kv_cache_manager.py:1156)."""
    def remove_skipped_blocks(self, request_id, processed_computed_tokens,
                              num_prompt_tokens=None):
        return original(self, request_id,
                        max(0, processed_computed_tokens - self.num_speculative_blocks),
                        num_prompt_tokens)
    return remove_skipped_blocks


CHANGES.append(
    Change("mamba_frees_without_margin",
           "a Mamba group frees its skipped blocks from the computed tokens as they are; 0.25.1 "
           "first took `num_speculative_blocks` off them, in case draft tokens were rejected "
           "(with EAGLE: a block freed a step earlier)",
           [SRC + "single_type_kv_cache_manager.py:1629-1657", SRC + "kv_cache_manager.py:555-567"],
           "`allocate_slots` now frees every group \"on the processed-token basis\": the "
           "computed tokens less the request's tokens in flight, which \"rejected spec "
           "tokens can roll back\" (kv_cache_manager.py:561-567); Mamba's own margin went",
           "`MambaManager.remove_skipped_blocks` takes `num_speculative_blocks` off first",
           patches=[(SINGLE, "MambaManager.remove_skipped_blocks", _keep_speculative_margin)]))
CHANGE_KEYS = [c.key for c in CHANGES]


@contextlib.contextmanager
def undone(changes: list[Change]):
    """The newer release with these changes undone, for the duration."""
    import importlib

    saved = []
    try:
        for change in changes:
            for module_name, dotted, make in change.patches:
                owner = importlib.import_module(module_name)
                *path, attribute = dotted.split(".")
                for name in path:
                    owner = getattr(owner, name)
                original = owner.__dict__[attribute] if path else getattr(owner, attribute)
                saved.append((owner, attribute, original))
                setattr(owner, attribute, make(original))
        yield
    finally:
        for owner, attribute, original in reversed(saved):
            setattr(owner, attribute, original)


# --------------------------------------------------------------------------
# the worker: one release, every trace


def _short(value, limit: int = 160):
    text = json.dumps(value)
    return value if len(text) <= limit else text[:limit] + "..."


def replay_trace(trace: dict, version: str, changes: list[Change]) -> dict:
    """Replay with ``changes`` undone: ``{"identical": True}``, or the first
    divergence: op index (-1: construction), op name, field path, the values
    there (shortened) and both whole answers of that op (``"0.25.1"``, ``"new"``)."""
    from kvref.verify.trace_replay import compare_observation, first_difference
    from vllm_versions import replayer_class

    hooks = [c.after_build for c in changes if c.after_build]
    unobserved = {c.unobserved_op for c in changes if c.unobserved_op}
    base = replayer_class(version)

    class Accounting(base):
        def build_manager(self, header):
            manager = super().build_manager(header)
            for hook in hooks:
                hook(manager)
            return manager

    def divergence(index, op, diff, old, new):
        return {"identical": False, "index": index, "op": op, "path": diff[0],
                "expected": _short(diff[1]), "actual": _short(diff[2]),
                "answers": {"0.25.1": old, "new": new}}

    with undone(changes):
        try:
            replayer = Accounting(trace["header"])
        except Exception as exc:  # noqa: BLE001 - a construction divergence
            raised = f"{type(exc).__name__}: {exc}"
            return divergence(-1, "construction", ("construction", "a manager", raised),
                              trace["expect_init"], {"raises": raised})
        init = replayer.initial_observation()
        diff = first_difference(trace["expect_init"], init, "init")
        if diff:
            return divergence(-1, "construction", diff, trace["expect_init"], init)
        state = trace["expect_init"]["state"]
        for i, op in enumerate(trace["ops"]):
            observed = replayer.run(op)
            expected = op["expect"]
            state = expected.get("state", state)
            if op["op"] in unobserved:
                expected = {k: v for k, v in expected.items() if k != "ret"}
                compared = {k: v for k, v in observed.items() if k != "ret"}
            else:
                compared = observed
            diff = compare_observation(op, expected, compared, state, True)
            if diff:
                old = {**{k: v for k, v in op["expect"].items() if k != "state"},
                       "state": state}
                return divergence(i, op["op"], diff, old, observed)
    return {"identical": True}


def worker(version: str) -> dict:
    """Every vendored trace on ``version``: as it is, and (newer releases) with
    all undos and with each one left out."""
    from kvref.verify.trace_replay import find_traces, load_trace

    traces = list(find_traces([TRACE_DIR]))
    results = []
    started = time.monotonic()
    for n, path in enumerate(traces, start=1):
        trace = load_trace(path)
        entry = {"trace": path.name.removesuffix(".json.gz"), "class": path.parent.name,
                 "ops": len(trace["ops"]), "as_is": replay_trace(trace, version, [])}
        if version != "0.25.1" and not entry["as_is"]["identical"]:
            entry["all_undone"] = replay_trace(trace, version, CHANGES)
            if entry["all_undone"]["identical"]:
                entry["shows"] = {}
                for change in CHANGES:
                    others = [c for c in CHANGES if c is not change]
                    result = replay_trace(trace, version, others)
                    if not result["identical"]:
                        entry["shows"][change.key] = result
        results.append(entry)
        if n % 25 == 0 or n == len(traces):
            print(f"  vLLM {version}: {n}/{len(traces)} traces "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    return {"version": version, "traces": results}


# --------------------------------------------------------------------------
# what no undo here gives back: named by where the trace still diverges


@dataclass
class Residual:
    key: str
    title: str
    cause: list[str]
    why: str

    def matches(self, entry: dict) -> bool:
        found = entry["all_undone"]
        if self.key == "mamba_all_removed":
            return "mamba_cache_mode='align'" in str(found.get("actual"))
        return False


RESIDUALS = [
    Residual("mamba_all_removed",
             "Mamba mode `all` is gone (the modes are `align` and `none`), and a Mamba group "
             "with prefix caching must use `align` (building the manager raises "
             "`AssertionError`)",
             ["vllm/config/cache.py:176", "vllm/config/cache.py:304-311",
              SRC + "single_type_kv_cache_manager.py:1442-1444"],
             "the mode now follows prefix caching: `none` without it, `align` with it "
             "(vllm/config/cache.py:305-311); there is no mode that caches every state"),
]

NEW_MECHANISMS = [
    ("partial hash hits with copy-on-write: with a Mamba `align` group whose block is "
     "larger than the hash block, a hit may end inside a cache block; the shared tail "
     "block is copied before the request writes to it",
     [SRC + "single_type_kv_cache_manager.py:389-398", SRC + "single_type_kv_cache_manager.py:455"]),
    ("Mamba prefill checkpoints: extra state blocks saved during a long prefill",
     ["vllm/v1/kv_cache_interface.py:1101-1102"]),
    ("shared-prefix junction retention: `get_computed_blocks` also answers the boundary of "
     "a shared prefix a sparse-retention group has not cached, so it is pinned",
     [SRC + "kv_cache_manager.py:266-328"]),
    ("lookahead hashing: hashes computed for tokens not yet scheduled "
     "(`num_hash_lookahead_tokens`)", [SRC + "kv_cache_manager.py:141"]),
    ("in-flight tokens: blocks are freed only below the tokens fully processed "
     "(`num_computed_tokens - num_in_flight_tokens`), and window groups get an admission cap "
     "from `max_in_flight_tokens`",
     [SRC + "kv_cache_manager.py:561-567", SRC + "single_type_kv_cache_manager.py:2636-2651"]),
    ("a host tier with its own block pool (HiSparse)",
     [SRC + "single_type_kv_cache_manager.py:2223-2240"]),
    ("circular-buffer KV cache specs", ["vllm/v1/kv_cache_interface.py:968"]),
]


# --------------------------------------------------------------------------
# how much the KV layer grew (read from both releases' sources; stdlib only)

KV_LAYER = ["block_pool.py", "kv_cache_coordinator.py", "kv_cache_manager.py",
            "kv_cache_utils.py", "single_type_kv_cache_manager.py"]
# 0.33.0 moved the KV cache config builder out of kv_cache_utils.py into these.
NEW_MODULES = {"0.33.0": ["kv_cache_config_builder.py", "kv_cache_planning.py"]}


def _drop_docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
    return tree


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not in a docstring."""
    tree = ast.parse(source)
    in_docstring = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                in_docstring.update(range(body[0].lineno, body[0].end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(n for n in range(token.start[0], token.end[0] + 1)
                         if n not in in_docstring)
    return len(lines)


def functions(source: str) -> dict[str, str]:
    """Module functions and methods (``Class.name``), each as its AST without docstrings."""
    found = {}
    for node in ast.parse(source).body:
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        for f in members:
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{node.name}.{f.name}" if f is not node else f.name
                found[name] = ast.dump(_drop_docstrings(ast.parse(ast.unparse(f))))
    return found


def source_sizes(old_core: Path, new_core: Path, new: str = NEW) -> dict:
    """Code lines of the KV layer and functions of the single-type managers, both releases."""
    def read(core, name):
        return (core / name).read_text(encoding="utf-8")
    old_lines = sum(code_lines(read(old_core, f)) for f in KV_LAYER)
    new_lines = sum(code_lines(read(new_core, f)) for f in KV_LAYER + NEW_MODULES.get(new, []))
    old_f = functions(read(old_core, "single_type_kv_cache_manager.py"))
    new_f = functions(read(new_core, "single_type_kv_cache_manager.py"))
    return {"code_lines": {"0.25.1": old_lines, new: new_lines},
            "single_type_functions": {"0.25.1": len(old_f), new: len(new_f)},
            "single_type_functions_unchanged": sum(old_f[k] == new_f.get(k) for k in old_f),
            "modules": {"0.25.1": KV_LAYER, new: KV_LAYER + NEW_MODULES.get(new, [])}}


# --------------------------------------------------------------------------
# the report


def summarise(old: dict, new: dict, sizes: dict | None = None) -> dict:
    """The report's numbers and first ops from both workers' results."""
    old_identical = {t["trace"] for t in old["traces"] if t["as_is"]["identical"]}
    classes: dict[str, dict] = {}
    changes = {c.key: {"traces": 0, "first": None} for c in CHANGES}
    residuals = {r.key: {"traces": 0, "first": None} for r in RESIDUALS}
    unexplained = []

    def keep_first(slot, entry, found):
        candidate = {"trace": entry["trace"], "class": entry["class"], **found}
        if slot["first"] is None or (found["index"], entry["trace"]) < (
                slot["first"]["index"], slot["first"]["trace"]):
            slot["first"] = candidate

    for entry in new["traces"]:
        row = classes.setdefault(entry["class"], {"traces": 0, "identical_0.25.1": 0,
                                                  "identical_as_is": 0, "accounted": 0})
        row["traces"] += 1
        row["identical_0.25.1"] += entry["trace"] in old_identical
        if entry["as_is"]["identical"]:
            row["identical_as_is"] += 1
            row["accounted"] += 1
            continue
        if entry["all_undone"]["identical"]:
            row["accounted"] += 1
            for key, found in entry["shows"].items():
                changes[key]["traces"] += 1
                keep_first(changes[key], entry, found)
            continue
        residual = next((r for r in RESIDUALS if r.matches(entry)), None)
        if residual is None:
            unexplained.append({"trace": entry["trace"], **entry["all_undone"]})
        else:
            residuals[residual.key]["traces"] += 1
            keep_first(residuals[residual.key], entry, entry["all_undone"])
    total = {k: sum(row[k] for row in classes.values())
             for k in ("traces", "identical_0.25.1", "identical_as_is", "accounted")}
    return {"format": "vllm-changes/1", "old": "0.25.1", "new": new["version"],
            "tool": "python3 tools/vllm_changes.py", "total": total, "classes": classes,
            "changes": changes, "residuals": residuals, "unexplained": unexplained,
            "sizes": sizes}


def _answer(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 90 else text[:87] + "..."


def render(summary: dict) -> str:
    new, t = summary["new"], summary["total"]
    lines = [
        f"# vLLM {new}'s KV layer against kvref's traces of vLLM 0.25.1",
        "",
        "Generated by `python3 tools/vllm_changes.py` (do not edit; the method is in its",
        "docstring). Each of kvref's vendored traces (`tests/conformance/traces/`), recorded",
        f"on vLLM 0.25.1, is replayed on vLLM 0.25.1 and on vLLM {new} through the adapter of",
        "`tools/vllm_versions.py` (API changes only). *After accounting* means with every",
        "behaviour change below undone, one small patch each; a change *shows* in a trace",
        "when leaving its undo out makes that trace diverge. Lesson 16",
        "(`tutorials/16_what_changed_since_0_25_1.py`) runs each first op on kvref.",
        "",
        f"**{t['traces']} traces: {t['identical_0.25.1']} identical on 0.25.1, "
        f"{t['identical_as_is']} identical on {new} as they are, {t['accounted']} after "
        "accounting.**",
        "",
        f"| config class | traces | identical on 0.25.1 | identical on {new} | after accounting |",
        "|---|---|---|---|---|",
    ]
    for name, row in sorted(summary["classes"].items()):
        lines.append(f"| `{name}` | {row['traces']} | {row['identical_0.25.1']} | "
                     f"{row['identical_as_is']} | {row['accounted']} |")
    lines.append(f"| **all** | {t['traces']} | {t['identical_0.25.1']} | "
                 f"{t['identical_as_is']} | {t['accounted']} |")
    lines += ["", "## Behaviour changes, undone", "",
              f"The first op is the earliest op where the change shows; the answers are "
              f"0.25.1's (recorded in the trace) and {new}'s there.", ""]
    by_key = {c.key: c for c in CHANGES}
    for key, found in summary["changes"].items():
        change, first = by_key[key], found["first"]
        lines += [f"### `{key}`: shows in {found['traces']} traces", "", change.title + ".", "",
                  "- cause: " + ", ".join(f"`{c}`" for c in change.cause),
                  "- why: " + change.why,
                  "- undo: " + change.undo]
        if first:
            where = ("construction" if first["index"] < 0
                     else f"op #{first['index']} `{first['op']}`")
            lines += [f"- first op: `{first['trace']}` {where}, `{first['path']}`: "
                      f"0.25.1 `{_answer(first['expected'])}`, {new} "
                      f"`{_answer(first['actual'])}`"]
        lines.append("")
    lines += ["## Behaviour changes not undone here", "",
              "Traces still diverging with every undo applied, named by where they diverge.", ""]
    by_key = {r.key: r for r in RESIDUALS}
    for key, found in summary["residuals"].items():
        residual, first = by_key[key], found["first"]
        lines += [f"### `{key}`: {found['traces']} traces", "", residual.title + ".", "",
                  "- cause: " + ", ".join(f"`{c}`" for c in residual.cause),
                  "- why: " + residual.why]
        if first:
            where = ("construction" if first["index"] < 0
                     else f"op #{first['index']} `{first['op']}`")
            lines += [f"- first op: `{first['trace']}` {where}, `{first['path']}`: "
                      f"0.25.1 `{_answer(first['expected'])}`, {new} "
                      f"`{_answer(first['actual'])}`"]
        lines.append("")
    if summary["unexplained"]:
        lines += ["### Unexplained", ""] + [
            f"- `{u['trace']}` op #{u['index']} `{u['op']}` `{u['path']}`"
            for u in summary["unexplained"]] + [""]
    sizes = summary.get("sizes")
    if sizes:
        lines += ["## How much the KV layer grew", "",
                  f"Code lines (not blank, comment or docstring) of `{SRC}`: "
                  f"{sizes['code_lines']['0.25.1']:,} in 0.25.1 "
                  f"({', '.join(sizes['modules']['0.25.1'])}), "
                  f"{sizes['code_lines'][new]:,} in {new} (the same and "
                  f"{', '.join(sizes['modules'][new][len(sizes['modules']['0.25.1']):])}, which "
                  "took over the KV cache config builder). Functions and methods of "
                  f"`single_type_kv_cache_manager.py`: {sizes['single_type_functions']['0.25.1']}"
                  f" in 0.25.1, {sizes['single_type_functions'][new]} in {new}; "
                  f"{sizes['single_type_functions_unchanged']} unchanged (the same code, "
                  "docstrings aside).", ""]
    lines += ["## New mechanisms none of kvref's traces reach", ""]
    for text, cause in NEW_MECHANISMS:
        lines.append(f"- {text} (" + ", ".join(f"`{c}`" for c in cause) + ")")
    lines += ["", "## API changes the adapter bridges", "",
              "See `tools/vllm_versions.py`: `KVCacheManager(max_num_batched_tokens=)` is",
              "`max_in_flight_tokens=`; `get_computed_blocks` returns three values; prefix-cache",
              "stats are recorded by `record_prefix_cache_stats` at admission; the retention",
              "interval is `KVCacheConfig.prefix_cache_retention_interval`;",
              "`SinkFullAttentionManager` takes the coordinator's keywords in neither release.",
              ""]
    return "\n".join(lines)


def lesson_answers(summary: dict) -> dict:
    """The first op of each change with both answers: what lesson 16 shows."""
    entries = {}
    for group in ("changes", "residuals"):
        for key, found in summary[group].items():
            first = found["first"]
            if first is None:
                continue
            entries[key] = {"trace": f"{first['class']}/{first['trace']}.json.gz",
                            "index": first["index"], "op": first["op"],
                            "path": first["path"], "undone_here": group == "changes",
                            "traces": found["traces"],
                            "0.25.1": first["answers"]["0.25.1"],
                            summary["new"]: first["answers"]["new"]}
    return {"format": "vllm-answers/1", "recorded_by": "python3 tools/vllm_changes.py",
            "old": "0.25.1", "new": summary["new"], "total": summary["total"],
            "answers": entries}


def run_worker(python: str, version: str) -> dict:
    if not Path(python).exists():
        sys.exit(f"vllm_changes: no interpreter at {python} for vLLM {version}; make it with "
                 f"`python3 tools/setup_vllm_venv.py --vllm-version {version} DIR` and pass "
                 f"--python-{version} DIR/bin/python")
    out = REPO / "build" / f"vllm_changes_{version}.json"
    out.parent.mkdir(exist_ok=True)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": os.pathsep.join(
        [str(REPO), str(REPO / "tools"), os.environ.get("PYTHONPATH", "")])}
    print(f"replaying on vLLM {version} ({python})", file=sys.stderr, flush=True)
    subprocess.run([python, __file__, "--worker", version, "--worker-out", str(out)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-0.25.1", dest="old_python", default=DEFAULT_PYTHON["0.25.1"])
    parser.add_argument(f"--python-{NEW}", dest="new_python", default=DEFAULT_PYTHON[NEW])
    parser.add_argument("--out", type=Path, default=OUT,
                        help="report path without suffix (.md and .json are written)")
    parser.add_argument("--answers", type=Path, default=ANSWERS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.worker_out.write_text(json.dumps(worker(args.worker)), encoding="utf-8")
        return 0
    started = time.monotonic()
    old = run_worker(args.old_python, "0.25.1")
    new = run_worker(args.new_python, NEW)
    sizes = source_sizes(Path(args.old_python).parents[1] / "vllm-src" / SRC,
                         Path(args.new_python).parents[1] / "vllm-src" / SRC)
    summary = summarise(old, new, sizes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = Path(f"{args.out}.md")
    report.write_text(render(summary), encoding="utf-8")
    Path(f"{args.out}.json").write_text(json.dumps(summary, indent=1) + "\n",
                                        encoding="utf-8")
    args.answers.parent.mkdir(parents=True, exist_ok=True)
    args.answers.write_text(json.dumps(lesson_answers(summary), indent=1) + "\n",
                            encoding="utf-8")
    t = summary["total"]
    print(f"{t['traces']} traces: {t['identical_0.25.1']} identical on 0.25.1, "
          f"{t['identical_as_is']} on {NEW} as they are, {t['accounted']} after accounting; "
          f"wrote {report}, .json and {args.answers} "
          f"in {time.monotonic() - started:.0f} s")
    return 0 if t["identical_0.25.1"] == t["traces"] else 1


if __name__ == "__main__":
    sys.exit(main())
