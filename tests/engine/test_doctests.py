"""The examples in the engine modules' docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["kvref.engine.core", "kvref.sched.scheduler", "kvref.worker.model_free_runner",
           "kvref.request", "kvref.sampling_params", "kvref.model_executor.model",
           "kvref.worker.gpu_model_runner", "kvref.model_executor.loader",
           "kvref.spec_decode.ngram_proposer", "kvref.config.model"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
