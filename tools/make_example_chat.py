"""The example chat log and its small tokenizer, in ``docs/examples/`` (docs/simulate.md runs them).

No vLLM counterpart. A chat log as a server's logs give it: three users'
conversations over one system prompt, each line the chat ``messages`` sent,
the reply the server gave (``output`` text) and the arrival time. The
tokenizer is a word-level one made here from the log's own words (nothing is
downloaded), with a begin-of-sequence token the tokenizer adds to a
completion and a chat template that renders each message as
``<|role|> text <|end|>`` and ends, for the generation prompt, with
``<|assistant|>``, as a real model's template does::

    python3 tools/make_example_chat.py             # writes docs/examples/
    python3 tools/make_example_chat.py --check     # exit 1 if the files differ

``tests/simulate/test_text.py`` checks the committed files are what this makes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "examples"

SYSTEM = ("You are the help desk of a bike shop . Answer in one or two short sentences . "
          "The shop opens at nine and closes at six , every day but Sunday . "
          "A tune-up costs forty dollars and takes one day .")
# (user, their message, the reply they got), in the order the requests came.
TURNS = [
    ("ana", "When do you open on Saturday ?", "We open at nine on Saturday ."),
    ("ben", "How much is a tune-up ?", "A tune-up costs forty dollars ."),
    ("ana", "And when do you close ?", "We close at six ."),
    ("cy", "Can I bring my bike on Sunday ?", "Sorry , the shop is closed on Sunday ."),
    ("ben", "How long does it take ?", "It takes one day ."),
    ("ana", "Can I pick it up the same day ?", "Yes , bring it at nine and pick it up at six ."),
    ("cy", "Then Monday at nine ?", "Yes , Monday at nine is fine ."),
    ("ben", "Can I pay by card ?", "Yes , we take cards ."),
    ("cy", "Do I need to call first ?", "No , just bring the bike ."),
    ("ana", "Thank you !", "You are welcome !"),
]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                 "<|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
SPECIAL = ["<unk>", "<s>", "</s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def chat_log() -> list[dict]:
    """The log's lines: each the whole conversation so far, as a client resends it."""
    history: dict[str, list[dict]] = {}
    lines = []
    for i, (user, message, reply) in enumerate(TURNS):
        messages = history.setdefault(user, [{"role": "system", "content": SYSTEM}])
        messages.append({"role": "user", "content": message})
        lines.append({"id": f"{user}-{i}", "messages": list(messages), "output": reply,
                      "arrival_s": 5.0 * i})
        messages.append({"role": "assistant", "content": reply})
    return lines


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of the log's words: split at spaces, BOS added to a
    completion, the chat template above. ``tokenizer.json`` is written by
    ``tokenizers``; ``tokenizer_config.json`` by hand, naming the plain
    ``PreTrainedTokenizerFast`` rather than whatever class the installed
    ``transformers`` would write."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted({w for _, m, r in TURNS for w in (m + " " + r).split()} | set(SYSTEM.split()))
    vocab = {w: i for i, w in enumerate(SPECIAL + words)}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    model.add_special_tokens(SPECIAL)
    folder.mkdir(parents=True, exist_ok=True)
    model.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 4096,
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "chat_log.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in chat_log()))
    save_tokenizer(out / "tokenizer")
    return [log, out / "tokenizer" / "tokenizer.json", out / "tokenizer" / "tokenizer_config.json"]


def _same(name: str, a: Path, b: Path) -> bool:
    """The same file; ``tokenizer.json`` compared by what it means (a newer
    ``tokenizers`` may write it in other words): vocabulary, special tokens,
    pre-tokenizer and post-processor."""
    if not (a.is_file() and b.is_file()):
        return False
    if not name.endswith("tokenizer.json"):
        return a.read_bytes() == b.read_bytes()
    x, y = json.loads(a.read_text()), json.loads(b.read_text())
    meaning = lambda t: (t["model"]["vocab"], sorted(tok["content"] for tok in t["added_tokens"]),
                         t["pre_tokenizer"]["type"], t["post_processor"]["single"])
    return meaning(x) == meaning(y)


def differences(out: Path = OUT) -> list[str]:
    """The committed files that are not what ``write`` makes now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = write(Path(tmp))
        return [str(p.relative_to(tmp)) for p in fresh
                if not _same(p.name, out / p.relative_to(tmp), p)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare, do not write")
    args = p.parse_args(argv)
    if args.check:
        stale = differences()
        for name in stale:
            print(f"docs/examples/{name} differs from what tools/make_example_chat.py makes")
        return 1 if stale else 0
    for path in write(OUT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
