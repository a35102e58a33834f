"""Make a CPU-only Python environment in which vLLM's KV layer imports (v0.25.1 by default).

No vLLM counterpart. The benchmarks (``benchmarks/run.py``) time vLLM's own
``KVCacheManager`` beside kvref's, and recording new conformance traces needs
it too. vLLM's full install pulls a GPU stack; its KV layer needs far less.
This script makes, in TARGET:

* a venv with torch 2.13.0 (CPU) and the small packages that importing
  ``vllm.v1.core``, ``vllm.v1.request``, ``vllm.v1.kv_cache_interface`` and
  ``vllm.distributed.kv_events`` needs (the versions it was tried with);
* ``TARGET/vllm-src/vllm/``: the ``.py`` files of the vllm 0.25.1 wheel, put on
  the venv's path by a ``.pth`` file (no compiled vLLM extension is needed to
  import the KV layer);
* then it imports those modules to prove it worked.

    python3 tools/setup_vllm_venv.py /root/.cache/vllm-oracle
    python3 tools/setup_vllm_venv.py --dry-run DIR      # print the steps only
    python3 tools/setup_vllm_venv.py --wheel vllm-0.25.1-....whl DIR

``--vllm-version`` builds another listed release the same way, in a folder of
its own (kvref mirrors 0.25.1; a newer release is only for comparing, see
``tools/vllm_changes.py``)::

    python3 tools/setup_vllm_venv.py --vllm-version 0.33.0 /root/.cache/vllm-oracle-0.33.0

vLLM 0.33.0's KV layer reaches two more packages when it imports
(``fastapi``, ``partial-json-parser``); its wheel asks for torch 2.14.0, but
the KV layer imports and runs on the same torch 2.13.0 CPU build.

It needs the package registry (or a local wheel with ``--wheel``) and takes
about a minute and a half.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

VLLM_VERSION = "0.25.1"          # the release kvref mirrors: the default
TORCH = "torch==2.13.0"
# What the KV layer's imports reach, with versions known to work together.
DEPENDENCIES = [
    "numpy==2.4.6", "packaging==26.4", "regex==2026.11.19", "psutil==7.2.2", "pyzmq==27.3.0",
    "urllib3==2.8.0", "msgspec==0.23.0", "pydantic==2.14.4", "cbor2==6.3.0",
    "transformers==5.24.0", "pyyaml==6.0.4", "aiohttp==3.14.5", "requests==2.34.2",
    "openai-harmony==0.0.8", "openai==3.57.0", "pillow==13.0.0", "pybase64==1.5.1",
    "cachetools==8.0.2", "cloudpickle==3.1.3", "uvloop==0.23.0", "py-cpuinfo==9.0.0",
    "prometheus_client==0.26.0", "llguidance==1.9.1", "xgrammar==0.2.9", "einops==0.8.2",
    # tools/record_vllm_scheduler.py's n-gram profiles call vLLM's own proposer.
    "numba==0.68.1",
]
# The releases this script can build: the packages each needs beyond DEPENDENCIES.
VERSIONS = {
    "0.25.1": [],
    "0.33.0": ["fastapi==0.136.3", "partial-json-parser==0.2.1.1.post7"],
}
IMPORT_CHECK = ("import vllm.v1.core.kv_cache_manager, vllm.v1.request, "
                "vllm.v1.kv_cache_interface, vllm.distributed.kv_events, vllm.utils.hashing; "
                "print('vLLM KV layer imports from', vllm.__file__)")


def steps(target: Path, wheel: Path | None,
          version: str = VLLM_VERSION) -> list[tuple[str, object]]:
    """(what, how) for each step: how is an argv list, or a callable."""
    if version not in VERSIONS:
        raise SystemExit(f"setup_vllm_venv: vLLM {version} is not one this script builds "
                         f"(choose from {', '.join(VERSIONS)})")
    py = str(target / "bin" / "python")
    pip = [py, "-m", "pip", "--disable-pip-version-check", "-q"]
    plan: list[tuple[str, object]] = [
        ("create the venv", [sys.executable, "-m", "venv", str(target)]),
        ("install torch (CPU) and the KV layer's dependencies",
         pip + ["install", TORCH, *DEPENDENCIES, *VERSIONS[version]]),
    ]
    if wheel is None:
        plan.append((f"download the vllm {version} wheel (no dependencies)",
                     pip + ["download", "--no-deps", "-d", str(target / "wheel"),
                            f"vllm=={version}"]))
    plan.append(("unpack vllm/**/*.py into vllm-src/ and put it on the venv's path",
                 lambda: unpack(target, wheel, version)))
    plan.append(("import the KV layer", [py, "-c", IMPORT_CHECK]))
    return plan


def unpack(target: Path, wheel: Path | None, version: str = VLLM_VERSION) -> None:
    if wheel is None:
        found = sorted((target / "wheel").glob(f"vllm-{version}-*.whl"))
        if not found:
            raise SystemExit(f"no vllm-{version} wheel in {target / 'wheel'}")
        wheel = found[0]
    elif not wheel.name.startswith(f"vllm-{version}-"):
        raise SystemExit(f"setup_vllm_venv: {wheel.name} is not a vllm {version} wheel "
                         f"(--vllm-version {version})")
    dest = target / "vllm-src"
    count = 0
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                archive.extract(name, dest)
                count += 1
    print(f"  {count} files from {wheel.name}")
    site = subprocess.run([str(target / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "vllm_src.pth").write_text(f"{dest}\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="folder for the venv (created)")
    parser.add_argument("--wheel", type=Path, help="a local vllm wheel of that version to unpack")
    parser.add_argument("--vllm-version", default=VLLM_VERSION, choices=list(VERSIONS),
                        help=f"the release to build (default {VLLM_VERSION}, the one kvref "
                             "mirrors); give each its own TARGET")
    parser.add_argument("--dry-run", action="store_true", help="print the steps, do nothing")
    args = parser.parse_args(argv)
    target = args.target.resolve()
    for k, (what, how) in enumerate(steps(target, args.wheel, args.vllm_version), start=1):
        shown = " ".join(how) if isinstance(how, list) else "(in this script)"
        print(f"[{k}] {what}: {shown}", flush=True)
        if args.dry_run:
            continue
        if isinstance(how, list):
            subprocess.run(how, check=True)
        else:
            how()
    if args.dry_run:
        print(f"dry run: nothing was done; without --dry-run this builds {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
