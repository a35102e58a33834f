"""Sweeps: one trace at many settings, on local processes or a Ray cluster; the capacity curve.

No vLLM counterpart. A sweep is a list of points, each a dict of ``simulate``
settings on top of a base (``kv_cache_tokens``, ``block_size``,
``max_num_batched_tokens``, ``max_num_seqs``, ``long_prefill_token_threshold``,
``arrivals``, ...). Every point is one independent run, so the points spread over
workers: local processes by default (``concurrent.futures``), or the tasks of
a Ray cluster when given its address (``ray_address="auto"`` or
``"ray://head:10001"``; Ray is an optional extra: ``pip install 'kvref[ray]'``).
Each worker reads the trace itself; only the settings and the summary travel.

``capacity_curve`` is the sweep over ``kv_cache_tokens`` that Mooncake's
Figure 9 plots (hit rate against cache capacity, log axis), with the trace's
theoretical maximum (a pool that never evicts); ``plot_capacity_curve`` draws it.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

__all__ = ["SWEEPABLE", "capacity_curve", "expand_grid", "is_whole_conversation_trace",
           "plot_capacity_curve", "run_point", "run_sweep"]

# Settings a point may set: simulate()'s keywords, and the pool's.
SWEEPABLE = {"kv_cache_tokens": float, "block_size": int, "max_num_batched_tokens": int,
             "max_model_len": int,
             "max_num_seqs": int, "long_prefill_token_threshold": int,
             "max_output_tokens": int, "arrivals": str, "enable_prefix_caching": bool,
             "scheduler_reserve_full_isl": bool}


def expand_grid(axes: dict[str, Sequence]) -> list[dict]:
    """Every combination of the axes' values, as points::

        >>> expand_grid({"block_size": [16, 512], "kv_cache_tokens": [1e6]})
        [{'block_size': 16, 'kv_cache_tokens': 1000000.0}, {'block_size': 512, 'kv_cache_tokens': 1000000.0}]
    """
    for name in axes:
        if name not in SWEEPABLE:
            raise ValueError(f"cannot sweep {name!r}; sweepable: {', '.join(SWEEPABLE)}")
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*axes.values())]


def run_point(trace: str, max_requests: int | None, point: dict, base: dict | None = None
              ) -> dict:
    """One point: load the trace, size the pool, simulate; the JSON summary plus the point."""
    from kvref.math_utils import cdiv
    from kvref.simulate.engine import simulate
    from kvref.simulate.sizing import blocks_never_evicting, pool_from_tokens
    from kvref.simulate.traces import load_trace

    settings = dict(base or {})
    settings.update(point)
    tokens = settings.pop("kv_cache_tokens", float("inf"))
    block_size = settings.pop("block_size", 16)
    tokenizer = settings.pop("tokenizer", None)       # a name: each worker loads its own
    if tokenizer is not None:
        from kvref.simulate.text import load_text_tokenizer

        tokenizer = load_text_tokenizer(tokenizer)
    requests = load_trace(trace, max_requests=max_requests, tokenizer=tokenizer)
    if tokens == float("inf"):
        num_blocks = blocks_never_evicting(requests, block_size,
                                           max_output_tokens=settings.get("max_output_tokens"))
    else:
        num_blocks = cdiv(int(tokens), block_size) + 1
    try:
        result = simulate(requests, pool_from_tokens(num_blocks, block_size=block_size),
                          **settings)
    except ValueError as exc:           # e.g. a pool too small for vLLM to start
        return {"point": dict(point), "error": str(exc)}
    summary = result.to_json()
    summary["point"] = dict(point)
    return summary


def run_sweep(trace: str, points: list[dict], *, max_requests: int | None = None,
              base: dict | None = None, workers: int | None = None,
              ray_address: str | None = None,
              on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every point; the summaries in the order of ``points``."""
    if ray_address is not None:
        return _run_on_ray(trace, points, max_requests, base, ray_address, on_done)
    workers = workers or min(len(points), os.cpu_count() or 1)
    if workers <= 1:
        out = []
        for p in points:
            out.append(run_point(trace, max_requests, p, base))
            if on_done:
                on_done(out[-1])
        return out
    results: list[dict | None] = [None] * len(points)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_point, trace, max_requests, p, base): i
                   for i, p in enumerate(points)}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            if on_done:
                on_done(results[futures[future]])
    return results


def _run_on_ray(trace, points, max_requests, base, address, on_done) -> list[dict]:
    try:
        import ray
    except ImportError:
        raise ValueError("--ray-address needs Ray: pip install 'kvref[ray]' (or run the "
                         "sweep on local processes, without --ray-address)") from None
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, log_to_driver=False)
    try:
        remote = ray.remote(run_point)
        refs = [remote.remote(trace, max_requests, p, base) for p in points]
        results = []
        for ref in refs:
            results.append(ray.get(ref))
            if on_done:
                on_done(results[-1])
        return results
    finally:
        if started_here:
            ray.shutdown()


def capacity_curve(trace: str, capacities: Sequence[float], *, block_size: int = 512,
                   max_requests: int | None = None, workers: int | None = None,
                   ray_address: str | None = None, max_output_tokens: int = 1,
                   on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Hit ratio (each request once) at each capacity in tokens, plus ``inf`` last.

    Order-only arrivals, as Mooncake's Figure 9; outputs capped at
    ``max_output_tokens`` (a Mooncake trace holds no output tokens, so outputs
    never hit; they only take room for as long as a request runs).
    """
    points = [{"kv_cache_tokens": float(c)} for c in capacities]
    points.append({"kv_cache_tokens": float("inf")})
    base = {"block_size": block_size, "arrivals": "order",
            "max_output_tokens": max_output_tokens}
    return run_sweep(trace, points, max_requests=max_requests, base=base, workers=workers,
                     ray_address=ray_address, on_done=on_done)


def is_whole_conversation_trace(trace: str, max_requests: int | None, skip: int = 0) -> bool:
    """Whether a run is the whole vendored Mooncake conversation trace: the only
    traffic the Mooncake paper's capacity claims are about."""
    return trace == "conversation" and max_requests is None and not skip


def plot_capacity_curve(curves: dict[str, list[dict]], path: str,
                        paper_claims: bool = False, title: str | None = None) -> None:
    """Draw ``{label: capacity_curve(...)}`` as hit ratio against capacity (log axis),
    each with its maximum (the ``inf`` point) dashed, to a PNG at ``path``.
    ``paper_claims`` marks the Mooncake paper's two capacities: give it only for the
    whole conversation trace (``is_whole_conversation_trace``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for (label, curve), color in zip(curves.items(), ["C0", "C1", "C2", "C3"]):
        finite = [p for p in curve if p["point"]["kv_cache_tokens"] != float("inf")
                  and "error" not in p]
        xs = [p["point"]["kv_cache_tokens"] for p in finite]
        ys = [100 * p["hit_ratio_once"] for p in finite]
        ax.plot(xs, ys, "o-", color=color, label=label)
        top = [p for p in curve if p["point"]["kv_cache_tokens"] == float("inf")]
        if top:
            ax.axhline(100 * top[0]["hit_ratio_once"], color=color, ls="--", lw=1,
                       label=f"{label}: maximum (never evicts) "
                             f"{100 * top[0]['hit_ratio_once']:.1f} %")
    if paper_claims:
        ax.axvline(3e6, color="grey", ls=":", lw=1)
        ax.axvline(5e7, color="grey", ls=":", lw=1)
        # Each label sits left of its line, inside the axes (right of 50 M it was cut).
        for x, words in ((3e6, "3 M tokens, < half"), (5e7, "50 M tokens, nearly")):
            ax.annotate(f"Mooncake paper:\n{words}\nthe maximum", xy=(x, 1), xytext=(-4, 0),
                        textcoords="offset points", fontsize=7, color="grey", ha="right")
    ax.set_xscale("log")
    ax.set_xlabel("KV cache capacity (tokens)")
    ax.set_ylabel("prompt tokens served from the cache (%)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "Prefix-cache hit ratio against capacity")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
