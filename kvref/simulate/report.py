"""The human report of ``kvref simulate`` (``--json`` gives the numbers instead)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvref.math_utils import cdiv
from kvref.stats import HIT_RATE, PREEMPTED_APART, RETRIES_ARE_QUERIES, SERVED_ONCE
from kvref.simulate.attribution import CAUSES
from kvref.simulate.engine import SimulationResult

__all__ = ["render_report", "reply_words", "sparkline"]

# What each cause means, in a few words (specs/simulate.md has the rules).
CAUSE_WORDS = {
    "first_occurrence": "no earlier request had computed these tokens",
    "evicted_before_reuse": "computed before, evicted before this request came",
    "shared_prefix_ends_inside_block": "shared, but the shared part ends inside a block "
                                        "(only full blocks are cached)",
    "last_token_cap": "cached, but the last token is always computed (num_tokens - 1 cap)",
    "window_or_mamba_limit": "cached for full attention, but a sliding window or Mamba "
                             "group had no hit that long",
    "recompute_after_preemption": "computed again after the request was preempted",
    "prefix_caching_disabled": "computed before, prefix caching is off",
}

_BARS = " ▁▂▃▄▅▆▇█"


def sparkline(values, width: int = 60, top: float | None = None) -> str:
    """``values`` (>= 0) as a line of block characters, ``width`` wide, scaled to ``top``."""
    if not values:
        return ""
    top = top or max(values) or 1.0
    step = max(1, cdiv(len(values), width))
    out = []
    for i in range(0, len(values), step):
        chunk = values[i:i + step]
        level = max(chunk) / top
        out.append(_BARS[min(len(_BARS) - 1, round(level * (len(_BARS) - 1)))])
    return "".join(out)


def _pct(values, q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def reply_words(r: SimulationResult) -> str:
    """Whose tokens the simulated model generated, and what that does to the hits."""
    stand_in = ("stand-in tokens no prompt contains: a later prompt that resends such a "
                "reply computes it again (counted under first_occurrence); give each "
                "line's reply (output_token_ids, or output text with --tokenizer)")
    if r.requests_with_replies == 0:
        return f"the trace gives none, so the model generated {stand_in}"
    if r.requests_with_replies == r.num_requests:
        return ("the server's, as the trace gives them for every request: a later prompt "
                "that resends one hits on it as on vLLM")
    return (f"the server's for the {r.requests_with_replies:,} of {r.num_requests:,} "
            f"requests whose line gives one; for the others, {stand_in}")


def render_report(result: SimulationResult, trace: str = "trace",
                  replies: str | None = None) -> Group:
    """``replies``: what to say of the generated tokens, if not ``reply_words``."""
    r = result
    head = Table.grid(padding=(0, 2))
    head.add_row("trace", f"{trace}: {r.num_requests:,} request{'' if r.num_requests == 1 else 's'}"
                 + (f" ({r.num_rejected} rejected: prompt >= max_model_len)"
                    if r.num_rejected else "")
                 + f", {r.prompt_tokens:,} prompt tokens, {r.output_tokens:,} generated")
    head.add_row("replies", replies or reply_words(r))
    head.add_row("KV cache", f"{r.num_gpu_blocks:,} blocks of {r.block_size} "
                 f"({r.kv_cache_tokens:,} tokens){': ' + r.pool if r.pool else ''}")
    head.add_row("scheduler", f"max_num_batched_tokens {r.max_num_batched_tokens}, "
                 f"max_num_seqs {r.max_num_seqs}, max_model_len {r.max_model_len:,}; "
                 f"arrivals: {r.arrivals}")
    head.add_row("prefix cache", f"{HIT_RATE} {r.prefix_cache_hit_rate:.1%} "
                 f"({r.prefix_cache_hits:,} hits / {r.prefix_cache_queries:,} queries, "
                 "in tokens)")
    if r.preempted_prefix_cache_queries:
        head.add_row("", f"{PREEMPTED_APART}: {r.preempted_prefix_cache_hits:,} hits / "
                     f"{r.preempted_prefix_cache_queries:,} queries ({RETRIES_ARE_QUERIES})")
    head.add_row("", f"{SERVED_ONCE}: {r.hit_ratio_once:.1%} of prompt tokens "
                 f"({r.prompt_tokens_cached_once:,}); computed: {r.prompt_tokens_computed:,}")
    if r.num_cpu_blocks:
        head.add_row("host tier", f"{r.kv_offloading_size:g} GiB: {r.num_cpu_blocks:,} blocks; "
                     f"prompt tokens loaded from it: {r.prompt_tokens_from_host:,} "
                     f"({r.host_blocks_stored:,} blocks stored, "
                     f"{r.host_blocks_loaded:,} loaded)")

    causes = Table(title="prompt tokens computed, by cause", title_justify="left")
    causes.add_column("cause", no_wrap=True)          # a name: never cut (the meaning wraps)
    causes.add_column("tokens", justify="right", no_wrap=True)
    causes.add_column("share", justify="right")
    causes.add_column("meaning")
    total = r.prompt_tokens_computed or 1
    for cause in sorted(CAUSES, key=lambda c: -r.misses_by_cause.get(c, 0)):
        n = r.misses_by_cause.get(cause, 0)
        if n:
            causes.add_row(cause, f"{n:,}", f"{n / total:.1%}", CAUSE_WORDS[cause])

    engine = Table.grid(padding=(0, 2))
    engine.add_row("steps", f"{r.num_steps:,} ({r.simulated_seconds:,.1f} s simulated, "
                   f"{r.wall_seconds:,.1f} s to run)")
    engine.add_row("preemptions", f"{r.num_preemptions:,}")
    delays = r.queue_delays_s
    if r.arrivals == "timestamps" and delays:
        engine.add_row("waiting", f"arrival to first step: median {_pct(delays, 0.5):.2f} s, "
                       f"p90 {_pct(delays, 0.9):.2f} s, max {max(delays):.2f} s")
    if r.timeline:
        usage = [u for _, u, _, _, _ in r.timeline]
        waiting = [w for _, _, _, w, _ in r.timeline]
        running = [n for _, _, n, _, _ in r.timeline]
        engine.add_row("KV usage", f"median {_pct(usage, 0.5):.1%}, p90 {_pct(usage, 0.9):.1%}, "
                       f"max {max(usage):.1%}")
        engine.add_row("", Text(sparkline(usage, top=1.0), style="cyan"))
        engine.add_row("running", f"max {max(running)}")
        engine.add_row("waiting", f"max {max(waiting)} ")
        engine.add_row("", Text(sparkline(waiting), style="yellow"))
    return Group(head, Text(""), causes, Text(""), engine)
