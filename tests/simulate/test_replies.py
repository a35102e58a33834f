"""``kvref simulate`` with the replies a server gave (``output_token_ids``).

A chat's next turn sends the previous turn's reply back. On vLLM that reply's
blocks were cached as they filled during decode, so the resent reply hits. The
simulation generates the trace's replies when it has them; without them it
generates stand-in tokens, the resent replies miss, and the report says so.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from kvref.cli import main
from kvref.simulate import TraceError, load_trace, pool_from_tokens, simulate

ROOT = Path(__file__).resolve().parents[2]
ORACLE = Path("/root/.cache/vllm-oracle/bin/python")


def chat_log(seed: int = 7, users: int = 4, requests: int = 30) -> list[dict]:
    """A hand-made chat log: ``users`` conversations over one 120-token system
    prompt, turns taken in turn, each turn's prompt the whole conversation so far
    (system, then each earlier message and reply, then the new message), each
    with the reply it got. Token ids as a tokenizer would give them."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 30000) for _ in range(120)]
    history = {u: list(system) for u in range(users)}
    lines = []
    for i in range(requests):
        user = rng.randrange(users)
        message = [rng.randrange(100, 30000) for _ in range(rng.randrange(12, 48))]
        reply = [rng.randrange(100, 30000) for _ in range(rng.randrange(16, 70))]
        prompt = history[user] + message
        lines.append({"request_id": f"u{user}-{i}", "prompt_token_ids": prompt,
                      "output_token_ids": reply, "arrival_s": 2.0 * i})
        history[user] = prompt + reply
    return lines


def write(path: Path, lines: list[dict], replies: bool = True) -> Path:
    with path.open("w") as f:
        for line in lines:
            if not replies:
                line = {k: v for k, v in line.items() if k != "output_token_ids"} | {
                    "max_tokens": len(line["output_token_ids"])}
            f.write(json.dumps(line) + "\n")
    return path


def test_a_resent_reply_hits_when_the_trace_gives_it(tmp_path):
    lines = chat_log()
    given = load_trace(write(tmp_path / "given.jsonl", lines))
    stand_in = load_trace(write(tmp_path / "stand_in.jsonl", lines, replies=False))
    pool = pool_from_tokens(4096)
    with_replies = simulate(given, pool)
    without = simulate(stand_in, pool)
    assert with_replies.requests_with_replies == 30 and without.requests_with_replies == 0
    # Same prompts, same output lengths: only the generated tokens differ.
    assert with_replies.prompt_tokens == without.prompt_tokens
    assert with_replies.output_tokens == without.output_tokens == sum(
        len(line["output_token_ids"]) for line in lines)
    # Every turn after a user's first resends the previous turn's prompt (cached
    # either way) and its reply. Given, the reply is cached up to the block its last
    # token ends (that sampled token's KV is never computed); as stand-ins, it is a
    # first occurrence. So the gain is the replies resent, each within a block.
    reply_tokens_resent, turns_after_first = 0, 0
    last_reply: dict[str, int] = {}
    for line in lines:
        user = line["request_id"].split("-")[0]
        if user in last_reply:
            reply_tokens_resent += last_reply[user]
            turns_after_first += 1
        last_reply[user] = len(line["output_token_ids"])
    gained = with_replies.prompt_tokens_cached_once - without.prompt_tokens_cached_once
    assert abs(gained - reply_tokens_resent) < 16 * turns_after_first
    assert gained > 0.6 * reply_tokens_resent
    # The gain comes out of first_occurrence (a few tokens of it move to the blocks
    # a reply's end leaves partial: shared_prefix_ends_inside_block).
    drop = without.misses_by_cause["first_occurrence"] - with_replies.misses_by_cause[
        "first_occurrence"]
    inside = "shared_prefix_ends_inside_block"
    assert drop == gained + with_replies.misses_by_cause[inside] - without.misses_by_cause[inside]
    assert drop >= gained
    # docs/simulate.md quotes these two figures.
    assert (round(without.hit_ratio_once, 3), round(with_replies.hit_ratio_once, 3)) == (
        0.819, 0.901)


def test_the_model_generates_exactly_the_reply(tmp_path):
    from kvref.simulate.engine import SimulationRunner

    seen = {}
    original = SimulationRunner._execute

    def spy(self, scheduler_output):
        out = original(self, scheduler_output)
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids):
            seen.setdefault(rid, []).extend(tokens)
        return out

    lines = chat_log(requests=6)
    SimulationRunner._execute = spy
    try:
        simulate(load_trace(write(tmp_path / "t.jsonl", lines)), pool_from_tokens(2048))
    finally:
        SimulationRunner._execute = original
    assert {line["request_id"]: line["output_token_ids"] for line in lines} == seen


def test_the_report_says_whose_replies_were_generated(tmp_path, capsys):
    lines = chat_log(requests=8)
    for replies, words in ((True, "the server's, as the trace gives them for every request"),
                           (False, "the trace gives none, so the model generated stand-in "
                                   "tokens")):
        path = write(tmp_path / f"{replies}.jsonl", lines, replies=replies)
        assert main(["simulate", str(path), "--kv-cache-tokens", "4096"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert words in out, out
        if not replies:
            assert "counted under first_occurrence" in out
    mixed = lines[:4] + [{k: v for k, v in line.items() if k != "output_token_ids"}
                         for line in lines[4:]]
    path = write(tmp_path / "mixed.jsonl", mixed)
    assert main(["simulate", str(path), "--kv-cache-tokens", "4096", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests_with_replies"] == 4


@pytest.mark.parametrize("line, words", [
    ({"prompt_token_ids": [1, 2], "output_token_ids": []}, "'output_token_ids' must be"),
    ({"prompt_token_ids": [1, 2], "output_token_ids": [1, "a"]}, "'output_token_ids' must be"),
    ({"prompt_token_ids": [1, 2], "output_token_ids": [5, 6, 7], "max_tokens": 2},
     "the reply has 3 tokens but 'max_tokens' is 2"),
])
def test_a_bad_reply_is_one_line_naming_file_and_line(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(TraceError, match=f"{path}:2: .*{words}"):
        load_trace(path)


def test_a_reply_within_max_tokens_is_generated_whole(tmp_path):
    """A server stops at its end-of-sequence token before max_tokens: the reply's
    length, not max_tokens, is what was generated."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5],
                                "max_tokens": 256}) + "\n")
    (request,) = load_trace(path)
    assert request.max_tokens == 2 and request.output_tokens == [4, 5]


@pytest.mark.skipif(not ORACLE.exists(), reason=f"needs the vLLM 0.25.1 oracle environment "
                    f"({ORACLE}; tools/setup_vllm_venv.py, which .ci/run builds)")
def test_the_chat_log_hits_as_on_vllms_own_scheduler(tmp_path, capsys):
    """The same chat log, replies given, through vLLM 0.25.1's own Scheduler
    (benchmarks/simulate_vs_vllm.py, which imports nothing of kvref on vLLM's
    side): every request's first-admission hit, the steps and vLLM's counters
    identical; in a pool that holds them all and in one that evicts."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import simulate_vs_vllm

    path = write(tmp_path / "chat.jsonl", chat_log())
    ratios = []
    for arrivals, tokens in (("timestamps", 4096), ("order", 1200)):
        code = simulate_vs_vllm.main(["--trace", str(path), "--arrivals", arrivals,
                                      "--kv-cache-tokens", str(tokens),
                                      "--max-num-batched-tokens", "256",
                                      "--max-num-seqs", "8"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert "per-request first-admission hits identical: True" in out, out
        kvref_ratio = float(out.split("hit ratio once ")[1].split(",")[0])
        vllm_ratio = float(out.split("vLLM Scheduler hit ratio once ")[1].split()[0])
        assert kvref_ratio == vllm_ratio
        ratios.append(kvref_ratio)
    assert ratios[0] > 0.85 > ratios[1]      # the small pool evicts conversations
