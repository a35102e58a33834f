"""Tiny random ``transformers`` models and their answers without paging.

The expected side of every engine test: ``model.generate(do_sample=False)`` on
one prompt at a time, with the logits of every generated position. Weights are
initialised with a large spread so greedy decoding does not collapse onto one
repeated token (which would make equality with the engine an easy test), and
every parameter transformers would start at a constant (each RMSNorm weight at
one, each bias at zero) is drawn at random too: with regular weights a model
that swapped two norms or dropped a bias would still generate the same tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no GPU is present")),
]


def llama(seed: int = 0, *, vocab_size: int = 96, hidden_size: int = 32, layers: int = 2,
          heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
          tie: bool = False, rope_parameters: dict | None = None,
          attention_bias: bool = False, mlp_bias: bool = False
          ) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden_size // heads, max_position_embeddings=256,
        tie_word_embeddings=tie, initializer_range=0.3, rope_parameters=rope_parameters,
        attention_bias=attention_bias, mlp_bias=mlp_bias,
        attn_implementation="eager", eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return perturb(transformers.LlamaForCausalLM(config).eval())


def hybrid(seed: int = 0, *, arch: str = "qwen3", window: int = 5,
           layer_types: tuple[str, ...] = ("full_attention", "sliding_attention",
                                           "sliding_attention"),
           vocab_size: int = 96, hidden_size: int = 32, heads: int = 4, kv_heads: int = 2,
           head_dim: int = 8, tie: bool = True,
           attention_bias: bool = False) -> transformers.PreTrainedModel:
    """Qwen3 (or Qwen2): full-attention layers mixed with sliding-window layers."""
    config_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    config = config_cls(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=len(layer_types), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=256,
        use_sliding_window=True, sliding_window=window, layer_types=list(layer_types),
        tie_word_embeddings=tie, initializer_range=0.3, attn_implementation="eager",
        attention_bias=attention_bias,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return perturb(model_cls(config).eval())


def perturb(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """Give every constant-initialised parameter random values.

    transformers starts every bias at zero and every RMSNorm weight (the
    layer norms, the final norm, Qwen3's q/k norms) at one: a bias the engine
    dropped, or a norm applied in another norm's place, would go unnoticed.
    Norm weights become ``1 + N(0, 0.3)`` per element (different in every
    norm), biases ``N(0, 0.3)``; tied embeddings stay tied.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.3)
            elif "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
                param.normal_(1.0, 0.3)
    return model


def constant_parameters(model: torch.nn.Module) -> list[str]:
    """Names of parameters whose elements are all equal (what ``perturb`` removes)."""
    return [name for name, param in model.named_parameters()
            if param.numel() > 1 and bool((param == param.flatten()[0]).all())]


@functools.lru_cache(maxsize=None)
def _generate(model: transformers.PreTrainedModel, prompt: tuple[int, ...],
              max_tokens: int) -> tuple[list[int], torch.Tensor]:
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        # An explicit mask: else generate() masks every prompt token equal to pad_token_id.
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([step[0] for step in out.logits]).float()


def reference(model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and ``[max_tokens, vocab]`` logits of ``model`` alone on ``prompt``."""
    return _generate(model, tuple(prompt), max_tokens)


def assert_matches_transformers(model, prompts, outputs, max_tokens: int,
                                atol: float = 1e-4) -> None:
    """Token for token equal, and every generated position's logits within ``atol``."""
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        tokens, logits = reference(model, prompt, max_tokens)
        got = output.outputs[0]
        assert got.token_ids == tokens, f"prompt {i} (length {len(prompt)})"
        engine_logits = torch.stack(got.logits)
        assert engine_logits.shape == logits.shape
        err = (engine_logits - logits).abs().max().item()
        assert err <= atol, f"prompt {i}: logits differ by {err}"
