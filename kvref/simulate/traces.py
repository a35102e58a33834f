"""Request traces for ``kvref simulate``: Mooncake's, a JSONL of prompts (ids, text, chat).

No vLLM counterpart. A trace is a list of ``TraceRequest``: a prompt, how many
tokens to generate, and when it arrives. These line formats are read, one JSON
object per line, gzip-compressed or not (the first line decides):

* **Mooncake** (FAST'25, ``kvref/data/mooncake/``)::

      {"timestamp": 27482, "input_length": 6955, "output_length": 52,
       "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}

  No tokens, one id per 512-token block of the prompt. Block id ``b`` becomes
  the token run ``TOKEN_BASE + 512 * b + j`` for ``j`` in ``0..511``, and the
  prompt is those runs end to end, cut at ``input_length`` (the last block is
  usually partial). Equal ids give equal tokens, so two prompts share exactly
  the tokens their shared leading ids cover, at any kvref block size; different
  ids share no token at all, so no prefix can continue past a differing id::

      >>> tokens = mooncake_prompt([0, 7], input_length=515)
      >>> len(tokens), tokens[0], tokens[511], tokens[512] - TOKEN_BASE
      (515, 1000, 1511, 3584)

* **Plain**: what a server's own logs can give::

      {"prompt_token_ids": [1, 2, 3], "max_tokens": 16, "arrival_s": 0.25}

  ``max_tokens`` defaults to 1; the arrival is ``arrival_s`` (seconds) or
  ``timestamp`` (milliseconds, as Mooncake's), 0 when absent; ``request_id``
  is optional.

  The reply the server gave may come too, as ``output_token_ids`` (the ids
  vLLM's response carries). Then the simulated model generates exactly those
  tokens, as many as there are (``max_tokens``, if given, must allow them):
  a later request that resends the reply finds it cached, as it would on vLLM,
  which caches a reply's blocks as they fill during decode. Without a reply
  the model generates stand-in tokens no prompt contains, so a resent reply
  is computed again (cause ``first_occurrence``)::

      {"prompt_token_ids": [1, 2, 3], "output_token_ids": [7, 8, 2]}

* **Text and chat**, with a tokenizer (``--tokenizer``; ``text.py`` says how
  each is tokenized, as vLLM's server does): ``"prompt"`` text (the line of
  vLLM's offline analyzer proposal, ``{"id": ..., "prompt": TEXT}``) or
  OpenAI chat ``"messages"``, with the reply as ``"output"`` text or
  ``output_token_ids``; a line of OpenAI's batch format
  (``{"custom_id": ..., "body": {"messages": [...], "max_tokens": N}}``, as
  ``vllm run-batch`` reads it) is its ``body``. ``max_completion_tokens`` is
  read as ``max_tokens``; the id is ``request_id``, ``id`` or ``custom_id``::

      {"id": "a", "prompt": "You are a helpful assistant.", "output": "Hello!"}
      {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}

A bad line is one line of error naming the file and line (``TraceError``).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MOONCAKE_BLOCK_SIZE", "TOKEN_BASE", "TraceError", "TraceRequest", "load_trace",
           "mooncake_prompt", "resolve_trace_path", "workload_trace"]

MOONCAKE_BLOCK_SIZE = 512
# Prompt tokens start here; generated tokens (``runner.OUTPUT_TOKEN_BASE``) lie above them all.
TOKEN_BASE = 1000


class TraceError(ValueError):
    """A trace that cannot be read: one line, with the file and line number."""


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace. The prompt is built on demand (``prompt_token_ids``):
    a whole Mooncake trace as token lists would take gigabytes."""

    request_id: str
    input_length: int
    max_tokens: int
    arrival_s: float
    block_ids: tuple[int, ...] | None = None     # Mooncake: the 512-token block ids
    tokens: list[int] | None = None              # plain: the prompt itself
    # plain: the reply the server gave (``max_tokens`` is its length), or None
    output_tokens: list[int] | None = None
    # A kvref workload's follow-up: arrives when request ``after`` finishes, its
    # prompt made from that request's tokens by ``prompt_from``.
    after: str | None = None
    prompt_from: object = None

    def prompt_token_ids(self) -> list[int]:
        if self.tokens is not None:
            return list(self.tokens)
        return mooncake_prompt(self.block_ids, self.input_length)


def mooncake_prompt(block_ids, input_length: int) -> list[int]:
    """The prompt a Mooncake line stands for (see the module docstring)."""
    tokens: list[int] = []
    for b in block_ids:
        start = TOKEN_BASE + MOONCAKE_BLOCK_SIZE * b
        tokens.extend(range(start, start + MOONCAKE_BLOCK_SIZE))
    del tokens[input_length:]
    return tokens


def resolve_trace_path(trace: str | Path) -> Path:
    """A path, or the name of a vendored trace (``conversation``, ``synthetic``)."""
    from kvref.data import MOONCAKE_TRACES

    if str(trace) in MOONCAKE_TRACES:
        return MOONCAKE_TRACES[str(trace)]
    path = Path(trace)
    if not path.is_file():
        raise TraceError(f"no trace file {str(trace)!r} (a JSONL file, .gz or not, or one of "
                         f"the vendored traces: {', '.join(sorted(MOONCAKE_TRACES))})")
    return path


def _lines(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            yield from f
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read it as {'gzip ' if opener is gzip.open else ''}"
                         f"JSONL text: {exc}") from None


def _int(obj: dict, key: str, where: str, minimum: int = 0, default: int | None = None) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _mooncake(obj: dict, index: int, where: str) -> TraceRequest:
    length = _int(obj, "input_length", where, minimum=1)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not ids or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a non-empty list of integers >= 0")
    if not (len(ids) - 1) * MOONCAKE_BLOCK_SIZE < length <= len(ids) * MOONCAKE_BLOCK_SIZE:
        raise TraceError(f"{where}: input_length {length} does not fit {len(ids)} blocks of "
                         f"{MOONCAKE_BLOCK_SIZE} tokens")
    output = _int(obj, "output_length", where, minimum=0, default=1)
    return TraceRequest(f"r{index}", length, max(output, 1),
                        _int(obj, "timestamp", where, default=0) / 1000.0, block_ids=tuple(ids))


PLAIN_KEYS = ("prompt_token_ids", "prompt", "messages", "body")


def _text(obj: dict, key: str, where: str, tokenizer, encode) -> list[int]:
    """``obj[key]`` turned into token ids by ``encode`` (a ``TextTokenizer`` method)."""
    if tokenizer is None:
        raise TraceError(f"{where}: {key!r} is text: give --tokenizer (the served model's "
                         "tokenizer: a folder, or a Hugging Face name in the local cache) "
                         "to turn it into token ids as vLLM's server does")
    try:
        tokens = encode(obj[key])
    except Exception as exc:               # a template or tokenizer error: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(f"{where}: cannot tokenize {key!r}: {first}") from None
    if not tokens:
        raise TraceError(f"{where}: {key!r} gives no tokens")
    return tokens


def _prompt_tokens(obj: dict, where: str, tokenizer) -> list[int]:
    if "prompt_token_ids" in obj:
        tokens = obj["prompt_token_ids"]
        if not isinstance(tokens, list) or not tokens or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise TraceError(f"{where}: 'prompt_token_ids' must be a non-empty list of "
                             "integers")
        return tokens
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise TraceError(f"{where}: 'prompt' must be non-empty text (token ids go in "
                             "'prompt_token_ids')")
        return _text(obj, "prompt", where, tokenizer,
                     tokenizer.completion if tokenizer else None)
    from kvref.simulate.text import check_messages

    try:
        check_messages(obj.get("messages"))
    except ValueError as exc:
        raise TraceError(f"{where}: {exc}") from None
    return _text(obj, "messages", where, tokenizer, tokenizer.chat if tokenizer else None)


def _plain(obj: dict, index: int, where: str, tokenizer=None) -> TraceRequest:
    if "body" in obj and "prompt_token_ids" not in obj:      # OpenAI's batch format
        body = obj["body"]
        if not isinstance(body, dict):
            raise TraceError(f"{where}: 'body' must be a JSON object (OpenAI's batch format)")
        obj = body | {k: v for k, v in obj.items() if k in ("custom_id", "arrival_s",
                                                             "timestamp", "output",
                                                             "output_token_ids")}
    if not any(k in obj for k in PLAIN_KEYS[:3]):
        raise TraceError(f"{where}: no prompt: give 'prompt_token_ids', 'prompt' text or "
                         "chat 'messages'")
    if "max_tokens" not in obj and "max_completion_tokens" in obj:
        obj = obj | {"max_tokens": obj["max_completion_tokens"]}
    tokens = _prompt_tokens(obj, where, tokenizer)
    if "arrival_s" in obj:
        arrival = obj["arrival_s"]
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or arrival < 0:
            raise TraceError(f"{where}: 'arrival_s' must be a number >= 0, got {arrival!r}")
    else:
        arrival = _int(obj, "timestamp", where, default=0) / 1000.0
    rid = next((obj[k] for k in ("request_id", "id", "custom_id") if k in obj), f"r{index}")
    reply = obj.get("output_token_ids")
    if reply is None and "output" in obj:
        if not isinstance(obj["output"], str):
            raise TraceError(f"{where}: 'output' must be the reply's text (token ids go in "
                             "'output_token_ids')")
        # An empty reply text (the model generated only special tokens) resends
        # nothing: the request generates stand-in tokens, as one without a reply.
        if obj["output"].strip():
            reply = _text(obj, "output", where, tokenizer,
                          tokenizer.reply if tokenizer else None)
    if reply is None:
        return TraceRequest(str(rid), len(tokens), _int(obj, "max_tokens", where, minimum=1,
                                                        default=1), float(arrival), tokens=tokens)
    if not isinstance(reply, list) or not reply or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in reply):
        raise TraceError(f"{where}: 'output_token_ids' must be a non-empty list of integers "
                         "(the reply's token ids)")
    limit = _int(obj, "max_tokens", where, minimum=1, default=len(reply))
    if limit < len(reply):
        raise TraceError(f"{where}: the reply has {len(reply)} tokens but 'max_tokens' is "
                         f"{limit}: a server could not have generated it")
    return TraceRequest(str(rid), len(tokens), len(reply), float(arrival), tokens=tokens,
                        output_tokens=reply)


def load_trace(trace: str | Path, max_requests: int | None = None,
               skip: int = 0, tokenizer=None) -> list[TraceRequest]:
    """Requests ``skip .. skip + max_requests`` of a trace file (or vendored trace name).
    ``tokenizer``: a ``kvref.simulate.text.TextTokenizer``, for text and chat lines."""
    if max_requests is not None and max_requests < 1:
        raise TraceError(f"max_requests must be at least 1, got {max_requests}")
    if skip < 0:
        raise TraceError(f"skip must be >= 0, got {skip}")
    path = resolve_trace_path(trace)
    requests: list[TraceRequest] = []
    parse = None
    seen_ids: set[str] = set()
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object per line")
        if parse is None:
            if "hash_ids" in obj:
                parse = _mooncake
            elif any(k in obj for k in PLAIN_KEYS):
                parse = _plain
            else:
                raise TraceError(f"{where}: neither a Mooncake line ('hash_ids') nor a plain "
                                 "one ('prompt_token_ids', 'prompt' text, chat 'messages', "
                                 "or a batch line's 'body')")
        index = number - 1
        if index < skip:
            continue
        request = (parse(obj, index, where, tokenizer) if parse is _plain
                   else parse(obj, index, where))
        if request.request_id in seen_ids:
            raise TraceError(f"{where}: duplicate request_id {request.request_id!r}")
        seen_ids.add(request.request_id)
        requests.append(request)
        if max_requests is not None and len(requests) >= max_requests:
            break
    if not requests:
        raise TraceError(f"{path}: no requests (empty file, or --skip past its end)")
    return requests


def workload_trace(name: str, step_seconds: float = 0.01):
    """A kvref workload (``kvref.viz.workloads``, e.g. ``chat``, ``multi-turn``) as
    ``(requests, preset)``: an arrival at step ``k`` arrives at ``k * step_seconds``;
    a follow-up turn arrives when the turn before it finishes. Presets with a remote
    prefill (``connector``) are refused: the simulation runs no remote-prefill
    connector (its one connector is the host tier, ``kv_offloading_size``)."""
    from kvref.viz.workloads import PRESETS

    if name not in PRESETS:
        raise TraceError(f"unknown workload {name!r}; choose from: {', '.join(PRESETS)}")
    preset = PRESETS[name]()
    if preset.remote:
        raise TraceError(f"workload {name!r} needs a remote-prefill KV connector, which "
                         "kvref simulate does not run")
    requests = []
    for a in preset.arrivals:
        if a.after is not None:
            requests.append(TraceRequest(a.request_id, 0, a.max_tokens, 0.0, after=a.after,
                                         prompt_from=a.prompt))
        else:
            requests.append(TraceRequest(a.request_id, len(a.prompt), a.max_tokens,
                                         a.step * step_seconds, tokens=list(a.prompt)))
    return requests, preset
