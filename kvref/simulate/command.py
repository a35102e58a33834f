"""``kvref simulate``: the command line of ``kvref.simulate`` (``kvref/cli.py`` adds it).

    kvref simulate conversation --max-requests 500 --arrivals order --kv-cache-tokens inf --json
    kvref simulate my_prompts.jsonl --model llama-3-8b-like --gpu-memory-gib 80
    kvref simulate synthetic --model path/to/config.json --tensor-parallel-size 2

The pool: ``--kv-cache-tokens N`` (or ``inf``: never evict), or a model shape
(``--model``: a named shape or a local ``config.json``) on a GPU of
``--gpu-memory-gib`` at ``--gpu-memory-utilization``, split over
``--tensor-parallel-size`` GPUs (default: ``llama-3-8b-like`` on 80 GiB).
Scheduler flags are vLLM's, with ``vllm serve``'s defaults on such a GPU.
``--kv-offloading-size GIB`` puts the CPU offload tier behind the pool, as
vLLM's flag of that name does (``vllm/engine/arg_utils.py:1197``,
``vllm/config/vllm.py:796-824``).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_simulate_parser", "cmd_simulate"]


def _tokens_arg(value: str) -> float:
    if value in ("inf", "infinite"):
        return float("inf")
    try:
        n = int(value.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or 'inf', got {value!r}")
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_simulate_parser(sub, usage_error: type[Exception] = ValueError
                        ) -> argparse.ArgumentParser:
    """Add ``simulate`` to the subcommands ``sub``; bad input raises ``usage_error``
    (the CLI's one-line error), so this module need not import the CLI."""
    from kvref.simulate.sizing import NAMED_SHAPES

    p = sub.add_parser(
        "simulate", help="run a request trace through vLLM's scheduler and KV cache (no model)",
        description="Replay a request trace (Mooncake JSONL, or a JSONL of prompt_token_ids "
        "or, with --tokenizer, 'prompt' text or chat 'messages', each with max_tokens, "
        "arrival_s and the reply the server gave, output_token_ids or 'output' text; "
        "'conversation' and 'synthetic' are the vendored Mooncake traces) through kvref's vLLM 0.25.1 scheduler and KV cache manager with no model. "
        "Reports vLLM's prefix-cache counters and why every computed prompt token was not "
        "served from the cache (specs/simulate.md).")
    p.add_argument("trace", nargs="?",
                   help="a .jsonl or .jsonl.gz trace, or 'conversation' / 'synthetic'")
    p.add_argument("--workload", metavar="W",
                   help="instead of a trace, one of kvref's workloads (chat, multi-turn, rag, "
                   "agent, hybrid, pressure), on its own pool and scheduler settings")
    p.add_argument("--tokenizer", metavar="DIR_OR_NAME",
                   help="the served model's tokenizer (a folder, or a Hugging Face name in "
                   "the local cache), for lines with 'prompt' text, chat 'messages' or "
                   "'output' text; needs pip install 'kvref[text]'")
    p.add_argument("--max-requests", type=int, metavar="N", help="the first N requests only")
    p.add_argument("--skip", type=int, default=0, metavar="N", help="skip the first N requests")
    g = p.add_argument_group("time")
    g.add_argument("--arrivals", choices=["timestamps", "order"], default="timestamps",
                   help="timestamps: each request arrives at its trace time on the step-time "
                   "model; order: one request after another (default: timestamps)")
    g.add_argument("--step-base-ms", type=float, default=10.0, metavar="MS",
                   help="step time = this + --step-ms-per-token x tokens scheduled (10)")
    g.add_argument("--step-ms-per-token", type=float, default=0.04, metavar="MS",
                   help="(0.04)")
    g.add_argument("--max-output-tokens", type=int, metavar="N",
                   help="cap each request's output length (the trace's otherwise)")
    g = p.add_argument_group("KV cache size")
    g.add_argument("--kv-cache-tokens", type=_tokens_arg, metavar="N|inf",
                   help="a pool of N tokens (per KV cache group), or inf: one that never evicts")
    g.add_argument("--num-gpu-blocks-override", type=int, metavar="N",
                   help="a pool of N blocks (vLLM's flag)")
    g.add_argument("--model", default=None, metavar="SHAPE|CONFIG",
                   help=f"a named shape ({', '.join(NAMED_SHAPES)}) or a config.json "
                   "(default: llama-3-8b-like)")
    g.add_argument("--gpu-memory-gib", type=float, default=80.0, metavar="GIB",
                   help="memory of one GPU (80)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="vLLM's flag (0.9)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    g.add_argument("--reserved-gib", type=float, default=2.0, metavar="GIB",
                   help="activations, CUDA graphs and other non-KV memory, which vLLM "
                   "measures by profiling (2)")
    g.add_argument("--mamba-cache-mode", choices=["all", "align", "none"],
                   help="Mamba hybrids: vLLM's choice by default (all, or align for models "
                   "without Mamba prefix caching)")
    g = p.add_argument_group("host tier (vLLM's flag)")
    g.add_argument("--kv-offloading-size", type=float, metavar="GIB",
                   help="a CPU offload tier of GIB GiB behind the device pool "
                        "(SimpleCPUOffloadConnector, timed as vLLM's; prefix caching on)")
    g.add_argument("--kv-offload-copy-steps", type=int, default=1, metavar="N",
                   help="kvref's: a host copy is found done N steps after its launch "
                        "(default 1: the next step, as kvref's worker)")
    g = p.add_argument_group("scheduler (vLLM's flags)")
    g.add_argument("--block-size", type=int, default=16, metavar="N")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N")
    g.add_argument("--max-num-seqs", type=int, default=1024, metavar="N")
    g.add_argument("--max-model-len", type=int, metavar="N",
                   help="default: the trace's longest prompt + output")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    g.add_argument("--no-scheduler-reserve-full-isl", dest="scheduler_reserve_full_isl",
                   action="store_false")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="one JSON object on stdout")
    g.add_argument("--per-request", action="store_true",
                   help="with --json: each request's first-admission hit tokens")
    g.add_argument("--record", metavar="FILE",
                   help="also write the first --record-steps steps as a kvtrace/1 trace "
                   "(.json or .json.gz) for kvref viz / kvref explain")
    g.add_argument("--record-steps", type=int, default=50, metavar="N")
    g = p.add_argument_group("sweeps")
    g.add_argument("--sweep", action="append", metavar="NAME=V1,V2,...",
                   help="run every combination of these values (repeatable); NAME is one of "
                   "kv-cache-tokens, block-size, max-num-batched-tokens, max-num-seqs, "
                   "long-prefill-token-threshold, max-output-tokens, arrivals")
    g.add_argument("--workers", type=int, metavar="N",
                   help="local processes for a sweep (default: one per CPU)")
    g.add_argument("--ray-address", metavar="ADDR",
                   help="run the sweep's points as tasks on this Ray cluster ('auto', "
                   "'ray://host:10001'; needs pip install 'kvref[ray]')")
    g.add_argument("--plot", metavar="FILE.png",
                   help="with --sweep kv-cache-tokens=...: draw the capacity curve")
    p.set_defaults(run=lambda args, console: cmd_simulate(args, console, usage_error))
    return p


def _pool(args, requests):
    """The pool the flags ask for (see the module docstring)."""
    from pathlib import Path

    from kvref.math_utils import cdiv
    from kvref.simulate.sizing import (NAMED_SHAPES, blocks_never_evicting,
                                       model_shape_from_hf_config, pool_from_memory,
                                       pool_from_tokens)

    shape = None
    if args.model is not None:
        if args.model in NAMED_SHAPES:
            shape = NAMED_SHAPES[args.model]
        elif Path(args.model).exists():
            shape = model_shape_from_hf_config(args.model)
        else:
            raise ValueError(f"--model {args.model!r} is neither a named shape "
                             f"({', '.join(NAMED_SHAPES)}) nor a config.json path")
    sizes = [args.kv_cache_tokens is not None, args.num_gpu_blocks_override is not None]
    if sum(sizes) > 1:
        raise ValueError("give --kv-cache-tokens or --num-gpu-blocks-override, not both")
    common = dict(shape=shape, block_size=args.block_size,
                  enable_prefix_caching=args.enable_prefix_caching,
                  mamba_cache_mode=args.mamba_cache_mode)
    if args.kv_cache_tokens is not None or args.num_gpu_blocks_override is not None:
        probe = pool_from_tokens(2, **common)       # its groups and block size
        groups = len(probe.kv_cache_config.kv_cache_groups)
        if args.num_gpu_blocks_override is not None:
            num_blocks, how = args.num_gpu_blocks_override, "--num-gpu-blocks-override"
        elif args.kv_cache_tokens == float("inf"):
            num_blocks = blocks_never_evicting(requests, probe.block_size, groups,
                                               args.max_output_tokens)
            how = "--kv-cache-tokens inf (a pool that never evicts)"
        else:
            num_blocks = cdiv(int(args.kv_cache_tokens), probe.block_size) + 1
            how = f"--kv-cache-tokens {int(args.kv_cache_tokens):,}"
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is the null block), "
                             f"got {num_blocks}")
        return pool_from_tokens(num_blocks, how=how, **common)
    from kvref.simulate.sizing import NAMED_SHAPES as shapes
    max_len = args.max_model_len or max(
        r.input_length + (r.max_tokens if args.max_output_tokens is None
                          else min(r.max_tokens, args.max_output_tokens)) for r in requests)
    return pool_from_memory(shape or shapes["llama-3-8b-like"],
                            gpu_memory_gib=args.gpu_memory_gib, max_model_len=max_len,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            tensor_parallel_size=args.tensor_parallel_size,
                            reserved_gib=args.reserved_gib, block_size=args.block_size,
                            enable_prefix_caching=args.enable_prefix_caching,
                            mamba_cache_mode=args.mamba_cache_mode)


def _check_args(args) -> None:
    for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "record_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, "
                             f"got {getattr(args, name)}")
    for name in ("max_model_len", "max_output_tokens", "max_requests"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.long_prefill_token_threshold < 0 or args.skip < 0:
        raise ValueError("--long-prefill-token-threshold and --skip must be >= 0")
    if args.step_base_ms < 0 or args.step_ms_per_token < 0:
        raise ValueError("--step-base-ms and --step-ms-per-token must be >= 0")
    if args.kv_offloading_size is not None and (args.sweep or args.workload or args.record):
        raise ValueError("--kv-offloading-size runs one trace: --sweep, --workload and "
                         "--record do not take it")
    if args.tokenizer is not None and args.workload is not None:
        raise ValueError("--tokenizer reads a trace's text: a --workload is token ids already")
    if args.kv_offloading_size is None and args.kv_offload_copy_steps != 1:
        raise ValueError("--kv-offload-copy-steps needs --kv-offloading-size")
    if args.record is not None and not args.record.endswith((".json", ".json.gz")):
        raise ValueError(f"--record writes a kvtrace/1 trace: the file must end in .json "
                         f"or .json.gz, got {args.record!r}")


def cmd_simulate(args, console, usage_error: type[Exception] = ValueError) -> int:
    from kvref.simulate.engine import StepTime
    from kvref.simulate.report import render_report
    from kvref.simulate.traces import TraceError, load_trace

    try:
        _check_args(args)
        if args.sweep:
            return _sweep(args, console)
        if (args.trace is None) == (args.workload is None):
            raise ValueError("give a TRACE or --workload W (one of them)")
        if args.workload is not None:
            return _workload(args, console)
        requests = load_trace(args.trace, max_requests=args.max_requests, skip=args.skip,
                              tokenizer=_tokenizer(args))
        pool = _pool(args, requests)
        options = dict(max_model_len=args.max_model_len,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs,
                       long_prefill_token_threshold=args.long_prefill_token_threshold,
                       enable_prefix_caching=args.enable_prefix_caching,
                       scheduler_reserve_full_isl=args.scheduler_reserve_full_isl,
                       arrivals=args.arrivals,
                       step_time=StepTime(args.step_base_ms, args.step_ms_per_token),
                       max_output_tokens=args.max_output_tokens)
        if args.kv_offloading_size is not None:
            options.update(kv_offloading_size=args.kv_offloading_size,
                           kv_offload_copy_steps=args.kv_offload_copy_steps)
        result = _run_with_progress(requests, pool, options)
        if args.record is not None:
            from kvref.simulate.record import record_steps

            size = record_steps(requests, pool, options, args.record, args.record_steps)
            if not args.json:
                console.print(f"wrote {args.record}: the first {size} steps as kvtrace/1 "
                              f"(kvref viz {args.record})")
    except (TraceError, ValueError) as exc:
        raise usage_error(f"kvref simulate: {exc}") from None
    if args.json:
        json.dump(result.to_json(per_request=args.per_request), sys.stdout)
        sys.stdout.write("\n")
        return 0
    console.print(render_report(result, trace=str(args.trace)))
    return 0


def _tokenizer(args):
    """``--tokenizer``, loaded (or None)."""
    if args.tokenizer is None:
        return None
    from kvref.simulate.text import load_text_tokenizer

    return load_text_tokenizer(args.tokenizer)


def _run_with_progress(requests, pool, options):
    """Progress on stderr: a bar on a terminal, else a line every tenth of a long trace."""
    from rich.console import Console

    from kvref.simulate.engine import simulate

    console = Console(stderr=True)
    if not console.is_terminal:
        if len(requests) >= 1000:
            # Not a terminal (a log, CI): a line every tenth of the trace.
            marks = {len(requests) * k // 10 for k in range(1, 10)}
            shown = set()

            def line(done, total):
                for m in sorted(marks - shown):
                    if done >= m:
                        shown.add(m)
                        print(f"kvref simulate: {done:,}/{total:,} requests arrived",
                              file=sys.stderr, flush=True)
            return simulate(requests, pool, on_progress=line, **options)
        return simulate(requests, pool, **options)
    from rich.progress import Progress

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("simulating", total=len(requests))
        return simulate(requests, pool, on_progress=lambda done, total: progress.update(
            task, completed=done), **options)


def _workload(args, console) -> int:
    """``--workload W``: a preset of ``kvref.viz.workloads`` on its own pool and limits."""
    from kvref.simulate.engine import StepTime, simulate
    from kvref.simulate.report import render_report
    from kvref.simulate.sizing import PoolSize
    from kvref.simulate.traces import workload_trace

    if args.sweep or args.record:
        raise ValueError("--workload runs one preset: --sweep and --record do not apply "
                         "(kvref record --workload W records it)")
    requests, preset = workload_trace(args.workload, args.step_base_ms / 1000.0)
    pool = PoolSize(preset.config, preset.block_size,
                    f"the {args.workload} workload's pool ({preset.description})")
    result = simulate(requests, pool, max_model_len=preset.max_model_len,
                      max_num_batched_tokens=preset.max_num_batched_tokens,
                      max_num_seqs=preset.max_num_seqs, watermark=preset.watermark,
                      long_prefill_token_threshold=preset.long_prefill_token_threshold,
                      arrivals=args.arrivals,
                      step_time=StepTime(args.step_base_ms, args.step_ms_per_token))
    if args.json:
        json.dump(result.to_json(per_request=args.per_request), sys.stdout)
        sys.stdout.write("\n")
    else:
        follow_ups = any(r.after is not None for r in requests)
        console.print(render_report(result, trace=f"workload {args.workload}", replies=(
            "the model's stand-in tokens; the workload's follow-up turns are made from "
            "the tokens generated, so a resent reply hits as on vLLM" if follow_ups else
            "the model's stand-in tokens (no request of this workload resends a reply)")))
    return 0


# How an error names the kind of value a sweep axis takes.
KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false"}


def _parse_axes(specs: list[str]) -> dict[str, list]:
    from kvref.simulate.sweep import SWEEPABLE

    axes: dict[str, list] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        key = name.strip().replace("-", "_")
        if not sep or key not in SWEEPABLE or not values:
            raise ValueError(f"--sweep {spec!r}: expected NAME=V1,V2,... with NAME one of "
                             + ", ".join(k.replace("_", "-") for k in SWEEPABLE))
        kind = SWEEPABLE[key]
        parsed = []
        for v in values.split(","):
            v = v.strip()
            try:
                if kind is float:
                    parsed.append(float("inf") if v == "inf" else float(v))
                elif kind is int:
                    parsed.append(int(float(v)))
                elif kind is bool:
                    parsed.append(v.lower() in ("1", "true", "yes", "on"))
                else:
                    parsed.append(v)
            except ValueError:
                raise ValueError(f"--sweep {name}: {v!r} is not "
                                 f"{KIND_WORDS.get(kind, 'a ' + kind.__name__)}") from None
        axes[key] = parsed
    return axes


def _sweep(args, console) -> int:
    """``--sweep``: the points on processes or Ray, one line each, or JSON."""
    from rich.table import Table

    from kvref.simulate.sweep import (expand_grid, is_whole_conversation_trace,
                                      plot_capacity_curve, run_sweep)

    if args.model is not None or args.num_gpu_blocks_override is not None:
        raise ValueError("--sweep sizes pools by --kv-cache-tokens (sweep it, or give one "
                         "value); --model and --num-gpu-blocks-override do not apply")
    if args.skip:
        raise ValueError("--skip does not apply to --sweep (use --max-requests)")
    points = expand_grid(_parse_axes(args.sweep))
    base = dict(block_size=args.block_size, arrivals=args.arrivals,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                enable_prefix_caching=args.enable_prefix_caching,
                scheduler_reserve_full_isl=args.scheduler_reserve_full_isl,
                max_output_tokens=args.max_output_tokens,
                kv_cache_tokens=(args.kv_cache_tokens if args.kv_cache_tokens is not None
                                 else float("inf")))
    if args.tokenizer is not None:
        base["tokenizer"] = args.tokenizer
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    load_trace_check(args)
    results = run_sweep(str(args.trace), points, max_requests=args.max_requests, base=base,
                        workers=args.workers, ray_address=args.ray_address)
    if args.plot:
        if "kv_cache_tokens" not in points[0]:
            raise ValueError("--plot draws a capacity curve: sweep kv-cache-tokens")
        plot_capacity_curve({str(args.trace): results}, args.plot,
                            paper_claims=is_whole_conversation_trace(str(args.trace),
                                                                     args.max_requests))
    if args.json:
        json.dump(results, sys.stdout, default=str)
        sys.stdout.write("\n")
        return 0
    table = Table(title=f"{args.trace}: {len(points)} points")
    names = list(points[0])
    # The single run's words (kvref.stats): served from the cache once per request,
    # vLLM's hit rate.
    # Headers broken into short lines by hand: at 80 columns rich would cut
    # "block-size" to "block-si…" rather than wrap it.
    headers = [name.replace("_", "-\n") for name in names] + [
        "served\nonce per\nrequest", "vLLM's\nhit rate", "computed", "preemp-\ntions", "run s"]
    for header in headers:
        table.add_column(header, justify="right")
    errors = []
    for r in results:
        cells = [_cell(r["point"][n]) for n in names]
        if "error" in r:
            point = " ".join(f"{n}={r['point'][n]}" for n in names)
            errors.append(f"{point}: {r['error']}")
            table.add_row(*cells, f"error {len(errors)}", "", "", "", "")
        else:
            table.add_row(*cells, f"{r['hit_ratio_once']:.1%}",
                          f"{r['prefix_cache_hit_rate']:.1%}",
                          f"{r['prompt_tokens_computed']:,}", f"{r['num_preemptions']:,}",
                          f"{r['wall_seconds']:.1f}")
    console.print(table)
    for i, error in enumerate(errors, 1):
        console.print(f"error {i}: {error}", highlight=False)
    if args.plot:
        console.print(f"wrote {args.plot}")
    return 0


def _cell(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value == float("inf"):
        return str(value)
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,}"


def load_trace_check(args) -> None:
    """Fail in the caller with one line, before workers start, if the trace is bad."""
    from kvref.simulate.traces import load_trace

    load_trace(args.trace, max_requests=min(args.max_requests or 10, 10), skip=args.skip,
               tokenizer=_tokenizer(args))
