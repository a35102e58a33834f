"""``kvref simulate --tokenizer``: text and chat lines tokenized as vLLM's server tokenizes them.

The tokenizer is the example one ``tools/make_example_chat.py`` builds (word
level, from the example log's words; nothing is downloaded), rebuilt here in a
temporary folder and compared with the committed ``docs/examples/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvref.cli import main
from kvref.simulate import TraceError, load_trace, pool_from_tokens, simulate
from kvref.simulate.text import load_text_tokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import make_example_chat  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("example")
    make_example_chat.write(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(folder):
    return load_text_tokenizer(str(folder / "tokenizer"))


def lines_file(tmp_path, lines) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_committed_examples_are_what_the_tool_makes():
    assert make_example_chat.differences() == [], \
        "run python3 tools/make_example_chat.py and commit docs/examples/"


def test_a_completion_is_tokenized_with_the_bos_a_chat_through_its_template(tmp_path,
                                                                               tokenizer):
    hf = tokenizer.tokenizer
    messages = [{"role": "system", "content": "You are the help desk"},
                {"role": "user", "content": "When do you open ?"}]
    path = lines_file(tmp_path, [
        {"prompt": "When do you open on Saturday ?", "id": "text"},
        {"messages": messages, "max_completion_tokens": 3, "id": "chat"},
        {"custom_id": "batch", "body": {"messages": messages, "max_tokens": 5}},
    ])
    text, chat, batch = load_trace(path, tokenizer=tokenizer)
    bos = hf.convert_tokens_to_ids("<s>")
    # /v1/completions: the text's tokens with the BOS the tokenizer adds.
    assert text.tokens == [bos] + hf.encode("When do you open on Saturday ?",
                                            add_special_tokens=False)
    # /v1/chat/completions: the template (its own BOS) and the assistant's turn opened.
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<s><|system|> You are the help desk <|end|> <|user|>")
    assert rendered.rstrip().endswith("<|assistant|>")
    assert chat.tokens == hf.encode(rendered, add_special_tokens=False)
    assert chat.tokens.count(bos) == 1
    assert (text.request_id, chat.request_id, batch.request_id) == ("text", "chat", "batch")
    assert (chat.max_tokens, batch.max_tokens, batch.tokens) == (3, 5, chat.tokens)


def test_the_example_chat_log_hits_on_its_replies(folder, tokenizer):
    """Each turn resends the conversation with the reply it got: given as text, the
    reply is generated and cached, so the next turn of that user hits on it."""
    log = folder / "chat_log.jsonl"
    requests = load_trace(log, tokenizer=tokenizer)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for request, line in zip(requests, lines):
        assert request.output_tokens == tokenizer.reply(line["output"])
    # Every later turn's prompt starts with the earlier turn's prompt and its reply.
    by_user: dict[str, object] = {}
    for request in requests:
        user = request.request_id.split("-")[0]
        if user in by_user:
            before = by_user[user]
            assert request.tokens[:len(before.tokens) + len(before.output_tokens)] == \
                before.tokens + before.output_tokens
        by_user[user] = request
    pool = pool_from_tokens(64, block_size=4)
    with_replies = simulate(requests, pool)
    stand_in = [type(r)(r.request_id, r.input_length, r.max_tokens, r.arrival_s,
                        tokens=r.tokens) for r in requests]
    without = simulate(stand_in, pool)
    assert with_replies.requests_with_replies == len(requests) == 10
    assert with_replies.hit_ratio_once > without.hit_ratio_once
    # Block by block: a later turn's hit covers its earlier turn's prompt and the
    # reply's tokens whose KV was computed (all but the last sampled one), in whole
    # blocks of 4.
    hits = with_replies.per_request_hits
    for request in requests:
        user = request.request_id.split("-")[0]
        earlier = [r for r in requests if r.request_id.split("-")[0] == user]
        index = earlier.index(request)
        if index == 0:
            continue
        before = earlier[index - 1]
        computed = len(before.tokens) + len(before.output_tokens) - 1
        assert hits[request.request_id] == computed // 4 * 4, request.request_id


def test_the_docs_command_on_the_committed_example(capsys):
    """docs/simulate.md's command, and the figure the page gives for it (78 %)."""
    examples = ROOT / "docs" / "examples"
    code = main(["simulate", str(examples / "chat_log.jsonl"), "--tokenizer",
                 str(examples / "tokenizer"), "--kv-cache-tokens", "256", "--block-size", "4",
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["num_requests"] == 10 and doc["requests_with_replies"] == 10
    assert round(doc["hit_ratio_once"], 2) == 0.78
    assert "78 % of\nthe prompt tokens come from the cache" in (
        ROOT / "docs" / "simulate.md").read_text()


@pytest.mark.parametrize("line, words", [
    ({"prompt": "hi there"}, "'prompt' is text: give --tokenizer"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "'messages' is text: give --tokenizer"),
    ({"prompt_token_ids": [1, 2], "output": "We open"}, "'output' is text: give --tokenizer"),
])
def test_text_without_a_tokenizer_is_one_line(tmp_path, line, words):
    path = lines_file(tmp_path, [{"prompt_token_ids": [5, 6]}, line])
    with pytest.raises(TraceError, match=f"{path}:2: {words}"):
        load_trace(path)


@pytest.mark.parametrize("line, words", [
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"content": "hi"}]}, "message 0 needs a 'role'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     r"message 0 \(user\): 'content' must be text"),
    ({"prompt": ""}, "'prompt' must be non-empty text"),
    ({"prompt": [1, 2]}, "'prompt' must be non-empty text"),
    ({"prompt": "hi", "output": ["x"]}, "'output' must be the reply's text"),
    ({"body": "x"}, "'body' must be a JSON object"),
    ({"body": {"model": "m"}}, "no prompt: give 'prompt_token_ids', 'prompt' text or chat"),
    ({"max_tokens": 3}, "no prompt"),
])
def test_a_bad_text_line_is_one_line(tmp_path, tokenizer, line, words):
    path = lines_file(tmp_path, [{"prompt": "When do you open ?"}, line])
    with pytest.raises(TraceError, match=f"{path}:2: {words}"):
        load_trace(path, tokenizer=tokenizer)


def test_a_tokenizer_without_a_chat_template_refuses_messages(tmp_path, folder):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((folder / "tokenizer" / "tokenizer.json").read_bytes())
    config = json.loads((folder / "tokenizer" / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    path = lines_file(tmp_path, [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(TraceError, match="has no chat template"):
        load_trace(path, tokenizer=load_text_tokenizer(str(plain)))


def test_a_tokenizer_that_cannot_be_loaded_is_one_line(tmp_path, capsys):
    path = lines_file(tmp_path, [{"prompt": "hi"}])
    code = main(["simulate", str(path), "--tokenizer", str(tmp_path / "nothing-here"),
                 "--kv-cache-tokens", "64"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--tokenizer" in err and "nothing-here" in err


def test_an_empty_reply_text_resends_nothing(tmp_path, tokenizer):
    """A reply of special tokens only has empty text: the line is read, without a reply."""
    path = lines_file(tmp_path, [{"prompt": "When do you open ?", "output": "", "max_tokens": 3},
                                 {"prompt": "When do you open ?", "output": "We open"}])
    empty, given = load_trace(path, tokenizer=tokenizer)
    assert empty.output_tokens is None and empty.max_tokens == 3
    assert given.output_tokens == tokenizer.reply("We open")


def test_a_tokenizer_with_a_workload_is_refused(capsys):
    assert main(["simulate", "--workload", "chat", "--tokenizer", "docs/examples/tokenizer"]) == 2
    assert "--tokenizer reads a trace's text" in capsys.readouterr().err
