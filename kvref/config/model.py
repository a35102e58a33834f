"""The architecture a model runs with, read from a ``transformers`` config.

Mirrors the part of ``vllm/config/model.py`` (``ModelConfig``) and
``vllm/transformers_utils/config.py`` that kvref's three architectures need:
sizes, RoPE, biases, per-layer attention types and the window. Kept apart
from ``kvref/model_executor/model.py`` so that the network reads first there; no torch here.
``ModelConfig.from_hf_config`` accepts transformers 4 and 5 configs.

    >>> config = ModelConfig(architecture="qwen3", vocab_size=32, hidden_size=16,
    ...     intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    ...     num_key_value_heads=1, head_dim=8, sliding_window=4,
    ...     layer_types=("sliding_attention", "full_attention"))
    >>> config.layer_sliding_window(0), config.layer_sliding_window(1)
    (4, None)
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES"]


SUPPORTED_ARCHITECTURES = {"llama", "qwen2", "qwen3"}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture, read from a ``transformers`` config (``from_hf_config``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "default"})
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False     # bias on q, k, v (always in Qwen2)
    o_proj_bias: bool = False        # bias on the output projection (never in Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False            # RMSNorm over each head of q and k (Qwen3)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads {self.num_key_value_heads}")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; "
                             f"supported: {sorted(SUPPORTED_ROPE_TYPES)}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types",
                               ("full_attention",) * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        for kind in self.layer_types:
            if kind not in ("full_attention", "sliding_attention"):
                raise ValueError(f"layer type {kind!r} is not supported "
                                 "(full_attention, sliding_attention)")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer ``layer_idx`` (None: full attention)."""
        if self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_hf_config(cls, hf_config) -> ModelConfig:
        """Read a ``LlamaConfig``/``Qwen2Config``/``Qwen3Config`` (transformers 4 or 5)."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model_type {model_type!r} is not supported; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (silu)")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        # transformers 5 keeps theta and scaling in rope_parameters; 4 in two fields.
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if not rope:
            rope = dict(getattr(hf_config, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.get("type", "default"))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1.0 is not supported")
        layer_types = tuple(getattr(hf_config, "layer_types", None) or ())
        sliding_window = getattr(hf_config, "sliding_window", None)
        if "sliding_attention" not in layer_types:
            sliding_window = None
        eos = getattr(hf_config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return cls(
            architecture=model_type, vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size, intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers, num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim, rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 10000.0)), rope_scaling=rope,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            # Qwen2 has a q/k/v bias and no output bias, whatever its config
            # says; Llama's and Qwen3's attention_bias puts one on all four.
            attention_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias",
                                                                 False)),
            o_proj_bias=model_type != "qwen2" and bool(getattr(hf_config, "attention_bias",
                                                               False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3", layer_types=layer_types,
            sliding_window=sliding_window, eos_token_id=eos)
