"""Data files that ship with kvref (see each folder's README for its source and licence).

``mooncake/``: two of the Mooncake FAST'25 request traces (Apache-2.0), read by
``kvref simulate`` and ``kvref.simulate.load_trace``::

    >>> from kvref.data import MOONCAKE_TRACES
    >>> sorted(MOONCAKE_TRACES)
    ['conversation', 'synthetic']
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parent
MOONCAKE_DIR = DATA_DIR / "mooncake"
# Short names for the vendored traces (``kvref simulate conversation`` reads the first).
MOONCAKE_TRACES = {"conversation": MOONCAKE_DIR / "conversation_trace.jsonl.gz",
                   "synthetic": MOONCAKE_DIR / "synthetic_trace.jsonl.gz"}
