"""``LLM``: the offline entry point, generating with kvref's KV cache manager.

Mirrors ``vllm/entrypoints/llm.py`` (``LLM.generate``); each ``LLM.step`` is
one ``EngineCore.step`` (``kvref/engine/core.py``, vLLM's ``vllm/v1/engine/core.py``): the
scheduler plans a batch over ``kvref.KVCacheManager``, the model runner runs it
over the paged KV cache, and the scheduler takes the sampled tokens back::

    llm = LLM("path/to/checkpoint", num_gpu_blocks=64)        # or a transformers model
    outs = llm.generate([[1, 2, 3], [1, 2, 4]], SamplingParams(max_tokens=8))
    outs[0].outputs[0].token_ids          # 8 greedy tokens
    llm.generate("Hello")                 # text: only with a tokenizer (the folder's own)
    llm.stats                             # prompt tokens computed vs cached, preemptions
    llm.kv_cache_manager.block_pool       # the live pool

``after_step`` hooks run after every step with the ``LLM`` (tests check the
manager's invariants there; the visualizer draws the pool).

With ``async_scheduling=True`` the loop is ``AsyncEngineCore`` (vLLM's
``step_with_batch_queue``): the model runs step N on a worker thread while
the ``AsyncScheduler`` plans step N+1; greedy tokens are the same as the
synchronous engine's.

The defaults of the scheduling knobs are vLLM 0.25.1's for ``vllm.LLM``
(``EngineArgs.get_batch_defaults`` with the ``LLM_CLASS`` usage context, one
GPU, ``performance_mode`` "balanced")::

    device          max_num_batched_tokens   max_num_seqs
    CPU             4096                     256
    CUDA < 70 GiB   8192                     256
    (or an A100)
    CUDA >= 70 GiB  16384                    1024

then, as vLLM does for a value left at its default: ``max_num_batched_tokens``
at least ``max_model_len`` without chunked prefill, at most ``max_num_seqs *
max_model_len``; ``max_num_seqs`` at most ``max_num_batched_tokens``.
``scheduler_reserve_full_isl`` is True (vLLM's ``SchedulerConfig`` default);
``async_scheduling`` left as None is vLLM's rule: on for CUDA unless
speculative decoding with n-gram drafts is asked for (vLLM allows async
scheduling with ``ngram_gpu``, not ``ngram``), off on CPU (vLLM's CPU
platform turns it off; kvref runs it on CPU when asked to). Asked for
explicitly together with n-gram drafts, it is refused, as vLLM refuses it.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvref import KVCacheConfig, KVCacheManager
from kvref.distributed.kv_transfer.kv_connector.factory import (
    resolve_disable_hybrid_kv_cache_manager)
from kvref.sched.async_scheduler import AsyncScheduler
from kvref.engine.core import make_engine_core
from kvref.model_executor.loader import load_model
from kvref.worker.gpu_model_runner import GPUModelRunner, make_kv_cache_config
from kvref.spec_decode.ngram_proposer import NgramProposer
from kvref.outputs import Logprob
from kvref.request import EngineRequest
from kvref.sampling_params import SamplingParams
from kvref.sched.scheduler import Scheduler, SchedulerStats

__all__ = ["CompletionOutput", "LLM", "RequestOutput", "default_batch_limits",
           "resolve_batch_limits"]

GiB = 1 << 30


def default_batch_limits(device: torch.device | str) -> tuple[int, int]:
    """vLLM 0.25.1's ``(max_num_batched_tokens, max_num_seqs)`` for ``vllm.LLM`` on
    ``device`` before the ``max_model_len`` adjustments (see the module docstring)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4096, 256
    props = torch.cuda.get_device_properties(device)
    if props.total_memory >= 70 * GiB and "a100" not in props.name.lower():
        return 16384, 1024
    return 8192, 256


def resolve_batch_limits(device: torch.device | str, max_model_len: int,
                         max_num_batched_tokens: int | None = None,
                         max_num_seqs: int | None = None,
                         enable_chunked_prefill: bool = True) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` as vLLM 0.25.1 sets them for
    ``vllm.LLM`` (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``):
    a value given is kept; a value left out takes the device's default, and then
    ``max_num_batched_tokens`` is at least ``max_model_len`` without chunked
    prefill and at most ``max_num_seqs * max_model_len``, and ``max_num_seqs`` at
    most ``max_num_batched_tokens``.

        >>> resolve_batch_limits("cpu", 64), resolve_batch_limits("cpu", 8)
        ((4096, 256), (2048, 256))
        >>> resolve_batch_limits("cpu", 64, max_num_seqs=2)
        (128, 2)
    """
    default_tokens, default_seqs = default_batch_limits(device)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_tokens
        if not enable_chunked_prefill:
            max_num_batched_tokens = max(max_model_len, max_num_batched_tokens)
        max_num_batched_tokens = min((max_num_seqs or default_seqs) * max_model_len,
                                     max_num_batched_tokens)
    if max_num_seqs is None:
        max_num_seqs = min(default_seqs, max_num_batched_tokens)
    return max_num_batched_tokens, max_num_seqs


@dataclass
class CompletionOutput:
    """One generated sequence (``vllm/outputs.py``). ``stop_reason``: the stop
    token that ended it (None for EOS or a length cap, as in vLLM). ``logits``:
    one ``[vocab]`` float32 tensor per generated token, when the LLM keeps them."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    logits: list[torch.Tensor] = field(default_factory=list)
    text: str | None = None        # the tokens decoded, when the LLM has a tokenizer
    stop_reason: int | None = None


@dataclass
class RequestOutput:
    """A finished request: its prompt, its completion, and its prefix-cache hit."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    prompt: str | None = None      # the prompt's text, when it was given as text
    kv_transfer_params: dict | None = None    # what a KV connector returned for it
    # With SamplingParams(prompt_logprobs=k): None for the first prompt token, then
    # one {token_id: Logprob} per prompt token (vLLM's RequestOutput.prompt_logprobs).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class LLM:
    """Generate with a ``transformers`` causal LM running on kvref's paged KV cache.

    Args:
        model: a ``transformers`` ``PreTrainedModel`` (Llama, Qwen2, Qwen3) or
            a local checkpoint folder (``config.json`` + weights).
        block_size: tokens per KV block.
        num_gpu_blocks: KV blocks in the pool, null block included; default:
            room for ``max_num_seqs`` full-length requests within
            ``kv_cache_memory_bytes``. Small pools force preemption and eviction.
        enable_prefix_caching: reuse cached blocks of identical prefixes.
        max_num_batched_tokens: tokens per step (default: vLLM's for the
            device, 4096 on CPU; see the module docstring).
        max_num_seqs: requests running at once (default: vLLM's, 256 on CPU).
        max_model_len: longest sequence (default: the config's
            ``max_position_embeddings``).
        long_prefill_token_threshold, enable_chunked_prefill: as in the scheduler.
        watermark: fraction of the pool new requests leave free.
        device, dtype: where the model and KV cache live, and their dtype.
        keep_logits: put each generated token's logits in ``CompletionOutput.logits``.
        kv_cache_memory_bytes: the memory the default pool size may use.
        tokenizer: what turns string prompts into token ids (and generated
            tokens back into ``CompletionOutput.text``): a ``transformers``
            tokenizer, or a local folder to load one from. Default: the
            checkpoint folder's own tokenizer files, if it has any (never
            downloaded). Without one, prompts must be token ids.
        enable_kv_cache_events: queue the manager's block events
            (``llm.scheduler.take_events()``, after each step).
        speculative_config: ``{"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_min": a, "prompt_lookup_max": b}`` (vLLM's keys and
            defaults: ``a = b = 5`` when neither is given, else the one given).
        scheduler_reserve_full_isl: admit a request only when the blocks of
            its whole prompt fit (vLLM's default, True); False admits the chunk
            that fits this step, and may preempt it later (lesson 09).
        async_scheduling: plan step N+1 while the model runs step N
            (``AsyncScheduler`` + ``AsyncEngineCore``); None: vLLM's default
            for the device (see the module docstring).
        kv_transfer_config: a ``KVTransferConfig`` (``kvref.distributed``): a KV
            connector, its scheduler half in ``llm.scheduler.connector`` and its
            worker half in ``llm.model_runner.kv_connector``. Hybrid models run
            with any connector, as in vLLM 0.25.1: see the next argument.
        disable_hybrid_kv_cache_manager: vLLM's ``SchedulerConfig`` field. None
            (the default) decides as vLLM does (``config/vllm.py:1530-1567``):
            on, unless a connector without ``SupportsHMA`` is set (kvref's
            ``ExampleConnector``), which turns it off with vLLM's warning. Off,
            window layers join the full-attention group as
            ``FullAttentionSpec(sliding_window=W)`` (one group, every block
            kept, each layer still attending over its window). False with such
            a connector is refused (vLLM's ``factory.py:54-60``). A connector
            with ``SupportsHMA`` (``P2pConnector``) keeps the groups and gets
            per-group block ids.
    """

    def __init__(self, model, *, block_size: int = 16, num_gpu_blocks: int | None = None,
                 enable_prefix_caching: bool = True, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 long_prefill_token_threshold: int = 0, enable_chunked_prefill: bool = True,
                 watermark: float = 0.0, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, keep_logits: bool = False,
                 kv_cache_memory_bytes: int = 1 << 30,
                 enable_kv_cache_events: bool = False,
                 speculative_config: dict | None = None,
                 scheduler_reserve_full_isl: bool = True,
                 async_scheduling: bool | None = None, tokenizer=None,
                 kv_transfer_config=None,
                 disable_hybrid_kv_cache_manager: bool | None = None) -> None:
        self.device = torch.device(device)
        self.model = load_model(model, self.device, dtype)
        self.tokenizer = _load_tokenizer(model, tokenizer)
        self.dtype = next(self.model.parameters()).dtype
        config = self.model.config
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.max_num_batched_tokens, self.max_num_seqs = resolve_batch_limits(
            self.device, self.max_model_len, max_num_batched_tokens, max_num_seqs,
            enable_chunked_prefill)
        if async_scheduling is None:
            async_scheduling = self.device.type == "cuda" and not speculative_config
        elif async_scheduling and speculative_config:
            self._refuse_async_speculation(speculative_config)
        self.async_scheduling = async_scheduling
        if not enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len})")

        self.disable_hybrid_kv_cache_manager = resolve_disable_hybrid_kv_cache_manager(
            kv_transfer_config, disable_hybrid_kv_cache_manager)
        unify = dict(disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager)
        probe = make_kv_cache_config(config, block_size, 1, self.dtype, **unify)
        per_request = self._blocks_per_full_request(probe)
        if num_gpu_blocks is None:
            num_tensors = max(len(g.layer_names) for g in probe.kv_cache_groups)
            block_bytes = num_tensors * probe.kv_cache_groups[0].kv_cache_spec.page_size_bytes
            num_gpu_blocks = min(kv_cache_memory_bytes // block_bytes,
                                 1 + self.max_num_seqs * per_request)
        if num_gpu_blocks < 1 + per_request:
            # vLLM refuses to start too: a full-length request could never run.
            # (Its check leaves out the null block; kvref counts it, one block stricter.)
            raise ValueError(f"num_gpu_blocks={num_gpu_blocks} cannot hold one request of "
                             f"max_model_len={self.max_model_len} tokens: it needs "
                             f"{per_request} blocks plus the null block")
        self.kv_cache_config = make_kv_cache_config(config, block_size, num_gpu_blocks,
                                                    self.dtype, **unify)

        self.kv_cache_manager = KVCacheManager(
            self.kv_cache_config, max_model_len=self.max_model_len,
            scheduler_block_size=block_size, hash_block_size=block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_caching=enable_prefix_caching, log_stats=True, watermark=watermark,
            enable_kv_cache_events=enable_kv_cache_events)
        drafter = self._make_drafter(speculative_config)
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_cls(
            self.kv_cache_manager, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_chunked_prefill=enable_chunked_prefill, eos_token_id=config.eos_token_id,
            scheduler_reserve_full_isl=scheduler_reserve_full_isl,
            num_speculative_tokens=drafter.k if drafter else 0,
            kv_transfer_config=kv_transfer_config, **unify)
        self.model_runner = GPUModelRunner(
            self.model, self.kv_cache_config, max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_reqs=self.max_num_seqs,
            device=self.device, dtype=self.dtype, keep_logits=keep_logits,
            drafter=drafter, async_scheduling=async_scheduling,
            kv_transfer_config=kv_transfer_config, **unify)
        self.engine_core = make_engine_core(self.scheduler, self.model_runner)
        self.after_step: list[Callable[[LLM], None]] = []
        self._logits: dict[str, list[torch.Tensor]] = {}
        self._prompt_logprobs: dict[str, list] = {}
        self._prompt_text: dict[str, str] = {}
        self._next_request_id = 0

    def _token_ids(self, index: int, prompt) -> tuple[list[int], str | None]:
        """A prompt of ``generate`` as token ids, and its text if it had one."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt {index}: a dict prompt needs 'prompt_token_ids' or "
                                 f"'prompt', got keys {sorted(prompt)}")
        if not isinstance(prompt, str):
            return prompt, None
        if self.tokenizer is None:
            raise ValueError(
                f"prompt {index} is text ({prompt[:30]!r}), but this LLM has no tokenizer: "
                "pass token ids (a list of ints, or {'prompt_token_ids': [...]}), or give "
                "LLM(..., tokenizer=FOLDER_OR_TOKENIZER) or a checkpoint folder with "
                "tokenizer files")
        return list(self.tokenizer(prompt)["input_ids"]), prompt

    def _refuse_async_speculation(self, speculative_config: dict) -> None:
        """vLLM 0.25.1's ``VllmConfig`` refuses ``async_scheduling=True`` with
        drafts other than EAGLE/MTP, a draft model, ``ngram_gpu`` or DSpark
        (``vllm/config/vllm.py:961-981``); kvref's drafts are the CPU n-gram
        proposer's (``method: "ngram"``), so it refuses the pairing too. (The
        runner's ``-1`` placeholder path that vLLM's GPU drafters use is tested
        below this check, ``tests/engine/test_async_scheduling.py``.)"""
        method = speculative_config.get("method", "ngram")
        raise ValueError(
            f"async_scheduling=True with speculative method {method!r}: vLLM 0.25.1 "
            "schedules asynchronously only with EAGLE/MTP, draft-model, ngram_gpu or "
            "DSpark drafts (vllm/config/vllm.py:961-981); kvref's drafts are the CPU "
            "n-gram proposer's: leave async_scheduling unset or False")

    def _make_drafter(self, speculative_config: dict | None) -> NgramProposer | None:
        if not speculative_config:
            return None
        config = dict(speculative_config)
        method = config.pop("method", "ngram")
        if method != "ngram":
            raise ValueError(f"speculative method {method!r} is not supported (ngram)")
        k = config.pop("num_speculative_tokens")
        low = config.pop("prompt_lookup_min", None)
        high = config.pop("prompt_lookup_max", None)
        if config:
            raise ValueError(f"unknown speculative_config keys {sorted(config)}")
        # vLLM's defaults: 5 and 5 when neither is given, else the one given for both.
        if low is None and high is None:
            low = high = 5
        low = high if low is None else low
        high = low if high is None else high
        return NgramProposer(low, high, k, self.max_model_len)

    def _blocks_per_full_request(self, kv_cache_config: KVCacheConfig) -> int:
        """Blocks one request of ``max_model_len`` tokens holds at its peak, summed
        over the groups: what vLLM's start-up check (``_check_enough_kv_cache_memory``
        over ``_max_memory_usage_bytes_from_groups``) asks the pool for."""
        return sum(group.kv_cache_spec.max_num_blocks_per_request(
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens)
            for group in kv_cache_config.kv_cache_groups)

    @property
    def stats(self) -> SchedulerStats:
        """Steps, preemptions, and prompt tokens computed versus served by the prefix cache."""
        return self.scheduler.stats

    def add_request(self, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> EngineRequest:
        """Queue one prompt (token ids); ``step()`` runs it."""
        ids = _as_token_ids(prompt_token_ids)
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab})")
        if request_id is None:
            request_id = str(self._next_request_id)
            self._next_request_id += 1
        return self.scheduler.new_request(request_id, ids, sampling_params)

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Forget every cached prefix, as vLLM's ``LLM.reset_prefix_cache``
        (``llm.py:800-805``): False while requests hold blocks, unless
        ``reset_running_requests`` preempts them first (they recompute);
        ``reset_connector`` also resets the KV connector's cache
        (``Scheduler.reset_prefix_cache``)."""
        return self.engine_core.reset_prefix_cache(reset_running_requests, reset_connector)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it. Under async
        scheduling a step that only queued a batch returns ``[]``."""
        # Frames a reset_prefix_cache(reset_running_requests=True) left in flight are
        # dropped by the scheduler when they arrive: so are their logits.
        to_discard = {req_id: request.async_tokens_to_discard
                      for req_id, request in self.scheduler.requests.items()
                      if request.async_tokens_to_discard}
        step = self.engine_core.step()
        if step is not None:
            for req_id, entries in step.model_runner_output.prompt_logprobs.items():
                self._prompt_logprobs[req_id] = [None, *entries]
            for req_id, logits in step.model_runner_output.logits.items():
                if req_id in to_discard and (self.scheduler.requests[req_id]
                                             .async_tokens_to_discard < to_discard[req_id]):
                    continue
                self._logits.setdefault(req_id, []).extend(logits)
        for hook in self.after_step:
            hook(self)
        return [] if step is None else [self._make_output(req) for req in step.finished]

    def generate(self, prompts: Sequence, sampling_params: SamplingParams
                 | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order.

        ``prompts``: one prompt or a list of them; a prompt is a token-id list,
        ``{"prompt_token_ids": [...]}``, or (with a tokenizer) a string or
        ``{"prompt": "..."}``, as ``vllm.LLM.generate`` takes them. A string
        without a tokenizer is an error that says what to pass instead.
        ``sampling_params``: one for all, or one per prompt.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} "
                             "prompts")
        order = []
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            ids, text = self._token_ids(index, prompt)
            request_id = self.add_request(ids, params).request_id
            if text is not None:
                self._prompt_text[request_id] = text
            order.append(request_id)
        done: dict[str, RequestOutput] = {}
        while self.engine_core.has_work():
            for output in self.step():
                done[output.request_id] = output
        return [done[request_id] for request_id in order]

    def _make_output(self, request: EngineRequest) -> RequestOutput:
        tokens = list(request.output_token_ids)
        # A stop inside an accepted draft drops its tail: drop those logits too.
        logits = self._logits.pop(request.request_id, [])[:len(tokens)]
        text = (None if self.tokenizer is None else
                self.tokenizer.decode(tokens, skip_special_tokens=True))
        completion = CompletionOutput(0, tokens, request.get_finished_reason(), logits, text,
                                      request.stop_reason)
        return RequestOutput(request.request_id, list(request.prompt_token_ids),
                             [completion], True, request.num_cached_tokens,
                             self._prompt_text.pop(request.request_id, None),
                             kv_transfer_params=request.kv_transfer_params_out,
                             prompt_logprobs=self._prompt_logprobs.pop(request.request_id,
                                                                       None))


def _as_token_ids(tokens) -> list[int]:
    """Token ids as ints; a clear ``TypeError`` for text or anything not an integer."""
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"token ids expected, got text {tokens[:30]!r}; text prompts go "
                        "through generate() on an LLM with a tokenizer")
    ids = []
    for t in tokens:
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise TypeError(f"token ids must be integers, got {t!r} "
                            f"({type(t).__name__})") from None
    return ids


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _load_tokenizer(model, tokenizer):
    """The LLM's tokenizer: the one given, one loaded from a given folder, or
    the checkpoint folder's own; None when there is none. Never downloads."""
    if tokenizer is None and isinstance(model, (str, os.PathLike)):
        if any(os.path.isfile(os.path.join(model, name)) for name in TOKENIZER_FILES):
            tokenizer = model
    if isinstance(tokenizer, (str, os.PathLike)):
        import transformers

        return transformers.AutoTokenizer.from_pretrained(os.fspath(tokenizer),
                                                          local_files_only=True)
    return tokenizer
