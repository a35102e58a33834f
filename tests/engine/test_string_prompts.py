"""String prompts, as vllm.LLM.generate takes them: only with a tokenizer.

The tokenizer is built here from a word list (``tokenizers``' WordLevel model,
saved next to the checkpoint), so nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from kvref.engine import LLM, SamplingParams

WORDS = ["<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def _llama(folder, with_tokenizer: bool):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    if with_tokenizer:
        words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                           unk_token="<unk>"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        transformers.PreTrainedTokenizerFast(tokenizer_object=words,
                                             unk_token="<unk>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {kind: _llama(tmp_path_factory.mktemp(kind), kind == "with")
            for kind in ("with", "without")}


def test_a_string_prompt_is_the_tokenizers_token_ids(folders):
    llm = LLM(str(folders["with"]), block_size=4, num_gpu_blocks=40, max_model_len=32)
    text = llm.generate("the cat sat on the mat", PARAMS)
    ids = llm.generate([[1, 2, 3, 4, 1, 5]], PARAMS)
    as_dict = llm.generate([{"prompt": "the cat sat on the mat"}], PARAMS)
    assert text[0].prompt_token_ids == [1, 2, 3, 4, 1, 5] and text[0].prompt == \
        "the cat sat on the mat"
    assert text[0].outputs[0].token_ids == ids[0].outputs[0].token_ids == \
        as_dict[0].outputs[0].token_ids
    decoded = text[0].outputs[0].text
    assert decoded.split() == [WORDS[t] for t in text[0].outputs[0].token_ids]
    assert ids[0].prompt is None


def test_a_string_prompt_without_a_tokenizer_says_what_to_pass(folders):
    llm = LLM(str(folders["without"]), block_size=4, num_gpu_blocks=40, max_model_len=32)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match=r"prompt 0 is text \('hello'\), but this LLM has no "
                                         r"tokenizer: pass token ids"):
        llm.generate("hello", PARAMS)
    with pytest.raises(ValueError, match="prompt 1 is text"):
        llm.generate([[1, 2], {"prompt": "hello"}], PARAMS)
    with pytest.raises(ValueError, match="needs 'prompt_token_ids' or 'prompt'"):
        llm.generate([{"text": "hello"}], PARAMS)
    with pytest.raises(TypeError, match=r"token ids must be integers, got 'h' \(str\)"):
        llm.generate([["h", "i"]], PARAMS)
    with pytest.raises(TypeError, match="token ids expected, got text"):
        llm.add_request("hello")
    assert llm.generate([torch.tensor([1, 2, 3])], PARAMS)[0].prompt_token_ids == [1, 2, 3]
    assert llm.generate([[1, 2, 3]], PARAMS)[0].outputs[0].text is None


def test_a_tokenizer_can_be_given_apart_from_the_model(folders):
    llm = LLM(str(folders["without"]), block_size=4, num_gpu_blocks=40, max_model_len=32,
              tokenizer=str(folders["with"]))
    assert llm.generate("a dog ran", PARAMS)[0].prompt_token_ids == [6, 7, 8]
