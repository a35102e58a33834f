#!/usr/bin/env python3
"""Record ``kvtrace/1`` conformance traces on the real vLLM 0.25.1 KV cache manager.

No vLLM counterpart. Two steps per trace:

1. **ops**: kvref's own ``Scheduler`` runs a seeded workload through a
   ``RecordingKVCacheManager``, which writes every call it makes to the KV layer
   as a trace op (the ``kvref record`` machinery);
2. **expect**: the same ops run on vLLM's ``KVCacheManager`` (``VllmReplayer``:
   kvref's ``TraceReplayer`` with vLLM's specs, manager and requests, observed by
   the same code) and what vLLM answered becomes each op's ``expect``.

The tool then replays the recorded trace on kvref and prints the first
divergence, if any: the scheduler decided on kvref's answers, so the trace is
one vLLM's scheduler could produce exactly when there is none (a divergence is a
kvref bug to fix, then record again). Run it with the oracle's interpreter
(``python3 tools/setup_vllm_venv.py DIR`` makes one) from the repository root::

    PY=/root/.cache/vllm-oracle/bin/python
    PYTHONPATH=$PWD $PY tools/record_vllm_traces.py --class rswa --count 8 \\
        --out tests/conformance/traces/rswa
    PYTHONPATH=$PWD $PY tools/record_vllm_traces.py --rerecord tests/conformance/traces/swa
    PYTHONPATH=$PWD /root/.cache/vllm-oracle-0.33.0/bin/python tools/record_vllm_traces.py \\
        --vllm-version 0.33.0 --rerecord tests/conformance/traces/sink

``--rerecord`` runs traces' ops on vLLM again and reports any answer that
differs from the stored one: it checks this recorder against the traces the
workplace's conformance tools recorded. ``--vllm-version`` records (or
re-records) the answers of another listed release instead, through the adapter
of ``tools/vllm_versions.py`` (the version switch lives there, never in
``kvref/core/``); kvref still answers as 0.25.1, so there a divergence is news
about the release, not a kvref bug.

Classes (``CLASSES``): ``rswa`` (R-SWA, alone or beside full attention),
``sink`` (sink attention), ``prompt_embeds`` (requests with prompt embeddings
beside plain ones over the same tokens). Each trace mixes shared prefixes,
multi-turn follow-ups, chunked prefill, a pool small enough to preempt, aborts
and prefix-cache resets.

vLLM 0.25.1 cannot build a manager for a sink group: the coordinator passes
``scheduler_block_size=`` to every single-type manager and
``SinkFullAttentionManager.__init__`` has no such parameter (its positional call
of the base class puts ``dcp_world_size`` there), so ``KVCacheManager(...)``
raises ``TypeError``. ``VllmReplayer`` wraps that ``__init__`` to take the
argument, run vLLM's own body and then set ``scheduler_block_size``; kvref's
manager takes the argument (what vLLM's coordinator plainly intends). Every
other line that runs is vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

from kvref.engine.core import engine_step
from kvref.worker.model_free_runner import ModelFreeRunner
from kvref.request import EngineRequest
from kvref.verify.trace_replay import prompt_embeds_from_rows
from kvref.sampling_params import SamplingParams
from kvref.sched.scheduler import Scheduler
from kvref.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvref.math_utils import cdiv
from kvref.verify.trace_record import RecordingKVCacheManager, make_header, write_trace
from kvref.verify.trace_replay import (
    TraceReplayer,
    find_traces,
    first_difference,
    load_trace,
    prompt_embeds_tensor,
    replay,
)
from vllm_versions import MIRRORED, VERSIONS, replayer_class

CLASSES = ("rswa", "sink", "prompt_embeds")
VOCAB = 1000
MAX_STEPS = 2000
RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
HIDDEN = 4                  # prompt-embedding width: small, the bytes are what is hashed


# --------------------------------------------------------------------------
# vLLM's side: the same replayer, building vLLM's objects


def _vllm():
    """vLLM's KV-layer modules (imported on first use: only recording needs them)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import torch
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams as VllmSamplingParams
        from vllm.utils.hashing import sha256, sha256_cbor
        from vllm.v1 import kv_cache_interface as spec
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.single_type_kv_cache_manager import SinkFullAttentionManager
        from vllm.v1.request import Request
    except ImportError as exc:
        sys.exit(f"record_vllm_traces: vLLM 0.25.1 does not import here ({exc}); run with "
                 "the oracle's python (python3 tools/setup_vllm_venv.py DIR makes one)")
    let_sink_manager_take_scheduler_block_size(SinkFullAttentionManager)
    return dict(torch=torch, LoRARequest=LoRARequest, MultiModalFeatureSpec=MultiModalFeatureSpec,
                PlaceholderRange=PlaceholderRange, SamplingParams=VllmSamplingParams,
                hash_functions={"sha256": sha256, "sha256_cbor": sha256_cbor}, spec=spec,
                kv_cache_utils=kv_cache_utils, KVCacheManager=KVCacheManager, Request=Request)


def let_sink_manager_take_scheduler_block_size(manager_class) -> None:
    """The one change to vLLM (module docstring): accept the coordinator's keyword."""
    vllm_init = manager_class.__init__
    if getattr(vllm_init, "_takes_scheduler_block_size", False):
        return

    def init(self, kv_cache_spec, *, scheduler_block_size: int, **kwargs) -> None:
        vllm_init(self, kv_cache_spec, **kwargs)     # vLLM's body: takes the sink blocks
        self.scheduler_block_size = scheduler_block_size

    init._takes_scheduler_block_size = True
    manager_class.__init__ = init


class VllmReplayer(TraceReplayer):
    """``TraceReplayer`` on vLLM 0.25.1: same ops, same observations, vLLM's objects."""

    def __init__(self, header: dict) -> None:
        self.v = _vllm()
        self.utils = self.v["kv_cache_utils"]
        self.hash_functions = self.v["hash_functions"]
        super().__init__(header)

    def _spec(self, group: dict):
        spec, kind = self.v["spec"], group["kind"]
        attn = dict(block_size=group["block_size"], num_kv_heads=group.get("num_kv_heads", 1),
                    head_size=group.get("head_size", 1), dtype=self.v["torch"].float16)
        if kind == "full":
            return spec.FullAttentionSpec(**attn)
        if kind == "rswa":
            return spec.RSWASpec(**attn, rswa_window=group["rswa_window"])
        if kind == "sink_full":
            return spec.SinkFullAttentionSpec(**attn, sink_len=group["sink_len"])
        if kind == "sliding_window":
            return spec.SlidingWindowSpec(**attn, sliding_window=group["sliding_window"])
        if kind == "chunked_local":
            return spec.ChunkedLocalAttentionSpec(
                **attn, attention_chunk_size=group["attention_chunk_size"])
        if kind == "cross_attention":
            return spec.CrossAttentionSpec(**attn)
        if kind == "mamba":
            return spec.MambaSpec(block_size=group["block_size"], shapes=((1,),),
                                  dtypes=(attn["dtype"],),
                                  mamba_cache_mode=group["mamba_cache_mode"],
                                  num_speculative_blocks=group.get("num_speculative_blocks", 0))
        raise ValueError(f"unknown group kind {kind!r}")

    def build_manager(self, header: dict):
        spec = self.v["spec"]
        groups = [spec.KVCacheGroupSpec(g.get("layer_names", [f"layer.{i}"]), self._spec(g),
                                        is_eagle_group=g.get("is_eagle_group", False))
                  for i, g in enumerate(header["groups"])]
        m = header["manager"]
        config = spec.KVCacheConfig(num_blocks=header["num_blocks"], kv_cache_tensors=[],
                                    kv_cache_groups=groups)
        # vLLM's coordinator reads the retention interval from its environment when
        # built: the header's value (absent: unset) around the build only.
        retention = header.get("prefix_cache_retention_interval")
        saved = os.environ.pop(RETENTION_ENV, None)
        if retention is not None:
            os.environ[RETENTION_ENV] = str(retention)
        try:
            return self.v["KVCacheManager"](
                config, max_model_len=m["max_model_len"],
                scheduler_block_size=m["scheduler_block_size"],
                hash_block_size=m["hash_block_size"],
                max_num_batched_tokens=m.get("max_num_batched_tokens"),
                enable_caching=m["enable_caching"], use_eagle=m.get("use_eagle", False),
                log_stats=m.get("log_stats", False),
                enable_kv_cache_events=m.get("enable_kv_cache_events", False),
                watermark=m.get("watermark", 0.0))
        finally:
            os.environ.pop(RETENTION_ENV, None)
            if saved is not None:
                os.environ[RETENTION_ENV] = saved

    def make_request(self, op: dict):
        v, lora = self.v, op.get("lora")
        features = [v["MultiModalFeatureSpec"](
            data=None, modality=f.get("modality", "image"), identifier=f["identifier"],
            mm_position=v["PlaceholderRange"](offset=f["offset"], length=f["length"]))
            for f in op.get("mm_features") or []]
        return v["Request"](
            request_id=op["req"], prompt_token_ids=list(op["prompt"]),
            sampling_params=v["SamplingParams"](
                max_tokens=op.get("max_tokens") or 1 << 20,
                skip_reading_prefix_cache=bool(op.get("skip_reading_prefix_cache"))),
            pooling_params=None, mm_features=features or None,
            lora_request=(v["LoRARequest"](lora_name=lora["name"], lora_int_id=lora["id"],
                                           lora_path=f"/loras/{lora['name']}")
                          if lora else None),
            cache_salt=op.get("cache_salt"), block_hasher=self.block_hasher,
            prompt_embeds=prompt_embeds_tensor(op))


def record_on_vllm(trace: dict, version: str = MIRRORED) -> dict:
    """A copy of ``trace`` whose ``expect_init`` and every ``expect`` are vLLM
    ``version``'s (a release other than the mirrored one goes through the adapter
    of ``tools/vllm_versions.py``; run with that release's oracle interpreter)."""
    replayer = (VllmReplayer if version == MIRRORED else replayer_class(version))(
        trace["header"])
    recorded = json.loads(json.dumps(trace))
    recorded["expect_init"] = replayer.initial_observation()
    state = recorded["expect_init"]["state"]
    for op in recorded["ops"]:
        observed = replayer.run(op)
        expect = {k: observed[k] for k in ("ret", "raises") if k in observed}
        if observed["state"] != state:
            expect["state"] = state = observed["state"]
        op["expect"] = expect
    recorded["vllm_version"] = version
    recorded["generator"] = {**trace.get("generator", {}),
                             "expect": f"recorded on vLLM {version} by "
                                       "tools/record_vllm_traces.py"}
    return recorded


def first_changed_expect(old: dict, new: dict) -> str | None:
    """Where two recordings of the same ops first answer differently, or None."""
    diff = first_difference(old.get("expect_init"), new.get("expect_init"), "expect_init")
    if diff:
        return f"{diff[0]}: {diff[1]!r} vs {diff[2]!r}"
    for i, (a, b) in enumerate(zip(old["ops"], new["ops"])):
        diff = first_difference(a.get("expect"), b.get("expect"), "expect")
        if diff:
            return f"op #{i} {a['op']}: {diff[0]}: {diff[1]!r} vs {diff[2]!r}"
    return None


# --------------------------------------------------------------------------
# the workloads: kvref's scheduler decides, the recorder writes the ops


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def _embeds_rows(tokens: list[int], variant: int) -> list[list[float]]:
    """Rows a function of (token, variant) only: equal prefixes, equal rows.
    Small integers and halves, which float32 and JSON both hold exactly."""
    return [[float((t * (3 + k) + variant * 5) % 17 - 8) / 2 for k in range(HIDDEN)]
            for t in tokens]


def make_config(cls: str, rng: random.Random) -> tuple[KVCacheConfig, int, dict]:
    """(config, block size, knobs) of one trace of class ``cls``."""
    bs = rng.choice([4, 8])
    num_blocks = rng.randint(12, 32)
    knobs: dict = {}
    if cls == "rswa":
        window = rng.choice([bs, 2 * bs, 2 * bs + rng.randrange(1, bs), 3 * bs])
        rswa = KVCacheGroupSpec(["rswa"], RSWASpec(bs, rswa_window=window))
        groups = [rswa]
        if rng.random() < 0.4:      # beside global full attention layers (hybrid coordinator)
            groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(bs)), rswa]
            num_blocks += 12
        knobs["rswa_window"] = window
    elif cls == "sink":
        sink_len = bs * rng.choice([1, 2, 3])
        num_blocks += sink_len // bs
        groups = [KVCacheGroupSpec(["sink"], SinkFullAttentionSpec(bs, sink_len=sink_len))]
        knobs["sink_len"] = sink_len
    elif cls == "prompt_embeds":
        groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(bs))]
        if rng.random() < 0.3:
            groups.append(KVCacheGroupSpec(["swa"], SlidingWindowSpec(bs, 2 * bs + 1)))
            num_blocks += 12
    else:
        raise ValueError(f"unknown class {cls!r}; choose from {CLASSES}")
    return KVCacheConfig(num_blocks, groups), bs, knobs


def run_workload(cls: str, seed: int, name: str) -> dict:
    """One trace of class ``cls`` with kvref's answers as ``expect``."""
    rng = random.Random(f"{cls}:{seed}")
    config, bs, knobs = make_config(cls, rng)
    max_model_len = 256
    budget = rng.choice([16, 24, 32, 64])
    header = make_header(config, max_model_len=max_model_len, scheduler_block_size=bs,
                         hash_block_size=bs, max_num_batched_tokens=budget,
                         watermark=rng.choice([0.0, 0.0, 0.05]), none_hash_seed=str(seed))
    recorder = RecordingKVCacheManager(header)
    scheduler = Scheduler(recorder, max_num_batched_tokens=budget,
                          max_num_seqs=rng.randint(2, 6),
                          scheduler_reserve_full_isl=rng.random() < 0.5)
    runner = ModelFreeRunner(vocab_size=VOCAB)
    # A request must fit the pool alone (beside sink blocks) or it would wait forever.
    usable = config.num_blocks - 1 - knobs.get("sink_len", 0) // bs
    per_group = usable // len(config.kv_cache_groups)

    def fits(num_tokens: int) -> bool:
        return cdiv(num_tokens, bs) + 2 <= per_group

    systems = [_tokens(rng, rng.randrange(bs, 5 * bs)) for _ in range(2)]
    pending: list[tuple[int, str, list[int], int, int | None]] = []  # step, id, prompt, out, embeds
    num_requests = rng.randint(8, 12)
    for i in range(num_requests):
        head = rng.choice(systems) if rng.random() < 0.7 else []
        prompt = head + _tokens(rng, rng.randrange(2, 6 * bs))
        variant = None
        if cls == "prompt_embeds" and rng.random() < 0.6:
            variant = rng.choice([0, 0, 1])     # mostly the same embeddings, some others
        max_out = rng.randrange(2, 12) if cls != "rswa" else rng.randrange(4, 32)
        while len(prompt) > bs and not fits(len(prompt) + max_out):
            prompt = prompt[:-bs]
        if not fits(len(prompt) + max_out):
            raise RuntimeError(f"{name}: a {per_group}-block group fits no request")
        pending.append((rng.randrange(0, num_requests), f"r{i}", prompt, max_out, variant))
    pending.sort(key=lambda p: p[0])
    live: dict[str, EngineRequest] = {}
    follow_ups = 0
    step = 0
    while pending or scheduler.has_unfinished_requests():
        if step == MAX_STEPS:
            raise RuntimeError(f"{name}: not done after {MAX_STEPS} steps (a request that "
                               "never fits?)")
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_out, variant = pending.pop(0)
            embeds = (prompt_embeds_from_rows(_embeds_rows(prompt, variant), "float32")
                      if variant is not None else None)
            request = EngineRequest(rid, prompt, SamplingParams(max_tokens=max_out,
                                                                ignore_eos=True),
                                    block_hasher=scheduler.block_hasher, prompt_embeds=embeds)
            scheduler.add_request(request)
            live[rid] = request
        if scheduler.has_unfinished_requests():
            engine_step(scheduler, runner)
            record = scheduler.step_records[-1]
            for rid in record.finished:
                done = live[rid]
                # Multi-turn: a follow-up resends the whole history (a prefix hit),
                # only for plain-token requests (a follow-up has no embeddings).
                if (follow_ups < 4 and done.prompt_embeds is None and rng.random() < 0.4
                        and fits(done.num_tokens + 2 * bs + 10)):
                    follow_ups += 1
                    pending.append((step + 1, f"{rid}.next", list(done.all_token_ids)
                                    + _tokens(rng, rng.randrange(1, 2 * bs)),
                                    rng.randrange(2, 10), None))
                    pending.sort(key=lambda p: p[0])
            running = [r for r in scheduler.running if not r.is_finished()]
            if running and rng.random() < 0.3:
                # What the model runner reads: the table, null blocks included.
                recorder.get_block_ids(rng.choice(running).request_id)
            if running and rng.random() < 0.03:
                scheduler.finish_requests(rng.choice(running).request_id)
            recorder.sync_requests()
            recorder.take_events()
            recorder.make_prefix_cache_stats()
            if rng.random() < 0.04:
                recorder.reset_prefix_cache()     # fails while any block is in use
        elif rng.random() < 0.2:
            recorder.reset_prefix_cache()         # idle: succeeds (except with sinks)
        step += 1
    recorder.take_events()
    return recorder.finish_trace(name=name, config_class=cls,
                                 generator={"tool": "tools/record_vllm_traces.py",
                                            "class": cls, "seed": seed, **knobs})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--class", dest="cls", choices=CLASSES)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rerecord", nargs="+", metavar="TRACE",
                        help="run stored traces' ops on vLLM again and compare the answers")
    parser.add_argument("--vllm-version", choices=VERSIONS, default=MIRRORED,
                        help="the release whose answers are recorded (default: the one "
                             "kvref mirrors); run with its oracle interpreter "
                             "(tools/setup_vllm_venv.py --vllm-version V DIR)")
    args = parser.parse_args(argv)
    if args.rerecord:
        changed = 0
        for path in find_traces(args.rerecord):
            trace = load_trace(path)
            where = first_changed_expect(trace, record_on_vllm(trace, args.vllm_version))
            changed += where is not None
            print(f"{path.name}: {where or 'same answers'}")
        return 1 if changed else 0
    if not args.cls or not args.out:
        parser.error("give --class and --out (or --rerecord TRACE...)")
    args.out.mkdir(parents=True, exist_ok=True)
    divergent = 0
    for seed in range(args.seed, args.seed + args.count):
        name = f"{args.cls}-{seed:05d}"
        trace = record_on_vllm(run_workload(args.cls, seed, name), args.vllm_version)
        result = replay(trace, check_invariants=True)
        divergent += result.divergence is not None
        path = args.out / f"{name}.json.gz"
        write_trace(trace, path)
        print(f"{path}: {len(trace['ops'])} ops, kvref "
              f"{'identical' if result.divergence is None else result.divergence}")
    # kvref answers as the release it mirrors; a newer one's answers may differ.
    return 1 if divergent and args.vllm_version == MIRRORED else 0


if __name__ == "__main__":
    sys.exit(main())
