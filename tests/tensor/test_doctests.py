"""The examples in the tensor modules' docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["kvref.worker.block_table", "kvref.attention.paged_attention",
           "kvref.attention.flashinfer", "kvref.attention.cascade",
           "kvref.attention.fast_paged_attention",
           "kvref.attention.mamba_state"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
