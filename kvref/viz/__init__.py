"""Pictures of the block pool in the terminal (``rich``); no vLLM counterpart."""

from kvref.viz.pool import render_pool

__all__ = ["render_pool"]
