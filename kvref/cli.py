"""The ``kvref`` command line.

    kvref demo            walk through prefix caching on a small pool, step by step
    kvref replay PATH...  replay recorded vLLM traces against kvref
"""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.progress import Progress
from rich.rule import Rule

from kvref import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    RequestStatus,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)
from kvref.viz import render_pool

BLOCK_SIZE = 4


def _demo_steps(manager: KVCacheManager, hasher):
    """The scenario as (narration, action) pairs; each action runs one scheduler move."""
    system_prompt = [101, 102, 103, 104, 105, 106, 107, 108]   # 2 blocks
    reqs = {}

    def arrive(name, tokens):
        req = Request(name, tokens, block_hasher=hasher)
        reqs[name] = req
        hit, num_hit = manager.get_computed_blocks(req)
        new = manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit)
        if new is None:
            return f"prefix hit: {num_hit} tokens; no room: allocate_slots returned None"
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_tokens
        return (f"prefix hit: {num_hit} tokens {hit.get_block_ids()[0]}; "
                f"new blocks {new.get_block_ids()[0]}")

    def decode(name, token):
        req = reqs[name]
        req.append_output_token_ids(token)
        new = manager.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        return f"new blocks {new.get_block_ids()[0]}" if new.get_block_ids()[0] else \
            "fits in the last block"

    def finish(name):
        manager.free(reqs[name])
        return "blocks freed tail first: cached ones go to the back of the queue"

    yield ("Request A arrives: a 2-block system prompt and 3 tokens of its own. Nothing "
           "is cached yet; it gets 3 blocks and its 2 full blocks are cached.",
           lambda: arrive("A", system_prompt + [1, 2, 3]))
    yield ("A decodes one token: it completes block 3, which gets cached too.",
           lambda: decode("A", 4))
    yield ("Request B arrives with the same system prompt: the 2 cached blocks are a "
           "prefix hit, shared (ref count 2).",
           lambda: arrive("B", system_prompt + [9, 9, 9, 9, 9]))
    yield ("A finishes. Its private blocks become free but stay cached (○); the shared "
           "prefix is still held by B.", lambda: finish("A"))
    yield ("Request C repeats A's whole conversation: it hits 3 blocks. The hit stops "
           "one token short of the prompt: the last token is always recomputed.",
           lambda: arrive("C", system_prompt + [1, 2, 3, 4, 5]))
    yield ("B finishes. Its unfinished last block has no hash: nobody can hit it, so it "
           "goes to the FRONT of the free queue. Its cached block goes to the back.",
           lambda: finish("B"))
    yield ("Request D needs 7 blocks. They come from the head of the queue: B's "
           "unhashed block first, and last of all the cached block 4, which is evicted.",
           lambda: arrive("D", list(range(500, 528))))
    yield ("Everyone finishes; reset_prefix_cache then forgets every cached prefix.",
           lambda: (finish("C"), finish("D"),
                    f"reset_prefix_cache() -> {manager.reset_prefix_cache()}")[-1])


def run_demo(console: Console, pause: float = 0.0) -> int:
    init_none_hash(sha256)
    config = KVCacheConfig(num_blocks=12, kv_cache_groups=[
        KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size=BLOCK_SIZE))])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=BLOCK_SIZE,
                             hash_block_size=BLOCK_SIZE, enable_caching=True)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    console.print(Rule("kvref demo: prefix caching on an 11-block pool, 4 tokens per block"))
    console.print(render_pool(manager))
    for n, (story, action) in enumerate(_demo_steps(manager, hasher), start=1):
        console.print(Rule(f"step {n}"))
        console.print(story)
        console.print(f"[bold]->[/bold] {action()}")
        console.print(render_pool(manager))
        if pause:
            time.sleep(pause)
    return 0


def run_replay(console: Console, paths: list[str], compare_hashes: bool,
               check_invariants: bool = False) -> int:
    from kvref.verify.trace_replay import find_traces, replay_file

    files = list(find_traces(paths))
    if not files:
        console.print(f"[red]no trace files under {paths}[/red]")
        return 2
    divergent, ops = [], 0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replaying", total=len(files))
        for path in files:
            result = replay_file(path, compare_hashes, check_invariants)
            ops += result.num_ops
            if result.divergence is not None:
                divergent.append((path, result.divergence))
            progress.advance(task)
    for path, divergence in divergent:
        console.print(f"[red]DIVERGENCE[/red] {path}: {divergence}")
    console.print(f"{len(files)} traces, {ops} ops, {len(divergent)} divergent traces")
    return 1 if divergent else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvref", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="step through prefix caching on a small pool")
    demo.add_argument("--pause", type=float, default=0.0, help="seconds between steps")
    rep = sub.add_parser("replay", help="replay recorded vLLM traces against kvref")
    rep.add_argument("paths", nargs="+", help="trace files or folders")
    rep.add_argument("--no-hashes", action="store_true",
                     help="do not compare hash values (their count still is)")
    rep.add_argument("--check-invariants", action="store_true",
                     help="also assert the invariants of specs/ after every op")
    args = parser.parse_args(argv)
    console = Console()
    if args.command == "demo":
        return run_demo(console, args.pause)
    return run_replay(console, args.paths, not args.no_hashes, args.check_invariants)


if __name__ == "__main__":
    sys.exit(main())
