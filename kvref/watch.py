"""``kvref watch``: follow a running vLLM's prefix cache through its KV events.

No vLLM counterpart: this is the other end of vLLM 0.25.1's
``ZmqEventPublisher`` (``vllm/distributed/kv_events.py:278``), what a KV-aware
router runs. vLLM sends one ZMQ message per engine step with cache events::

    [topic, seq (8 bytes, big-endian), payload]                  kv_events.py:434-438
    payload = msgpack [ts, [event, ...], data_parallel_rank]     an array: kv_events.py:25-33
    event   = msgpack map {"type": "BlockStored", ...}           tagged: kv_events.py:36-41

and keeps the last batches for a ROUTER replay socket when given one
(``kv_events.py:448-469``: ask with an 8-byte start seq, get ``[seq, payload]``
messages, then seq ``-1``). The events become kvref's own
(``kvref.kv_events``), and ``PrefixCacheIndex`` keeps what lesson 11's router
keeps: ``(group_idx, hash) -> copies``, exactly the pool's index.

To answer "would this prompt hit, and how far?" the index must hash a prompt as
the server does, and a server started without ``PYTHONHASHSEED`` seeds its hash
chain with random bytes (``vllm/v1/core/kv_cache_utils.py:111-112``, ``init_none_hash``).
So it learns the hashes from the events instead: a dense ``BlockStored`` names
each block's tokens, its parent's hash and its own hash, enough to walk a
prompt's chain of hashes block by block with no seed at all. The hit itself is
kvref's own search (``HybridKVCacheCoordinator``'s fixed point over full
attention, sliding window and Mamba groups), asked of a pool that answers from
the index (``IndexLookup``)::

    >>> from kvref.kv_events import BlockStored
    >>> index = PrefixCacheIndex()
    >>> index.apply(BlockStored([11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None,
    ...                         group_idx=0, kv_cache_spec_kind="full_attention"))
    >>> index.query([1, 2, 3, 4, 5, 6, 7, 8, 9]).hit_tokens
    8
    >>> index.query([1, 2, 3, 4, 5, 6, 0, 0, 9]).hit_tokens
    4

Which end binds: vLLM's publisher binds when its endpoint has ``*`` or ``::``
or is ``ipc://`` / ``inproc://``, and connects otherwise (``kv_events.py:391-401``;
its default ``tcp://*:5557`` binds, ``vllm/config/kv_events.py:23``). ``Watcher``
takes the endpoint the server was given and does the other.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from kvref.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
# Group kinds whose hit is their leading run of cached blocks, whose dense stores
# teach the chain of hashes (vLLM's KVCacheSpecKind, vllm/v1/kv_cache_interface.py:86-96).
PREFIX_KINDS = ("full_attention", "mla_attention")
END_SEQ = -1                 # the replay socket's last message (kv_events.py:303, 469)


class WatchError(Exception):
    """Something the user can fix (an endpoint, a foreign message): one line."""


# -- the wire format -----------------------------------------------------------------


def frozen(value: Any) -> Any:
    """msgpack gives lists where vLLM had tuples (extra keys): make them hashable."""
    return tuple(frozen(v) for v in value) if isinstance(value, list) else value


def decode_event(item: Any) -> KVCacheEvent:
    """One msgpack-decoded event map as kvref's event; ``ValueError`` if it is not one."""
    if not isinstance(item, dict) or item.get("type") not in EVENT_TYPES:
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise ValueError(f"an event of type {kind!r} (vLLM sends {', '.join(EVENT_TYPES)})")
    kind = item["type"]
    try:
        if kind == "BlockStored":
            extra = item.get("extra_keys")
            return BlockStored(
                block_hashes=list(item["block_hashes"]),
                parent_block_hash=item["parent_block_hash"],
                token_ids=list(item["token_ids"]), block_size=int(item["block_size"]),
                lora_id=item["lora_id"], medium=item["medium"], lora_name=item["lora_name"],
                extra_keys=None if extra is None else [frozen(k) for k in extra],
                group_idx=item.get("group_idx"),
                kv_cache_spec_kind=item.get("kv_cache_spec_kind"),
                kv_cache_spec_sliding_window=item.get("kv_cache_spec_sliding_window"))
        if kind == "BlockRemoved":
            return BlockRemoved(block_hashes=list(item["block_hashes"]),
                                medium=item["medium"], group_idx=item.get("group_idx"))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"a {kind} without a valid {exc}") from None
    return AllBlocksCleared()


class Batch(NamedTuple):
    seq: int
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None


def decode_message(frames: list[bytes]) -> Batch:
    """``[topic, seq, payload]`` as vLLM's publisher sends it; ``ValueError``
    (saying what was found) for anything else."""
    import msgspec

    if len(frames) != 3 or len(frames[1]) != 8:
        sizes = ", ".join(f"{len(f)} bytes" for f in frames)
        raise ValueError(f"{len(frames)} frames ({sizes}); vLLM sends 3: topic, an 8-byte "
                         "sequence number, a msgpack KVEventBatch")
    try:
        body = msgspec.msgpack.decode(frames[2])
    except msgspec.DecodeError as exc:
        raise ValueError(f"a payload that is not msgpack ({exc})") from None
    if not (isinstance(body, list) and 2 <= len(body) <= 3 and
            isinstance(body[0], (int, float)) and isinstance(body[1], list)):
        raise ValueError(f"a payload of {type(body).__name__} {str(body)[:60]!r}, not a "
                         "KVEventBatch [ts, events, data_parallel_rank]")
    rank = body[2] if len(body) == 3 else None
    return Batch(int.from_bytes(frames[1], "big"), float(body[0]),
                 [decode_event(e) for e in body[1]], rank)


# -- the index a router keeps -----------------------------------------------------------


@dataclass
class GroupInfo:
    kind: str | None
    block_size: int
    sliding_window: int | None = None


class Answer(NamedTuple):
    """How far a prompt would hit: ``hit_tokens`` of ``num_tokens``; ``runs``: per
    modelled group, how many of the prompt's leading blocks it holds; ``note``: what
    the answer leaves out."""
    num_tokens: int
    hit_tokens: int
    runs: dict[int, int]
    note: str = ""


def spec_of(info: GroupInfo):
    """kvref's spec for a group as events describe it (kind, block size, window);
    None for kinds whose hit the events cannot pin down (chunked local attention:
    no chunk size in events; cross and encoder-only attention: never hit)."""
    from kvref.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if info.kind in PREFIX_KINDS:
        return FullAttentionSpec(info.block_size)
    if info.kind in ("sliding_window", "sliding_window_mla") and info.sliding_window:
        return SlidingWindowSpec(info.block_size, sliding_window=info.sliding_window)
    if info.kind == "mamba":      # the hit search is the same in "all" and "align"
        return MambaSpec(info.block_size, mamba_cache_mode="align")
    return None


class IndexLookup:
    """The two things kvref's hit search asks a block pool, answered from an index:
    ``get_cached_block(hash, group_ids)`` (a stand-in block per group, or None)
    and ``null_block``. ``groups[i]`` is the vLLM group of the coordinator's group i."""

    null_block = "null"

    def __init__(self, blocks: Counter, groups: list[int]) -> None:
        self.blocks, self.groups = blocks, groups

    def get_cached_block(self, block_hash, group_ids: list[int]):
        if block_hash is None or any((self.groups[i], block_hash) not in self.blocks
                                     for i in group_ids):
            return None
        return ["cached"] * len(group_ids)


@dataclass
class PrefixCacheIndex:
    """The pool's prefix-cache index rebuilt from events, and the token chain to query it.

    ``blocks``: ``(group_idx, hash) -> copies`` (the pool may cache two blocks with
    one hash, and one ``BlockRemoved`` drops one copy: lesson 11). ``chain``:
    ``(block_size, parent hash, block tokens, extra keys) -> hash``, learned from
    dense stores and forgotten when no group holds the hash any more.
    """

    blocks: Counter = field(default_factory=Counter)
    groups: dict[int, GroupInfo] = field(default_factory=dict)
    chain: dict[tuple, Any] = field(default_factory=dict)
    chain_key_of: dict[Any, tuple] = field(default_factory=dict)
    holders: Counter = field(default_factory=Counter)      # hash -> copies, all groups
    counts: Counter = field(default_factory=Counter)       # event type -> how many
    sparse_stores: int = 0
    coordinator_for: tuple | None = None                   # (groups, kvref coordinator)

    def apply(self, event: KVCacheEvent) -> None:
        self.counts[type(event).__name__] += 1
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                key = (event.group_idx, h)
                if self.blocks[key] <= 1:
                    self.blocks.pop(key, None)
                else:
                    self.blocks[key] -= 1
                self._release(h)
        elif isinstance(event, AllBlocksCleared):
            for name in ("blocks", "chain", "chain_key_of", "holders"):
                getattr(self, name).clear()

    def _store(self, event: BlockStored) -> None:
        g = event.group_idx
        if g not in self.groups or event.block_size > self.groups[g].block_size:
            # (a partial-block entry, kv_events of cache_partial_block, is smaller)
            self.groups[g] = GroupInfo(event.kv_cache_spec_kind, event.block_size,
                                       event.kv_cache_spec_sliding_window)
        for h in event.block_hashes:
            self.blocks[(g, h)] += 1
            self.holders[h] += 1
        size, hashes = event.block_size, event.block_hashes
        if len(event.token_ids) != size * len(hashes):
            self.sparse_stores += 1      # null or masked blocks skipped: no pairing (lesson 11)
            return
        extra = event.extra_keys or [None] * len(hashes)
        parent = event.parent_block_hash
        for i, h in enumerate(hashes):
            key = (size, parent, tuple(event.token_ids[i * size:(i + 1) * size]), extra[i])
            self.chain[key] = h
            self.chain_key_of[h] = key
            parent = h

    def _release(self, h: Any) -> None:
        if self.holders[h] <= 1:
            self.holders.pop(h, None)
            key = self.chain_key_of.pop(h, None)
            if key is not None and self.chain.get(key) == h:
                del self.chain[key]
        else:
            self.holders[h] -= 1

    def prompt_hashes(self, tokens: list[int], block_size: int) -> list[Any]:
        """The prompt's leading block hashes the chain knows (no LoRA, salt or
        multimodal extra keys: a plain prompt's)."""
        hashes, parent = [], None
        for i in range(len(tokens) // block_size):
            h = self.chain.get((block_size, parent, tuple(tokens[i * block_size:
                                                               (i + 1) * block_size]), None))
            if h is None:
                break
            hashes.append(h)
            parent = h
        return hashes

    def query(self, tokens: list[int]) -> Answer:
        """How many tokens of ``tokens``, sent as a new request, the cache would serve:
        kvref's own hit search (the coordinator's, vLLM's rule for every group kind
        below) run on a pool that answers from this index."""
        if not self.groups:
            return Answer(len(tokens), 0, {}, "no block stored yet")
        size = min(info.block_size for info in self.groups.values())
        modelled = {g: info for g, info in sorted(self.groups.items())
                    if info.block_size == size and spec_of(info) is not None}
        hashes = self.prompt_hashes(tokens, size)
        runs = {}
        for g in modelled:
            run = 0
            while run < len(hashes) and (g, hashes[run]) in self.blocks:
                run += 1
            runs[g] = run
        left_out = [g for g in self.groups if g not in modelled]
        note = ""
        if left_out:
            note = "at most: groups " + ", ".join(
                f"{g} ({self.groups[g].kind}, block {self.groups[g].block_size})"
                for g in left_out) + " are not modelled"
        elif not any(info.kind in PREFIX_KINDS for info in modelled.values()):
            note = "no full-attention group: the chain of hashes cannot be learned"
        if not modelled or len(tokens) < 2:
            return Answer(len(tokens), 0, runs, note)
        coordinator = self._coordinator(tuple(modelled.items()), size)
        coordinator.block_pool = IndexLookup(self.blocks, list(modelled))
        padded = hashes + [None] * (len(tokens) // size - len(hashes))
        _, hit = coordinator.find_longest_cache_hit(padded, len(tokens) - 1)
        return Answer(len(tokens), hit, runs, note)

    def _coordinator(self, groups: tuple, block_size: int):
        """kvref's coordinator for these groups (its pool is replaced per query)."""
        if self.coordinator_for and self.coordinator_for[0] == groups:
            return self.coordinator_for[1]
        from kvref.core.kv_cache_manager import KVCacheManager
        from kvref.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

        config = KVCacheConfig(4, [KVCacheGroupSpec([f"layer.{g}"], spec_of(info))
                                   for g, info in groups])
        manager = KVCacheManager(config, max_model_len=1 << 30,
                                 scheduler_block_size=block_size,
                                 hash_block_size=block_size, enable_caching=True)
        self.coordinator_for = (groups, manager.coordinator)
        return manager.coordinator

    def summary(self) -> list[dict]:
        """Per group: kind, block size, cached blocks (copies counted)."""
        per_group = Counter(g for (g, _h) in self.blocks.elements())
        return [{"group": g, "kind": info.kind, "block_size": info.block_size,
                 "cached_blocks": per_group[g]} for g, info in sorted(self.groups.items())]


# -- prompts to ask about --------------------------------------------------------------


def parse_tokens(text: str) -> list[int]:
    """``"1 2 3"``, ``"1,2,3"`` or ``"[1, 2, 3]"`` -> ``[1, 2, 3]``."""
    words = text.replace("[", " ").replace("]", " ").replace(",", " ").split()
    if not words or not all(w.lstrip("-").isdigit() for w in words):
        raise ValueError(f"--query {text!r}: give token ids, e.g. '1 2 3' or '[1, 2, 3]'")
    return [int(w) for w in words]


def read_queries(texts: list[str], path: str | None, prompts: list[str] = (),
                 tokenize: Callable[[str], list[int]] | None = None
                 ) -> list[tuple[str, list[int]]]:
    """Named prompts from ``--query`` token ids, ``--prompt`` texts and a
    ``--query-file``: JSON lines, each a token-id list or an object with
    ``"prompt_token_ids"`` (or, with a tokenizer, ``"prompt"`` text) and an
    optional ``"id"``; or one JSON list of them. Text needs ``tokenize``."""
    import json

    def tokens_of(text: str, where: str) -> list[int]:
        if tokenize is None:
            raise ValueError(f"{where} is text: give --tokenizer (the served model's "
                             "tokenizer folder) to turn it into token ids")
        return tokenize(text)

    queries = [(f"query {i + 1}", parse_tokens(t)) for i, t in enumerate(texts)]
    queries += [(f"prompt {i + 1}", tokens_of(t, f"--prompt {t[:20]!r}"))
                for i, t in enumerate(prompts)]
    if path is None:
        return queries
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as exc:
        raise ValueError(f"--query-file {path}: {exc.strerror}") from None
    try:
        whole = json.loads(text)
        items = whole if isinstance(whole, list) and all(
            isinstance(x, (list, dict)) for x in whole) and whole else [whole]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"--query-file {path}: line {exc.lineno}: not JSON "
                             f"({exc.msg})") from None
    for n, item in enumerate(items, 1):
        tokens = item.get("prompt_token_ids") if isinstance(item, dict) else item
        if isinstance(item, dict) and tokens is None and isinstance(item.get("prompt"), str):
            tokens = tokens_of(item["prompt"], f"--query-file {path}: prompt {n}")
        if not (isinstance(tokens, list) and tokens and
                all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
            raise ValueError(f"--query-file {path}: prompt {n} is not a list of token ids "
                             "nor {\"prompt_token_ids\": [...]} nor {\"prompt\": TEXT}")
        name = str(item.get("id", f"{path}:{n}")) if isinstance(item, dict) else f"{path}:{n}"
        queries.append((name, tokens))
    return queries


def load_tokenizer(folder: str) -> Callable[[str], list[int]]:
    """A local tokenizer folder (never downloads) as text -> token ids, with the
    special tokens vLLM's ``/v1/completions`` adds by default (the completion
    rule of ``kvref.simulate.text``). A chat request's prompt goes through the
    chat template first: give its token ids instead."""
    from kvref.simulate.text import load_text_tokenizer

    return load_text_tokenizer(folder).completion


def import_zmq():
    """pyzmq and msgspec, or a one-line ``WatchError`` saying how to get them."""
    try:
        import msgspec  # noqa: F401
        import zmq
    except ImportError as exc:
        raise WatchError(f"kvref watch needs {exc.name}: pip install 'kvref[watch]'") from None
    return zmq


# -- data parallel: one publisher, one cache, per rank ----------------------------------


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank ``rank`` publishes, given the endpoint vLLM was
    given: the TCP port plus the rank (``kv_events.py:471-502``; vLLM accepts
    only tcp:// and inproc:// endpoints with more than one rank)."""
    if rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://") or ":" not in endpoint[len("tcp://"):]:
        raise WatchError(f"{endpoint}: with data parallel ranks vLLM publishes only on "
                         "tcp://HOST:PORT endpoints, rank r on PORT + r")
    base, port = endpoint.rsplit(":", 1)
    if not port.isdigit():
        raise WatchError(f"{endpoint}: no port (tcp://HOST:PORT, e.g. tcp://*:5557)")
    return f"{base}:{int(port) + rank}"


def watch_all(watchers: list, *, duration_s: float | None = None,
              max_batches: int | None = None, tick_s: float = 0.25) -> None:
    """Poll every watcher until ``duration_s`` has passed or they applied
    ``max_batches`` batches between them."""
    zmq = import_zmq()
    poller = zmq.Poller()
    for watcher in watchers:
        poller.register(watcher.socket, zmq.POLLIN)
    start = time.monotonic()
    while True:
        left = None if duration_s is None else duration_s - (time.monotonic() - start)
        if (left is not None and left <= 0) or \
                (max_batches is not None and sum(w.batches for w in watchers) >= max_batches):
            return
        wait = tick_s if left is None else max(0.0, min(tick_s, left))
        if poller.poll(int(wait * 1000)):
            for watcher in watchers:
                watcher.poll(0)


# -- the socket -------------------------------------------------------------------------


def server_binds(endpoint: str) -> bool:
    """vLLM's rule for its PUB socket (kv_events.py:393-399)."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")
            or endpoint.startswith("inproc://"))


def watcher_address(endpoint: str, host: str = "127.0.0.1") -> tuple[str, bool]:
    """(address, bind?) for the watcher, given the endpoint the server was given."""
    if endpoint.startswith("inproc://"):
        raise WatchError(f"{endpoint}: an inproc:// endpoint lives inside the server's "
                         "process; give vLLM a tcp:// or ipc:// endpoint to watch it")
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise WatchError(f"{endpoint!r} is not a ZMQ endpoint vLLM publishes on "
                         "(tcp://HOST:PORT, tcp://*:PORT or ipc://PATH)")
    if endpoint.startswith("tcp://"):
        hostport = endpoint[len("tcp://"):]
        port = hostport.rsplit(":", 1)[-1] if ":" in hostport else ""
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise WatchError(f"{endpoint}: no port (tcp://HOST:PORT, e.g. tcp://*:5557)")
    if not server_binds(endpoint):
        return endpoint, True
    server_host, port = endpoint[len("tcp://"):].rsplit(":", 1) if endpoint.startswith(
        "tcp://") else (None, None)
    if server_host in ("*", "[::]"):         # every interface: reach it at --host
        return f"tcp://{host}:{port}", False
    return endpoint, False                   # ipc://, or one address such as [::1]


class Watcher:
    """A SUB socket on vLLM's KV events, and the index they build.

    ``endpoint``: as given to vLLM (``--kv-events-config '{"endpoint": ...}'``);
    ``host``: where to reach a server that binds (``tcp://*:PORT``). With
    ``replay_endpoint`` (vLLM's ``replay_endpoint``, which vLLM binds), missed
    batches are asked for again, from seq 0 at the start.
    """

    def __init__(self, endpoint: str, *, host: str = "127.0.0.1", topic: str = "",
                 replay_endpoint: str | None = None) -> None:
        zmq = import_zmq()

        self.address, self.binds = watcher_address(endpoint, host)
        replay_address = None if replay_endpoint is None else \
            watcher_address(replay_endpoint, host)[0]      # vLLM binds it: we connect
        self.index = PrefixCacheIndex()
        self.next_seq: int | None = None
        self.batches = 0                  # applied
        self.received = 0                 # live messages read (applied or not)
        self.restarts = 0
        self.seq0_ts: float | None = None
        self.missed = 0                   # batches never received (seq gaps)
        self.first_seq: int | None = None
        self.ranks: set = set()
        self.recent: deque = deque(maxlen=8)      # (ts, seq, event), the latest
        self.last_ts: float | None = None
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.replay = None
        self.replay_address = replay_address
        self.pending_replays = 0          # replay requests not answered to the end yet
        self.replay_answers = 0           # messages the replay socket sent back
        try:
            if "[" in self.address:
                self.socket.setsockopt(zmq.IPV6, 1)
            (self.socket.bind if self.binds else self.socket.connect)(self.address)
            if replay_address is not None:
                self.replay = self.context.socket(zmq.DEALER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.connect(replay_address)
        except zmq.ZMQError as exc:
            self.close()
            verb = "bind" if self.binds else "connect to"
            raise WatchError(f"cannot {verb} {self.address}: {exc}") from None
        self.catch_up()

    def close(self) -> None:
        for sock in (self.socket, self.replay):
            if sock is not None:
                sock.close(0)
        self.context.term()

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def poll(self, timeout_s: float, max_messages: int = 1000) -> int:
        """Wait up to ``timeout_s`` for a message, then apply what has arrived (at
        most ``max_messages``, so a busy server still lets the screen redraw); the
        number of batches applied. ``WatchError`` on a message that is not vLLM's."""
        applied = 0
        if not self.socket.poll(int(timeout_s * 1000)):
            return 0
        for _ in range(max_messages):
            if not self.socket.poll(0):
                break
            frames = self.socket.recv_multipart()
            try:
                batch = decode_message(frames)
            except ValueError as exc:
                raise WatchError(f"{self.address}: message {self.received + 1} is not "
                                 f"vLLM's KV events: {exc}") from None
            self.received += 1
            if batch.seq == 0 and self.next_seq and batch.ts != self.seq0_ts:
                self.restart()          # a new publisher counts from 0: a new server
            applied += self._receive(batch)
        return applied

    def restart(self) -> None:
        """The server restarted (its sequence began again at 0): its cache is empty."""
        self.restarts += 1
        self.index = PrefixCacheIndex()
        self.next_seq = self.first_seq = None
        self.missed = 0

    def _receive(self, batch: Batch) -> int:
        expected = 0 if self.next_seq is None else self.next_seq
        if batch.seq < expected and self.next_seq is not None:
            return 0                                   # already applied (replayed)
        if batch.seq > expected and self.replay is not None:
            self.catch_up(timeout_s=1.0)               # the batches in between, first
            if self.next_seq is not None and batch.seq < self.next_seq:
                return 0
            expected = 0 if self.next_seq is None else self.next_seq
        self.missed += batch.seq - expected
        if self.first_seq is None:
            self.first_seq = batch.seq
        if batch.seq == 0:
            self.seq0_ts = batch.ts     # the live copy of a replayed batch is no restart
        for event in batch.events:
            self.index.apply(event)
            self.recent.append((batch.ts, batch.seq, event))
        self.next_seq = batch.seq + 1
        self.batches += 1
        self.ranks.add(batch.data_parallel_rank)
        self.last_ts = batch.ts
        return 1

    def catch_up(self, timeout_s: float = 2.0) -> int:
        """Ask vLLM's replay socket for every batch it still holds from the next
        one expected on (from seq 0 at the start); the number applied. An answer
        that takes longer than ``timeout_s`` is read by a later call."""
        if self.replay is None:
            return 0
        start = 0 if self.next_seq is None else self.next_seq
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        self.pending_replays += 1
        applied = 0
        saved, self.replay = self.replay, None         # no catching up inside a catch-up
        try:
            while self.pending_replays and saved.poll(int(timeout_s * 1000)):
                parts = saved.recv_multipart()
                self.replay_answers += 1
                if len(parts) != 3:
                    raise WatchError(f"replay socket: {len(parts)} frames, expected vLLM's "
                                     "[empty, seq, payload]")
                if int.from_bytes(parts[1], "big", signed=True) == END_SEQ:
                    self.pending_replays -= 1
                    continue
                try:
                    batch = decode_message([b"", parts[1], parts[2]])
                except ValueError as exc:
                    raise WatchError(f"replay socket: not vLLM's KV events: {exc}") from None
                applied += self._receive(batch)
        finally:
            self.replay = saved
        return applied

    def run(self, *, duration_s: float | None = None, max_batches: int | None = None,
            tick_s: float = 0.25) -> None:
        """Poll until ``duration_s`` has passed or ``max_batches`` were applied."""
        watch_all([self], duration_s=duration_s, max_batches=max_batches, tick_s=tick_s)

    def status(self) -> dict:
        return {"endpoint": self.address, "bound": self.binds, "batches": self.batches,
                "first_seq": self.first_seq, "next_seq": self.next_seq,
                "missed_batches": self.missed, "restarts": self.restarts,
                "replay": None if self.replay_address is None else {
                    "endpoint": self.replay_address, "answered": self.replay_answers > 0},
                "events": dict(self.index.counts),
                "sparse_stores": self.index.sparse_stores,
                "data_parallel_ranks": sorted(r for r in self.ranks if r is not None),
                "groups": self.index.summary()}
