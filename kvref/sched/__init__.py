"""The scheduler: which requests run each step, and how many tokens each.

Mirrors ``vllm/v1/core/sched/``: ``scheduler.py`` (``Scheduler``),
``async_scheduler.py`` (``AsyncScheduler``), ``output.py`` (what a step hands
the runner) and ``utils.py`` (``check_stop``). The scheduler is the KV layer's
caller: it reads ``kvref.core`` and the connectors, and imports no torch.
vLLM keeps this folder inside ``v1/core/``; kvref keeps ``kvref/core/`` for the
KV layer's five files alone, so the scheduler sits one floor up.
"""
