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


def _is_hash(value: Any) -> bool:
    """vLLM's ExternalBlockHash: bytes, or an int (``kv_events.py``)."""
    return isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def decode_event(item: Any) -> KVCacheEvent:
    """One msgpack-decoded event map as kvref's event; ``ValueError`` if it is not one.

    Every field is checked against the type vLLM sends, so nothing that reaches the
    index can make it fail later (a block size of 0, a hash that is a map)."""
    if not isinstance(item, dict) or item.get("type") not in EVENT_TYPES:
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise ValueError(f"an event of type {str(kind)[:40]!r} "
                         f"(vLLM sends {', '.join(EVENT_TYPES)})")
    kind = item["type"]
    try:
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        hashes = item["block_hashes"]
        _check(isinstance(hashes, list) and all(_is_hash(h) for h in hashes),
               "block_hashes (a list of ints or bytes)")
        group = item.get("group_idx")
        _check(group is None or (_is_int(group) and group >= 0), "group_idx")
        medium = item["medium"]
        _check(medium is None or isinstance(medium, str), "medium")
        if kind == "BlockRemoved":
            return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)
        parent, tokens, size = item["parent_block_hash"], item["token_ids"], item["block_size"]
        _check(parent is None or _is_hash(parent), "parent_block_hash")
        _check(isinstance(tokens, list) and all(_is_int(t) for t in tokens), "token_ids")
        _check(_is_int(size) and size > 0, "block_size (a positive int)")
        extra = item.get("extra_keys")
        _check(extra is None or (isinstance(extra, list) and len(extra) == len(hashes)),
               "extra_keys (one per block)")
        extra = None if extra is None else [frozen(k) for k in extra]
        hash(tuple(extra or ()))                       # a map inside: TypeError
        lora_id, lora_name = item["lora_id"], item["lora_name"]
        _check(lora_id is None or _is_int(lora_id), "lora_id")
        _check(lora_name is None or isinstance(lora_name, str), "lora_name")
        spec_kind = item.get("kv_cache_spec_kind")
        window = item.get("kv_cache_spec_sliding_window")
        _check(spec_kind is None or isinstance(spec_kind, str), "kv_cache_spec_kind")
        _check(window is None or (_is_int(window) and window > 0),
               "kv_cache_spec_sliding_window")
        return BlockStored(
            block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
            block_size=size, lora_id=lora_id, medium=medium, lora_name=lora_name,
            extra_keys=extra, group_idx=group, kv_cache_spec_kind=spec_kind,
            kv_cache_spec_sliding_window=window)
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"a {kind} without a valid {str(exc)[:60]}") from None


class Batch(NamedTuple):
    seq: int
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None


def decode_message(frames: list[bytes]) -> Batch:
    """``[topic, seq, payload]`` as vLLM's publisher sends it; ``ValueError``
    (saying what was found) for anything else, whatever the bytes."""
    import math

    import msgspec

    if len(frames) != 3 or len(frames[1]) != 8:
        sizes = ", ".join(f"{len(f)} bytes" for f in frames[:4])
        raise ValueError(f"{len(frames)} frames ({sizes}{', ...' if len(frames) > 4 else ''}); "
                         "vLLM sends 3: topic, an 8-byte sequence number, a msgpack "
                         "KVEventBatch")
    try:
        body = msgspec.msgpack.decode(frames[2])
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError) as exc:
        raise ValueError(f"a payload that is not msgpack ({str(exc)[:60]})") from None
    if not (isinstance(body, list) and 2 <= len(body) <= 3 and
            isinstance(body[0], (int, float)) and not isinstance(body[0], bool) and
            math.isfinite(body[0]) and isinstance(body[1], list)):
        raise ValueError(f"a payload of {type(body).__name__} {str(body)[:60]!r}, not a "
                         "KVEventBatch [ts, events, data_parallel_rank]")
    rank = body[2] if len(body) == 3 else None
    if not (rank is None or _is_int(rank)):
        raise ValueError(f"a data_parallel_rank of {type(rank).__name__}, not an int")
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
    blocks_stored: int = 0                                 # blocks, not events
    blocks_removed: int = 0
    cached_blocks: int = 0                                 # copies held: sum of blocks
    coordinator_for: tuple | None = None                   # (groups, kvref coordinator)

    def apply(self, event: KVCacheEvent) -> None:
        self.counts[type(event).__name__] += 1
        if isinstance(event, BlockStored):
            self.blocks_stored += len(event.block_hashes)
            self._store(event)
        elif isinstance(event, BlockRemoved):
            self.blocks_removed += len(event.block_hashes)
            for h in event.block_hashes:
                key = (event.group_idx, h)
                self.cached_blocks -= key in self.blocks
                if self.blocks[key] <= 1:
                    self.blocks.pop(key, None)
                else:
                    self.blocks[key] -= 1
                self._release(h)
        elif isinstance(event, AllBlocksCleared):
            for name in ("blocks", "chain", "chain_key_of", "holders"):
                getattr(self, name).clear()
            self.cached_blocks = 0

    def _store(self, event: BlockStored) -> None:
        g = event.group_idx
        if g not in self.groups or event.block_size > self.groups[g].block_size:
            # (a partial-block entry, kv_events of cache_partial_block, is smaller)
            self.groups[g] = GroupInfo(event.kv_cache_spec_kind, event.block_size,
                                       event.kv_cache_spec_sliding_window)
        for h in event.block_hashes:
            self.blocks[(g, h)] += 1
            self.holders[h] += 1
        self.cached_blocks += len(event.block_hashes)
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

    def prompt_hashes(self, tokens: list[int], block_size: int, *,
                      lora_name: str | None = None, cache_salt: str | None = None) -> list[Any]:
        """The prompt's leading block hashes the chain knows. A block's extra keys
        are vLLM's (``generate_block_hash_extra_keys``, kv_cache_utils.py:539-574):
        the LoRA name on every block, then the cache salt on the first one only;
        none for a plain prompt (multimodal prompts are not modelled)."""
        hashes, parent = [], None
        for i in range(len(tokens) // block_size):
            extra = ([lora_name] if lora_name else []) + ([cache_salt] if cache_salt and
                                                          i == 0 else [])
            h = self.chain.get((block_size, parent, tuple(tokens[i * block_size:
                                                               (i + 1) * block_size]),
                                tuple(extra) if extra else None))
            if h is None:
                break
            hashes.append(h)
            parent = h
        return hashes

    def query(self, tokens: list[int], *, lora_name: str | None = None,
              cache_salt: str | None = None) -> Answer:
        """How many tokens of ``tokens``, sent as a new request (with that LoRA
        adapter's name and that ``cache_salt``, if given), the cache would serve:
        kvref's own hit search (the coordinator's, vLLM's rule for every group kind
        below) run on a pool that answers from this index."""
        if not self.groups:
            return Answer(len(tokens), 0, {}, "no block stored yet")
        size = min(info.block_size for info in self.groups.values())
        modelled = {g: info for g, info in sorted(self.groups.items())
                    if info.block_size == size and spec_of(info) is not None}
        hashes = self.prompt_hashes(tokens, size, lora_name=lora_name, cache_salt=cache_salt)
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
    ``max_batches`` batches between them. Every wait inside is bounded, so the
    deadline holds whatever the sockets do. ``WatchError`` when an endpoint is
    not what it should be (see ``Watcher.fault``)."""
    start = time.monotonic()
    while True:
        left = None if duration_s is None else duration_s - (time.monotonic() - start)
        if (left is not None and left <= 0) or \
                (max_batches is not None and sum(w.batches for w in watchers) >= max_batches):
            return
        wait = tick_s if left is None else max(0.0, min(tick_s, left))
        for watcher in watchers:
            watcher.poll(wait / len(watchers))
            fault = watcher.fault()
            if fault:
                raise WatchError(fault)


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
        if not port.isdigit():
            raise WatchError(f"{endpoint}: no port (tcp://HOST:PORT, e.g. tcp://*:5557)")
        if not 0 < int(port) < 65536:
            raise WatchError(f"{endpoint}: port {port} is out of range (1 to 65535)")
    if not server_binds(endpoint):
        return endpoint, True
    server_host, port = endpoint[len("tcp://"):].rsplit(":", 1) if endpoint.startswith(
        "tcp://") else (None, None)
    if server_host in ("*", "[::]"):         # every interface: reach it at --host
        return f"tcp://{host}:{port}", False
    return endpoint, False                   # ipc://, or one address such as [::1]


def bind_hint(endpoint: str, error: str) -> str:
    """Why the watcher binds ``endpoint``, and what to give instead, in one line."""
    port = endpoint.rsplit(":", 1)[-1]
    return (f"cannot bind {endpoint}: {error}. The watcher binds because vLLM, given "
            f"tcp://HOST:PORT, connects; give ENDPOINT exactly as vLLM was given it: its "
            f"default tcp://*:{port} binds in vLLM, and the watcher then connects (--host)")


CONNECT_WAIT_S = 5.0         # how long before "nothing is there" is said
SILENCE_S = 30.0             # after a silence this long, the next batch is checked
REPLAY_TIMEOUT_S = 1.0       # the most the replay socket may take for each message
MAX_MESSAGE_BYTES = 64 << 20     # a larger frame drops the sender (ZMQ's MAXMSGSIZE)
MAX_INDEX_BLOCKS = 1 << 22   # a batch that would grow the index past this is dropped
MAX_REPLAY_BATCHES = 100_000     # vLLM keeps buffer_steps (10 000 by default)


class Link:
    """What ZMQ's socket monitor says of one socket's peer: ``state`` is
    ``waiting`` (nothing yet), ``refused`` (connections refused), ``connected``
    (a ZMQ handshake succeeded), ``wrong type`` (a TCP connection whose ZMQ
    handshake failed: another socket type) or ``gone`` (the peer went away);
    ``since``: monotonic time of the last change."""

    def __init__(self, socket, zmq) -> None:
        self.zmq, self.socket = zmq, socket
        events = (zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED |
                  zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED |
                  zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.monitor = socket.get_monitor_socket(events)
        self.state, self.since = "waiting", time.monotonic()
        self.pending = 0                 # TCP connections not through the handshake yet
        self.peers = 0
        self.ever_connected = False

    def _set(self, state: str) -> None:
        if state != self.state:
            self.state, self.since = state, time.monotonic()

    def read(self) -> bool:
        """Take the monitor's news; True when a connected peer went away."""
        from zmq.utils.monitor import recv_monitor_message

        zmq, lost = self.zmq, False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.pending += 1
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.pending = max(0, self.pending - 1)
                self.peers += 1
                self.ever_connected = True
                self._set("connected")
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                           zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                if not self.peers:
                    self._set("wrong type")
            elif event == zmq.EVENT_DISCONNECTED:
                if self.pending:                 # dropped before its handshake
                    self.pending -= 1
                    if not self.peers:
                        self._set("wrong type")
                elif self.peers:
                    self.peers -= 1
                    if not self.peers:
                        lost = True
                        self._set("gone")
            elif event == zmq.EVENT_CONNECT_RETRIED and not self.peers and \
                    self.state not in ("wrong type", "gone"):
                self._set("refused")
        return lost

    def close(self) -> None:
        try:
            self.socket.disable_monitor()
        except self.zmq.ZMQError:
            pass
        self.monitor.close(0)


class Watcher:
    """A SUB socket on vLLM's KV events, and the index they build.

    ``endpoint``: as given to vLLM (``--kv-events-config '{"endpoint": ...}'``);
    ``host``: where to reach a server that binds (``tcp://*:PORT``). With
    ``replay_endpoint`` (vLLM's ``replay_endpoint``, which vLLM binds), missed
    batches are asked for again, from seq 0 at the start.

    The index follows the server, not the socket. vLLM's publisher numbers its
    batches from 0 (``kv_events.py:334``, ``count()``) and a new server process
    starts again, with an empty cache. So the watcher starts a new index when the
    sequence goes back at a later time, and checks a batch before trusting it
    after a gap, a lost connection or ``SILENCE_S`` of silence: with a replay
    socket it asks for the last batch it applied, and a different batch there
    means a different server, whose history it then replays from 0. What it
    cannot check, it marks: ``unknown_since`` (wall time, reason).
    """

    def __init__(self, endpoint: str, *, host: str = "127.0.0.1", topic: str = "",
                 replay_endpoint: str | None = None, max_blocks: int = MAX_INDEX_BLOCKS,
                 silence_s: float = SILENCE_S, num_gpu_blocks: int | None = None) -> None:
        zmq = self.zmq = import_zmq()

        self.address, self.binds = watcher_address(endpoint, host)
        self.replay_address = None if replay_endpoint is None else \
            watcher_address(replay_endpoint, host)[0]      # vLLM binds it: we connect
        if self.replay_address == self.address:
            raise WatchError(f"--replay {replay_endpoint}: the event endpoint again; vLLM's "
                             "replay_endpoint is a second port (its kv-events-config)")
        # The pool's size is not in any event: given (vLLM's num_gpu_blocks), it
        # shows how much of the pool holds cached prefixes, and bounds the index.
        self.num_gpu_blocks = num_gpu_blocks
        self.max_blocks = max_blocks if num_gpu_blocks is None else min(max_blocks,
                                                                         num_gpu_blocks)
        self.silence_s = silence_s
        self.index = PrefixCacheIndex()
        self.next_seq: int | None = None
        self.last_ts: float | None = None     # the publisher's time of the last batch applied
        self.first_seq: int | None = None     # this server's first batch applied
        self.batches = 0                  # applied, every server
        self.server_batches = 0           # applied since this index began
        self.received = 0                 # live messages read (applied or not)
        self.dropped = 0                  # messages that were not vLLM's KV events
        self.last_dropped = ""
        self.duplicates = 0               # batches already applied (from the replay socket)
        self.restarts: list[tuple[float, str]] = []     # (wall time, how it was seen)
        self.missed = 0                   # batches never received (seq gaps), this index
        self.unknown_since: tuple[float, str] | None = None
        self.check_next: str | None = None      # why the next batch must be checked
        self.last_check = 0.0
        self.started = time.monotonic()
        self.last_message: float | None = None  # monotonic time of the last message read
        self.ranks: set = set()
        self.recent: deque = deque(maxlen=8)      # (ts, seq, event), this server's latest
        self.last_reset: float | None = None      # wall time an AllBlocksCleared arrived
        self.replay_answers = 0           # messages the replay socket sent back
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.link = Link(self.socket, zmq)
        self.replay = self.replay_link = None
        try:
            if "[" in self.address:
                self.socket.setsockopt(zmq.IPV6, 1)
            (self.socket.bind if self.binds else self.socket.connect)(self.address)
            self._open_replay()
        except zmq.ZMQError as exc:
            self.close()
            if self.binds and self.address.startswith("tcp://"):
                raise WatchError(bind_hint(self.address, str(exc))) from None
            verb = "bind" if self.binds else "connect to"
            raise WatchError(f"cannot {verb} {self.address}: {exc}") from None
        self.catch_up()

    # -- sockets ------------------------------------------------------------------------

    def _open_replay(self) -> None:
        if self.replay_address is None:
            return
        zmq = self.zmq
        self.replay = self.context.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.replay.setsockopt(zmq.SNDTIMEO, 0)
        self.replay_link = Link(self.replay, zmq)
        self.replay.connect(self.replay_address)

    def _close_replay(self) -> None:
        if self.replay is not None:
            self.replay_link.close()
            self.replay.close(0)
            self.replay = None

    def close(self) -> None:
        self._close_replay()
        self.link.close()
        self.socket.close(0)
        self.context.term()

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read_links(self) -> None:
        if self.link.read() and self.next_seq is not None:
            self._mark_unknown("the server went away")
            self.check_next = "the connection was lost"
        if self.replay_link is not None:
            self.replay_link.read()

    # -- reading --------------------------------------------------------------------------

    def poll(self, timeout_s: float, max_messages: int = 1000) -> int:
        """Wait up to ``timeout_s`` for a message, then apply what has arrived (at
        most ``max_messages``, so a busy server still lets the screen redraw); the
        number of batches applied. A message that is not vLLM's is dropped and
        counted (``dropped``, ``last_dropped``); it never raises for one."""
        self._read_links()
        applied = 0
        if self.socket.poll(int(timeout_s * 1000)):
            self._read_links()            # a lost connection is news before its messages
            for _ in range(max_messages):
                if not self.socket.poll(0):
                    break
                applied += self.handle(self.socket.recv_multipart())
        self._check_idle_server()
        if (self.last_message is not None and self.check_next is None and
                self.replay is not None and
                time.monotonic() - self.last_message > self.silence_s):
            self.check_next = f"no message for {self.silence_s:g} s"
        return applied

    def handle(self, frames: list[bytes]) -> int:
        """One live message: applied (1), or dropped, a duplicate, or a sign of a
        new server (0 or what the replay socket gave)."""
        self.received += 1
        self.last_message = time.monotonic()
        try:
            batch = decode_message(frames)
        except ValueError as exc:
            self._drop(f"message {self.received} is not vLLM's KV events: {exc}")
            return 0
        why = None
        if self.next_seq is not None:
            if batch.seq < self.next_seq:
                if batch.ts <= self.last_ts:
                    self.duplicates += 1          # already applied, or out of order
                    return 0
                self._start_over(f"its batch numbers went back from {self.next_seq - 1} "
                                 f"to {batch.seq}", restart=True)
            elif batch.seq > self.next_seq:
                why = f"batches {self.next_seq}..{batch.seq - 1} never arrived"
            elif self.check_next:
                why = self.check_next
        self.check_next = None
        applied = 0
        if why is not None and self.replay is not None:
            resynced = self._resync(why)
            if resynced is None:              # no answer: this batch waits in vLLM's
                self.check_next = why         # buffer for the next check
                return 0
            applied += resynced
        elif why is not None:
            self._mark_unknown(f"{why}; without --replay they cannot be fetched, nor a "
                               "restarted server told apart")
        elif self.next_seq is None and batch.seq > 0 and self.replay is not None:
            applied += self.catch_up()                # this server's earlier batches
        return applied + self._apply(batch)

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self.last_dropped = reason

    def _mark_unknown(self, reason: str) -> None:
        if self.unknown_since is None:
            self.unknown_since = (time.time(), reason)

    def _start_over(self, how: str, *, restart: bool) -> None:
        """A new index: the server restarted (``restart``) or its history must be
        read again from the replay socket."""
        if restart:
            self.restarts.append((time.time(), how))
        self.index = PrefixCacheIndex()
        self.next_seq = self.first_seq = self.last_ts = None
        self.missed = self.server_batches = 0
        self.unknown_since = self.last_reset = None
        self.recent.clear()

    def _apply(self, batch: Batch) -> int:
        if self.next_seq is not None and batch.seq < self.next_seq:
            self.duplicates += 1
            return 0
        if self._would_hold(batch) > self.max_blocks:
            self._drop(f"batch {batch.seq} would make the index hold more than "
                       f"{self.max_blocks} blocks")
            self._mark_unknown(f"batch {batch.seq} was dropped")
            self.next_seq = batch.seq + 1
            return 0
        expected = 0 if self.next_seq is None else self.next_seq
        if batch.seq > expected:
            self.missed += batch.seq - expected
            self._mark_unknown(f"{plural_batches(batch.seq - expected)} before batch "
                               f"{batch.seq} never arrived")
        if self.first_seq is None:
            self.first_seq = batch.seq
        for event in batch.events:
            self.index.apply(event)
            self.recent.append((batch.ts, batch.seq, event))
            if isinstance(event, AllBlocksCleared):
                self.last_reset = time.time()
        self.next_seq, self.last_ts = batch.seq + 1, batch.ts
        self.batches += 1
        self.server_batches += 1
        self.ranks.add(batch.data_parallel_rank)
        return 1

    def _would_hold(self, batch: Batch) -> int:
        """How many blocks the index would hold after ``batch``, counting each
        removal as one fewer (a removal of an unknown hash makes this an
        underestimate by one; the next batch is checked against the real count)."""
        held = self.index.cached_blocks
        for event in batch.events:
            if isinstance(event, BlockStored):
                held += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held -= len(event.block_hashes)
            else:
                held = 0
        return held

    # -- the replay socket ----------------------------------------------------------------

    def ask_replay(self, start: int, timeout_s: float = REPLAY_TIMEOUT_S) -> list[Batch] | None:
        """Every batch vLLM's replay socket holds from ``start`` on, or None when it
        does not answer within ``timeout_s`` a message (the socket is then opened
        again, so a late answer is not read as the next one's)."""
        if self.replay is None:
            return None
        zmq = self.zmq
        try:
            self.replay.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
        except zmq.Again:             # no peer: nothing listens there, or not a ROUTER
            return None
        batches: list[Batch] = []
        while True:
            self.replay_link.read()
            if not self.replay.poll(int(timeout_s * 1000)):
                self._close_replay()
                self._open_replay()
                return None
            parts = self.replay.recv_multipart()
            self.replay_answers += 1
            self.last_message = time.monotonic()
            if len(parts) != 3 or len(parts[1]) != 8:
                self._drop(f"the replay socket sent {len(parts)} frames, not vLLM's "
                           "[empty, seq, payload]")
                continue
            if int.from_bytes(parts[1], "big", signed=True) == END_SEQ:
                return batches
            try:
                batches.append(decode_message([b"", parts[1], parts[2]]))
            except ValueError as exc:
                self._drop(f"the replay socket sent what is not vLLM's KV events: {exc}")
            if len(batches) > MAX_REPLAY_BATCHES:
                self._close_replay()
                self._open_replay()
                return None

    def catch_up(self, timeout_s: float = 2.0) -> int:
        """Ask vLLM's replay socket for every batch it still holds from the next
        one expected on (from seq 0 at the start); the number applied."""
        if self.replay is None:
            return 0
        answer = self.ask_replay(0 if self.next_seq is None else self.next_seq, timeout_s)
        return sum(self._apply(b) for b in sorted(answer or [], key=lambda b: b.seq))

    def _resync(self, why: str) -> int | None:
        """Check with the replay socket that the server is the one whose batches
        were applied, and fill in what was missed; if it is another, rebuild the
        index from its history. The number of batches applied; None when the
        replay socket did not answer (nothing changed but the mark)."""
        last = self.next_seq - 1
        answer = self.ask_replay(last)
        if answer is None:
            self._mark_unknown(f"{why}, and the replay socket did not answer")
            return None
        if answer and answer[0].seq == last and answer[0].ts == self.last_ts:
            self.unknown_since = None if not self.missed else self.unknown_since
            return sum(self._apply(b) for b in answer[1:])      # the same server
        if not answer or answer[0].seq == last:
            how = (f"{why}; the replay socket has no batch {last}" if not answer else
                   f"{why}; the replay socket's batch {last} is another one")
            self._start_over(how, restart=True)
        else:
            self._start_over(f"{why}; the replay socket no longer holds batch {last}",
                             restart=False)
        history = answer if answer and answer[0].seq == 0 else self.ask_replay(0)
        if history is None:
            self._mark_unknown(f"{why}, and the replay socket did not answer")
            return 0
        return sum(self._apply(b) for b in history)

    def _check_idle_server(self) -> None:
        """After a lost connection, check as soon as the server is back, without
        waiting for its next batch: a restarted server that is idle would otherwise
        be shown with the old server's cache (at most one try a second)."""
        now = time.monotonic()
        if (self.check_next and self.replay is not None and self.next_seq is not None and
                self.link.state == "connected" and now - self.last_check >= 1.0):
            self.last_check = now
            if self._resync(self.check_next) is not None:
                self.check_next = None

    # -- what to say ----------------------------------------------------------------------

    def fault(self) -> str | None:
        """A line when an endpoint is certainly wrong: the first messages are not
        vLLM's, or a socket of another type answers there."""
        if self.dropped and not self.batches and "replay socket" not in self.last_dropped:
            return f"{self.address}: {self.last_dropped}"
        if self.link.state == "wrong type" and not self.link.ever_connected:
            return (f"{self.address} answers, but not as vLLM's KV-events PUB socket (the ZMQ "
                    "handshake fails): is that the replay_endpoint? give the endpoint")
        if self.replay_link is not None and self.replay_link.state == "wrong type" and \
                not self.replay_link.ever_connected:
            return (f"--replay {self.replay_address} answers, but not as vLLM's replay ROUTER "
                    "socket (the ZMQ handshake fails): is that the event endpoint?")
        return None

    def connection(self) -> dict:
        """Whether a server is there: ``state`` and a line saying it."""
        link, now = self.link, time.monotonic()
        waited = now - link.since
        state = link.state
        if state == "connected":
            text = (f"bound at {self.address}, vLLM connected" if self.binds else
                    f"connected to {self.address}")
        elif state == "gone":
            text = (f"the server at {self.address} went away {waited:.0f} s ago; waiting for "
                    "it to come back")
        elif state == "wrong type":
            text = f"{self.address} answers, but not as a PUB socket (the handshake fails)"
        elif waited < CONNECT_WAIT_S and now - self.started < CONNECT_WAIT_S:
            text = (f"bound at {self.address}, waiting for vLLM to connect" if self.binds
                    else f"connecting to {self.address}")
        elif self.binds:
            state = "no server"
            text = (f"bound at {self.address}: no server has connected in "
                    f"{now - self.started:.0f} s (was vLLM given this endpoint?)")
        else:
            state = "no server"
            text = (f"nothing accepts connections at {self.address} (for "
                    f"{now - self.started:.0f} s): is the server up, and is this its "
                    "KV-events endpoint?")
        return {"state": state, "text": text}

    def status(self) -> dict:
        now = time.monotonic()
        replay = None
        if self.replay_address is not None:
            replay = {"endpoint": self.replay_address, "answered": self.replay_answers > 0,
                      "state": self.replay_link.state if self.replay_link else "closed"}
        unknown = self.unknown_since
        return {"endpoint": self.address, "bound": self.binds,
                "connection": self.connection(),
                "last_message_s_ago": None if self.last_message is None else
                round(now - self.last_message, 1),
                "index_exact": unknown is None,
                "unknown_since": None if unknown is None else time.strftime(
                    "%H:%M:%S", time.localtime(unknown[0])),
                "unknown_because": None if unknown is None else unknown[1],
                "batches": self.batches, "server_batches": self.server_batches,
                "first_seq": self.first_seq, "next_seq": self.next_seq,
                "missed_batches": self.missed, "restarts": len(self.restarts),
                "restarts_seen": [{"at": time.strftime("%H:%M:%S", time.localtime(t)),
                                   "how": how} for t, how in self.restarts],
                "cache_reset_at": None if self.last_reset is None else time.strftime(
                    "%H:%M:%S", time.localtime(self.last_reset)),
                "dropped_messages": self.dropped, "last_dropped": self.last_dropped or None,
                "duplicate_batches": self.duplicates,
                "replay": replay,
                "events": dict(self.index.counts),
                "blocks_stored": self.index.blocks_stored,
                "blocks_removed": self.index.blocks_removed,
                "sparse_stores": self.index.sparse_stores,
                "pool": {"num_gpu_blocks": self.num_gpu_blocks,
                         "cached_blocks": self.index.cached_blocks},
                "data_parallel_ranks": sorted(r for r in self.ranks if r is not None),
                "groups": self.index.summary()}


def plural_batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"
