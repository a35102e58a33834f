"""The README's engine example runs as printed (on a checkpoint this test saves)."""

from __future__ import annotations

import contextlib
import io

import transformers

README_EXAMPLE = '''
from rich import print
from kvref.engine import LLM, SamplingParams
from kvref.viz import render_pool

llm = LLM("CHECKPOINT", block_size=4, num_gpu_blocks=24, max_model_len=64)  # a local folder
llm.after_step.append(lambda llm: print(render_pool(llm.kv_cache_manager)))  # pool each step
prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10]]        # 8 tokens shared
outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
print([o.outputs[0].token_ids for o in outputs], llm.stats)
'''


def test_readme_example_generates_and_prints_the_pool(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    code = README_EXAMPLE.replace("CHECKPOINT", str(tmp_path))
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README example", "exec"), namespace)
    text = printed.getvalue()
    assert "free queue" in text and "prompt_tokens_cached=8" in text
    assert [len(o.outputs[0].token_ids) for o in namespace["outputs"]] == [8, 8]
