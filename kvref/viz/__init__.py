"""Pictures of the KV cache in the terminal (``rich``); no vLLM counterpart.

``pool`` (grid, free queue), ``tables`` (block tables, prefix tree), ``panels``
(ops in words, events, figures over time, a whole frame), ``player`` (a trace
replayed to any position), ``workloads`` and ``walkthroughs`` (what ``kvref demo``
runs), ``explain`` (why an op did what it did), ``interactive`` (stepping by
typed commands), ``app`` (the full-screen viewer, Textual), ``details`` (one
block or request as the replayed manager holds it), ``html_player`` (the whole
trace as one offline HTML page, and ``Player`` for notebooks), ``demo`` (the
demo's pacing), ``request_life`` and ``disagg_life`` (docs/pictures.md's tables of one
request's life and of one disaggregated request's calls, checked as they run),
``watch`` (what ``kvref watch`` shows of a running vLLM), ``gates``
(``allocate_slots``' gates as the manager weighed them, for ``explain``).
"""

from kvref.viz.panels import render_frame, render_pool
from kvref.viz.pool import render_free_queue, render_grid
from kvref.viz.tables import render_block_tables, render_prefix_tree

__all__ = ["render_block_tables", "render_free_queue", "render_frame", "render_grid",
           "render_pool", "render_prefix_tree"]
