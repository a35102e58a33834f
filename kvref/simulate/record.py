"""``kvref simulate --record``: the first steps of a simulation as a ``kvtrace/1`` trace.

No vLLM counterpart. The same run, stopped after ``max_steps`` steps, on a
``RecordingKVCacheManager`` (``kvref/verify/trace_record.py``), so every
manager call is written down with kvref's answer: a file ``kvref viz`` steps
through and ``kvref explain`` reasons about (why a lookup hit where it did,
which gate refused an admission). The window starts at the first step: a
trace replays from an empty pool, and later steps depend on all earlier ones.
"""

from __future__ import annotations

__all__ = ["record_steps"]


def record_steps(requests, pool, options: dict, path: str, max_steps: int) -> int:
    """Run the first ``max_steps`` steps recorded, write the trace to ``path``; returns
    the steps written."""
    from kvref.verify.trace_record import RecordingKVCacheManager, make_header, write_trace
    from kvref.simulate.engine import simulate

    recorders = []

    def factory(config, **manager_args):
        header = make_header(config, max_model_len=manager_args["max_model_len"],
                             scheduler_block_size=manager_args["scheduler_block_size"],
                             hash_block_size=manager_args["hash_block_size"],
                             max_num_batched_tokens=manager_args["max_num_batched_tokens"],
                             enable_caching=manager_args["enable_caching"],
                             watermark=manager_args["watermark"])
        recorder = RecordingKVCacheManager(header)
        recorders.append(recorder)
        return recorder

    result = simulate(requests, pool, max_steps=max_steps, manager_factory=factory, **options)
    [recorder] = recorders
    recorder.sync_requests()
    trace = recorder.finish_trace(
        name="kvref-simulate", config_class="kvref-simulate",
        generator={"tool": "kvref simulate", "steps": result.num_steps,
                   "requests": len(requests), "pool": pool.how})
    try:
        write_trace(trace, path)
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror}") from None
    return result.num_steps
