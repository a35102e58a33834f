"""A decoder-only transformer in plain torch, reading and writing a paged KV cache.

Mirrors ``vllm/model_executor/models/llama.py`` (and ``qwen2.py``/``qwen3.py``,
which are Llama plus QKV bias, or plus per-head q/k RMSNorm and sliding-window
layers). Written the gpt-fast way: each piece a few lines, shapes in comments.
The batch is packed: ``[num_tokens, ...]``, requests back to back, no padding.

    token ids ─ embed ─ N x [ x + attention(RMSNorm(x)) ; x + MLP(RMSNorm(x)) ]
              ─ RMSNorm ─ lm_head ─ logits        (x: the residual stream)

Attention writes this step's keys and values into the layer's paged cache
(``kvref.attention.write_kv``, through the step's plan) and reads the
request's whole context back through its block table
(``kvref.attention.PagedAttentionPlan.attend``, the batched form of the
reference ``paged_attention``); a layer whose
``layer_types`` entry is ``"sliding_attention"`` sees only the last
``sliding_window`` positions. Weights load from a Hugging Face state dict with
vLLM's fused ``qkv_proj`` and ``gate_up_proj`` (``load_weights``).

    >>> import torch
    >>> config = ModelConfig(architecture="llama", vocab_size=32, hidden_size=16,
    ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    ...     num_key_value_heads=1, head_dim=8)
    >>> model = TransformerForCausalLM(config)
    >>> model.layers[0].self_attn.qkv_proj.weight.shape    # q 2x8, k 1x8, v 1x8 rows
    torch.Size([32, 16])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvref.attention import KVGatherBuffer, PagedAttentionPlan
from kvref.config.model import ModelConfig

# ModelConfig lives in model_config.py (the HF-config plumbing); exported here too.
__all__ = ["AttentionMetadata", "ModelConfig", "RotaryEmbedding", "TransformerForCausalLM"]

@dataclass
class AttentionMetadata:
    """One KV cache group's view of the packed batch (vLLM's FlashAttentionMetadata).

    For each request, its query is the tail of its sequence::

        |<------------- seq_len -------------->|
        |<--- context_len --->|<- query_len ->|
          already in the cache   computed now

    ``query_start_loc``: ``[num_reqs + 1]`` cumulative query lengths;
    ``seq_lens``: ``[num_reqs]``; ``block_table``: ``[num_reqs, max_blocks]``;
    ``slot_mapping``: ``[num_tokens]``, where each new token's key and value go;
    ``plan``: the step's gathers and masks for ``kvref.attention``'s batched
    paged attention, worked out once for every layer of the group.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    plan: PagedAttentionPlan
    # The worker half of a KV connector, or None: each attention layer waits for its
    # load before and hands its KV to save after (vLLM's maybe_transfer_kv_layer).
    kv_connector: object | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()                                     # normalise in float32, as HF does
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half (GPT-NeoX) layout, as Llama uses.

    ``inv_freq[i] = theta ** (-2i / head_dim)``, then rescaled by the config's
    ``rope_type``: ``linear`` divides every frequency by ``factor``; ``llama3``
    divides only the low frequencies (long wavelengths) and blends in between.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                    / head_dim))
        rope_type = scaling.get("rope_type", "default")
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin``: ``[T, 1, D]`` for positions ``[T]``, the same for every layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]      # [T, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]            # [T, 1, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Every head of ``x [T, heads, D]`` turned by its token's ``cos, sin [T, 1, D]``."""
        return x * cos + _rotate_half(x) * sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are stretched by factor; short ones kept.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class Attention(nn.Module):
    """Grouped-query attention over the paged cache of one layer."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_name = f"model.layers.{layer_idx}.self_attn.attn"   # its KV cache's name
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.sliding_window = config.layer_sliding_window(layer_idx)
        # One matmul for q, k and v (vLLM's QKVParallelLinear): rows [q | k | v].
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rope_theta, config.rope_scaling)
        self.gather_buffer = KVGatherBuffer()     # the model hands every layer the same one

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, heads = hidden.shape[0], self.num_heads
        qkv = self.qkv_proj(hidden)                                       # [T, q | k | v]
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, heads + self.num_kv_heads,
                                                      self.head_dim)    # [T, H + KV, D]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads,
                                                     self.head_dim)     # [T, KV, D]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        # q's and k's heads side by side turn by the same angles: one rotation for both,
        # not one each (5 tensor ops less per layer; a toy decode step's 16 tokens:
        # ~75-90 -> ~50 us per layer).
        qk = self.rotary_emb.rotate(qk, *rope)            # rope: (cos, sin) of the positions
        q, k = qk[:, :heads], qk[:, heads:]               # [T, H, D], [T, KV, D]
        if meta.kv_connector is not None:
            meta.kv_connector.wait_for_layer_load(self.layer_name)
        meta.plan.write_kv(kv_cache, k, v)            # write_kv, slots checked once per step
        if meta.plan.sliding_window != self.sliding_window:
            raise ValueError(f"layer window {self.sliding_window}, but its metadata was "
                             f"planned for window {meta.plan.sliding_window}")
        out = meta.plan.attend(q, kv_cache, self.scale, self.gather_buffer)   # [T, H, D]
        if meta.kv_connector is not None:
            meta.kv_connector.save_kv_layer(self.layer_name, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))          # [T, hidden]


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate and up in one matmul (vLLM's gate_up_proj)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        if torch.is_grad_enabled():                  # autograd needs gate kept as it was
            return self.down_proj(nn.functional.silu(gate) * up)
        # Inference: silu and the product overwrite gate's half of the fused output in
        # place instead of allocating two [T, intermediate] tensors (same values; a
        # 1,250-token prefill, per layer: toy ~1.3 -> ~0 ms, 12-layer model ~7 -> ~5 ms).
        return self.down_proj(nn.functional.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class TransformerForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 over kvref's paged KV cache.

    ``forward(input_ids [T], positions [T], kv_caches, attn_metadata)`` returns
    hidden states ``[T, hidden]``; ``compute_logits`` maps chosen rows to the
    vocabulary. ``kv_caches[i]`` is layer ``i``'s cache and
    ``attn_metadata[i]`` the metadata of layer ``i``'s KV cache group.
    """

    # HF checkpoint names fused into one parameter: (ours, theirs, shard).
    stacked_params_mapping = (
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        # Layers run one after another: one gather buffer serves them all (one
        # per layer would hold num_layers copies of a step's gathered keys).
        shared = KVGatherBuffer()
        for layer in self.layers:
            layer.self_attn.gather_buffer = shared
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor],
                attn_metadata: Sequence[AttentionMetadata]) -> torch.Tensor:
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions "
                             f"{tuple(positions.shape)} must be the same [num_tokens] shape")
        hidden = self.embed_tokens(input_ids)                              # [T, hidden]
        # Every layer rotates by the same angles: cos and sin once per step, not per
        # layer (5 tensor ops per layer saved).
        rope = self.layers[0].self_attn.rotary_emb.cos_sin(positions, hidden.dtype)
        for layer, kv_cache, meta in zip(self.layers, kv_caches, attn_metadata, strict=True):
            hidden = layer(rope, hidden, kv_cache, meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)                                        # [N, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy a Hugging Face state dict in; return the names of our parameters set.

        Mirrors ``LlamaForCausalLM.load_weights``: ``model.`` prefixes are
        dropped, ``q/k/v_proj`` and ``gate/up_proj`` land in their slice of the
        fused parameter, and a tied ``lm_head`` is skipped (it is the embedding).
        Raises ``ValueError`` on an unknown name or a shape that does not fit.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue                                   # recomputed, not learned
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for fused, part, shard in self.stacked_params_mapping:
                if f".{part}." in name:
                    target = name.replace(part, fused)
                    self._param(params, target, name)
                    rows = self._shard_rows(fused, shard, params[target].shape[0])
                    self._copy(params[target].data[rows], tensor, name)
                    loaded.add(target)
                    break
            else:
                self._param(params, name, name)
                self._copy(params[name].data, tensor, name)
                loaded.add(name)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"the checkpoint has no weights for {sorted(missing)}")
        return loaded

    def _shard_rows(self, fused: str, shard, total_rows: int) -> slice:
        c = self.config
        if fused == "qkv_proj":
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[shard]
        half = total_rows // 2
        return slice(shard * half, (shard + 1) * half)

    @staticmethod
    def _param(params: dict, target: str, source: str) -> None:
        if target not in params:
            raise ValueError(f"checkpoint weight {source!r} has no parameter here "
                             f"(looked for {target!r})")

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        if dst.shape != src.shape:
            raise ValueError(f"checkpoint weight {name!r} has shape {tuple(src.shape)}, "
                             f"the model expects {tuple(dst.shape)}")
        dst.copy_(src.to(dst.dtype))
