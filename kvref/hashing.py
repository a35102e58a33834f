"""The two block-hash functions, byte-identical to vLLM's.

Mirrors ``sha256`` and ``sha256_cbor`` in ``vllm/utils/hashing.py``. Both hash a
Python value ``(parent_hash, token_ids, extra_keys)``; they differ in how the
value becomes bytes:

- ``sha256`` pickles it (highest protocol). Pickle remembers objects it has
  already written, so a tuple that holds the *same* str object twice gives other
  bytes than one holding two *equal* strs. Pass the request's own objects.
- ``sha256_cbor`` writes canonical CBOR: language-neutral, equal values give
  equal bytes.

    >>> len(sha256((b"parent", (1, 2, 3), None)))
    32
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import cbor2


def sha256(value: Any) -> bytes:
    """SHA-256 of ``pickle.dumps(value, HIGHEST_PROTOCOL)``; 32 bytes."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``value``; 32 bytes."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()
