"""Every tutorial runs as a script, checks every claim it makes, and opens as a notebook.

Each ``tutorials/NN_*.py`` runs in a subprocess (on CPU, and with ``--device
cuda`` when a GPU is present). It must exit 0 and end with the summary line of
``tutorials/_lesson.py``::

    LESSON 01: 21 claims checked; sites 21/21 ran: 1,2,...,21

The test finds the ``claim(`` call sites in the file itself and checks that
every one of them ran, and that the number of claims checked equals the
``✓`` lines printed: a lesson cannot pass by printing, nor by skipping a claim.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

REPO = Path(__file__).resolve().parents[2]
TUTORIALS_DIR = REPO / "tutorials"
TUTORIALS = sorted(TUTORIALS_DIR.glob("[0-9][0-9]_*.py"))
SUMMARY = re.compile(r"^LESSON (\d\d): (\d+) claims checked; sites (\d+)/(\d+) ran: ([\d,]*)$")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda",
                 marks=pytest.mark.skipif(not _cuda_available(), reason="no GPU present")),
]


def static_claim_sites(path: Path) -> int:
    """``claim(...)`` and ``x.claim(...)`` calls in the file's source."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Name) and func.id == "claim") or \
                    (isinstance(func, ast.Attribute) and func.attr == "claim"):
                count += 1
    return count


def run_script(path: Path, *args: str, extra_path: Path | None = None,
               timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a lesson as a reader would, with this checkout's kvref importable."""
    env = dict(os.environ)
    paths = [str(REPO)] + ([str(extra_path)] if extra_path else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env["MPLBACKEND"] = "Agg"
    return subprocess.run([sys.executable, str(path), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, encoding="utf-8", timeout=timeout)


def test_there_are_tutorials():
    assert TUTORIALS, f"no tutorials/NN_*.py found under {TUTORIALS_DIR}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs_and_checks_every_claim(path, device, tmp_path):
    result = run_script(path, "--device", device, "--figures", str(tmp_path))
    assert result.returncode == 0, (
        f"{path.name} --device {device} exited {result.returncode}\n"
        f"--- stdout (tail) ---\n{result.stdout[-4000:]}\n"
        f"--- stderr (tail) ---\n{result.stderr[-4000:]}")

    lines = [line for line in result.stdout.splitlines() if line.strip()]
    match = SUMMARY.match(lines[-1])
    assert match, f"{path.name}: last line is not the lesson summary: {lines[-1]!r}"
    number, checked, ran, total, ids = match.groups()
    assert number == path.name[:2]

    sites = static_claim_sites(path)
    assert sites > 0, f"{path.name} makes no claim"
    assert int(total) == sites, f"{path.name}: the helper saw {total} claim sites, the test {sites}"
    assert int(ran) == sites and ids == ",".join(str(i) for i in range(1, sites + 1)), \
        f"{path.name}: claim sites {ids} ran of 1..{sites}"
    ticks = sum(1 for line in lines if line.lstrip().startswith("✓"))
    assert int(checked) == ticks >= sites, \
        f"{path.name}: {checked} claims counted, {ticks} ✓ lines printed, {sites} sites"
    assert_prose_printed(path, result.stdout)


def _plain(text: str) -> str:
    # Rich drops inline code and emphasis marks without leaving a space ("`none`:"
    # prints "none:"), so those go; other markup becomes a space.
    text = re.sub(r"[`*]", "", text)
    return " ".join(re.sub(r"[_\[\]()#>|]", " ", text).split())


def assert_prose_printed(path, stdout: str) -> None:
    """Run as a script, a lesson prints its markdown cells: the opening words
    of every paragraph of every cell after the title appear, in order."""
    sys.path.insert(0, str(TUTORIALS_DIR))
    from _lesson import markdown_cells

    out, at = _plain(stdout), 0
    for line, text in markdown_cells(path.read_text(encoding="utf-8"))[1:]:
        for paragraph in text.split("\n\n"):
            words = _plain(paragraph).split()
            if len(words) < 6 or paragraph.lstrip().startswith(("|", "-", "*", "1.", "```")):
                continue          # tables, lists and code render differently; prose does not
            probe = " ".join(words[:4])
            found = out.find(probe, at)
            assert found >= 0, f"{path.name}: the prose of the cell at line {line} " \
                               f"({probe!r}...) is not in the output (after position {at})"
            at = found


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_opens_as_a_notebook(path):
    """jupytext reads the percent format into prose and code cells, title first."""
    notebook = jupytext.read(path)
    kinds = [cell.cell_type for cell in notebook.cells]
    assert kinds.count("markdown") >= 3 and kinds.count("code") >= 3, \
        f"{path.name}: cells {kinds}; a lesson alternates prose and code"
    first = notebook.cells[0]
    assert first.cell_type == "markdown" and \
        first.source.startswith(f"# Lesson {path.name[:2]}:"), \
        f"{path.name}: the first cell must be the markdown title '# Lesson NN: ...'"
    assert '"cells"' in jupytext.writes(notebook, fmt="ipynb")


NOTEBOOK_RUNNER = """
import os, sys, types
import jupytext
sys.modules.setdefault("ipykernel", types.ModuleType("ipykernel"))  # as under Jupyter
# The real IPython (the test extra installs it, as Jupyter does): a stand-in module
# of that name is taken for a running IPython by matplotlib, which then calls its
# get_ipython(). Only display, what a notebook would show inline, is replaced.
import IPython.display as shown
shown.display = lambda obj: print("INLINE", type(obj).__name__)
path = sys.argv[1]
os.chdir(os.path.dirname(path))
sys.path.insert(0, os.path.dirname(path))
namespace = {"__name__": "__main__"}
for cell in jupytext.read(path).cells:
    if cell.cell_type == "code":
        exec(compile(cell.source, path, "exec"), namespace)
"""


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs_cell_by_cell_as_a_notebook(path, tmp_path):
    """The code cells, run in order in one namespace the way a kernel runs them
    (notebook mode: no script arguments, no site count), check their claims."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), env_path()]),
               KVREF_TUTORIAL_FIGURES=str(tmp_path), MPLBACKEND="Agg")
    result = subprocess.run([sys.executable, "-c", NOTEBOOK_RUNNER, str(path)], cwd=REPO,
                            env=env, capture_output=True, text=True, encoding="utf-8",
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    number = path.name[:2]
    match = re.search(rf"^LESSON {number} \(notebook\): (\d+) claims checked$", result.stdout,
                      re.M)
    assert match and int(match.group(1)) >= static_claim_sites(path), result.stdout[-2000:]
    # Titled by number, as the script is; no progress-bar warning box.
    assert f"Lesson {number}: " in result.stdout.splitlines()[0] + result.stdout[:2000]
    assert "TqdmWarning" not in result.stderr and "IProgress" not in result.stderr
    if "save_figure(" in path.read_text(encoding="utf-8"):
        assert "INLINE Figure" in result.stdout, f"{path.name}: a figure not shown inline"


def env_path() -> str:
    return os.environ.get("PYTHONPATH", "")


def test_readme_lists_every_tutorial():
    readme = (TUTORIALS_DIR / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in TUTORIALS if p.name not in readme]
    assert not missing, f"tutorials/README.md does not list {missing}"


# -- the helper itself: a lesson that skips or breaks a claim must fail ----------

LESSON_HEAD = "from _lesson import claim, finish, start\nstart('test lesson')\n"


@pytest.mark.parametrize("body, expect_rc, expect_text", [
    ("for i in range(3):\n    claim(i < 3, 'in a loop')\nfinish()\n",
     0, "LESSON 98: 3 claims checked; sites 1/1 ran: 1"),
    ("claim(True, 'one')\nif False:\n    claim(True, 'never')\nfinish()\n",
     1, "claim sites never run at lines [5]"),
    ("finish()\n", 1, "0 claims checked"),
    ("claim(1 == 2, 'one is two')\nfinish()\n", 1, "ClaimFailed"),
    ("claim([0], 'a list is not a bool')\nfinish()\n", 1, "condition must be a bool"),
    ("claim(True,\n      'spans two lines')\nclaim(True, 'x')\nfinish()\n",
     0, "LESSON 98: 2 claims checked; sites 2/2 ran: 1,2"),
], ids=["loop", "skipped-site", "no-claims", "false-claim", "non-bool", "multi-line"])
def test_lesson_helper_catches_what_it_must(tmp_path, body, expect_rc, expect_text):
    script = tmp_path / "98_helper_check.py"
    script.write_text(LESSON_HEAD + body, encoding="utf-8")
    result = run_script(script, extra_path=TUTORIALS_DIR, timeout=60)
    assert result.returncode == expect_rc, result.stdout + result.stderr
    assert expect_text in result.stdout + result.stderr


def test_the_notebook_progress_bar_warning_is_silenced(tmp_path):
    """In Jupyter without ipywidgets, tqdm (imported by transformers, which the
    lessons import only after _lesson) warns 'IProgress not found' in a red box;
    _lesson filters exactly that warning."""
    code = ("import sys, warnings; sys.path.insert(0, sys.argv[1]); import _lesson\n"
            "from tqdm import TqdmWarning\nfrom tqdm.notebook import WARN_NOIPYW\n"
            "warnings.warn(WARN_NOIPYW, TqdmWarning)\n"
            "warnings.warn('IProgress is fine', TqdmWarning)\n")
    result = subprocess.run([sys.executable, "-c", code, str(TUTORIALS_DIR)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "IProgress not found" not in result.stderr and "IProgress is fine" in result.stderr


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_transformers_comes_after_lesson_helper(path):
    """``import transformers`` loads tqdm's notebook module at once, so a lesson
    must import _lesson (which filters its warning) first."""
    lines = path.read_text(encoding="utf-8").splitlines()
    first = {key: next((i for i, ln in enumerate(lines) if ln.startswith(key)), None)
             for key in ("from _lesson", "import transformers", "from transformers")}
    for key in ("import transformers", "from transformers"):
        if first[key] is not None:
            assert first["from _lesson"] is not None and first["from _lesson"] < first[key], \
                f"{path.name}: {key} at line {first[key] + 1} comes before _lesson"
