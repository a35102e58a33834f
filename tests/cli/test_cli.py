"""The kvref command end to end, in a subprocess: exit codes, --help, every bad input."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ["demo", "viz", "record", "explain", "replay"]


def kvref(*args, stdin: str = "", cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="80", TERM="dumb")
    return subprocess.run([sys.executable, "-m", "kvref.cli", *map(str, args)],
                          input=stdin, capture_output=True, text=True, env=env,
                          cwd=cwd or ROOT, timeout=120)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "pressure.json"
    result = kvref("record", "--workload", "pressure", "--steps", "20", "-o", path)
    assert result.returncode == 0, result.stderr
    assert f"wrote {path}:" in result.stdout
    return path


def test_help_on_everything():
    top = kvref("--help")
    assert top.returncode == 0 and all(cmd in top.stdout for cmd in SUBCOMMANDS)
    for cmd in SUBCOMMANDS:
        result = kvref(cmd, "--help")
        assert result.returncode == 0 and result.stdout.startswith(f"usage: kvref {cmd}")


def test_demo_without_animation_ends_with_the_summary():
    result = kvref("demo", "--no-animate")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "kvref demo: prefix-caching" in out and "step 8/8" in out
    assert "plays no role" in out                            # the fixed step-5 story
    for figure in ("vLLM's hit rate", "served from the cache, once per request", "evicted",
                   "preemptions"):
        assert figure in out


def test_demo_of_a_workload_for_a_few_steps():
    result = kvref("demo", "--workload", "hybrid", "--steps", "3")    # not a terminal: plain
    assert result.returncode == 0, result.stderr
    assert "step 2/2" in result.stdout and "g1 window 8" in result.stdout


def test_record_then_replay_has_no_divergence(recorded):
    result = kvref("replay", recorded, "--check-invariants")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("1 trace replayed, " + str(len(json.loads(
        recorded.read_text())["ops"])) + " ops, 0 divergent traces")


def test_replay_reports_a_divergence_with_exit_1(recorded, tmp_path):
    trace = json.loads(recorded.read_text())
    op = next(op for op in trace["ops"] if op["op"] == "usage" or "state" in op["expect"])
    op["expect"]["state"] = {"nfree": -1, "free": [], "ref": [], "hashed": []}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(trace))
    result = kvref("replay", bad)
    assert result.returncode == 1 and "DIVERGENCE" in result.stdout


def test_viz_steps_through_a_trace_with_typed_commands(recorded):
    result = kvref("viz", recorded, stdin="n\nn\np\nj 5\nq\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    positions = [line.split(": step ")[1].split(",")[0] for line in out.splitlines()
                 if ": step " in line and "/19" in line]
    assert positions == ["0/19", "1/19", "2/19", "1/19", "5/19"]


def test_viz_export_writes_an_svg_of_the_grid(recorded, tmp_path):
    svg = tmp_path / "frame.svg"
    result = kvref("viz", recorded, "--step", "6", "--export", svg)
    assert result.returncode == 0, result.stderr
    text = svg.read_text()
    assert text.startswith("<svg") and "free queue" in text.replace("&#160;", " ")
    assert "◉" in text and "evictable" in text


def test_viz_no_interactive_prints_the_frame_asked_for(recorded):
    result = kvref("viz", recorded, "--op", "40", "--no-interactive")
    assert result.returncode == 0, result.stderr
    assert ", op 40/" in result.stdout and "free queue" in result.stdout


def test_viz_export_html_is_the_player_of_the_whole_trace(tmp_path):
    html = tmp_path / "player.html"
    result = kvref("viz", "--workload", "prefix-caching", "--op", "30", "--export", html)
    assert result.returncode == 0, result.stderr
    text = html.read_text()
    assert "<html" in text.lower() and "kvref player: kvref-prefix-caching" in text
    assert '"start":30' in text and text.count('"take_events"') >= 9    # every op is in it
    assert "a player of 58 ops" in " ".join(result.stdout.split())  # rich wraps long paths
    assert result.stdout.strip().endswith("op 30)")


def test_explain_an_op(recorded):
    trace = json.loads(recorded.read_text())
    refused = [i for i, op in enumerate(trace["ops"]) if op["op"] == "allocate_slots"
               and op["expect"].get("ret", 1) is None]
    # An admission refused by the full-sequence gate, and a running request's refusal.
    gated = next(i for i in refused if trace["ops"][i].get("full_sequence_must_fit"))
    result = kvref("explain", recorded, "--op", gated)
    assert result.returncode == 0, result.stderr
    assert "full-sequence gate" in result.stdout
    i = next(i for i in refused if not trace["ops"][i].get("full_sequence_must_fit"))
    result = kvref("explain", recorded, "--op", i)
    assert result.returncode == 0, result.stderr
    assert "REFUSED by the capacity gate" in result.stdout


def _bad_files(tmp_path, recorded):
    missing = tmp_path / "missing.json"
    truncated = tmp_path / "truncated.json.gz"
    data = gzip.compress(recorded.read_bytes())
    truncated.write_bytes(data[: len(data) // 2])
    cut = tmp_path / "cut.json"
    cut.write_text(recorded.read_text()[:500])
    notjson = tmp_path / "notjson.json"
    notjson.write_text("this is not json\n")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"format": "otherformat/3", "ops": []}))
    bogus = tmp_path / "bogus.json"
    trace = json.loads(recorded.read_text())
    trace["ops"].insert(3, {"op": "bogus", "expect": {}})
    bogus.write_text(json.dumps(trace))
    return {"missing": (missing, "no such file"), "unknown op": (bogus, "unknown op 'bogus'"), "truncated gzip": (truncated, "cannot read"),
            "truncated json": (cut, "not valid JSON"), "not json": (notjson, "not valid JSON"),
            "wrong format": (wrong, "not a kvtrace/1 trace")}


BAD_CASES = ["missing", "truncated gzip", "truncated json", "not json", "wrong format",
             "unknown op"]


@pytest.mark.parametrize("command", ["viz", "explain", "replay"])
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_trace_files_exit_2_with_one_line(tmp_path, recorded, command, case):
    path, reason = _bad_files(tmp_path, recorded)[case]
    args = [command, path] + (["--op", "5"] if command == "explain" else [])
    result = kvref(*args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and reason in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, reason", [
    (["demo", "--workload", "nope"], "unknown workload 'nope'"),
    (["record", "--workload", "nope", "-o", "x.json"], "unknown workload 'nope'"),
    (["viz", "--workload", "nope"], "unknown workload 'nope'"),
    (["explain", "TRACE", "--op", "99999"], "op 99999 is out of range"),
    (["explain", "TRACE", "--op", "-3"], "op -3 is out of range"),
    (["explain", "TRACE", "--op", "x"], "invalid int value: 'x'"),
    (["explain", "TRACE"], "the following arguments are required: --op"),
    (["viz", "TRACE", "--op", "99999"], "no op 99999"),
    (["viz", "TRACE", "--step", "500"], "no step 500"),
    (["viz", "TRACE", "--export", "out.png"], "must end in .svg or .html"),
    (["viz"], "give a TRACE file or --workload"),
    (["viz", "TRACE", "--steps", "3"], "--steps applies to --workload only"),
    (["demo", "--steps", "0"], "--steps must be at least 1"),
    (["demo", "--pause", "-1"], "--pause must be >= 0"),
    (["record", "--workload", "chat", "-o", "/nonexistent-dir/x.json"], "cannot write"),
    (["record", "--workload", "chat", "-o", "x.svg"], "-o must end in .json or .json.gz"),
    (["record", "--workload", "chat", "-o", "x.html"], "kvref viz --workload chat --export"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["replay", "/nonexistent-dir/"], "no such file"),
])
def test_bad_arguments_exit_2_with_one_line(recorded, args, reason):
    result = kvref(*[recorded if a == "TRACE" else a for a in args])
    assert result.returncode == 2, result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert reason in result.stderr and "Traceback" not in result.stderr


def test_version_and_python_dash_m():
    from kvref import __version__

    assert kvref("--version").stdout.strip().startswith(f"kvref {__version__} ")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "kvref", "--version"], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith(f"kvref {__version__} ")
    result = subprocess.run([sys.executable, "-m", "kvref", "demo", "--steps", "1"],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert result.returncode == 0 and "kvref demo: prefix-caching" in result.stdout


def test_record_refuses_an_output_name_it_would_not_honour(tmp_path):
    result = kvref("record", "--workload", "chat", "-o", tmp_path / "x.svg")
    assert result.returncode == 2 and not (tmp_path / "x.svg").exists()


def test_replay_of_a_folder_reports_every_file_and_goes_on(tmp_path, recorded):
    folder = tmp_path / "mixed"
    folder.mkdir()
    bad = _bad_files(tmp_path, recorded)
    for case in ("truncated json", "not json", "wrong format", "unknown op"):
        src = bad[case][0]
        (folder / ("bad-" + case.replace(" ", "-") + ".json")).write_bytes(src.read_bytes())
    (folder / "good-a.json").write_bytes(recorded.read_bytes())
    (folder / "good-z.json").write_bytes(recorded.read_bytes())
    result = kvref("replay", folder)
    assert result.returncode == 2
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 4 and all(line.startswith("error: ") for line in errors)
    for case in ("truncated json", "not json", "wrong format", "unknown op"):
        assert any(bad[case][1] in line for line in errors), case
    ops = len(json.loads(recorded.read_text())["ops"])
    assert " ".join(result.stdout.split()).endswith(
        f"2 traces replayed, {2 * ops} ops, 0 divergent traces; 4 files could not be "
        "replayed (listed on stderr)")


def test_replay_of_a_folder_skips_the_projects_other_formats_with_a_note(tmp_path, recorded):
    """tests/conformance holds blockpooltrace/1 files beside kvtrace/1 ones: replaying
    the folder skips them, says what replays them, and exits 0 when nothing diverged."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "good.json").write_bytes(recorded.read_bytes())
    for i in range(2):
        (folder / f"pool-{i}.json").write_text(json.dumps({"format": "blockpooltrace/1",
                                                           "vllm": "0.25.1", "ops": []}))
    result = kvref("replay", folder)
    assert result.returncode == 0, result.stdout + result.stderr
    out = " ".join(result.stdout.split())
    assert "1 trace replayed" in out and "0 divergent traces" in out
    assert ("skipped 2 files of format blockpooltrace/1 (not kvtrace/1; "
            "tests/conformance/test_block_pool_traces.py replays them)") in out
    assert result.stderr == ""
    alone = kvref("replay", folder / "pool-0.json")          # nothing to replay: bad input
    assert alone.returncode == 2 and "no kvtrace/1 traces under" in alone.stderr


def test_replay_of_the_conformance_folder_exits_0():
    """The folder a reader finds first holds three formats; none is an error."""
    result = kvref("replay", ROOT / "tests" / "conformance")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "0 divergent traces" in " ".join(result.stdout.split())


def _diverging_copy(recorded, tmp_path):
    trace = json.loads(recorded.read_text())
    i = next(i for i, op in enumerate(trace["ops"]) if op["op"] == "allocate_slots"
             and op["expect"].get("ret"))
    trace["ops"][i]["expect"]["ret"] = [[999]]
    path = tmp_path / "diverging.json"
    path.write_text(json.dumps(trace))
    return path, i


def test_viz_and_explain_warn_when_the_recorded_answers_differ(recorded, tmp_path):
    path, i = _diverging_copy(recorded, tmp_path)
    later = kvref("viz", path, "--op", i + 1)
    assert later.returncode == 0
    assert later.stderr.startswith("warning: kvref viz: this trace's recorded answers differ")
    assert f"op #{i} allocate_slots" in later.stderr and f"from op {i} on" in later.stderr
    exp = kvref("explain", path, "--op", i)
    assert exp.returncode == 0 and "warning: kvref explain" in exp.stderr
    svg = tmp_path / "d.svg"
    assert "warning: kvref viz" in kvref("viz", path, "--export", svg).stderr
    # A trace whose recorded answers are kvref's: not a word.
    assert kvref("viz", recorded, "--op", i + 1).stderr == ""
    assert kvref("explain", recorded, "--op", i).stderr == ""
