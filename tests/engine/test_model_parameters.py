"""Every parameter of the model matters: norms, biases, tied and untied heads.

A freshly initialised transformers model has every RMSNorm weight at one and
every bias at zero, so a model that swapped two norms, dropped a bias or
read the wrong head would still generate the same tokens. The test models
(``hf_models.perturb``) draw all of them at random; these tests check that
they did, that it changes the answers, and run each architecture with every
optional parameter on, tied and untied, loaded in memory and from a folder.
"""

from __future__ import annotations

import pytest
import torch

from kvref.engine import LLM, SamplingParams

from .hf_models import assert_matches_transformers, constant_parameters, hybrid, llama, reference
from .test_llm import shared_prefix_prompts


def every_parameter_model(arch: str, tie: bool):
    if arch == "llama":
        return llama(seed=21, tie=tie, attention_bias=True, mlp_bias=True, layers=2)
    return hybrid(seed=21, arch=arch, tie=tie, attention_bias=True)


ARCHS = ["llama", "qwen3", "qwen2"]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_no_parameter_keeps_its_constant_initial_value(arch, tie):
    model = every_parameter_model(arch, tie)
    assert constant_parameters(model) == []
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("norm.weight") for n in names)
    assert any(n.endswith(".bias") for n in names)
    if arch == "qwen3":
        assert any("q_norm" in n for n in names) and any("k_norm" in n for n in names)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie


@pytest.mark.parametrize("arch", ARCHS)
def test_random_norm_weights_change_the_answer(arch):
    """Guards the tests below: with every norm weight back at one, transformers
    itself answers differently, so a norm applied in the wrong place shows."""
    model = every_parameter_model(arch, tie=False)
    prompt = shared_prefix_prompts(model.config.vocab_size, seed=21)[6]
    tokens, logits = reference(model, prompt, 6)
    flat = every_parameter_model(arch, tie=False)
    with torch.no_grad():
        for name, param in flat.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
    flat_tokens, flat_logits = reference(flat, prompt, 6)
    assert (logits - flat_logits).abs().max() > 1e-2
    assert tokens != flat_tokens


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_parameter_perturbed_matches_transformers(arch, tie):
    model = every_parameter_model(arch, tie)
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=22)[:6]
    llm = LLM(model, block_size=4, max_model_len=64, max_num_batched_tokens=16,
              num_gpu_blocks=40, keep_logits=True)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert_matches_transformers(model, prompts, outputs, 6)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_parameter_loads_from_a_checkpoint_folder(tmp_path, arch, tie):
    model = every_parameter_model(arch, tie)
    model.save_pretrained(tmp_path)
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=23)[:3]
    llm = LLM(str(tmp_path), block_size=4, max_model_len=64, num_gpu_blocks=40,
              keep_logits=True)
    loaded = llm.model
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tie
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert_matches_transformers(model, prompts, outputs, 4)


def test_mlp_in_place_under_inference_equals_the_autograd_path():
    # GatedMLP overwrites its fused gate|up output in place when autograd is off; with
    # autograd on it keeps the out-of-place ops (backward needs gate). Same values.
    from kvref.model_executor.model import GatedMLP, ModelConfig
    config = ModelConfig(architecture="llama", vocab_size=32, hidden_size=16,
                         intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    mlp = GatedMLP(config)
    x = torch.randn(5, 16)
    with_grad = mlp(x)
    assert with_grad.requires_grad
    with_grad.sum().backward()                       # the out-of-place path differentiates
    assert mlp.gate_up_proj.weight.grad is not None
    with torch.inference_mode():
        in_place = mlp(x)
    assert torch.equal(in_place, with_grad.detach())
