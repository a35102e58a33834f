"""Programs and the offline API a user starts from.

Mirrors ``vllm/entrypoints/``: ``llm.py`` is ``LLM`` (``vllm/entrypoints/llm.py``);
``disagg_prefill.py`` is a prefill engine run as its own process, the role
``vllm serve`` plays with a ``kv_producer`` transfer config
(``vllm/entrypoints/cli/serve.py``). Both need torch.
"""
