"""The examples in the engine modules' docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["kvref.engine.core", "kvref.engine.scheduler", "kvref.engine.model_free_runner",
           "kvref.engine.request", "kvref.engine.sampling_params", "kvref.engine.model",
           "kvref.engine.model_runner", "kvref.engine.loader", "kvref.engine.ngram_proposer",
           "kvref.engine.model_config"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
