"""``kvref simulate`` on a log of a real vLLM 0.25.1 server: does it predict the server's hits?

No vLLM counterpart. The check a user's own traffic needs: a chat log taken from
vLLM's real OpenAI server (``python -m vllm.entrypoints.openai.api_server`` in
the engine environment ``tools/setup_vllm_engine_venv.py`` builds, on a tiny
random Llama with the example tokenizer of ``docs/examples/``, made here,
nothing downloaded), then ``kvref simulate`` on that log, request by request:

1. Three users talk over ``tools/make_example_chat.py``'s system prompt and
   messages, one request at a time, each turn resending the conversation with
   the replies the server gave (as a chat client does); then two completions.
   Each response carries the server's prompt token ids, reply token ids
   (``"return_token_ids": true``) and ``usage.prompt_tokens_details.cached_tokens``.
2. The log is written twice: as the client saw it (chat ``messages`` and
   ``output`` text, completions' ``prompt`` text) and as token ids
   (``prompt_token_ids``, ``output_token_ids``).
3. kvref reads the text log with ``--tokenizer`` and must give the server's own
   prompt token ids for every request; ``kvref simulate`` on each log, with the
   server's pool and limits and one request after another, predicts each
   request's cached tokens, compared with the server's; and once more with the
   replies left out (stand-in tokens), to show what they are worth.

::

    python3 tools/simulate_on_vllm_server.py                  # prints the comparison
    python3 tools/simulate_on_vllm_server.py --json-out build/server_check.json

Exit 0 when every prompt's token ids agree and the token-id log's predictions
equal the server's cached tokens for every request. The text log's
predictions can differ where the server's reply text hides special tokens the
model generated (the reply's text then no longer stands for its tokens); the
output counts them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import make_example_chat  # noqa: E402

ENGINE_PYTHON = Path("/root/.cache/kvref-vllm-engine/bin/python")
# The server's pool and limits, given to kvref simulate too.
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 12                   # 11 usable blocks of 16: 176 tokens, so evictions
MAX_MODEL_LEN = 176
MAX_NUM_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 16
MAX_TOKENS = 12
COMPLETIONS = ["When do you open on Saturday ?",
               "You are the help desk of a bike shop . How much is a tune-up ?"]

# head_dim 64: vLLM's CPU attention refuses 16 ("Unsupported CPU attention configuration").
MAKE_MODEL = """
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=int(sys.argv[2]), hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=None,
    tie_word_embeddings=False)
transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(sys.argv[1])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_healthy(base: str, process: subprocess.Popen, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it "
                               "answered /health")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise RuntimeError(f"the server did not answer /health within {limit_s:.0f} s")


def make_model(folder: Path, python: Path) -> None:
    """The tiny Llama, its vocabulary exactly the tokenizer's: every token the model
    can generate has a text, as in a real model's."""
    make_example_chat.save_tokenizer(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    subprocess.run([str(python), "-c", MAKE_MODEL, str(folder), str(len(vocab))], check=True,
                   capture_output=True, text=True, timeout=300)


def talk(base: str) -> list[dict]:
    """The conversations and completions, one request at a time: what the client
    sent, and what the server answered."""
    history: dict[str, list[dict]] = {}
    records = []
    for i, (user, message, _) in enumerate(make_example_chat.TURNS):
        messages = history.setdefault(
            user, [{"role": "system", "content": make_example_chat.SYSTEM}])
        messages.append({"role": "user", "content": message})
        answer = post(base + "/v1/chat/completions", {
            "model": "m", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        choice = answer["choices"][0]
        reply = choice["message"]["content"] or ""
        records.append({"id": f"{user}-{i}", "messages": [dict(m) for m in messages],
                        "output": reply, "prompt_token_ids": answer["prompt_token_ids"],
                        "output_token_ids": choice["token_ids"],
                        "cached_tokens": answer["usage"]["prompt_tokens_details"][
                            "cached_tokens"] or 0})
        messages.append({"role": "assistant", "content": reply})
    for j, text in enumerate(COMPLETIONS):
        answer = post(base + "/v1/completions", {
            "model": "m", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        choice = answer["choices"][0]
        records.append({"id": f"completion-{j}", "prompt": text, "output": choice["text"],
                        "prompt_token_ids": choice["prompt_token_ids"],
                        "output_token_ids": choice["token_ids"],
                        "cached_tokens": answer["usage"]["prompt_tokens_details"][
                            "cached_tokens"] or 0})
    return records


def run_server(model: Path, python: Path, limit_s: float) -> list[dict]:
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1",
               PYTHONHASHSEED="0")
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
               "--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--block-size", str(BLOCK_SIZE),
               "--num-gpu-blocks-override", str(NUM_GPU_BLOCKS),
               "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
               "--max-num-seqs", str(MAX_NUM_SEQS), "--enable-prompt-tokens-details"]
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, process, limit_s)
        return talk(base)
    except Exception:
        log.seek(0)
        sys.stderr.write(log.read()[-4000:])
        raise
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()


def write_logs(records: list[dict], folder: Path) -> tuple[Path, Path]:
    text, ids = folder / "log_text.jsonl", folder / "log_ids.jsonl"
    with text.open("w") as t, ids.open("w") as i:
        for r in records:
            said = {"id": r["id"], **({"messages": r["messages"]} if "messages" in r
                                      else {"prompt": r["prompt"]})}
            if r["output"]:
                said["output"] = r["output"]
            else:                       # nothing to resend: the reply's length only
                said["max_tokens"] = len(r["output_token_ids"])
            t.write(json.dumps(said) + "\n")
            i.write(json.dumps({"id": r["id"], "prompt_token_ids": r["prompt_token_ids"],
                                "output_token_ids": r["output_token_ids"]}) + "\n")
    return text, ids


def compare(records: list[dict], text_log: Path, ids_log: Path, tokenizer: Path) -> dict:
    from kvref.simulate import load_trace, pool_from_tokens, simulate
    from kvref.simulate.text import load_text_tokenizer

    tok = load_text_tokenizer(str(tokenizer))
    read = load_trace(text_log, tokenizer=tok)
    prompts_equal = [r.tokens == s["prompt_token_ids"] for r, s in zip(read, records)]
    pool = pool_from_tokens(NUM_GPU_BLOCKS, block_size=BLOCK_SIZE)
    options = dict(arrivals="order", max_model_len=MAX_MODEL_LEN,
                   max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS)
    by_ids = simulate(load_trace(ids_log), pool, **options).per_request_hits
    by_text = simulate(read, pool, **options).per_request_hits
    # The same log without its replies: the model generates stand-in tokens.
    stand_in = [type(r)(r.request_id, r.input_length, r.max_tokens, r.arrival_s,
                        tokens=r.tokens) for r in read]
    by_stand_in = simulate(stand_in, pool, **options).per_request_hits
    rows = [{"id": s["id"], "server_cached_tokens": s["cached_tokens"],
             "kvref_from_token_ids": by_ids[s["id"]], "kvref_from_text": by_text[s["id"]],
             "kvref_without_replies": by_stand_in[s["id"]],
             "prompt_tokens": len(s["prompt_token_ids"]), "prompt_ids_equal": same}
            for s, same in zip(records, prompts_equal)]
    return {"rows": rows,
            "prompts_equal": sum(prompts_equal),
            "ids_equal": sum(r["kvref_from_token_ids"] == r["server_cached_tokens"]
                             for r in rows),
            "text_equal": sum(r["kvref_from_text"] == r["server_cached_tokens"] for r in rows),
            "without_replies_equal": sum(r["kvref_without_replies"] == r["server_cached_tokens"]
                                         for r in rows),
            "without_replies_total": sum(r["kvref_without_replies"] for r in rows),
            "requests": len(rows), "server_cached_total": sum(s["cached_tokens"]
                                                             for s in records)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-python", type=Path, default=ENGINE_PYTHON)
    p.add_argument("--start-limit-s", type=float, default=300)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--keep", type=Path, help="also copy the model, tokenizer and logs here")
    args = p.parse_args(argv)
    if not args.engine_python.exists():
        print(f"no engine environment at {args.engine_python} "
              "(python3 tools/setup_vllm_engine_venv.py builds it)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = folder / "model"
        make_model(model, args.engine_python)
        started = time.monotonic()
        records = run_server(model, args.engine_python, args.start_limit_s)
        server_s = time.monotonic() - started
        text_log, ids_log = write_logs(records, folder)
        result = compare(records, text_log, ids_log, model)
        if args.keep:
            shutil.copytree(folder, args.keep, dirs_exist_ok=True)
    for r in result["rows"]:
        print(f"{r['id']:>13}: prompt {r['prompt_tokens']:>3} tokens"
              f"{'' if r['prompt_ids_equal'] else ' (kvref tokenized it differently)'}, "
              f"server cached {r['server_cached_tokens']:>3}, kvref predicts "
              f"{r['kvref_from_token_ids']:>3} from token ids, {r['kvref_from_text']:>3} "
              f"from text, {r['kvref_without_replies']:>3} without the replies")
    n = result["requests"]
    print(f"prompt token ids equal to the server's: {result['prompts_equal']} of {n}")
    print(f"cached tokens predicted exactly: {result['ids_equal']} of {n} from the token-id "
          f"log, {result['text_equal']} of {n} from the text log "
          f"(server: {result['server_cached_total']} cached tokens in all; "
          f"{server_s:.0f} s with the server)")
    print(f"without the replies (stand-in tokens): {result['without_replies_equal']} of {n}, "
          f"{result['without_replies_total']} cached tokens predicted")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1))
    return 0 if result["prompts_equal"] == n and result["ids_equal"] == n else 1


if __name__ == "__main__":
    sys.exit(main())
