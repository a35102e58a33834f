"""The package layout is the map of vLLM: no import cycles, every module says what it mirrors.

A reader opens ``kvref/core/block_pool.py`` next to ``vllm/v1/core/block_pool.py``;
these tests keep that promise true as files move.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "kvref"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """kvref modules ``path`` imports anywhere in its text (function bodies too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvref"):
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if f"{node.module}.{a.name}" in known)
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
    return found & known


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge of a depth-first search, as the cycle it closes."""
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_package_import_graph_has_no_cycles():
    modules = _modules()
    graph = {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}
    # ``from kvref import X`` inside a submodule goes through the package's
    # __init__, which must then not import that submodule back: a real cycle.
    assert import_cycles(graph) == []


def imports_torch(path: pathlib.Path) -> bool:
    """Whether a module's text imports torch anywhere (a function body too)."""
    tree = ast.parse(path.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module}
    return "torch" in names


# Torch lives only here: the tensor side, the model, the programs that run it,
# and one function of the trace replayer (traces with prompt embeddings).
TORCH_SIDE = ("kvref.attention", "kvref.worker.block_table", "kvref.worker.gpu_model_runner",
              "kvref.model_executor", "kvref.entrypoints", "kvref.distributed",
              "kvref.verify.trace_replay")


def test_torch_is_imported_only_on_the_tensor_side():
    """The core, the vocabulary, the scheduler, the step loop, the model-free
    runner and the pictures are pure Python: not even a function imports torch."""
    strays = [name for name, path in _modules().items()
              if not name.startswith(TORCH_SIDE) and imports_torch(path)]
    assert strays == [], f"{strays} import torch; only {TORCH_SIDE} may"


def test_the_scheduling_side_imports_without_torch():
    code = ("import sys, kvref, kvref.engine, kvref.sched.scheduler, kvref.sched.utils, "
            "kvref.worker.model_free_runner, kvref.spec_decode.ngram_proposer, "
            "kvref.config.model, kvref.worker; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(n for n in _modules() if n.startswith("kvref.core.")))
def test_core_module_names_the_vllm_file_it_mirrors(name):
    path = _modules()[name]
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    expected = "vllm/v1/core/" + path.name
    assert expected in doc, f"{path} should say in its docstring that it mirrors {expected}"


# -- one formula per fact -------------------------------------------------------

REPO = PACKAGE.parent
SOURCE_DIRS = ("kvref", "tests", "tutorials", "benchmarks", "tools")


def _repo_sources() -> list[pathlib.Path]:
    return sorted(p for d in SOURCE_DIRS for p in (REPO / d).rglob("*.py"))


def ceil_divisions(tree: ast.AST) -> list[int]:
    """Lines that spell a ceiling division out: ``-(-a // b)``, ``-(a // -b)``,
    ``math.ceil(a / b)`` (``cdiv`` is the one spelling)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and \
                isinstance(node.operand, ast.BinOp) and \
                isinstance(node.operand.op, ast.FloorDiv) and any(
                    isinstance(side, ast.UnaryOp) and isinstance(side.op, ast.USub)
                    for side in (node.operand.left, node.operand.right)):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and len(node.args) == 1 and \
                isinstance(node.args[0], ast.BinOp) and isinstance(node.args[0].op, ast.Div):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "ceil":
                found.append(node.lineno)
    return found


def test_the_ceil_division_finder_finds_every_spelling():
    tree = ast.parse("a = -(-n // b)\nb = -(n // -b)\nc = math.ceil(n / b)\n"
                     "d = ceil(n / b)\ne = -(n // b)\nf = cdiv(n, b)\n")
    assert ceil_divisions(tree) == [1, 2, 3, 4]


def test_cdiv_is_defined_once_and_never_spelled_out():
    definitions, spelled = [], []
    for path in _repo_sources():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        rel = path.relative_to(REPO).as_posix()
        definitions += [rel for node in ast.walk(tree)
                        if isinstance(node, ast.FunctionDef) and node.name == "cdiv"]
        # tools/ scripts also run in vLLM's own environment, where kvref may not import.
        if rel != "kvref/math_utils.py" and not rel.startswith("tools/"):
            spelled += [f"{rel}:{line}" for line in ceil_divisions(tree)]
    assert definitions == ["kvref/math_utils.py"]
    assert spelled == [], "use kvref.math_utils.cdiv"


# -- what the core may import -----------------------------------------------------

CORE_ORDER = ["kvref.core.kv_cache_manager", "kvref.core.kv_cache_coordinator",
              "kvref.core.single_type_kv_cache_manager", "kvref.core.block_pool",
              "kvref.core.kv_cache_utils"]
# kvref.kv_cache_spec_registry: the spec -> manager table kv_cache_interface consults.
VOCABULARY = {"kvref.kv_cache_interface", "kvref.request", "kvref.kv_events", "kvref.stats",
              "kvref.hashing", "kvref.math_utils", "kvref.kv_cache_spec_registry",
              "kvref.sampling_params", "kvref.outputs"}
_DYNAMIC_IMPORTERS = {"import_module", "__import__"}


def kvref_imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """The kvref modules a module's text imports, wherever the import sits (a
    function body, ``if TYPE_CHECKING:``): ``from kvref.x import y`` -> ``kvref.x``,
    relative imports resolved against ``module``'s name, and the string handed
    to ``importlib.import_module`` or ``__import__``. ``from kvref import X``
    counts as ``kvref`` itself: the package, which imports everything."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
                found.update([name] if node.module else
                             [f"{name}.{a.name}" for a in node.names])
            elif node.module and node.module.split(".")[0] == "kvref":
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "kvref")
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _DYNAMIC_IMPORTERS and node.args[0].value.split(".")[0] == "kvref":
                found.add(node.args[0].value)
    return found


def _kvref_imports(name: str, path: pathlib.Path) -> set[str]:
    return kvref_imports(path.read_text(), name, is_package=path.name == "__init__.py")


def test_the_import_finder_sees_imports_that_climb_inside_functions():
    source = ("from kvref.core.block_pool import BlockPool\n"
              "def check(self):\n"
              "    from kvref.verify.invariants import check_block_pool\n"
              "    from ..verify import invariants\n"
              "    from . import kv_cache_utils\n"
              "    import kvref.sched.scheduler\n"
              "    importlib.import_module('kvref.viz.explain')\n"
              "    __import__('kvref.cli')\n"
              "    from kvref import KVCacheManager\n")
    assert kvref_imports(source, "kvref.core.kv_cache_manager") == {
        "kvref.core.block_pool", "kvref.verify.invariants", "kvref.verify",
        "kvref.core.kv_cache_utils", "kvref.sched.scheduler", "kvref.viz.explain",
        "kvref.cli", "kvref"}
    assert kvref_imports("from . import block_pool\nfrom .. import stats\n", "kvref.core",
                         is_package=True) == {"kvref.core.block_pool", "kvref.stats"}


def test_core_imports_only_down_the_core_and_the_vocabulary():
    """No import climbs the house: the core reads only what is below it (its own
    later modules and the vocabulary), never what reads it (``kvref.verify``, the
    engine, viz, the package ``kvref`` itself), not even inside a function."""
    modules = _modules()
    assert sorted(CORE_ORDER) == sorted(n for n in modules if n.startswith("kvref.core."))
    for i, name in enumerate(CORE_ORDER):
        allowed = set(CORE_ORDER[i + 1:]) | VOCABULARY
        stray = _kvref_imports(name, modules[name]) - allowed
        assert not stray, f"{name} imports {sorted(stray)}; the core imports only down " \
                          f"{CORE_ORDER} and {sorted(VOCABULARY)}"
    stray = _kvref_imports("kvref.core", modules["kvref.core"]) - set(CORE_ORDER) - VOCABULARY
    assert not stray, f"kvref/core/__init__.py imports {sorted(stray)}"
    for name in VOCABULARY:
        stray = _kvref_imports(name, modules[name]) - VOCABULARY
        assert not stray, f"{name} is vocabulary: it imports only other vocabulary " \
                          f"modules, never the core or anything above it ({sorted(stray)})"


# -- private stays private ----------------------------------------------------------

def private_imports(tree: ast.AST, folder: pathlib.Path) -> list[str]:
    """``from module import _name`` where the module is ours (``kvref``, a relative
    import, or a file next to the importer): a private helper used outside its
    module. (tools/ may reach into vLLM's privates: that is vLLM's code.)"""
    def ours(node: ast.ImportFrom) -> bool:
        top = (node.module or "").split(".")[0]
        return node.level > 0 or top == "kvref" or (folder / f"{top}.py").exists()

    return [a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and ours(node)
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_the_private_import_finder_finds_one():
    tree = ast.parse("from kvref.attention.paged_attention import _as_ints, attend\n"
                     "from __future__ import annotations\nfrom _lesson import claim\n"
                     "from vllm.v1.spec_decode.ngram_proposer import _private\n")
    assert private_imports(tree, REPO / "tutorials") == ["_as_ints"]


def test_no_underscore_name_is_imported_across_modules():
    found = [f"{p.relative_to(REPO).as_posix()}: {name}" for p in _repo_sources()
             for name in private_imports(ast.parse(p.read_text(encoding="utf-8")), p.parent)]
    assert found == [], "a helper another module needs is public (drop the underscore)"


# -- the map: README's layout table is the tree ---------------------------------------

# Folders that mirror a vLLM folder, and the top-level vocabulary: every module
# here has a row in README's table.
MAPPED = ("kvref.core.", "kvref.sched.", "kvref.worker.", "kvref.engine.", "kvref.entrypoints.",
          "kvref.model_executor.", "kvref.spec_decode.", "kvref.config.")
MAP_ROW = re.compile(r"^\| `(kvref/[\w/]+\.py)` \| (?:`(vllm/[\w/]+\.py)`|—) \|", re.M)


def readme_map() -> dict[str, str | None]:
    """README's layout table: kvref file -> the vLLM file it mirrors (None: none)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return {m.group(1): m.group(2) for m in MAP_ROW.finditer(text)}


def test_the_map_parser_reads_both_kinds_of_row():
    text = ("| `kvref/sched/utils.py` | `vllm/v1/core/sched/utils.py` | `check_stop` |\n"
            "| `kvref/worker/model_free_runner.py` | — | no model |\n"
            "| `kvref/a.py`, `b.py` | `vllm/a.py` | two files: not a map row |\n")
    assert {m.group(1): m.group(2) for m in MAP_ROW.finditer(text)} == {
        "kvref/sched/utils.py": "vllm/v1/core/sched/utils.py",
        "kvref/worker/model_free_runner.py": None}


def _mapped_files() -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for name, p in _modules().items()
                  if p.name != "__init__.py" and (name.startswith(MAPPED) or name in VOCABULARY))


def test_every_engine_and_core_module_has_a_row_in_the_map():
    table = readme_map()
    missing = [f for f in _mapped_files() if f not in table]
    assert missing == [], f"README's layout table has no row for {missing}"
    gone = [f for f in table if not (REPO / f).is_file()]
    assert gone == [], f"README's layout table names files that do not exist: {gone}"


@pytest.mark.parametrize("rel", _mapped_files())
def test_each_module_names_its_vllm_file_and_sits_in_its_folder(rel):
    vllm_file = readme_map().get(rel, "")
    doc = ast.get_docstring(ast.parse((REPO / rel).read_text(encoding="utf-8"))) or ""
    if vllm_file is None:
        assert "No vLLM counterpart" in doc, f"{rel} should say it has no vLLM counterpart"
        return
    assert vllm_file, f"README's layout table has no row for {rel}"
    assert vllm_file in doc, f"{rel} should name {vllm_file} in its docstring"
    folders = pathlib.PurePosixPath(rel).parts[1:-1]
    if folders:   # the top-level vocabulary sits outside vLLM's folders, as the table says
        assert folders[0] in pathlib.PurePosixPath(vllm_file).parts, \
            f"{rel} sits in kvref/{folders[0]}/, but {vllm_file} is in no such folder"


# -- the floors: no import climbs the house ---------------------------------------------

FLOORS = [
    ("the vocabulary", lambda n: n in VOCABULARY),
    ("the KV layer", lambda n: n == "kvref" or n == "kvref.core" or n.startswith("kvref.core.")),
    ("connectors, attention, config, proposer",
     lambda n: n.startswith(("kvref.distributed", "kvref.attention", "kvref.config",
                             "kvref.spec_decode"))),
    ("the scheduler and the model",
     lambda n: n.startswith(("kvref.sched", "kvref.model_executor"))),
    ("the worker", lambda n: n.startswith("kvref.worker")),
    ("the engine", lambda n: n.startswith("kvref.engine")),
    ("the entry points", lambda n: n.startswith("kvref.entrypoints")),
]
# The one import that runs up a floor on purpose: ``from kvref.engine import LLM``
# keeps working, fetched lazily from the entry points (``kvref/engine/__init__.py``).
HANDED_DOWN = {("kvref.engine", "kvref.entrypoints")}


def floor_of(module: str) -> int:
    """The floor a module lives on; kvref's own tools (verify, viz, ...) are the roof."""
    return next((i for i, (_, on) in enumerate(FLOORS) if on(module)), len(FLOORS))


def test_the_floors_put_each_layer_where_the_map_says():
    assert [floor_of(n) for n in ("kvref.request", "kvref", "kvref.core.block_pool",
                                  "kvref.distributed.kv_transfer.kv_connector.v1.base",
                                  "kvref.sched.scheduler", "kvref.worker.gpu_model_runner",
                                  "kvref.engine.core", "kvref.entrypoints.llm",
                                  "kvref.viz.explain")] == [0, 1, 1, 2, 3, 4, 5, 6, 7]


def test_no_import_climbs_the_house():
    """A module imports only from its own floor or below, anywhere in its text."""
    climbs = []
    for name, path in _modules().items():
        for target in _kvref_imports(name, path):
            if floor_of(target) > floor_of(name) and (name, target) not in HANDED_DOWN:
                climbs.append(f"{name} (floor {floor_of(name)}) imports {target} "
                              f"(floor {floor_of(target)})")
    assert climbs == [], "\n".join(climbs)


def test_the_handed_down_name_is_fetched_lazily():
    """``kvref.engine`` reaches the entry points only inside ``__getattr__``."""
    tree = ast.parse((PACKAGE / "engine" / "__init__.py").read_text())
    top_level = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith("kvref.entrypoints") for m in top_level)
