"""Loading a Hugging Face causal LM into kvref's model, from memory or a local folder.

Mirrors ``vllm/model_executor/model_loader/default_loader.py`` and
``weight_utils.py``: read the config, build the model, then stream
``(name, tensor)`` pairs from the checkpoint files (``*.safetensors``, else
``pytorch_model*.bin``) into ``model.load_weights``. Nothing is downloaded: a
path must be a folder on disk holding ``config.json`` and the weights.

    >>> import tempfile, transformers
    >>> hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    ...     vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...     num_attention_heads=2, num_key_value_heads=1))
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     hf.save_pretrained(folder)
    ...     model = load_model(folder)
    >>> model.config.architecture, model.config.num_key_value_heads
    ('llama', 1)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from kvref.model_executor.model import TransformerForCausalLM
from kvref.config.model import ModelConfig

__all__ = ["iterate_checkpoint_weights", "load_hf_config", "load_model"]


def load_hf_config(folder: str):
    """The folder's ``config.json`` as a ``transformers`` config (read locally only)."""
    import transformers

    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder!r} is not a checkpoint folder: no config.json")
    with open(path) as f:
        model_type = json.load(f).get("model_type")
    if model_type is None:
        raise ValueError(f"{path} has no model_type")
    return transformers.AutoConfig.from_pretrained(folder, local_files_only=True)


def iterate_checkpoint_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of the checkpoint, file by file (safetensors preferred)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(os.path.join(folder, file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    files = sorted(f for f in os.listdir(folder)
                   if f.startswith("pytorch_model") and f.endswith(".bin"))
    if not files:
        raise FileNotFoundError(f"{folder!r} has no *.safetensors or pytorch_model*.bin")
    for file in files:
        state = torch.load(os.path.join(folder, file), map_location="cpu", weights_only=True)
        yield from state.items()


def load_model(model, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None) -> TransformerForCausalLM:
    """Build kvref's model from a ``transformers`` model object or a checkpoint folder.

    ``dtype``: defaults to the in-memory model's dtype, or the checkpoint
    config's ``dtype``/``torch_dtype``, else float32.
    """
    if isinstance(model, (str, os.PathLike)):
        folder = os.fspath(model)
        hf_config = load_hf_config(folder)
        weights = iterate_checkpoint_weights(folder)
        default_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype",
                                                                      None)
    elif hasattr(model, "config") and hasattr(model, "state_dict"):
        hf_config = model.config
        weights = iter(model.state_dict().items())
        default_dtype = next(model.parameters()).dtype
    else:
        raise TypeError("model must be a transformers PreTrainedModel or a checkpoint folder "
                        f"path, got {type(model).__name__}")
    if isinstance(default_dtype, str):
        default_dtype = getattr(torch, default_dtype)
    dtype = dtype or default_dtype or torch.float32
    config = ModelConfig.from_hf_config(hf_config)
    net = TransformerForCausalLM(config)
    net.load_weights(weights)
    return net.to(device=device, dtype=dtype).eval()
