"""The benchmark harness's kvref side runs, and runs the right calls (no timing checked).

``benchmarks/`` is not a package: its scripts put themselves on ``sys.path``,
and so does this test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import replay  # noqa: E402
import scaling  # noqa: E402
import sides  # noqa: E402

TRACE = ROOT / "tests" / "conformance" / "traces" / "mamba_align" / \
    "mamba_align-public-00001.json.gz"


def test_replay_makes_every_call_and_raises_where_vllm_raised():
    trace = replay.load_trace(TRACE)
    wall, cpu, ops, raised = replay.time_trace(sides.get_side("kvref"), trace)
    assert ops == len(trace["ops"])
    assert raised == sum(1 for op in trace["ops"] if "raises" in (op.get("expect") or {}))
    assert wall >= 0 and cpu >= 0


def test_replayed_calls_leave_the_pool_as_vllm_left_it():
    trace = replay.load_trace(TRACE)
    built = sides.get_side("kvref").from_header(trace["header"])
    calls = replay.compile_calls(trace["ops"], built)
    built.pin_none_hash()
    replay.run_calls(calls)
    last_state = [op["expect"]["state"] for op in trace["ops"]
                  if "state" in (op.get("expect") or {})][-1]
    free = [b.block_id for b in built.manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert free == last_state["free"]


def test_scaling_workload_returns_every_block():
    side = sides.get_side("kvref")
    result = scaling.per_call_cost(side, num_blocks=1000, num_requests=80)
    assert set(result["per_call"]) == {"get_computed_blocks", "allocate_slots", "free"}
    assert result["num_free_after"] == 1000 - 1
    assert scaling.bytes_per_block(side, 1000) > 0


def test_worker_answers_a_traces_request():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "worker.py"), "kvref"],
        input=json.dumps({"cmd": "traces", "cls": "full", "passes": 1}) + "\n",
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    hello, answer = map(json.loads, proc.stdout.splitlines())
    assert hello["ready"] and answer["ops"] > 0, proc.stderr


def test_runner_runs_every_kvref_section_on_a_small_setting(tmp_path, capsys):
    import run
    out = tmp_path / "results.json"
    assert run.main(["traces", "ops", "scaling", "--no-vllm", "--classes", "cross_attention",
                     "--repeats", "1", "--passes", "1", "--sizes", "1000,2000",
                     "--requests", "64", "--json", str(out), "--markdown",
                     str(tmp_path / "tables.md"), "--plot", str(tmp_path / "plot.png")]) == 0
    results = json.loads(out.read_text())
    assert results["traces"]["calls"]["cross_attention"]["ops"] > 0
    assert set(results["scaling"]["kvref"]) == {"1000", "2000"}
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert "cross_attention" in capsys.readouterr().out


def test_a_section_missing_its_dependency_says_so_and_the_others_still_report(tmp_path):
    """hypothesis hidden: the state-machine section is skipped with the module's name,
    the traces section still prints its table, the run exits 0."""
    script = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'hypothesis':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import run\n"
        "sys.exit(run.main(['statemachine', 'traces', '--no-vllm', '--classes', "
        "'cross_attention', '--repeats', '1', '--passes', '1', '--modes', 'calls']))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "statemachine: skipped: needs the 'hypothesis' module" in proc.stdout
    assert "| cross_attention |" in proc.stdout
    assert "traces ok, statemachine skipped: needs the 'hypothesis' module" in proc.stdout


def test_a_failing_section_is_reported_and_the_run_exits_1(monkeypatch, capsys):
    import run

    def broken(*args, **kwargs):
        raise RuntimeError("a broken section")

    monkeypatch.setattr(run, "run_statemachine_section", broken)
    assert run.main(["statemachine", "traces", "--no-vllm", "--classes", "cross_attention",
                     "--repeats", "1", "--passes", "1", "--modes", "calls"]) == 1
    out = capsys.readouterr().out
    assert "statemachine: failed: RuntimeError: a broken section" in out
    assert "| cross_attention |" in out


def test_the_default_outputs_are_untracked():
    """Nothing tracked is rewritten unless asked: the default plot lies under a
    git-ignored folder, and tables and JSON are written only when named."""
    import run
    args = run.build_parser().parse_args([])
    assert args.json is None and args.markdown is None
    ignored = [line.strip().rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()]
    assert args.plot.parent.relative_to(ROOT).as_posix() in ignored


def test_one_process_alternates_both_sides_over_every_trace(monkeypatch):
    import one_process
    timed = []

    def fake_time_trace(side, trace, prebuild):
        timed.append((side, trace["header"]["name"], prebuild))
        return 0.0, {"a": 1.0, "b": 2.0}[side], 0, 0

    monkeypatch.setattr(one_process.replay, "time_trace", fake_time_trace)
    traces = [{"header": {"name": n}} for n in ("t0", "t1")]
    runs = one_process.compare("a", "b", traces, repeats=2, prebuild=True)
    assert runs == {"a": [2.0, 2.0], "b": [4.0, 4.0]}
    # Trace by trace, each on both sides; side A first in run 0, side B in run 1.
    assert timed == [("a", "t0", True), ("b", "t0", True), ("a", "t1", True),
                     ("b", "t1", True), ("b", "t0", True), ("a", "t0", True),
                     ("b", "t1", True), ("a", "t1", True)]


def test_one_process_runs_kvref_against_itself(capsys):
    import one_process
    assert one_process.main(["--sides", "kvref,kvref", "--classes", "cross_attention",
                             "--modes", "prebuilt", "--repeats", "1"]) == 0
    line = capsys.readouterr().out.splitlines()[-1].split()
    assert line[:2] == ["cross_attention", "prebuilt"] and float(line[2]) > 0


def test_one_process_without_vllm_says_which_python_to_use(capsys):
    import one_process
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert one_process.main(["--classes", "full", "--repeats", "1"]) == 2
        assert "vLLM's python" in capsys.readouterr().err
    else:  # vLLM importable here: the two sides build and the run reports
        assert one_process.main(["--classes", "cross_attention", "--modes", "prebuilt",
                                 "--repeats", "1"]) == 0


def test_the_engines_take_turns_to_go_first():
    # By path: under the whole suite, the name ``engine`` is tests/engine.
    import importlib.util
    spec = importlib.util.spec_from_file_location("benchmarks_engine",
                                                  ROOT / "benchmarks" / "engine.py")
    engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine)
    orders = [engine.turn_order(list(engine.ENGINES), r) for r in range(6)]
    assert orders[0] == ["kvref", "generate", "generate_batch"]
    assert orders[1] == ["generate", "generate_batch", "kvref"]
    assert orders[3] == orders[0]
    assert all(sorted(o) == sorted(engine.ENGINES) for o in orders)
    assert {o[0] for o in orders[:3]} == set(engine.ENGINES)


def test_startup_times_every_command_and_its_floors(tmp_path):
    out = tmp_path / "startup.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "startup.py"), "--repeats",
                           "1", "--no-torch", "--json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seconds = json.loads(out.read_text())["seconds"]
    assert {"kvref --version", "kvref --help", "python -c pass (floor)"} <= set(seconds)
    assert all(len(samples) == 1 for samples in seconds.values())
