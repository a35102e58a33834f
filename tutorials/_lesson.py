"""What every tutorial shares: arguments, printing, and claims that must all run.

No vLLM counterpart: a teaching aid. A lesson is a script in jupytext's percent
format (``# %%`` code cells, ``# %% [markdown]`` prose cells) that reads::

    from _lesson import claim, finish, section, show, start
    args = start("Blocks, the null block and the free queue")
    section("The null block")
    show(render_pool(manager))
    claim(pool.null_block.block_id == 0, "block 0 is the null block")
    finish()

and ends with one machine-readable line::

    LESSON 01: 14 claims checked; sites 9/9 ran: 1,2,3,4,5,6,7,8,9

A *site* is one ``claim(`` call in the lesson's source, numbered in source
order. ``finish()`` fails the lesson (exit 1) when it checked no claim or when
any site never ran, so a claim cannot be skipped by an ``if`` or an early
return; a claim inside a loop runs many times at one site. The tutorial test
finds the sites again on its own and compares.

Run a lesson as ``python tutorials/01_blocks_and_free_queue.py [--device cpu|cuda]
[--figures DIR] [--no-prose]``. Python puts the script's folder first on
``sys.path``, so ``import _lesson`` works from anywhere; in a notebook opened
from ``tutorials/`` it works too (there, the site check is off: a notebook has no
source file).

Run as a script, a lesson reads like its notebook: each markdown cell is printed
(rendered with ``rich``) just before the first output of the code that follows
it, so the prose, the pictures and the claims come in the notebook's order. In a
notebook, Jupyter shows the prose itself; the lesson still titles itself by its
number (found from its title among the lesson files), and ``save_figure``
shows a figure inline as well as saving it.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import warnings
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown
from rich.markup import escape
from rich.rule import Rule
from rich.text import Text

TUTORIALS_DIR = Path(__file__).resolve().parent
# Generated figures go where git ignores them unless a lesson is asked otherwise.
DEFAULT_FIGURES = TUTORIALS_DIR.parent / "build" / "tutorial-figures"
# tqdm (through transformers) warns in a notebook without ipywidgets; its progress
# bars are not part of any lesson.
warnings.filterwarnings("ignore", message="IProgress not found")
# Wide enough for a 16-block pool row when the output goes to a pipe or a file.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 110)


class ClaimFailed(AssertionError):
    """A lesson stated something its own run contradicts."""


class _State:
    """The running lesson (one per process)."""

    def __init__(self) -> None:
        self.number: str | None = None
        self.source: Path | None = None      # None in a notebook: no site check
        self.sites: list[tuple[int, int]] = []   # (first line, last line) per claim( call
        self.checked = 0
        self.sites_run: set[int] = set()
        self.prose: list[tuple[int, str]] = []   # (line, markdown) not printed yet


_state = _State()


def claim_sites(source_text: str) -> list[tuple[int, int]]:
    """Line ranges of every ``claim(...)`` call in a lesson's source, in order.

    Both ``claim(...)`` and ``something.claim(...)`` count; the test suite
    finds sites the same way on its own.
    """
    sites = []
    for node in ast.walk(ast.parse(source_text)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else \
                func.attr if isinstance(func, ast.Attribute) else None
            if name == "claim":
                sites.append((node.lineno, node.end_lineno or node.lineno))
    return sorted(sites)


def _in_notebook() -> bool:
    return "ipykernel" in sys.modules


def markdown_cells(source_text: str) -> list[tuple[int, str]]:
    """The ``# %% [markdown]`` cells of a percent-format lesson: (line of the
    cell marker, its markdown with the comment marks taken off)."""
    cells, current = [], None
    for number, line in enumerate(source_text.splitlines(), start=1):
        if line.startswith("# %%"):
            if current is not None:
                cells.append(current)
            current = (number, []) if "[markdown]" in line else None
        elif current is not None:
            if line.startswith("# ") or line == "#":
                current[1].append(line[2:])
            elif line.strip():
                current[1].append(line)
    if current is not None:
        cells.append(current)
    return [(number, "\n".join(lines).strip()) for number, lines in cells
            if "\n".join(lines).strip()]


def _lesson_line() -> int | None:
    """The line of the lesson file being run now (the innermost frame in it)."""
    if _state.source is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if Path(frame.f_code.co_filename).resolve() == _state.source:
            return frame.f_lineno
        frame = frame.f_back
    return None


def _print_prose(upto: int | None = None) -> None:
    """Print the markdown cells above line ``upto`` (all with None) not printed yet."""
    while _state.prose and (upto is None or _state.prose[0][0] < upto):
        _, text = _state.prose.pop(0)
        console.print()
        console.print(Markdown(text))


def number_of(title: str) -> str:
    """A lesson's number from its title: the NN of the ``NN_*.py`` lesson file
    whose ``start(...)`` call has this title (a notebook knows no file name)."""
    for path in sorted(TUTORIALS_DIR.glob("[0-9][0-9]_*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "start" and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == title):
                return path.name[:2]
    return "notebook"

def start(title: str, *, uses_tensors: bool = False,
          argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the lesson's arguments, print its title, return the arguments.

    ``--device cpu|cuda`` (default cpu) picks where tensors live; lessons with
    ``uses_tensors=False`` accept it and say it changes nothing. ``--figures
    DIR`` is where plots go (default ``$KVREF_TUTORIAL_FIGURES``, else
    ``build/tutorial-figures``, which git ignores). ``--no-prose`` leaves the
    markdown cells out of a script's output. In a notebook the kernel's
    arguments are ignored.
    """
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    parser = argparse.ArgumentParser(description=title)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where tensors live (lessons without tensors ignore it)")
    figures = os.environ.get("KVREF_TUTORIAL_FIGURES") or DEFAULT_FIGURES
    parser.add_argument("--figures", type=Path, default=Path(figures),
                        help="folder for the plots a lesson draws (default: "
                             "$KVREF_TUTORIAL_FIGURES, else build/tutorial-figures; "
                             "tutorials/figures holds the copies the README links)")
    parser.add_argument("--no-prose", action="store_true",
                        help="print only the pictures and claims, not the markdown cells")
    if argv is None:
        # A notebook kernel's own arguments are not ours.
        argv = [] if _in_notebook() else sys.argv[1:]
    args = parser.parse_args(argv)

    if main_file and Path(main_file).is_file() and not _in_notebook():
        _state.source = Path(main_file).resolve()
        _state.sites = claim_sites(_state.source.read_text(encoding="utf-8"))
        stem = _state.source.name
        _state.number = stem[:2] if stem[:2].isdigit() else stem
        if not args.no_prose:
            _state.prose = markdown_cells(_state.source.read_text(encoding="utf-8"))
    else:
        _state.number = number_of(title)

    if args.device == "cuda":
        if uses_tensors:
            import torch  # only tensor lessons pay for the import
            if not torch.cuda.is_available():
                parser.error("--device cuda: torch.cuda.is_available() is False here")
        else:
            console.print("[dim](this lesson touches no tensors: --device cuda changes "
                          "nothing)[/dim]")
    console.print(Rule(f"[bold]Lesson {_state.number}: {escape(title)}[/bold]"))
    if _state.prose and _state.prose[0][1].startswith("# "):
        # The title cell's heading is the rule just printed; its paragraphs follow.
        line, text = _state.prose[0]
        _state.prose[0] = (line, text.split("\n", 1)[1].strip() if "\n" in text else "")
        if not _state.prose[0][1]:
            _state.prose.pop(0)
    _print_prose(_lesson_line())
    return args


def section(title: str) -> None:
    """A step of the lesson: a heading in the output."""
    _print_prose(_lesson_line())
    console.print()
    console.print(Rule(escape(title), style="cyan", align="left"))


def show(*renderables) -> None:
    """Print text or any ``rich`` renderable (``kvref.viz`` pictures, tables).

    Strings print as they are: ``[1, 2]`` is a list, not ``rich`` markup."""
    _print_prose(_lesson_line())
    console.print(*[Text(r) if isinstance(r, str) else r for r in renderables])


def _site_of_caller(depth: int) -> int | None:
    """The 1-based site of the ``claim(`` call ``depth`` frames up, or None
    when the lesson has no source file (a notebook)."""
    if _state.source is None:
        return None
    frame = sys._getframe(depth + 1)
    caller = Path(frame.f_code.co_filename).resolve()
    if caller != _state.source:
        raise RuntimeError(f"claim() called from {caller}; claims belong in the lesson "
                           f"file {_state.source} so that their sites can be counted")
    line = frame.f_lineno
    # The innermost call whose lines hold the current line.
    matches = [i for i, (first, last) in enumerate(_state.sites, start=1)
               if first <= line <= last]
    if not matches:
        raise RuntimeError(f"claim() at line {line} of {caller.name} is not a claim( "
                           "call the site scan found; call claim(...) by that name")
    return max(matches, key=lambda i: _state.sites[i - 1][0])


def claim(condition: bool, text: str) -> None:
    """Assert ``condition`` and print ``✓ text``; ``ClaimFailed`` if it is false.

    ``condition`` must be a real ``bool`` (``torch.equal``, ``==``, ``all(...)``),
    not a list or a tensor whose truth would be decided implicitly.
    """
    if _state.number is None:
        raise RuntimeError("call start(...) before claim(...)")
    if type(condition).__name__ not in ("bool", "bool_"):
        raise TypeError(f"claim({text!r}): condition must be a bool, got "
                        f"{type(condition).__name__}; compare explicitly")
    site = _site_of_caller(1)
    _print_prose(_lesson_line())
    if not condition:
        console.print(f"[bold red]✗ {escape(text)}[/bold red]")
        raise ClaimFailed(f"lesson {_state.number}, claim site {site}: {text}")
    _state.checked += 1
    if site is not None:
        _state.sites_run.add(site)
    # One line per claim, never wrapped: the test counts the ✓ lines.
    console.print(f"[green]✓[/green] {escape(text)}", soft_wrap=True)


def tiny_llama(seed: int = 0):
    """The lessons' model: a 2-layer Llama (96 tokens, 4 heads over 2 KV heads)
    with random weights of a wide spread, so greedy decoding does not repeat
    one token (which would make equal outputs meaningless). Imports
    ``transformers`` only when called: most lessons need no model."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.3, attn_implementation="eager",
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def figure_path(args: argparse.Namespace, name: str) -> Path:
    """Where to save the figure ``name`` (the folder is created)."""
    args.figures.mkdir(parents=True, exist_ok=True)
    return args.figures / name


def save_figure(args: argparse.Namespace, fig, name: str) -> Path:
    """Save a matplotlib figure under ``--figures``; in a notebook also show it
    inline. The figure is closed after. Returns the file's path."""
    path = figure_path(args, name)
    fig.savefig(path, dpi=110)
    if _in_notebook():
        try:
            from IPython.display import display
        except ImportError:
            pass
        else:
            display(fig)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def finish() -> None:
    """Print the summary line; exit 1 if no claim ran or a claim site never ran."""
    _print_prose()
    console.print()
    if _state.source is None:
        where = "notebook" if _state.number == "notebook" else f"{_state.number} (notebook)"
        console.print(f"LESSON {where}: {_state.checked} claims checked")
        if _state.checked == 0:
            raise ClaimFailed("the lesson checked no claim")
        return
    ran = sorted(_state.sites_run)
    # Plain print: the test reads this line and rich could wrap it.
    print(f"LESSON {_state.number}: {_state.checked} claims checked; "
          f"sites {len(ran)}/{len(_state.sites)} ran: {','.join(map(str, ran))}",
          flush=True)
    missing = sorted(set(range(1, len(_state.sites) + 1)) - _state.sites_run)
    if _state.checked == 0 or missing:
        lines = [_state.sites[i - 1][0] for i in missing]
        print(f"lesson {_state.number} FAILED: {_state.checked} claims checked; "
              f"claim sites never run at lines {lines}", file=sys.stderr)
        sys.exit(1)


__all__ = ["ClaimFailed", "claim", "claim_sites", "console", "figure_path", "finish",
           "markdown_cells", "number_of", "save_figure", "section", "show", "start"]
