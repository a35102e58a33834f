"""Integer helpers shared by every layer: ``cdiv``, the one ceiling division.

Mirrors ``vllm/utils/math_utils.py``. Blocks for ``n`` tokens are always
``cdiv(n, block_size)``, never spelled out again::

    >>> cdiv(9, 4), cdiv(8, 4), cdiv(0, 4)
    (3, 2, 0)
"""

from __future__ import annotations

__all__ = ["cdiv"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division: ``a / b`` rounded up (blocks needed for ``a`` tokens of ``b``)."""
    return -(a // -b)
