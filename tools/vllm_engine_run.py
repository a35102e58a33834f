"""Run vLLM 0.25.1's real engine (``vllm.LLM.generate``) on vLLM's KV layer or on kvref's.

No vLLM counterpart: the end-to-end check of kvref. vLLM's own ``EngineCore``,
``Scheduler`` (or ``AsyncScheduler``), CPU model runner and attention kernels
run a small random-weight Llama; with ``--kv-layer kvref`` the seven modules of
vLLM's KV layer are kvref's (``tools/vllm_kvref_plugin.py``), so the real
scheduler allocates, caches, evicts and publishes KV events through kvref.
It runs in the engine environment (``tools/setup_vllm_engine_venv.py``); started
by another python, it starts itself again with that environment's python::

    python3 tools/vllm_engine_run.py --workload prefix --kv-layer kvref    # tokens, hits, events
    python3 tools/vllm_engine_run.py --workload evict --record evict.json.gz
    python3 tools/vllm_engine_run.py --compare                  # every workload, both layers
    python3 tools/vllm_engine_run.py --compare --workload prefix

It prints each request's tokens and ``num_cached_tokens`` and the KV events
vLLM's own ZMQ publisher sent. ``--record FILE`` (kvref layer) puts kvref's
``RecordingKVCacheManager`` where vLLM's scheduler builds its manager, so FILE is
a ``kvtrace/1`` trace of every call the real engine made to the KV layer
(``kvref replay`` / ``viz`` / ``explain`` open it). ``--compare`` runs each
workload once per layer, each in a fresh process (the swap must come before
vLLM imports its KV layer), and exits 1 unless tokens, cached tokens and KV
events are equal.

Facts it rests on (vLLM 0.25.1): the CPU platform sets a block size of 128
unless one is given (vllm/platforms/cpu.py:119) and turns
``async_scheduling`` off (vllm/platforms/cpu.py:136), so the async workload
names vLLM's ``AsyncScheduler`` as ``scheduler_cls``
(vllm/config/scheduler.py:199-201); the ZMQ publisher binds only an endpoint
with ``*``, ``::``, ``ipc://`` or ``inproc://`` and otherwise connects
(vllm/distributed/kv_events.py:393-397), so this tool binds the subscriber; ``NONE_HASH`` comes from ``PYTHONHASHSEED``
(vllm/v1/core/kv_cache_utils.py:102-114), which this tool sets to 0. Each
workload's pool is 64 blocks of 16 tokens unless it says otherwise
(``num_gpu_blocks_override``), small enough for the viewer to draw whole.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "build" / "vllm-engine"       # the random-weight checkpoints built here
ENGINE_VENV = Path("/root/.cache/kvref-vllm-engine")   # tools/setup_vllm_engine_venv.py's default
# Read by vLLM (or Python) at start-up: set before the interpreter runs the engine.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # one process: the swap reaches the engine
              "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0"}
QUIET_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
BLOCK_SIZE = 16
VOCAB = 512


def _prompt(seed: int, n: int) -> list[int]:
    """n token ids drawn from a fixed generator (the same in every process)."""
    out, x = [], seed * 7919 + 17
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(3 + x % (VOCAB - 3))
    return out


_SHARED = _prompt(1, 48)           # three full blocks every prefix request shares
_SYSTEM = _prompt(2, 40)

# name -> (what it shows, engine settings, generate calls: each a list of (prompt, max_tokens))
WORKLOADS: dict[str, dict] = {
    "prefix": {
        "about": "four requests share a 48-token prefix; a second call repeats two of them",
        "engine": {},
        "calls": [[(_SHARED + _prompt(10 + i, 5 + 3 * i), 20) for i in range(4)],
                  [(_SHARED + _prompt(10, 5), 6), (_SHARED + _prompt(12, 11), 6)]],
    },
    "evict": {
        "about": "a pool of 10 blocks for six 40-60 token prompts: evictions and preemptions",
        "engine": {"num_gpu_blocks_override": 10, "max_num_seqs": 4, "max_model_len": 128},
        "calls": [[(_SYSTEM[:16] + _prompt(20 + i, 24 + 4 * i), 16) for i in range(6)],
                  [(_SYSTEM[:16] + _prompt(20, 24), 4)]],
    },
    "chunked": {
        "about": "a 150-token prompt prefilled in chunks of 32 tokens beside two short ones",
        "engine": {"max_num_batched_tokens": 32, "enable_chunked_prefill": True,
                   "max_num_seqs": 3},
        "calls": [[(_prompt(30, 150), 6), (_prompt(31, 20), 10), (_SHARED + _prompt(32, 7), 5)],
                  [(_prompt(30, 150), 3)]],
    },
    "hybrid": {
        "about": "a Llama whose layer 0 has a 32-token sliding window and layer 1 full "
                 "attention (two KV cache groups); 100-116 token prompts share 48 tokens",
        "model": "tiny-llama-swa",
        "engine": {"num_gpu_blocks_override": 40, "max_num_seqs": 3},
        "calls": [[(_SHARED + _prompt(40 + i, 52 + 8 * i), 12) for i in range(3)],
                  [(_SHARED + _prompt(40, 52), 6)]],
    },
    "async": {
        "about": "the prefix workload under vLLM's AsyncScheduler",
        "engine": {"async_scheduling": True,
                   "scheduler_cls": "vllm.v1.core.sched.async_scheduler.AsyncScheduler"},
        "calls": [[(_SHARED + _prompt(10 + i, 5 + 3 * i), 20) for i in range(4)],
                  [(_SHARED + _prompt(10, 5), 6), (_SHARED + _prompt(12, 11), 6)]],
    },
}


# -- the model ------------------------------------------------------------------------


def build_model(path: Path, sliding_window: int | None = None) -> Path:
    """A random-weight Llama (2 layers, head size 32: vLLM's CPU attention takes
    32, 64, 80, ...), saved with transformers; no tokenizer (prompts are token ids).
    With sliding_window, layer 0 is ``sliding_attention``: vLLM's Llama reads
    ``layer_types`` and ``sliding_window`` from the config
    (vllm/model_executor/models/llama.py:183-201)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    extra = {}
    if sliding_window is not None:
        extra = {"layer_types": ["sliding_attention", "full_attention"],
                 "sliding_window": sliding_window}
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, torch_dtype="float32", **extra)
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    print(f"built a random-weight Llama at {path}", file=sys.stderr)
    return path


# -- the KV events, as vLLM's publisher sends them -----------------------------------


class EventListener:
    """A ZMQ SUB socket bound on 127.0.0.1 (vLLM's PUB connects to it); decodes
    every batch with vLLM's own ``KVEventBatch`` type."""

    def __init__(self) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.frames: list[bytes] = []
        self.seqs: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _run(self) -> None:
        poller = self._zmq.Poller()
        poller.register(self._sock, self._zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                _topic, seq, payload = self._sock.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.frames.append(payload)

    def wait_quiet(self, quiet_s: float = 0.5) -> None:
        """Return once nothing has arrived for quiet_s (the publisher has sent all)."""
        seen = -1
        while seen != len(self.frames):
            seen = len(self.frames)
            time.sleep(quiet_s)

    def close(self) -> list[dict]:
        """Stop, check no batch was lost, and decode every batch."""
        import msgspec

        from vllm.distributed.kv_events import KVEventBatch

        self.wait_quiet()
        if self.seqs != list(range(len(self.seqs))):
            raise RuntimeError(f"KV event batches were lost: sequence numbers {self.seqs}")
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        events = []
        for frame in self.frames:
            for event in decoder.decode(frame).events:   # ts differs run to run: not kept
                events.append({"type": type(event).__name__, **msgspec.to_builtins(event)})
        return events


# -- one run ----------------------------------------------------------------------------


def swap_in_kvref(kvref_root: Path) -> None:
    """vLLM's seven KV-layer modules become kvref's (before vLLM imports them),
    kvref imported from kvref_root."""
    sys.path.insert(0, str(ROOT / "tools"))
    sys.path.insert(0, str(kvref_root))
    import vllm_kvref_plugin

    vllm_kvref_plugin._swap()
    import kvref

    if Path(kvref.__file__).resolve().parent != (kvref_root / "kvref").resolve():
        raise SystemExit(f"kvref was imported from {kvref.__file__}, not {kvref_root}")


def install_recorder(holder: dict) -> None:
    """vLLM's scheduler builds kvref's RecordingKVCacheManager instead of its manager."""
    import vllm.v1.core.sched.scheduler as sched

    from kvref.verify.trace_record import RecordingKVCacheManager, make_header

    def build(*, kv_cache_config, max_model_len, max_num_batched_tokens=None,
              enable_caching=True, use_eagle=False, log_stats=False,
              enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
              scheduler_block_size=None, hash_block_size=None, metrics_collector=None,
              watermark=0.0):
        if use_eagle or dcp_world_size != 1 or pcp_world_size != 1:
            raise SystemExit("--record: EAGLE and context parallelism are not recordable")
        header = make_header(kv_cache_config, max_model_len=max_model_len,
                             scheduler_block_size=scheduler_block_size,
                             hash_block_size=hash_block_size,
                             max_num_batched_tokens=max_num_batched_tokens,
                             enable_caching=enable_caching, watermark=watermark,
                             enable_kv_cache_events=enable_kv_cache_events,
                             log_stats=log_stats)
        holder["recorder"] = RecordingKVCacheManager(header)
        return holder["recorder"]

    sched.KVCacheManager = build


def install_invariant_check(counter: dict) -> None:
    """kvref's invariant checker on the real manager after every engine step."""
    import vllm.v1.core.sched.scheduler as sched

    from kvref.verify.invariants import check

    original = sched.Scheduler.update_from_output

    def checked(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        manager = self.kv_cache_manager
        check(getattr(manager, "manager", manager))
        counter["steps"] = counter.get("steps", 0) + 1
        return out

    sched.Scheduler.update_from_output = checked


class Hooks:
    """What this tool adds to vLLM's scheduler, installed once per process: a step
    counter, and on request kvref's recorder and the invariant checker."""

    def __init__(self, layer: str, record: bool, check_invariants: bool,
                 kvref_path: Path | None = None) -> None:
        if layer == "kvref":
            swap_in_kvref(kvref_path or ROOT)
        elif record:
            raise SystemExit("--record needs --kv-layer kvref (the recorder is kvref's manager)")
        import vllm.v1.core.sched.scheduler as sched

        self.layer, self.steps, self.preemptions, self.scheduler = layer, 0, 0, ""
        self.groups: list[str] = []
        self.holder: dict = {}
        self.counter: dict = {}
        original_schedule = sched.Scheduler.schedule
        original_preempt = sched.Scheduler._preempt_request

        def counted(scheduler, *args, **kwargs):
            self.steps += 1
            self.scheduler = type(scheduler).__name__
            self.groups = [type(g.kv_cache_spec).__name__
                           for g in scheduler.kv_cache_config.kv_cache_groups]
            return original_schedule(scheduler, *args, **kwargs)

        def preempted(scheduler, *args, **kwargs):
            self.preemptions += 1
            return original_preempt(scheduler, *args, **kwargs)

        sched.Scheduler.schedule = counted
        sched.Scheduler._preempt_request = preempted
        if record:
            install_recorder(self.holder)
        self.check_invariants = check_invariants
        if check_invariants:
            install_invariant_check(self.counter)


def model_for(name: str, model: Path | None) -> Path:
    """The checkpoint a workload runs: --model if given, else one built under MODELS."""
    if model is not None:
        return model
    if WORKLOADS[name].get("model") == "tiny-llama-swa":
        return build_model(MODELS / "tiny-llama-swa", sliding_window=32)
    return build_model(MODELS / "tiny-llama")


def run_workload(name: str, hooks: Hooks, model: Path, record: str | None = None) -> dict:
    """Run one workload in this process; returns tokens, cached tokens, events."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.kv_cache_manager import KVCacheManager as manager_cls

    spec = WORKLOADS[name]
    hooks.steps, hooks.preemptions, hooks.counter["steps"] = 0, 0, 0
    listener = EventListener()
    engine = dict(model=str(model), skip_tokenizer_init=True, block_size=BLOCK_SIZE,
                  enable_prefix_caching=True, dtype="float32", max_model_len=256,
                  seed=0, enforce_eager=True, num_gpu_blocks_override=64,
                  max_num_batched_tokens=256, max_num_seqs=8,
                  kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                  endpoint=listener.endpoint))
    engine.update(spec["engine"])
    started = time.perf_counter()
    llm = LLM(**engine)
    requests = []
    for call in spec["calls"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in call]
        params = [SamplingParams(temperature=0.0, max_tokens=m, detokenize=False,
                                 ignore_eos=True) for _, m in call]
        for out in llm.generate(prompts, params, use_tqdm=False):
            requests.append({"tokens": list(out.outputs[0].token_ids),
                             "num_cached_tokens": out.num_cached_tokens,
                             "prompt_len": len(out.prompt_token_ids)})
    # The publisher's socket closes without lingering (vllm/distributed/kv_events.py:378):
    # let every batch arrive before shutting the engine down.
    listener.wait_quiet()
    llm.llm_engine.engine_core.shutdown()
    events = listener.close()
    del llm
    gc.collect()
    result = {"workload": name, "layer": hooks.layer, "requests": requests, "events": events,
              "engine_steps": hooks.steps, "scheduler": hooks.scheduler,
              "preemptions": hooks.preemptions, "kv_cache_groups": hooks.groups,
              "seconds": round(time.perf_counter() - started, 1),
              "manager": f"{manager_cls.__module__}.{manager_cls.__qualname__}",
              "vllm_version": __import__("vllm").__version__}
    if hooks.check_invariants:
        result["invariant_checks"] = hooks.counter["steps"]
    if record:
        from kvref.verify.trace_record import write_trace

        trace = hooks.holder["recorder"].finish_trace(
            name=f"vllm-engine-{name}", config_class="vllm-engine",
            generator={"tool": "tools/vllm_engine_run.py", "engine": "vllm.LLM.generate",
                       "vllm": result["vllm_version"],
                       "workload": name, "description": spec["about"]})
        Path(record).parent.mkdir(parents=True, exist_ok=True)
        write_trace(trace, record)
        result["recorded_ops"] = len(trace["ops"])
    return result


def print_result(r: dict) -> None:
    print(f"== {r['workload']} on {r['layer']}'s KV layer ({r['manager']}), vLLM "
          f"{r['vllm_version']}'s {r['scheduler']}: {r['engine_steps']} engine steps, "
          f"{r['preemptions']} preemptions, {r['seconds']} s; KV cache groups: "
          f"{', '.join(r['kv_cache_groups'])}")
    for i, q in enumerate(r["requests"]):
        print(f"  request {i}: prompt {q['prompt_len']} tokens, cached "
              f"{q['num_cached_tokens']}, tokens {q['tokens']}")
    kinds: dict[str, int] = {}
    for e in r["events"]:
        kinds[e["type"]] = kinds.get(e["type"], 0) + 1
    print(f"  KV events: {len(r['events'])} ({', '.join(f'{k} {v}' for k, v in kinds.items())})")
    if "recorded_ops" in r:
        print(f"  recorded {r['recorded_ops']} KV-layer calls")
    if "invariant_checks" in r:
        print(f"  kvref's invariant checker passed after {r['invariant_checks']} engine steps")


# -- comparing the two layers -----------------------------------------------------------


def run_in_subprocess(names: list[str], layer: str, extra: list[str]) -> list:
    """Workloads on one layer in a fresh interpreter (the swap must precede vLLM's imports)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--kv-layer", layer, "--json", str(out), *extra]
        for name in names:
            cmd += ["--workload", name]
        proc = subprocess.run(cmd, env={**QUIET_ENV, **os.environ, **ENGINE_ENV},
                              stdout=subprocess.DEVNULL)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"the run on {layer}'s KV layer failed (exit {proc.returncode})")
        return json.loads(out.read_text())


def compare(a: dict, b: dict) -> list[str]:
    """What differs between two runs of one workload ([] when equal)."""
    diffs = []
    ta = [q["tokens"] for q in a["requests"]]
    tb = [q["tokens"] for q in b["requests"]]
    if ta != tb:
        diffs.append("tokens differ")
    ca = [q["num_cached_tokens"] for q in a["requests"]]
    cb = [q["num_cached_tokens"] for q in b["requests"]]
    if ca != cb:
        diffs.append(f"cached tokens differ: {ca} vs {cb}")
    if a["events"] != b["events"]:
        first = next((i for i, (x, y) in enumerate(zip(a["events"], b["events"])) if x != y),
                     min(len(a["events"]), len(b["events"])))
        diffs.append(f"KV events differ ({len(a['events'])} vs {len(b['events'])}; first at "
                     f"#{first})")
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                        help="which workload (repeatable; default: all with --compare, "
                        "prefix otherwise)")
    parser.add_argument("--kv-layer", choices=("vllm", "kvref"), default="kvref",
                        help="whose KV layer vLLM's engine runs on (default kvref)")
    parser.add_argument("--compare", action="store_true",
                        help="run each workload on both layers and compare")
    parser.add_argument("--model", type=Path,
                        help="a local checkpoint for every workload (default: random-weight "
                        f"Llamas built under {MODELS})")
    parser.add_argument("--record", metavar="FILE", help="kvtrace/1 recording (kvref layer)")
    parser.add_argument("--check-invariants", action="store_true",
                        help="kvref's invariant checker after every engine step")
    parser.add_argument("--kvref-path", type=Path, metavar="DIR",
                        help="import kvref from DIR (a folder holding a kvref/ package) instead "
                        "of this checkout: how a test gives the engine a broken copy")
    parser.add_argument("--json", metavar="FILE", help="write the results (a list) as JSON")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    args = parser.parse_args(argv)
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (a transformers checkpoint "
                     "folder is expected)")
    if any(os.environ.get(key) != value for key, value in ENGINE_ENV.items()):
        # The engine reads these at import: start again with them set.
        os.execve(sys.executable, [sys.executable, __file__, *(argv or sys.argv[1:])],
                  {**QUIET_ENV, **os.environ, **ENGINE_ENV})
    try:
        import vllm  # noqa: F401
    except ImportError:
        engine_python = ENGINE_VENV / "bin" / "python"
        if engine_python.exists() and Path(sys.executable) != engine_python:
            # Any python may start this tool; the engine runs in its own environment.
            os.execve(str(engine_python), [str(engine_python), __file__,
                                           *(argv or sys.argv[1:])], os.environ)
        raise SystemExit(f"vllm is not importable here and {engine_python} does not exist: "
                         "build it with python3 tools/setup_vllm_engine_venv.py") from None
    names = args.workload or (sorted(WORKLOADS) if args.compare else ["prefix"])
    if args.compare:
        if args.record:
            raise SystemExit("--record records one run: use it without --compare")
        runs = {}
        for layer in ("vllm", "kvref"):
            print(f"running {', '.join(names)} on {layer}'s KV layer ...", flush=True)
            extra = ["--model", str(args.model)] if args.model else []
            if args.kvref_path and layer == "kvref":
                extra += ["--kvref-path", str(args.kvref_path)]
            runs[layer] = run_in_subprocess(names, layer, extra)
        failed, results = False, []
        for v, k in zip(runs["vllm"], runs["kvref"]):
            diffs = compare(v, k)
            hits = sum(q["num_cached_tokens"] for q in v["requests"])
            print(f"{v['workload']} ({v['scheduler']}): {len(v['requests'])} requests, "
                  f"{v['engine_steps']} engine steps, {v['preemptions']} preemptions, "
                  f"{hits} cached prompt tokens, "
                  f"{len(v['events'])} KV events (vLLM {v['seconds']} s, kvref {k['seconds']} s)")
            for what in ("tokens", "cached tokens", "KV events"):
                bad = [d for d in diffs if d.startswith(what)]
                print(f"  {what} {'DIFFER: ' + bad[0] if bad else 'equal'}")
            failed |= bool(diffs)
            results.append({"workload": v["workload"], "vllm": v, "kvref": k, "diffs": diffs})
        if args.json:
            Path(args.json).write_text(json.dumps(results))
        print("FAIL: the layers differ" if failed else
              f"tokens equal, cached tokens equal, KV events equal: {', '.join(names)}")
        return 1 if failed else 0
    if args.record and len(names) != 1:
        raise SystemExit("--record records one workload: give one --workload")
    hooks = Hooks(args.kv_layer, bool(args.record), args.check_invariants, args.kvref_path)
    results = []
    for name in names:
        result = run_workload(name, hooks, model_for(name, args.model), args.record)
        results.append(result)
        if not args.quiet:
            print_result(result)
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    if args.record and not args.quiet:
        print(f"wrote {args.record}: kvref replay / kvref viz / kvref explain open it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
