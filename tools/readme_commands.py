"""Every command printed in a README or a docs page, run as printed (or in a stated cheap form).

No vLLM counterpart: the project's promise to a newcomer. Every ```bash and
```python block of every tracked ``README.md`` and of every tracked page
``docs/*.md`` (the pages the top README links, where most commands live) is a
list of commands someone will paste. ``tests/test_readme_commands.py`` runs them all in CI's
environment; ``tools/readme_fresh_venv.py`` repeats them block by block, each
in a fresh clone and a fresh venv that installs only what the block names.

The rules, which both runners share:

* A command block is a fenced block labelled ``bash`` or ``python``. Other
  fenced blocks (``text``, unlabelled trees and tables) are not commands, and a
  line that looks like a command outside a command block is an error, so a
  command cannot hide in prose formatting.
* Every command block names what it needs installed: a ``pip install -e .`` or
  ``pip install -e '.[EXTRA,...]'`` line (in a python block, as its first
  comment). ``extras_of`` reads it; the fresh-venv runner installs exactly that.
* A command too long for CI (the full test suite, the 50-minute seeded-bug
  run, the deep Hypothesis profile, the full benchmark) has an entry in
  ``CHEAP``: the same program run on a small part of its work, and why. The
  entry is keyed by the command exactly as printed, so a page edit that
  changes such a command makes the test fail until the entry follows; an
  entry no page prints any more fails too. Nothing is skipped.
* In CI, a ``pip install`` line is not re-run (CI installed ``.[test]`` before
  the tests): ``check-install`` checks that every extra it names exists in
  ``pyproject.toml`` and that each of its requirements is installed here.

    python3 tools/readme_commands.py list                 # every block, what runs
    python3 tools/readme_commands.py check-install '.[engine]'
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND_LANGS = {"bash": "bash", "python": "python"}
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
INSTALL = re.compile(r"pip install -e (?P<q>'?)\.(?:\[(?P<extras>[\w,-]+)\])?(?P=q)(?=\s|$)")
LOOKS_LIKE_A_COMMAND = re.compile(r"^(?: {4}|\t)\s*(?:python3?|pip|kvref|pytest|jupytext|"
                                  r"jupyter|bash|gzip) ")
COMMENT = re.compile(r"\s+#.*$")

# command as printed (without its trailing comment) -> (what CI runs instead, why)
CHEAP: dict[str, tuple[str, str]] = {
    "python3 -m pytest": (
        "python3 -m pytest --collect-only -q",
        "the whole suite is what CI itself runs (.ci/run runs exactly this command, and "
        "this test is part of that run); here every test module must import and collect"),
    "python3 -m pytest tests/conformance": (
        "python3 -m pytest -q tests/conformance -k swa",
        "the classes named swa of the 254 traces; the full run is part of CI's suite"),
    "python3 -m pytest tests/stateful --hypothesis-profile=deep": (
        "python3 -m pytest -q tests/stateful --hypothesis-profile=deep "
        "-k 'gappy and full and not hybrid'",
        "the deep profile on one property (seconds); on every machine it takes tens of "
        "minutes"),
    "python3 -m pytest tests/tutorials": (
        "python3 -m pytest -q tests/tutorials -k 01_blocks",
        "lesson 01 as a script and as a notebook; every lesson runs in CI's suite"),
    "python3 tools/seeded_bugs.py": (
        "python3 tools/seeded_bugs.py -k hit-cap-off-by-one -- -k test_hit_search_properties",
        "one bug of the catalogue against the hit-search properties alone (under a minute) "
        "instead of every bug against the whole stateful suite (about 50 minutes)"),
    "python3 tools/seeded_bugs.py --catalogue tensor-engine -j 1": (
        "python3 tools/seeded_bugs.py --catalogue tensor-engine -k ngram-latest-copy "
        "-- -k test_drawn_token_lists_follow_the_spec",
        "one bug of the tensor/engine catalogue against the n-gram proposer's spec property "
        "alone (about a minute) instead of every bug against tests/tensor and tests/engine "
        "(about 45 minutes)"),
    "python3 tools/seeded_bugs.py --catalogue connector -j 1": (
        "python3 tools/seeded_bugs.py --catalogue connector -k fail-policy-inverted "
        "-- -k test_recompute_goes_back_to_the_first_failed_block",
        "one bug of the connector catalogue against one connector-path test (under a "
        "minute) instead of every bug against tests/engine and tests/distributed (about "
        "15 minutes)"),
    "python3 tools/seeded_bugs.py -k swa": (
        "python3 tools/seeded_bugs.py -k swa-run-too-short -- -k test_hit_search_properties",
        "one of the swa bugs, against the hit-search properties alone"),
    "python3 benchmarks/run.py": (
        "python3 benchmarks/run.py traces --classes full --repeats 1 --passes 1 --no-vllm",
        "one trace class, one run of one pass, kvref alone (the full run takes minutes and "
        "times vLLM too)"),
    "python3 benchmarks/run.py traces scaling": (
        "python3 benchmarks/run.py traces scaling --classes full --repeats 1 --passes 1 "
        "--sizes 1000 --requests 40 --no-vllm --plot build/readme-scaling.png",
        "both sections on one class and one small pool; the plot goes to an ignored path"),
    "python3 benchmarks/run.py --no-vllm": (
        "python3 benchmarks/run.py traces --no-vllm --classes swa --repeats 1 --passes 1",
        "kvref alone on one class of the traces section"),
    "python3 benchmarks/run.py ops --classes mamba_align": (
        "python3 benchmarks/run.py ops --classes mamba_align --passes 1 --no-vllm",
        "one pass, kvref alone"),
    "python3 tools/setup_vllm_venv.py /root/.cache/vllm-oracle": (
        "python3 tools/setup_vllm_venv.py --dry-run build/vllm-venv",
        "building vLLM's environment downloads a wheel and torch; the dry run prints every "
        "step it would take"),
    "python3 tools/vllm_machines.py": (
        "python3 tools/vllm_machines.py -- -q tests/stateful/test_free_queue_machine.py",
        "one machine on vLLM's KV layer (seconds); every machine on it is "
        "tests/on_vllm/test_machines_on_vllm.py's, in CI's suite"),
    "python3 tools/vllm_seeded_bugs.py": (
        "python3 tools/vllm_seeded_bugs.py -k hit-cap-off-by-one -j 1",
        "one bug through all four checks (about a minute) instead of 34 (about 20 minutes)"),
    "python3 benchmarks/simulate_vs_vllm.py": (
        "python3 benchmarks/simulate_vs_vllm.py --max-requests 20 --max-output-tokens 8 "
        "--kvref-only",
        "20 requests, kvref alone: the whole trace takes tens of minutes and vLLM's side "
        "needs the oracle environment"),
    "python3 benchmarks/simulate_curve.py": (
        "python3 benchmarks/simulate_curve.py --trace synthetic --max-requests 60 "
        "--workers 1 --out build/readme-simulate-curve",
        "60 requests of the synthetic trace, written to an ignored path (the whole "
        "conversation trace takes tens of minutes on 2 cores)"),
    "python3 tools/readme_fresh_venv.py": (
        "python3 tools/readme_fresh_venv.py --list",
        "the fresh-venv run builds one venv per block (tens of minutes); --list shows the "
        "blocks and what each installs"),
}


@dataclass
class Block:
    page: str              # path relative to the repository root
    line: int              # line of the opening fence, 1-based
    lang: str              # "bash" or "python"
    text: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def commands(self) -> list[str]:
        """The block's commands without their trailing comments (bash) or the
        whole program (python)."""
        if self.lang == "python":
            return [self.text]
        return [c for c in (COMMENT.sub("", ln).strip() for ln in self.text.splitlines()) if c]

    def extras(self) -> list[str] | None:
        """What the block says to install: [] for ``pip install -e .``, the
        extras for ``.[a,b]``, None if it names nothing."""
        match = INSTALL.search(self.text)
        if match is None:
            return None
        return [e for e in (match.group("extras") or "").split(",") if e]


def is_page(rel: str) -> bool:
    """A README.md anywhere, or a markdown page directly under docs/."""
    parts = rel.split("/")
    return parts[-1] == "README.md" or (len(parts) == 2 and parts[0] == "docs"
                                        and parts[1].endswith(".md"))


def pages(root: Path = ROOT) -> list[Path]:
    """The tracked pages whose commands run: every README.md and every
    ``docs/*.md`` (without git: every such file under root)."""
    try:
        out = subprocess.run(["git", "ls-files", "*README.md", "README.md", "docs/*.md"],
                             cwd=root, capture_output=True, text=True, check=True).stdout
        paths = sorted({root / p for p in out.split() if is_page(p)})
        if paths:
            return paths
    except (OSError, subprocess.CalledProcessError):
        pass
    return sorted(p for p in root.rglob("*.md")
                  if is_page(p.relative_to(root).as_posix())
                  and not any(part.startswith(".") or part in ("build", "node_modules")
                              for part in p.relative_to(root).parts))


class ReadmeFormatError(ValueError):
    """A page's commands are not where the runners can find them."""


def blocks(root: Path = ROOT) -> list[Block]:
    """Every command block of every page (``pages``), in file order."""
    found = []
    for path in pages(root):
        rel = path.relative_to(root).as_posix()
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if fence is None:
                if LOOKS_LIKE_A_COMMAND.match(lines[i]):
                    raise ReadmeFormatError(
                        f"{rel}:{i + 1}: {lines[i].strip()!r} looks like a command in an "
                        "indented block; put commands in a fenced ```bash block")
                i += 1
                continue
            start, lang = i, fence.group(2)
            i += 1
            body = []
            while i < len(lines) and not FENCE.match(lines[i]):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ReadmeFormatError(f"{rel}:{start + 1}: a code block is never closed")
            i += 1
            if lang in COMMAND_LANGS:
                found.append(Block(rel, start + 1, lang, "\n".join(body) + "\n"))
            elif lang in ("sh", "shell", "console", "py", "python3"):
                raise ReadmeFormatError(f"{rel}:{start + 1}: label command blocks ```bash or "
                                        f"```python (found ```{lang})")
    return found


def is_install(command: str) -> bool:
    return INSTALL.search(command) is not None


def ci_script(block: Block) -> str:
    """The bash script CI runs for a block: every command as printed, except
    the ``CHEAP`` ones (replaced, and said so) and ``pip install`` (checked)."""
    out = ["set -euo pipefail"]
    if block.lang == "python":
        extras = block.extras()
        spec = "." if not extras else f".[{','.join(extras)}]"
        out.append(f"python3 tools/readme_commands.py check-install '{spec}'")
        out.append("python3 - <<'KVREF_README_PYTHON'\n" + block.text + "KVREF_README_PYTHON")
        return "\n".join(out) + "\n"
    for command in block.commands():
        for part in command.split(" && "):
            part = part.strip()
            if is_install(part):
                match = INSTALL.search(part)
                spec = "." + (f"[{match.group('extras')}]" if match.group("extras") else "")
                out.append(f"python3 tools/readme_commands.py check-install '{spec}'")
            elif part in CHEAP:
                cheap, _why = CHEAP[part]
                out.append(f"echo '[cheap form of: {part}]' >&2")
                out.append(cheap)
            else:
                out.append(part)
    return "\n".join(out) + "\n"


def fresh_script(block: Block) -> str:
    """The script for a fresh venv: installs run for real, CHEAP still applies."""
    out = ["set -euo pipefail"]
    if block.lang == "python":
        out.append("python3 - <<'KVREF_README_PYTHON'\n" + block.text + "KVREF_README_PYTHON")
        return "\n".join(out) + "\n"
    for command in block.commands():
        parts = [p.strip() for p in command.split(" && ")]
        out.append(" && ".join(CHEAP[p][0] if p in CHEAP else p for p in parts))
    return "\n".join(out) + "\n"


def printed_commands(found: list[Block]) -> set[str]:
    return {part.strip() for b in found if b.lang == "bash" for c in b.commands()
            for part in c.split(" && ")}


# -- check-install ------------------------------------------------------------------


def _requirements(extras: list[str]) -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:          # python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"check-install: pyproject.toml has no extra {unknown}; "
                         f"extras: {', '.join(sorted(optional))}")
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        reqs += optional[extra]
    return reqs


def check_install(spec: str) -> int:
    """Every requirement of ``.`` or ``.[extras]`` is installed in this python."""
    from importlib.metadata import PackageNotFoundError, version

    match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", spec.strip("'\""))
    if match is None:
        raise SystemExit(f"check-install: expected . or .[extra,...], got {spec!r}")
    extras = [e for e in (match.group(1) or "").split(",") if e]
    missing = []
    for req in _requirements(extras):
        name = re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0]
        try:
            have = version(name)
        except PackageNotFoundError:
            missing.append(f"{req} (not installed)")
            continue
        pin = re.search(r"==\s*([\w.]+)", req)
        if pin and not (have == pin.group(1) or have.startswith(pin.group(1) + "+")):
            missing.append(f"{req} (found {have})")
    if missing:
        print(f"check-install {spec}: " + "; ".join(missing), file=sys.stderr)
        return 1
    print(f"check-install {spec}: every requirement is installed")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check-install"] and len(argv) == 2:
        return check_install(argv[1])
    if argv == ["list"]:
        for block in blocks():
            extras = block.extras()
            named = "NOTHING" if extras is None else (".[" + ",".join(extras) + "]"
                                                      if extras else ".")
            print(f"{block.id}  {block.lang}  installs {named}")
            for command in block.commands() if block.lang == "bash" else ["<python program>"]:
                cheap = CHEAP.get(command)
                print(f"    {command}" + (f"\n      CI runs: {cheap[0]}" if cheap else ""))
        return 0
    print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
    print("usage: readme_commands.py list | check-install SPEC", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
