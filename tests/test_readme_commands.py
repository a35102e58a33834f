"""Every command of every README and docs page runs, as printed or in its stated cheap form.

The rules are in ``tools/readme_commands.py``: each ```bash and ```python block
of every tracked README.md and ``docs/*.md`` page runs in a subprocess, in a copy of the repository
(so files the commands write land in the copy), with this python's folder first
on PATH (so ``python3``, ``kvref`` and ``jupytext`` are the ones CI installed).
Commands too long for CI run in the cheap form ``CHEAP`` names, and the test
says so in its output; ``pip install`` lines are checked (every extra exists
and is installed here), not re-run. No block and no command is skipped. The
fresh-venv repeat, one venv per block with only the extras it names, is
``tools/readme_fresh_venv.py`` (too slow for CI).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import readme_commands as rc  # noqa: E402

BLOCKS = rc.blocks(ROOT)
COPY_IGNORE = shutil.ignore_patterns(".git", "__pycache__", ".hypothesis", ".pytest_cache",
                                     "build", "*.egg-info", "*.ipynb")


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A copy of the working tree: what a fresh clone has (untracked clutter aside)."""
    dest = tmp_path_factory.mktemp("readme") / "kvref"
    shutil.copytree(ROOT, dest, ignore=COPY_IGNORE)
    return dest


def run_block(block: rc.Block, where: Path, script: str | None = None,
              timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(where), COLUMNS="80", TERM="dumb",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
               MPLBACKEND="Agg")
    env.pop("KVREF_TUTORIAL_FIGURES", None)
    return subprocess.run(["bash", "-c", script or rc.ci_script(block)], cwd=where, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def test_the_readmes_have_command_blocks():
    names = {b.page for b in BLOCKS}
    assert {"README.md", "tutorials/README.md", "benchmarks/README.md",
            "tests/conformance/README.md"} <= names, names
    assert sum(b.lang == "python" for b in BLOCKS) >= 3


def test_the_docs_pages_commands_are_run():
    """The pages the README sends a reader to are run like the READMEs: each
    page that prints commands is found, the README's two set-up commands too."""
    names = {b.page for b in BLOCKS}
    assert {"docs/first_look.md", "docs/pictures.md", "docs/watch.md", "docs/simulate.md",
            "docs/testing.md", "docs/seeded_bugs.md", "docs/benchmarks.md"} <= names, names
    assert sum(b.page == "README.md" for b in BLOCKS) == 2
    assert sum(b.page == "docs/first_look.md" and b.lang == "python" for b in BLOCKS) == 3


def test_every_block_names_what_it_installs():
    unnamed = [b.id for b in BLOCKS if b.extras() is None]
    assert not unnamed, f"blocks that do not say what to pip install: {unnamed}"


def test_every_cheap_form_is_for_a_printed_command():
    printed = rc.printed_commands(BLOCKS)
    stale = sorted(set(rc.CHEAP) - printed)
    assert not stale, f"CHEAP entries for commands no page prints any more: {stale}"


def test_ci_runs_both_readme_set_up_commands():
    """.ci/run runs the README's two set-up commands as printed: the first in a bare
    venv (nothing installed before it: no torch), before torch goes into the test
    venv; the second last."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8").split("## Set up", 1)[1]
    first, second = [b.strip() for b in re.findall(r"```bash\n(.*?)```", readme, re.S)[:2]]
    assert (first, second) == ("python3 -m pip install -e . && kvref demo",
                               "python3 -m pip install -e '.[test]' && python3 -m pytest")
    bare = ci.index(first)
    assert ci.rindex('python3 -m venv "$BARE"', 0, bare) < bare < ci.index("pip install -q torch")
    assert ci.rstrip().endswith(second)


def files_under(where: Path) -> set[str]:
    """Every file below ``where``, relative, leaving out caches the tools write."""
    skip = {"__pycache__", ".hypothesis", ".pytest_cache"}
    return {str(path.relative_to(where)) for path in where.rglob("*")
            if path.is_file() and not skip & set(path.relative_to(where).parts)}


def not_ignored(paths: set[str]) -> list[str]:
    """The paths of ``paths`` that this repository's .gitignore does not ignore."""
    if not paths:
        return []
    done = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT,
                          input="\n".join(sorted(paths)), capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr              # 1: none ignored
    return sorted(paths - set(done.stdout.splitlines()))


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block_runs(block, clone):
    before = files_under(clone)
    result = run_block(block, clone)
    assert result.returncode == 0, (
        f"{block.id}: a README command failed (exit {result.returncode})\n"
        f"--- script\n{rc.ci_script(block)}--- stdout (end)\n{result.stdout[-3000:]}\n"
        f"--- stderr (end)\n{result.stderr[-3000:]}")
    for command in block.commands() if block.lang == "bash" else []:
        for part in command.split(" && "):
            if part.strip() in rc.CHEAP:
                print(f"{block.id}: ran the cheap form of {part.strip()!r}: "
                      f"{rc.CHEAP[part.strip()][1]}")
    # What a page's commands write goes under build/ (ignored), so that a reader's
    # clone stays clean: no trace, page or picture left in the repository.
    litter = not_ignored(files_under(clone) - before)
    assert not litter, f"{block.id}: its commands left untracked files: {litter}"


def test_a_broken_readme_command_fails(clone, tmp_path):
    """The runner is not blind: a misspelt option, a missing file and a failing
    python line each fail the block they are in."""
    for text in ("kvref demo --workload no-such-workload\n",
                 "python3 tutorials/99_no_such_lesson.py\n",
                 "kvref demo --steps 1\nkvref replay no-such-trace.json\n"):
        bad = rc.Block("README.md", 1, "bash", "python3 -m pip install -e .\n" + text)
        assert run_block(bad, clone).returncode != 0, text
    bad = rc.Block("README.md", 1, "python", "# pip install -e .\nimport kvref\n"
                   "assert kvref.KVCacheManager is None\n")
    assert run_block(bad, clone).returncode != 0
    missing_extra = rc.Block("README.md", 1, "bash", "python3 -m pip install -e '.[nope]'\n")
    result = run_block(missing_extra, clone)
    assert result.returncode != 0 and "no extra ['nope']" in result.stderr


def test_commands_hiding_in_indented_blocks_are_refused(tmp_path):
    (tmp_path / "README.md").write_text("Run it:\n\n    kvref demo\n", encoding="utf-8")
    with pytest.raises(rc.ReadmeFormatError, match="fenced ```bash block"):
        rc.blocks(tmp_path)
