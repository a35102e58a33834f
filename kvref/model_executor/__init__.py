"""The model: a plain-torch transformer over the paged KV cache, and its loader.

Mirrors ``vllm/model_executor/``: ``model.py`` (``models/llama.py``, with
``qwen2.py``/``qwen3.py``) and ``loader.py`` (``model_loader/default_loader.py``).
Both need torch. The architecture they read is ``kvref/config/model.py``
(``ModelConfig``, vLLM's ``vllm/config/model.py``).
"""
