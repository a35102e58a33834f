"""Every README and docs-page block in a fresh clone and a fresh venv with only what it names.

No vLLM counterpart. ``tests/test_readme_commands.py`` runs every command of
every README and ``docs/*.md`` page in CI's environment, where ``.[test]``
(everything) is installed; that cannot show that a block which says
``pip install -e '.[tutorials]'`` works with the tutorials extra alone. This
script can: for each command block (``tools/readme_commands.py`` finds them,
with the same cheap forms of the long commands) it

1. clones the repository's committed ``HEAD`` into a temporary folder,
2. makes a new venv (no system site packages) for the install the block
   names; blocks naming the same install (``.``, ``.[test]``, ...) share that
   venv, each in its own fresh clone (``--venv-per-block`` makes one per
   block: with torch in most of them, hours on a busy 2-core machine),
3. for a python block, installs what its first comment names; a bash block's
   own ``pip install`` line runs as printed (in a shared venv it re-points the
   editable install at the block's clone),
4. runs the block in the clone with the venv first on PATH,

and prints one line per block (passed or failed, seconds) and a table at the
end. Too slow for CI (tens of minutes).

    python3 tools/readme_fresh_venv.py                  # every block
    python3 tools/readme_fresh_venv.py -k tutorials     # blocks whose id contains it
    python3 tools/readme_fresh_venv.py --list           # blocks and what each installs
    python3 tools/readme_fresh_venv.py --json build/fresh-venv.json

Exit status 0 only if every selected block passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import readme_commands as rc  # noqa: E402

ROOT = rc.ROOT


def run_in_fresh_venv(block: rc.Block, keep: bool = False, timeout: int = 3600,
                      venv: Path | None = None) -> dict:
    """Clone, venv (``venv``: an existing one to reuse), install, run; the outcome."""
    work = Path(tempfile.mkdtemp(prefix="kvref-fresh-"))
    started = time.monotonic()
    log: list[str] = []

    def step(argv, cwd, env=None) -> bool:
        result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                                stdin=subprocess.DEVNULL, timeout=timeout)
        log.append(f"$ {' '.join(map(str, argv))[:300]}\n{result.stdout[-4000:]}"
                   f"{result.stderr[-4000:]}")
        return result.returncode == 0

    clone = work / "kvref"
    ok = step(["git", "clone", "-q", str(ROOT), str(clone)], work)
    made = venv is None or not (venv / "bin" / "python3").exists()
    venv = venv or work / "venv"
    if made:
        ok = ok and step([sys.executable, "-m", "venv", str(venv)], work)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV",
                                                             "KVREF_TUTORIAL_FIGURES")}
    env.update(PATH=os.pathsep.join([str(venv / "bin"), env.get("PATH", "")]),
               VIRTUAL_ENV=str(venv), COLUMNS="80", TERM="dumb", MPLBACKEND="Agg")
    python = str(venv / "bin" / "python3")
    if made:
        ok = ok and step([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], clone, env)
    extras = block.extras()
    if ok and block.lang == "python":
        spec = "." if not extras else f".[{','.join(extras)}]"
        ok = step([python, "-m", "pip", "install", "-q", "-e", spec], clone, env)
    setup_s = time.monotonic() - started
    if ok:
        ok = step(["bash", "-c", rc.fresh_script(block)], clone, env)
    outcome = {"block": block.id, "installs": "." if not extras else f".[{','.join(extras)}]",
               "passed": ok, "seconds": round(time.monotonic() - started, 1),
               "setup_seconds": round(setup_s, 1), "new_venv": made}
    if not ok:
        outcome["log"] = "\n".join(log)[-8000:]
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        outcome["folder"] = str(work)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="select", default="", help="only block ids containing this")
    parser.add_argument("--list", action="store_true", help="list the blocks and exit")
    parser.add_argument("--keep", action="store_true", help="keep each clone and venv")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    parser.add_argument("--venv-per-block", action="store_true",
                        help="a new venv for every block, not one per distinct install")
    args = parser.parse_args(argv)
    chosen = [b for b in rc.blocks(ROOT) if args.select in b.id]
    if not chosen:
        print(f"no README block id contains {args.select!r}", file=sys.stderr)
        return 2
    if args.list:
        for block in chosen:
            extras = block.extras()
            print(f"{block.id:34s} {block.lang:7s} installs "
                  + ("." if not extras else f".[{','.join(extras)}]"))
        return 0
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        print("note: uncommitted changes are not in the clone (it is made from HEAD)",
              file=sys.stderr)
    outcomes = []
    venvs_dir = Path(tempfile.mkdtemp(prefix="kvref-fresh-venvs-"))
    for block in chosen:
        extras = block.extras()
        key = "base" if not extras else "-".join(extras)
        shared = None if args.venv_per_block else venvs_dir / key
        outcome = run_in_fresh_venv(block, keep=args.keep, venv=shared)
        outcomes.append(outcome)
        print(f"{'PASS' if outcome['passed'] else 'FAIL'}  {outcome['block']:34s} "
              f"{outcome['installs']:14s} {outcome['seconds']:7.1f} s "
              f"(clone + {'new venv + ' if outcome['new_venv'] else ''}install "
              f"{outcome['setup_seconds']:.1f} s)", flush=True)
        if not outcome["passed"]:
            print(outcome["log"], file=sys.stderr)
    if not args.keep:
        shutil.rmtree(venvs_dir, ignore_errors=True)
    passed = sum(o["passed"] for o in outcomes)
    print(f"\n{passed} of {len(outcomes)} README blocks passed in a fresh venv each, "
          f"{sum(o['seconds'] for o in outcomes) / 60:.1f} minutes in all")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(outcomes, indent=1), encoding="utf-8")
    return 0 if passed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
