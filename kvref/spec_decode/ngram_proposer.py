"""N-gram speculative decoding: guess the next tokens by finding the recent ones earlier.

Mirrors ``vllm/v1/spec_decode/ngram_proposer.py`` ("prompt lookup decoding").
The last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``) are searched for earlier in the request; the tokens that
followed the earliest occurrence of the longest match are the draft::

    tokens  1 2 3 4 2 3      last 3 = [4 2 3]: not seen before
                             last 2 = [2 3]: seen at position 1, followed by 4 2 3
    draft   4 2 3            (k = 4, but only 3 tokens follow the match)

    >>> NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3,
    ...               num_speculative_tokens=4, max_model_len=64).propose([1, 2, 3, 4, 2, 3])
    [4, 2, 3]

The scheduler then schedules the request's real next token plus the draft in
one step (the KV cache manager allocates slots for them), the runner checks
every draft position against the model's own choice, and the scheduler rolls
``num_computed_tokens`` back over the rejected ones: their keys and values are
overwritten at the same slots in a later step.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NgramProposer"]


class NgramProposer:
    """Drafts up to ``num_speculative_tokens`` tokens from n-gram matches.

    O(len(tokens) * prompt_lookup_max) per call (vLLM does the same search with
    a KMP-style table in numba).
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int,
                 num_speculative_tokens: int, max_model_len: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({prompt_lookup_max})")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{num_speculative_tokens}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """The draft after ``tokens`` (empty when nothing matches)."""
        total = len(tokens)
        # Never draft past the model's context.
        k = min(self.k, self.max_model_len - total)
        if k <= 0 or total < self.min_n:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = list(tokens[total - n:])
            # Earliest occurrence that ends before the suffix's own last token.
            for start in range(0, total - n):
                if list(tokens[start:start + n]) == suffix:
                    return list(tokens[start + n:start + n + k])
        return []
