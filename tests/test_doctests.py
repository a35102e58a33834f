"""The examples in docstrings and in ``specs/`` run as tests, so they cannot drift.

Every ``>>>`` example of the torch-free package (``kvref/*.py``, ``kvref/core``,
``kvref/verify``) and of the spec pages (``specs/*.md``) runs under plain
``python -m pytest``; a wrong number in an example fails here.
"""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvref"
MODULE_FILES = sorted([*PACKAGE.glob("*.py"), *(PACKAGE / "core").glob("*.py"),
                       *(PACKAGE / "verify").glob("*.py")])
SPEC_PAGES = sorted((ROOT / "specs").glob("*.md"))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# Pages whose worked numbers are the point: they must hold examples.
MUST_HAVE_EXAMPLES = {"kvref/kv_cache_interface.py", "kvref/core/kv_cache_utils.py",
                      "kvref/core/kv_cache_manager.py", "specs/capacity.md"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", MODULE_FILES, ids=_rel)
def test_module_examples_hold(path):
    module = importlib.import_module(_module_name(path))
    result = doctest.testmod(module, optionflags=FLAGS, verbose=False)
    assert result.failed == 0, f"{result.failed} example(s) in {_rel(path)} failed (see above)"
    if _rel(path) in MUST_HAVE_EXAMPLES:
        assert result.attempted > 0, f"{_rel(path)} lost its examples"


@pytest.mark.parametrize("path", SPEC_PAGES, ids=_rel)
def test_spec_page_examples_hold(path):
    result = doctest.testfile(str(path), module_relative=False, optionflags=FLAGS,
                              verbose=False)
    assert result.failed == 0, f"{result.failed} example(s) in {_rel(path)} failed (see above)"
    if _rel(path) in MUST_HAVE_EXAMPLES:
        assert result.attempted > 0, f"{_rel(path)} lost its examples"


def test_a_wrong_number_in_an_example_fails():
    """The runner above really compares outputs: a capacity example with a
    wrong answer is reported as a failure, not skipped."""
    wrong = '''
    >>> from kvref import FullAttentionSpec
    >>> FullAttentionSpec(16).max_num_blocks_per_request(max_model_len=1000)
    64
    '''
    test = doctest.DocTestParser().get_doctest(wrong, {}, "wrong", "wrong.md", 0)
    runner = doctest.DocTestRunner(optionflags=FLAGS, verbose=False)
    runner.run(test, out=lambda _text: None)
    assert runner.summarize(verbose=False) == doctest.TestResults(failed=1, attempted=2)
