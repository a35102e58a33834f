"""``kvref watch`` through what a real deployment does: restarts, outages, lost
messages, bad addresses, signals.

``Server`` speaks vLLM 0.25.1's protocol (``vllm/distributed/kv_events.py``): a PUB
socket that sends ``[topic, seq, payload]`` with seq counting from 0 in each
process (``:334``, ``count()``), and a ROUTER replay socket that answers an 8-byte
start seq with every buffered ``[seq, payload]`` from there, then seq -1
(``:448-469``). Its batches are the frames vLLM's own publisher sent
(``recorded/``); a second server is the same frames at a later time, as a
restarted process would send them. ``hold`` puts a batch in the replay buffer
without sending it: a batch the watcher never received (paused, or a network
blip). Every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter

import msgspec
import pytest
import zmq

from kvref.watch import PrefixCacheIndex, Watcher, decode_message

from tests.watch.test_watch import (DEADLINE_S, finish, frames_of, free_port, kvref,
                                    wait_for_subscription)


def at_time(frame: list[bytes], ts: float) -> list[bytes]:
    """The same batch as sent at publisher time ``ts``."""
    body = msgspec.msgpack.decode(frame[2])
    return [frame[0], frame[1], msgspec.msgpack.encode([ts] + body[1:])]


def server_frames(workload: str, ts: float) -> list[list[bytes]]:
    """A server process's batches: the recorded ones, numbered from 0, from ``ts`` on."""
    return [at_time(f, ts + i) for i, f in enumerate(frames_of(workload))]


def index_of(frames: list[list[bytes]]) -> Counter:
    index = PrefixCacheIndex()
    for frame in frames:
        for event in decode_message(frame).events:
            index.apply(event)
    return index.blocks


class Server:
    """vLLM's publisher: a bound XPUB socket (it sees the watcher subscribe) and a
    ROUTER replay socket served by a thread, over a buffer of sent batches."""

    def __init__(self, port: int, replay_port: int | None, frames: list[list[bytes]]):
        self.frames, self.buffer = frames, []
        context = zmq.Context.instance()
        self.pub = context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.router = None
        self.stop, self.lock = threading.Event(), threading.Lock()
        if replay_port is not None:
            self.router = context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self.thread = threading.Thread(target=self._serve, daemon=True)
            self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            with self.lock:
                held = list(self.buffer)
            for seq in held:
                if seq >= int.from_bytes(start, "big"):
                    self.router.send_multipart([client, b"", *self.frames[seq][1:]])
            self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True),
                                        b""])

    def subscribed(self, watcher: Watcher | None = None) -> "Server":
        wait_for_subscription(self.pub, watcher)
        return self

    def hold(self, seqs) -> None:
        with self.lock:
            self.buffer += list(seqs)

    def publish(self, seqs) -> None:
        for seq in seqs:
            self.hold([seq])
            self.pub.send_multipart(self.frames[seq])

    def close(self) -> None:
        self.stop.set()
        if self.router is not None:
            self.thread.join(DEADLINE_S)
            self.router.close(0)
        self.pub.close(0)


def poll_until(watcher: Watcher, done, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"never: {what}"
        watcher.poll(0.1)


def watch_one_server_then_lose_it(port, replay_port):
    """A watcher that applied the first server's batches 0..4, then lost it."""
    first = server_frames("full", ts=1000.0)
    watcher = Watcher(f"tcp://*:{port}", replay_endpoint=None if replay_port is None
                      else f"tcp://*:{replay_port}")
    server = Server(port, replay_port, first).subscribed(watcher)
    server.publish(range(5))
    poll_until(watcher, lambda: watcher.next_seq == 5, "the first server's batches")
    assert watcher.connection()["state"] == "connected"
    server.close()
    poll_until(watcher, lambda: watcher.link.state == "gone", "the server is seen gone")
    return watcher


@pytest.mark.parametrize("numbers", ["beyond the old server's", "the old server's next"])
def test_a_restart_missed_while_paused_is_found_and_the_index_rebuilt(numbers):
    """Item 1: the new server's batch 0 never reaches the watcher. The live batches
    after the gap, or after the lost connection, are checked against the replay
    socket: its batch 4 is not the one applied, so this is another server, and its
    history is replayed from 0."""
    port, replay_port = free_port(), free_port()
    watcher = watch_one_server_then_lose_it(port, replay_port)
    assert "the server went away" in watcher.status()["unknown_because"]
    second = server_frames("full", ts=5000.0)[:10]
    server = Server(port, replay_port, second)
    try:
        first_live = 7 if numbers.startswith("beyond") else 5
        server.hold(range(first_live))              # sent while the watcher was paused
        server.subscribed(watcher).publish(range(first_live, 10))
        poll_until(watcher, lambda: watcher.next_seq == 10, "the new server's batches")
        status = watcher.status()
    finally:
        server.close()
        watcher.close()
    assert watcher.index.blocks == index_of(second)
    assert status["restarts"] == 1 and status["index_exact"] and status["missed_batches"] == 0
    assert status["server_batches"] == 10 and status["first_seq"] == 0
    assert "is another one" in status["restarts_seen"][0]["how"]


def test_a_reconnect_to_the_same_server_keeps_the_index_and_fills_the_gap():
    port, replay_port = free_port(), free_port()
    frames = server_frames("full", ts=1000.0)
    with Watcher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}",
                 silence_s=0.3) as watcher:
        server = Server(port, replay_port, frames).subscribed(watcher)
        try:
            server.publish(range(5))
            poll_until(watcher, lambda: watcher.next_seq == 5, "batches 0..4")
            time.sleep(0.5)                          # silent longer than silence_s
            watcher.poll(0)
            assert watcher.check_next == "no message for 0.3 s"
            server.hold(range(5, 8))                 # lost on the way
            server.publish(range(8, 12))
            poll_until(watcher, lambda: watcher.next_seq == 12, "batches 5..11")
        finally:
            server.close()
        assert watcher.index.blocks == index_of(frames[:12])
        assert watcher.restarts == [] and watcher.unknown_since is None
        assert watcher.missed == 0 and watcher.batches == 12


def test_without_a_replay_socket_a_gap_after_an_outage_marks_the_index_unknown():
    port = free_port()
    watcher = watch_one_server_then_lose_it(port, None)
    server = Server(port, None, server_frames("full", ts=5000.0)[:10])
    try:
        server.subscribed(watcher).publish(range(7, 10))
        poll_until(watcher, lambda: watcher.next_seq == 10, "the live batches")
        status = watcher.status()
    finally:
        server.close()
        watcher.close()
    assert not status["index_exact"] and status["unknown_since"]
    assert status["unknown_because"] == "the server went away"
    assert status["missed_batches"] == 2


def test_without_a_replay_socket_a_new_servers_batch_0_starts_an_exact_index():
    port = free_port()
    watcher = watch_one_server_then_lose_it(port, None)
    second = server_frames("full", ts=5000.0)[:3]
    server = Server(port, None, second)
    try:
        server.subscribed(watcher).publish(range(3))
        poll_until(watcher, lambda: len(watcher.restarts) == 1 and watcher.next_seq == 3,
                   "the restart")
        status = watcher.status()
    finally:
        server.close()
        watcher.close()
    assert status["index_exact"] and watcher.index.blocks == index_of(second)
    assert "went back from 4 to 0" in status["restarts_seen"][0]["how"]
    # the batch counter and the last events are this server's; --batches counts all
    assert status["server_batches"] == 3 and status["batches"] == 8
    assert {seq for _ts, seq, _e in watcher.recent} <= {0, 1, 2}


# -- the command: no hang, no silence about what is wrong ----------------------------------


def test_the_event_port_given_as_the_replay_port_is_one_line_at_once():
    """Item 2: this hung forever in send_multipart, ignoring --duration."""
    port = free_port()
    start = time.monotonic()
    code, out, err = finish(kvref("watch", f"tcp://*:{port}", "--replay", f"tcp://*:{port}",
                                  "--duration", 10), timeout=30)
    assert code == 2 and "the event endpoint again" in err, err
    assert time.monotonic() - start < 10


def test_a_replay_address_that_is_not_a_replay_socket_is_named_within_the_duration():
    """A PUB socket at the --replay address: the DEALER's handshake fails, and the
    old watcher blocked in send_multipart for good."""
    port, other = free_port(), free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{other}")
    start = time.monotonic()
    try:
        code, out, err = finish(kvref("watch", f"tcp://*:{port}", "--replay",
                                      f"tcp://*:{other}", "--duration", 10), timeout=30)
    finally:
        pub.close(0)
    assert time.monotonic() - start < 15
    assert code == 2 and "not as vLLM's replay ROUTER socket" in err, err
    assert len(err.strip().splitlines()) == 1


def test_the_replay_port_given_as_the_event_port_is_named_not_shown_as_idle():
    """Item 3: a ROUTER where the PUB should be gave "batches": 0 and exit 0."""
    port = free_port()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    try:
        code, out, err = finish(kvref("watch", f"tcp://*:{port}", "--duration", 10, "--json"),
                                timeout=30)
    finally:
        router.close(0)
    assert code == 2 and "not as vLLM's KV-events PUB socket" in err, err


def test_a_port_where_nothing_listens_is_named_after_the_stated_wait():
    port = free_port()
    code, out, err = finish(kvref("watch", f"tcp://*:{port}", "--duration", 6, "--json"),
                            timeout=30)
    assert code == 0, err
    connection = json.loads(out)["connection"]
    assert connection["state"] == "no server"
    assert f"nothing accepts connections at tcp://127.0.0.1:{port}" in connection["text"]


def test_a_server_that_goes_away_is_not_shown_as_connected():
    port = free_port()
    watcher = watch_one_server_then_lose_it(port, None)
    try:
        status = watcher.status()
    finally:
        watcher.close()
    assert status["connection"]["state"] == "gone"
    assert "went away" in status["connection"]["text"]
    assert not status["index_exact"] and status["last_message_s_ago"] is not None


def test_an_address_the_watcher_cannot_bind_gets_the_hint_to_give_vllms_endpoint():
    """Item 4: tcp://127.0.0.1:PORT is an endpoint vLLM connects to, so the watcher
    binds it; with vLLM's default (tcp://*:PORT, bound by vLLM) it is in use."""
    port = free_port()
    holder = zmq.Context.instance().socket(zmq.PUB)
    holder.bind(f"tcp://127.0.0.1:{port}")
    try:
        code, out, err = finish(kvref("watch", f"tcp://127.0.0.1:{port}", "--duration", 1))
    finally:
        holder.close(0)
    assert code == 2 and "Address already in use" in err
    assert f"give ENDPOINT exactly as vLLM was given it: its default tcp://*:{port}" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("how", ["sigterm", "sigint"])
def test_a_signal_ends_a_json_run_with_its_report(how):
    port = free_port()
    process = kvref("watch", f"tcp://*:{port}", "--duration", 60, "--json")
    time.sleep(2)                                 # past the imports, in the loop
    process.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
    code, out, err = finish(process, timeout=20)
    assert code == 0 and "Traceback" not in err, err
    assert json.loads(out)["endpoint"] == f"tcp://127.0.0.1:{port}"


# -- the live view, in a real terminal (a pty) ---------------------------------------------


def run_in_terminal(args, action, *, timeout_s: float = 30.0):
    """``kvref watch ARGS`` on a pseudo-terminal; ``action(pid, fd)`` once the view
    is drawn; (exit code, everything written to the terminal)."""
    import pty
    import select
    import sys

    from tests.watch.test_watch import ROOT

    pid, fd = pty.fork()
    if pid == 0:                                  # the child: the command, on the pty
        try:
            env = dict(os.environ, PYTHONPATH=str(ROOT), TERM="xterm-256color",
                       COLUMNS="100", LINES="30")
            os.chdir(ROOT)
            os.execve(sys.executable,
                      [sys.executable, "-m", "kvref.cli", "watch", *map(str, args)], env)
        finally:
            os._exit(127)                         # never back into pytest
    written, acted = b"", False
    deadline = time.monotonic() + timeout_s
    code = None
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    chunk = b""
                written += chunk
            if not acted and b"quit" in written and len(written) > 2000:
                time.sleep(0.5)
                action(pid, fd)
                acted = True
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
    finally:
        if code is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    assert acted, f"the view never drew (exit {code}): {written[-500:]!r}"
    assert code is not None, f"kvref watch did not quit in {timeout_s} s"
    return code, written


@pytest.mark.parametrize("how", ["q", "ctrl-c", "sigint", "sigterm"])
def test_the_live_view_quits_and_gives_the_terminal_back(how):
    """Item 5: Ctrl-C showed Textual's "press ctrl+q", SIGINT did nothing, SIGTERM
    left the terminal in the alternate screen."""
    def act(pid, fd):
        if how in ("q", "ctrl-c"):
            os.write(fd, b"q" if how == "q" else b"\x03")
        else:
            os.kill(pid, signal.SIGINT if how == "sigint" else signal.SIGTERM)

    code, written = run_in_terminal([f"tcp://*:{free_port()}", "--duration", 60], act)
    assert code == 0, written[-800:]
    assert b"ctrl+q" not in written
    enter, leave = written.find(b"\x1b[?1049h"), written.rfind(b"\x1b[?1049l")
    assert 0 <= enter < leave, "the alternate screen was not left"
    assert b"KV cache groups" in written[leave:]        # the final state, printed after


def test_the_screen_says_when_the_index_is_unknown_and_marks_every_hit():
    """Item 6: with batches missed, the hit column gave a number with no doubt."""

    from kvref.viz.watch import Query, render_watch

    frames = server_frames("full", ts=1000.0)
    prompt = list(range(1000, 1012))               # stored by batch 0
    with Watcher(f"tcp://127.0.0.1:{free_port()}") as watcher:
        watcher.handle(frames[0])
        exact = render_text(render_watch(watcher, [Query("p", prompt)]))
        watcher.handle(frames[3])                  # batches 1 and 2 never arrived
        doubtful = render_text(render_watch(watcher, [Query("p", prompt)]))
    assert "UNKNOWN" not in exact and " 11 " not in exact
    row = next(line for line in exact.splitlines() if line.startswith("p "))
    assert row.split()[1:3] == ["12", "8"]
    assert "index UNKNOWN since" in doubtful and "batches 1..2 never arrived" in " ".join(
        doubtful.split())
    row = next(line for line in doubtful.splitlines() if line.startswith("p "))
    assert row.split()[1:3] == ["12", "8?"]


def test_a_reset_is_shown_the_moment_its_batch_arrives():
    from kvref.viz.watch import render_watch

    frames = server_frames("full", ts=1000.0)
    reset = next(i for i, f in enumerate(frames) if any(
        e.get("type") == "AllBlocksCleared" for e in msgspec.msgpack.decode(f[2])[1]))
    with Watcher(f"tcp://127.0.0.1:{free_port()}") as watcher:
        for frame in frames[:reset]:
            watcher.handle(frame)
        assert watcher.index.blocks and "prefix cache reset at" not in render_text(
            render_watch(watcher, []))
        watcher.handle(frames[reset])
        after = render_text(render_watch(watcher, []))
    assert "prefix cache reset at" in after and "(AllBlocksCleared)" in after


def render_text(renderable) -> str:
    from rich.console import Console

    console = Console(width=100, record=True)
    console.print(renderable)
    return console.export_text()
