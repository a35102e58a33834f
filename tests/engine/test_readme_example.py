"""The docs' engine example runs as printed and prints what the page says.

The code is read from docs/first_look.md itself (the python block that builds
an ``LLM``), not copied here, so the page cannot drift from what is tested.
``tests/test_readme_commands.py`` runs it in a subprocess as well; this test
looks at what it computes.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import readme_commands  # noqa: E402


def readme_engine_example() -> str:
    found = [b.text for b in readme_commands.blocks(ROOT)
             if b.page == "docs/first_look.md" and b.lang == "python" and "LLM(" in b.text]
    assert len(found) == 1, "docs/first_look.md should have one engine example"
    return found[0]


def test_readme_example_generates_and_prints_the_pool(tmp_path, monkeypatch):
    code = readme_engine_example()
    assert "save_pretrained(" in code          # it makes its own checkpoint: nothing downloaded
    monkeypatch.chdir(tmp_path)                # build/tiny-llama lands here
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README example", "exec"), namespace)
    text = printed.getvalue()
    assert (tmp_path / "build" / "tiny-llama" / "config.json").is_file()
    assert "free queue" in text and "prompt_tokens_cached=8" in text
    assert [len(o.outputs[0].token_ids) for o in namespace["outputs"]] == [8, 8]
    assert os.path.isdir(tmp_path / "build")
