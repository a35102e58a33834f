"""``kvref watch`` against vLLM 0.25.1's own KV events, over real ZMQ sockets.

``recorded/vllm_kv_events.json.gz`` holds the frames vLLM's ``ZmqEventPublisher``
sent for two workloads on vLLM's ``KVCacheManager`` (``tools/record_vllm_kv_events.py``,
run in the oracle environment), with vLLM's pool index and its
``get_computed_blocks`` answers at checkpoints. These tests send the frames byte
for byte over loopback sockets to a watcher and require its index and answers to
be vLLM's. ``test_live_vllm_publisher`` runs vLLM's publisher itself where the
oracle environment exists. Every loop here has a deadline: no test waits forever.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import msgspec  # noqa: E402
import zmq  # noqa: E402  (in the test extra: CI installs it)

from kvref.watch import (PrefixCacheIndex, WatchError, Watcher, decode_message,  # noqa: E402
                         server_binds, watcher_address)

ROOT = Path(__file__).resolve().parents[2]
RECORDED = json.loads(gzip.decompress(
    (Path(__file__).parent / "recorded/vllm_kv_events.json.gz").read_bytes()))
ORACLE = Path("/root/.cache/vllm-oracle/bin/python")
DEADLINE_S = 60              # only a failing test waits this long


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def frames_of(workload: str) -> list[list[bytes]]:
    return [[bytes.fromhex(part) for part in frame]
            for frame in RECORDED["workloads"][workload]["frames"]]


def sender(address: str, watcher: Watcher | None = None):
    """An XPUB socket connected to ``address`` that has seen the watcher's
    subscription, so nothing sent is lost to ZMQ's slow-joiner window. A SUB
    socket handles a new peer (and sends it its subscription) only inside a call
    on it: an in-process ``watcher`` is polled meanwhile."""
    pub = zmq.Context.instance().socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(address)
    wait_for_subscription(pub, watcher)
    return pub


def wait_for_subscription(pub, watcher: Watcher | None) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not pub.poll(50):
        assert time.monotonic() < deadline, "the watcher never subscribed"
        if watcher is not None:
            watcher.poll(0)
    assert pub.recv()[:1] == b"\x01"


def drain(watcher: Watcher, until_seq: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while (watcher.next_seq or 0) <= until_seq and time.monotonic() < deadline:
        watcher.poll(0.2)
    assert watcher.next_seq == until_seq + 1, f"stuck at seq {watcher.next_seq}"


def pool_index(checkpoint: dict) -> Counter:
    return Counter({(g, h): n for g, h, n in checkpoint["index"]})


def as_recorded(blocks: Counter) -> Counter:
    """The watcher's index with 32-byte hashes written as hex, as the file writes them."""
    return Counter({(g, h.hex() if isinstance(h, bytes) else h): n
                    for (g, h), n in blocks.items()})


@pytest.mark.parametrize("workload", ["full", "hybrid", "swa", "bytes-hashes"])
def test_the_watchers_index_is_vllms_pool_and_it_answers_as_vllm_does(workload):
    recorded = RECORDED["workloads"][workload]
    frames, port = frames_of(workload), free_port()
    # vLLM given tcp://127.0.0.1:PORT connects (kv_events.py:400-401): the watcher binds.
    with Watcher(f"tcp://127.0.0.1:{port}") as watcher:
        assert watcher.binds
        pub = sender(f"tcp://127.0.0.1:{port}", watcher)
        sent = 0
        probes_checked = []
        for checkpoint in recorded["checkpoints"]:
            while sent <= checkpoint["after_seq"]:
                pub.send_multipart(frames[sent])
                sent += 1
            drain(watcher, checkpoint["after_seq"])
            assert as_recorded(watcher.index.blocks) == pool_index(checkpoint), \
                f"index differs from vLLM's pool after batch {checkpoint['after_seq']}"
            for prompt, vllm_hit in checkpoint["probes"]:
                assert watcher.index.query(prompt).hit_tokens == vllm_hit, prompt
                probes_checked.append(vllm_hit)
        for frame in frames[sent:]:
            pub.send_multipart(frame)
        drain(watcher, len(frames) - 1)
        pub.close(0)
        assert watcher.missed == 0 and watcher.batches == len(frames)
        counts = watcher.index.counts
    # The workload is not trivial: evictions, a reset, hits and misses of many lengths.
    assert counts["BlockRemoved"] > 0 and counts["AllBlocksCleared"] == 1
    assert 0 in probes_checked and len(set(probes_checked)) >= 5
    assert any(n > 1 for c in recorded["checkpoints"] for _, _, n in c["index"])  # copies
    if workload == "hybrid":
        assert watcher.index.sparse_stores > 0    # Mamba align stores (lesson 11's defect)
    hash_types = {type(h) for _, h in watcher.index.blocks}
    assert hash_types == ({bytes} if workload == "bytes-hashes" else {int})


def test_a_server_that_binds_is_reached_by_connecting(tmp_path):
    # vLLM binds ipc:// endpoints (kv_events.py:396): the watcher connects.
    endpoint = f"ipc://{tmp_path}/kv-events"
    frames = frames_of("full")[:10]
    context = zmq.Context.instance()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    with Watcher(endpoint) as watcher:
        assert not watcher.binds
        wait_for_subscription(pub, watcher)
        for frame in frames:
            pub.send_multipart(frame)
        drain(watcher, 9)
        assert watcher.batches == 10
    pub.close(0)


def test_a_late_watcher_counts_the_batches_it_never_saw():
    port = free_port()
    frames = frames_of("full")
    with Watcher(f"tcp://127.0.0.1:{port}") as watcher:
        pub = sender(f"tcp://127.0.0.1:{port}", watcher)
        for frame in frames[5:12]:
            pub.send_multipart(frame)
        drain(watcher, 11)
        assert (watcher.first_seq, watcher.missed, watcher.batches) == (5, 5, 7)
        pub.close(0)


def test_a_duplicate_batch_is_applied_once_and_a_restarted_server_starts_a_new_index():
    frames = frames_of("full")
    index_once = PrefixCacheIndex()
    for frame in frames[:3]:
        for event in decode_message(frame).events:
            index_once.apply(event)
    port = free_port()
    with Watcher(f"tcp://127.0.0.1:{port}") as watcher:
        pub = sender(f"tcp://127.0.0.1:{port}", watcher)
        for frame in [frames[0], frames[1], frames[1], frames[0], frames[2]]:
            pub.send_multipart(frame)
        drain(watcher, 2)
        assert watcher.index.blocks == index_once.blocks and watcher.batches == 3
        assert watcher.restarts == []
        # A new server process: its publisher counts from 0 again, at a later time.
        seq, ts, events, rank = decode_message(frames[0])
        restarted = msgspec.msgpack.encode([ts + 60, [], rank])
        pub.send_multipart([b"", (0).to_bytes(8, "big"), restarted])
        deadline = time.monotonic() + DEADLINE_S
        while not watcher.restarts and time.monotonic() < deadline:
            watcher.poll(0.2)
        assert len(watcher.restarts) == 1 and watcher.next_seq == 1
        assert not watcher.index.blocks and watcher.missed == 0
        pub.close(0)


# -- the command --------------------------------------------------------------------


def kvref(*args, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100", TERM="dumb")
    return subprocess.Popen([sys.executable, "-m", "kvref.cli", *map(str, args)], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def finish(process, timeout=120):
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"kvref watch did not stop in {timeout} s: {err}")
    return process.returncode, out, err


def test_with_no_server_it_says_listening_and_that_the_replay_socket_is_silent():
    """A SUB socket connects whether or not a server is there, so until a batch
    arrives the picture says "listening to", not "connected to"; a replay socket
    that never answered is named, with what to check."""
    port, replay_port = free_port(), free_port()
    process = kvref("watch", f"tcp://*:{port}", "--replay", f"tcp://*:{replay_port}",
                    "--duration", 0.5)          # vLLM would bind both: the watcher connects
    code, out, err = finish(process)
    assert code == 0, err
    flat = " ".join(out.split())
    assert f"connecting to tcp://127.0.0.1:{port}" in flat
    assert "0 batches from this server" in flat and "connected to" not in flat
    assert (f"the replay socket tcp://127.0.0.1:{replay_port} has not answered: is the server "
            "up, and is that its replay_endpoint?") in flat


def test_one_batch_is_one_batch_not_one_batches():
    port = free_port()
    process = kvref("watch", f"tcp://127.0.0.1:{port}", "--batches", 1, "--duration", 60)
    pub = sender(f"tcp://127.0.0.1:{port}")
    pub.send_multipart(frames_of("full")[0])
    code, out, err = finish(process)
    pub.close(0)
    assert code == 0, err
    assert f"bound at tcp://127.0.0.1:{port}, vLLM connected" in out
    assert "this server: 1 batch (seq 0..0)" in out


def test_the_command_answers_queries_from_vllms_events(tmp_path):
    recorded = RECORDED["workloads"]["full"]
    final = recorded["checkpoints"][-1]
    frames, port = frames_of("full"), free_port()
    queries = tmp_path / "prompts.jsonl"
    queries.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt_token_ids": prompt})
                                 for i, (prompt, _) in enumerate(final["probes"][1:])))
    first_prompt, first_hit = final["probes"][0]
    process = kvref("watch", f"tcp://127.0.0.1:{port}", "--batches", len(frames),
                    "--duration", 60, "--json", "--query", " ".join(map(str, first_prompt)),
                    "--query-file", queries)
    pub = sender(f"tcp://127.0.0.1:{port}")
    for frame in frames:
        pub.send_multipart(frame)
    code, out, err = finish(process)
    pub.close(0)
    assert code == 0, err
    report = json.loads(out)
    assert report["batches"] == len(frames) and report["missed_batches"] == 0
    assert report["groups"] == [{"group": 0, "kind": "full_attention", "block_size": 4,
                                 "cached_blocks": sum(pool_index(final).values())}]
    answers = [(q["query"], q["hit_tokens"]) for q in report["queries"]]
    assert answers == [("query 1", first_hit)] + [
        (f"p{i}", hit) for i, (_, hit) in enumerate(final["probes"][1:])]


def test_the_command_without_json_prints_the_picture_once():
    port = free_port()
    process = kvref("watch", f"tcp://127.0.0.1:{port}", "--batches", 3, "--duration", 60,
                    "--query", "1000 1001 1002 1003 1004 1005 1006 1007 1008 7")
    pub = sender(f"tcp://127.0.0.1:{port}")
    for frame in frames_of("full")[:3]:
        pub.send_multipart(frame)
    code, out, err = finish(process)
    pub.close(0)
    assert code == 0, err
    assert f"bound at tcp://127.0.0.1:{port}, vLLM connected" in out
    assert "this server: 3 batches" in out
    assert "full_attention" in out and "query 1" in out and "stored" in out


def test_data_parallel_ranks_are_watched_on_consecutive_ports_each_with_its_cache(tmp_path):
    # vLLM's rank r publishes on PORT + r (kv_events.py:471-502), its own cache's events.
    port = free_port()
    while True:
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            port = free_port()
    workloads = ["full", "bytes-hashes"]
    finals = [RECORDED["workloads"][w]["checkpoints"][-1] for w in workloads]
    probes = [(rank, prompt, hit) for rank, final in enumerate(finals)
              for prompt, hit in final["probes"][:4]]
    queries = tmp_path / "prompts.json"
    queries.write_text(json.dumps([prompt for _, prompt, _ in probes]))
    frames = [frames_of(w) for w in workloads]
    process = kvref("watch", f"tcp://127.0.0.1:{port}", "--data-parallel-size", 2,
                    "--batches", sum(map(len, frames)), "--duration", 60, "--json",
                    "--query-file", queries)
    pubs = [sender(f"tcp://127.0.0.1:{port + rank}") for rank in (0, 1)]
    for pub, rank_frames in zip(pubs, frames):
        for frame in rank_frames:
            pub.send_multipart(frame)
    code, out, err = finish(process)
    for pub in pubs:
        pub.close(0)
    assert code == 0, err
    report = json.loads(out)
    assert [r["endpoint"] for r in report["ranks"]] == [f"tcp://127.0.0.1:{port + r}"
                                                        for r in (0, 1)]
    assert [r["batches"] for r in report["ranks"]] == [len(f) for f in frames]
    for (rank, _, vllm_hit), answer in zip(probes, report["queries"]):
        by_rank = answer["hit_tokens_by_rank"]
        assert by_rank[rank] == vllm_hit                  # each rank answers as its vLLM
        assert answer["hit_tokens"] == max(by_rank) == by_rank[answer["best_rank"]]
    assert any(a["hit_tokens_by_rank"][0] != a["hit_tokens_by_rank"][1]
               for a in report["queries"])                # the two caches differ


@pytest.mark.parametrize("endpoint, says", [
    ("http://127.0.0.1:5557", "is not a ZMQ endpoint vLLM publishes on"),
    ("tcp://127.0.0.1", "no port"),
    ("tcp://127.0.0.1:99999", "port 99999 is out of range (1 to 65535)"),
    ("inproc://kv", "lives inside the server's process"),
    ("ipc:///tmp/kv --data-parallel-size 2", "only on tcp://HOST:PORT endpoints"),
])
def test_a_bad_endpoint_is_one_line(endpoint, says):
    code, out, err = finish(kvref("watch", *endpoint.split(), "--duration", 1))
    assert code == 2 and says in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_an_endpoint_in_use_is_one_line():
    port = free_port()
    context = zmq.Context.instance()
    holder = context.socket(zmq.SUB)
    holder.bind(f"tcp://127.0.0.1:{port}")
    try:
        code, out, err = finish(kvref("watch", f"tcp://127.0.0.1:{port}", "--duration", 1))
    finally:
        holder.close(0)
    assert code == 2 and "cannot bind" in err and "Address already in use" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("message, says", [
    ([b"hello"], "1 frames (5 bytes); vLLM sends 3"),
    ([b"", (0).to_bytes(8, "big"), b"\xc1"], "not msgpack"),
    ([b"", (0).to_bytes(8, "big"), b"\x81\xa1a\x01"], "not a KVEventBatch"),
    ([b"", (0).to_bytes(8, "big"), b"\x92\xcb" + bytes(8) + b"\x91\x81\xa4type\xa4Oops"],
     "an event of type 'Oops'"),
])
def test_a_foreign_message_is_one_line(message, says):
    port = free_port()
    process = kvref("watch", f"tcp://127.0.0.1:{port}", "--duration", 60)
    pub = sender(f"tcp://127.0.0.1:{port}")
    pub.send_multipart(message)
    code, out, err = finish(process)
    pub.close(0)
    assert code == 2 and says in err and "is not vLLM's KV events" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("args, says", [
    (["--query", "one two"], "give token ids"),
    (["--query-file", "/nonexistent/prompts.jsonl"], "No such file"),
    (["--duration", "0"], "--duration must be positive"),
])
def test_bad_queries_and_limits_are_one_line(args, says):
    code, out, err = finish(kvref("watch", f"tcp://127.0.0.1:{free_port()}", *args))
    assert code == 2 and says in err and "Traceback" not in err


@pytest.mark.parametrize("server, watcher", [
    ("tcp://*:5557", ("tcp://127.0.0.1:5557", False)),      # vLLM's default: it binds
    ("tcp://[::]:5557", ("tcp://127.0.0.1:5557", False)),
    ("tcp://[::1]:5557", ("tcp://[::1]:5557", False)),       # binds one address: go there
    ("ipc:///run/kv", ("ipc:///run/kv", False)),
    ("tcp://127.0.0.1:5557", ("tcp://127.0.0.1:5557", True)),  # vLLM connects: we bind
])
def test_the_watcher_does_what_vllms_publisher_does_not(server, watcher):
    assert watcher_address(server) == watcher
    assert server_binds(server) == (not watcher[1])


def test_a_server_on_another_machine_that_binds_is_reached_at_host():
    assert watcher_address("tcp://*:5557", host="10.1.2.3") == ("tcp://10.1.2.3:5557", False)


def test_the_watch_api_refuses_a_bad_endpoint_with_watch_error():
    with pytest.raises(WatchError, match="lives inside"):
        Watcher("inproc://x")


# -- vLLM's own publisher, live ---------------------------------------------------------


@pytest.mark.skipif(not ORACLE.exists(), reason=f"needs the vLLM 0.25.1 oracle environment "
                    f"({ORACLE}; tools/setup_vllm_venv.py, which .ci/run builds); the "
                    "recorded frames are replayed without it")
def test_live_vllm_publisher_and_its_replay_socket():
    """vLLM's ZmqEventPublisher in its own process, connecting to the watcher; then a
    second watcher that only asks vLLM's replay socket, from seq 0."""
    port, replay_port = free_port(), free_port()
    replay = f"tcp://127.0.0.1:{replay_port}"
    with Watcher(f"tcp://127.0.0.1:{port}", replay_endpoint=replay) as watcher:
        publisher = subprocess.Popen(
            [str(ORACLE), str(ROOT / "tools/record_vllm_kv_events.py"),
             "--publish", f"tcp://127.0.0.1:{port}", "--replay-endpoint", replay,
             "--workload", "hybrid"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        watchdog = threading.Timer(300, publisher.kill)     # a hung publisher ends too
        watchdog.start()
        try:
            truth = json.loads(publisher.stdout.readline())   # after the last publish
            deadline = time.monotonic() + DEADLINE_S
            while watcher.next_seq != truth["batches"] and time.monotonic() < deadline:
                watcher.poll(0.2)
                if watcher.next_seq != truth["batches"]:
                    watcher.catch_up(timeout_s=1.0)    # what the live socket missed
            with Watcher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=replay) as late:
                late_blocks, late_next = late.index.blocks, late.next_seq
        finally:
            publisher.communicate("done\n", timeout=60)
            watchdog.cancel()
    final = truth["checkpoints"][-1]
    assert watcher.next_seq == late_next == truth["batches"] == final["after_seq"] + 1
    assert watcher.index.blocks == late_blocks == pool_index(final)
    for prompt, vllm_hit in final["probes"]:
        assert watcher.index.query(prompt).hit_tokens == vllm_hit


def test_text_prompts_go_through_the_served_models_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    import transformers

    words = {w: 1000 + i for i, w in enumerate("you are a helpful assistant today".split())}
    words["<unk>"] = 0
    model = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=model,
                                         unk_token="<unk>").save_pretrained(tmp_path)
    port = free_port()
    process = kvref("watch", f"tcp://127.0.0.1:{port}", "--batches", 1, "--duration", 60,
                    "--json", "--tokenizer", tmp_path,
                    "--prompt", "you are a helpful assistant today")
    pub = sender(f"tcp://127.0.0.1:{port}")
    # the first recorded batch stores tokens 1000..1011 (three blocks of 4)
    pub.send_multipart(frames_of("full")[0])
    code, out, err = finish(process)
    pub.close(0)
    assert code == 0, err
    [answer] = json.loads(out)["queries"]
    assert (answer["query"], answer["num_tokens"], answer["hit_tokens"]) == ("prompt 1", 6, 4)


def test_a_text_prompt_without_a_tokenizer_is_one_line():
    code, out, err = finish(kvref("watch", f"tcp://127.0.0.1:{free_port()}",
                                  "--prompt", "hello there"))
    assert code == 2 and "give --tokenizer" in err and "Traceback" not in err


def test_the_terminal_view_follows_the_events_and_asks_about_a_typed_prompt():
    import asyncio

    from kvref.viz.watch import Query, WatchApp

    recorded = RECORDED["workloads"]["full"]
    checkpoint = recorded["checkpoints"][2]
    frames, port = frames_of("full")[:checkpoint["after_seq"] + 1], free_port()
    (known, known_hit), (typed, typed_hit) = checkpoint["probes"][0], checkpoint["probes"][-1]

    def screen(app) -> str:
        return "\n".join(strip.text for strip in app.screen._compositor.render_strips())

    async def main(watcher, pub):
        app = WatchApp(watcher, [Query("system", known)], duration_s=DEADLINE_S)
        async with app.run_test(size=(100, 40)) as pilot:
            for frame in frames:
                pub.send_multipart(frame)
            deadline = time.monotonic() + DEADLINE_S
            while watcher.batches < len(frames) and time.monotonic() < deadline:
                await pilot.pause(0.1)
            await pilot.pause(0.3)
            before = screen(app)
            await pilot.press("slash")
            await pilot.press(*" ".join(map(str, typed)), "enter")
            await pilot.pause(0.3)
            after = screen(app)
            await pilot.press("q")
        return before, after

    with Watcher(f"tcp://127.0.0.1:{port}") as watcher:
        pub = sender(f"tcp://127.0.0.1:{port}", watcher)
        before, after = asyncio.run(main(watcher, pub))
        pub.close(0)
    assert f"this server: {len(frames)} batches" in before
    row = next(line for line in before.splitlines() if line.lstrip().startswith("system"))
    assert row.split()[1:3] == [str(len(known)), str(known_hit)]
    row = next(line for line in after.splitlines() if line.lstrip().startswith("asked 2"))
    assert row.split()[2:4] == [str(len(typed)), str(typed_hit)]
