"""How a request samples and when it stops.

Mirrors ``vllm/sampling_params.py`` for the fields this engine honours. Greedy
decoding is ``temperature=0.0`` (the default here, unlike vLLM's 1.0, because
kvref's engine is a test bench whose answers must be exact)::

    >>> params = SamplingParams(max_tokens=4, ignore_eos=True)
    >>> params.temperature, params.max_tokens
    (0.0, 4)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping rules of one request.

    Args:
        temperature: 0.0 is greedy (argmax); above 0, softmax sampling at that
            temperature, seeded by ``seed`` when given.
        max_tokens: generate at most this many tokens.
        ignore_eos: keep going past the end-of-sequence token, so exactly
            ``max_tokens`` come out (unless ``max_model_len`` stops first).
        min_tokens: no stop on EOS or stop tokens before this many tokens.
        stop_token_ids: more token ids that finish the request.
        seed: seed of this request's sampler (temperature > 0 only).
        extra_args: free-form extras; ``{"kv_transfer_params": {...}}`` is what a
            KV connector reads (``{"do_remote_decode": True}`` on a prefill engine,
            ``{"do_remote_prefill": True}`` on a decode engine).
        prompt_logprobs: for every prompt token after the first, the log
            probability the model gave it and the ``prompt_logprobs`` most likely
            tokens (-1: the whole vocabulary); ``RequestOutput.prompt_logprobs``.
        skip_reading_prefix_cache: compute the whole prompt, reading no cached
            block. None (the default) means: exactly when ``prompt_logprobs`` is
            set, since a cached prefix would have no logits to give (vLLM's rule,
            ``vllm/sampling_params.py:500-504``).
    """

    temperature: float = 0.0
    max_tokens: int = 16
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    extra_args: dict | None = None
    prompt_logprobs: int | None = None
    skip_reading_prefix_cache: bool | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0.0, got {self.temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or self.prompt_logprobs < -1):
            raise ValueError(f"prompt_logprobs must be None, -1 (the whole vocabulary) or "
                             f"a count >= 0, got {self.prompt_logprobs!r}")
        if self.skip_reading_prefix_cache is None:
            object.__setattr__(self, "skip_reading_prefix_cache",
                               self.prompt_logprobs is not None)
