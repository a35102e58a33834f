"""The worker: block ids become tensor rows, and a runner turns a step into tokens.

Mirrors ``vllm/v1/worker/``::

    block_table.py                      block_table.py            BlockTable, slot mapping
    gpu_input_batch.py                  gpu_input_batch.py        the runner's request rows
    gpu_model_runner.py                 gpu_model_runner.py       GPUModelRunner
    kv_connector_model_runner_mixin.py  kv_connector_model_runner_mixin.py
                                                                  the connector around a step
    model_free_runner.py                (none)                    a runner with no model

``block_table.py`` and ``gpu_model_runner.py`` need torch (the ``torch``
extra); the other three do not, so this package imports nothing at load time
and hands out the block table's names on first use. The core never imports
this package.

    >>> from kvref.worker import BlockTable, PAD_SLOT_ID
"""

BLOCK_TABLE_NAMES = ("PAD_SLOT_ID", "BlockTable", "MultiGroupBlockTable")


def __getattr__(name: str):
    if name in BLOCK_TABLE_NAMES:
        from kvref.worker import block_table
        return getattr(block_table, name)
    raise AttributeError(f"module 'kvref.worker' has no attribute {name!r}")


__all__ = list(BLOCK_TABLE_NAMES)
