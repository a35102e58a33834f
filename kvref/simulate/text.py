"""Text and chat requests for ``kvref simulate``: turned into token ids as vLLM's server does.

No vLLM counterpart of its own: this is the tokenizing vLLM's OpenAI server
does before a request reaches the scheduler, written out for the two kinds of
request a log holds (vLLM 0.25.1):

* **A completion** (``{"prompt": TEXT}``, the line vLLM's offline analyzer
  proposal reads too): the text is tokenized with the special tokens the
  tokenizer adds (a BOS, for most models), as ``/v1/completions`` does by
  default (``add_special_tokens`` is true,
  ``vllm/entrypoints/openai/completion/protocol.py:100-106``).
* **A chat** (``{"messages": [...]}``, OpenAI's): the messages go through the
  tokenizer's chat template with the generation prompt added, and its token ids
  are the prompt, added special tokens not added again
  (``vllm/entrypoints/openai/chat_completion/protocol.py:282-308``:
  ``add_generation_prompt`` true, ``add_special_tokens`` false;
  ``vllm/renderers/hf.py:707-800`` applies the template and tokenizes).

A reply given as text (``"output"``) is tokenized without special tokens.
Text does not say which stop token a reply ended with, nor whether its
tokens were exactly these (decoding and encoding again may merge pieces
differently): ``output_token_ids`` is the exact reply, when a log has it.

The tokenizer is a local folder (never downloaded) or a Hugging Face name
already in the local cache, loaded with ``transformers`` (the ``text``
extra, no torch); lines of token ids need none.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TextTokenizer", "load_text_tokenizer"]

ROLES = ("system", "developer", "user", "assistant", "tool")


class TextTokenizer:
    """A ``transformers`` tokenizer, used as vLLM's server uses it."""

    def __init__(self, tokenizer, name: str = "") -> None:
        self.tokenizer = tokenizer
        self.name = name

    def completion(self, text: str) -> list[int]:
        """A completion's prompt: the text with the tokenizer's special tokens."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def reply(self, text: str) -> list[int]:
        """A reply's text: no special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat(self, messages: list[dict]) -> list[int]:
        """A chat's prompt: the messages through the chat template, with the
        generation prompt (the start of the assistant's turn)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer {self.name} has no chat template, so a "
                             "'messages' line cannot be rendered (vLLM refuses such a "
                             "request too); give 'prompt' text or token ids")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return list(ids)


def check_messages(messages) -> list[dict]:
    """OpenAI chat messages with text content, or a ``ValueError`` saying what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {\"role\", \"content\"}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} needs a 'role' (one of {', '.join(ROLES)})")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} ({m['role']}): 'content' must be text (content "
                             "given as a list of parts, images included, is not read)")
    return messages


def load_text_tokenizer(name_or_folder: str) -> TextTokenizer:
    """A tokenizer from a local folder, or a Hugging Face name in the local cache;
    a ``ValueError`` of one line when it cannot be loaded."""
    import os

    # Without torch (the ``text`` extra) transformers warns at import that it can
    # load no models: true, and not needed for a tokenizer. Unless asked for.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import transformers
    except ImportError:
        raise ValueError("--tokenizer needs transformers: pip install 'kvref[text]'") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(name_or_folder),
                                                               local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = ("a folder" if Path(name_or_folder).is_dir() else
                 "not a folder, nor a Hugging Face name in the local cache")
        raise ValueError(f"--tokenizer {name_or_folder} ({where}): {first}") from None
    return TextTokenizer(tokenizer, str(name_or_folder))
