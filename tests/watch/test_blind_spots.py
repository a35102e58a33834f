"""What an operator cannot see from vLLM's KV events, and what the watcher can ask.

A LoRA adapter's name and a request's ``cache_salt`` enter vLLM's block hashes as
extra keys (``vllm/v1/core/kv_cache_utils.py:539-574``: the LoRA name on every
block, the salt on the first only), and ``BlockStored`` carries them
(``extra_keys``). So the watcher can answer for such requests when told the name
or salt (``--lora-name``, ``--cache-salt``), and a plain prompt does not hit a
salted cache. kvref's ``BlockPool`` makes the events: its ``BlockStored`` equals
vLLM 0.25.1's recorded one for a LoRA, salted, multimodal request
(``tests/unit/test_block_pool.py::test_block_stored_events_match_vllm``).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvref.core.block_pool import BlockPool
from kvref.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from kvref.hashing import sha256
from kvref.request import LoRARequest, Request
from kvref.watch import PrefixCacheIndex

from tests.watch.test_watch import finish, frames_of, free_port, kvref, sender

BS = 4


@pytest.fixture(autouse=True)
def seeded(monkeypatch):
    from kvref.core import kv_cache_utils as ku

    monkeypatch.setattr(ku, "NONE_HASH", ku.NONE_HASH)
    init_none_hash(sha256)


def index_after(request: Request, blocks: int) -> PrefixCacheIndex:
    """The watcher's index after vLLM-shaped events for ``request``'s first blocks."""
    pool = BlockPool(blocks + 2, enable_caching=True, hash_block_size=BS,
                     enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(blocks), 0, blocks, BS, 0)
    index = PrefixCacheIndex()
    for event in pool.take_events():
        index.apply(dataclasses.replace(event, kv_cache_spec_kind="full_attention"))
    return index


def request(tokens, **kwargs) -> Request:
    return Request("r", list(tokens), block_hasher=get_request_block_hasher(BS, sha256),
                   **kwargs)


TOKENS = list(range(100, 113))       # 3 full blocks and one token


@pytest.mark.parametrize("lora, salt", [("sql", None), (None, "tenant-a"), ("sql", "tenant-a")])
def test_a_lora_or_salted_cache_is_asked_about_with_its_name_and_salt(lora, salt):
    lora_request = None if lora is None else LoRARequest(lora, 7)
    index = index_after(request(TOKENS, lora_request=lora_request, cache_salt=salt), 3)
    assert index.query(TOKENS, lora_name=lora, cache_salt=salt).hit_tokens == 12
    assert index.query(TOKENS).hit_tokens == 0           # a plain request: no hit
    assert index.query(TOKENS, lora_name="other" if lora else None,
                       cache_salt="other" if salt else None).hit_tokens == 0


def test_the_salt_is_only_in_the_first_block_so_a_plain_prompt_misses_all_of_it():
    index = index_after(request(TOKENS, cache_salt="s"), 3)
    first, second = index.prompt_hashes(TOKENS, BS, cache_salt="s")[:2]
    # the second block's key has no salt: it is found through the salted parent only
    assert index.chain[(BS, first, tuple(TOKENS[4:8]), None)] == second


def test_the_command_asks_with_cache_salt_and_lora_name():
    """``--cache-salt`` / ``--lora-name`` reach every query (a recorded batch has
    no salt, so with a salt the same prompt misses)."""
    port = free_port()
    tokens = " ".join(str(t) for t in range(1000, 1012))
    process = kvref("watch", f"tcp://127.0.0.1:{port}", "--batches", 1, "--duration", 60,
                    "--json", "--query", tokens, "--cache-salt", "s1")
    pub = sender(f"tcp://127.0.0.1:{port}")
    pub.send_multipart(frames_of("full")[0])           # stores tokens 1000..1011
    code, out, err = finish(process)
    pub.close(0)
    assert code == 0, err
    assert json.loads(out)["queries"][0]["hit_tokens"] == 0


def test_the_pool_size_is_not_in_events_and_is_said_so_or_taken_from_the_flag():
    from rich.console import Console

    from kvref.viz.watch import render_watch
    from kvref.watch import Watcher

    for flag, says in [(None, "how full the pool is: not in the events"),
                       (16, "of 15 usable blocks hold cached prefixes")]:
        with Watcher(f"tcp://127.0.0.1:{free_port()}", num_gpu_blocks=flag) as watcher:
            watcher.handle(frames_of("full")[0])
            console = Console(width=80, record=True)
            console.print(render_watch(watcher, []))
            text = " ".join(console.export_text().split())
            assert says in text, text
            if flag:
                assert watcher.max_blocks == 16
                assert watcher.status()["pool"] == {"num_gpu_blocks": 16, "cached_blocks": 3}


def test_the_header_fits_an_80_column_terminal():
    """Item 6: the one-line header wrapped at 80 columns."""
    from rich.console import Console

    from kvref.viz.watch import render_watch
    from kvref.watch import Watcher

    with Watcher(f"tcp://127.0.0.1:{free_port()}") as watcher:
        for frame in frames_of("full")[:40]:
            watcher.handle(frame)
        console = Console(width=80, record=True)
        console.print(render_watch(watcher, []))
    head = console.export_text().splitlines()[:3]
    assert head[0].startswith("kvref watch bound at tcp://127.0.0.1:")
    assert head[1].startswith("this server: 40 batches (seq 0..39), ")
    assert "blocks stored" in head[1]
