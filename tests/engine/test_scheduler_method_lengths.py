"""``Scheduler.schedule`` stays a short narrator, and no scheduler method grows long.

Issue 34: ``schedule()`` tells one step in three parts (running requests,
waiting requests, the output), each a named method citing its vLLM lines; it
fits on one screen (at most 60 lines) and no method of ``Scheduler`` or
``AsyncScheduler`` is longer than 80 lines. A method's length here is from its
``def`` line to its last line, docstring and comments included.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLASSES = [("kvref/sched/scheduler.py", "Scheduler"),
           ("kvref/sched/async_scheduler.py", "AsyncScheduler")]
MAX_SCHEDULE_LINES = 60
MAX_METHOD_LINES = 80


def method_lengths(path: str, class_name: str) -> dict[str, int]:
    """Lines of each method of ``class_name`` in ``path`` (``def`` to last line)."""
    tree = ast.parse((ROOT / path).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {item.name: item.end_lineno - item.lineno + 1 for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    raise AssertionError(f"{path} defines no class {class_name}")


def test_method_lengths_are_measured():
    # The measure itself: a known one-line body is counted from def to its end.
    source = "class C:\n    def f(self):\n        return 1\n"
    tree = ast.parse(source)
    (method,) = tree.body[0].body
    assert method.end_lineno - method.lineno + 1 == 2
    lengths = method_lengths(*CLASSES[0])
    assert {"schedule", "__init__", "update_from_output"} <= set(lengths)


def test_schedule_fits_on_one_screen():
    n = method_lengths("kvref/sched/scheduler.py", "Scheduler")["schedule"]
    assert n <= MAX_SCHEDULE_LINES, (
        f"Scheduler.schedule is {n} lines (at most {MAX_SCHEDULE_LINES}): name the new "
        "part as a method citing its vLLM lines")


@pytest.mark.parametrize("path,class_name", CLASSES)
def test_no_scheduler_method_is_long(path, class_name):
    long = {name: n for name, n in method_lengths(path, class_name).items()
            if n > MAX_METHOD_LINES}
    assert not long, (f"{class_name} methods longer than {MAX_METHOD_LINES} lines: {long}; "
                      "split them into named steps")
