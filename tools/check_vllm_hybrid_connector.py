#!/usr/bin/env python3
"""Run vLLM 0.25.1's own scheduler and KV cache manager on the two hybrid-with-connector
cases ``tests/engine/test_kv_connectors_hybrid.py`` pins, and print what vLLM answers.

No vLLM counterpart. Run it with the oracle's interpreter (``python3
tools/setup_vllm_venv.py DIR`` makes one) from the repository root::

    PYTHONHASHSEED=0 /root/.cache/vllm-oracle/bin/python tools/check_vllm_hybrid_connector.py

1. **Mamba hybrid, per-group hit** (``scheduler.py:689-722``): a full-attention
   group and a Mamba group (``mamba_cache_mode="all"``), a connector with
   ``SupportsHMA`` that records what it is asked; request "a" caches 3 blocks in
   both groups and leaves, its Mamba states are evicted, then "b" (same 12-token
   prefix) is scheduled. Prints the hit the connector was asked from, the tokens
   scheduled and b's block ids. kvref's test expects ``("b", 12)``, ``{"b": 2}``,
   ``([1, 2, 3, 8], [0, 0, 4, 9])``.
2. **A whole prompt loaded asynchronously on a window hybrid**: a full group and
   a sliding-window group (window 5, block size 4), ``allocate_slots`` of a 16-token
   prompt with all 16 tokens external. Prints the block ids: kvref's test expects
   ``([1, 2, 3, 4], [0, 0, 0, 5])``, the window group's block of token 11 (the
   oldest token in the window of token 15, which the consumer recomputes) null.

The recording connector lives in a module this script writes to a temporary
folder (vLLM imports a connector outside its tree by module path).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record_vllm_scheduler import DEFAULT_MODEL_DIR, DEFAULT_SRC, load_vllm  # noqa: E402

BLOCK = 4
CONNECTOR_MODULE = '''
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA)

ASKED = []


class RecordingHMAConnector(KVConnectorBase_V1, SupportsHMA):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        ASKED.append((request.request_id, num_computed_tokens))
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass
'''


def mamba_hybrid_per_group_hit() -> None:
    import torch
    from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, MambaSpec)
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    import recording_hma_connector as recording

    model = str(DEFAULT_MODEL_DIR)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model, tokenizer=model, skip_tokenizer_init=True,
                                 dtype="float16", max_model_len=64),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True,
                                 prefix_caching_hash_algo="sha256"),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                         max_model_len=64, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        parallel_config=ParallelConfig(),
        kv_transfer_config=KVTransferConfig(kv_connector="RecordingHMAConnector",
                                            kv_connector_module_path="recording_hma_connector",
                                            kv_role="kv_both"))
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    vllm_config.cache_config.mamba_cache_mode = "all"
    vllm_config.cache_config.num_gpu_blocks = 60
    groups = [
        KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=2,
                                                     head_size=8, dtype=torch.float32)),
        KVCacheGroupSpec(["mamba"], MambaSpec(block_size=BLOCK, shapes=((8,),),
                                              dtypes=(torch.float32,),
                                              mamba_cache_mode="all"))]
    scheduler = Scheduler(vllm_config=vllm_config,
                          kv_cache_config=KVCacheConfig(num_blocks=60, kv_cache_tensors=[],
                                                        kv_cache_groups=groups),
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=BLOCK, hash_block_size=BLOCK, log_stats=True)
    manager = scheduler.kv_cache_manager
    hasher = hasher_for(BLOCK)
    prefix = list(range(1, 13))
    a = Request("a", prefix + [40, 41], SamplingParams(max_tokens=1), None, None,
                block_hasher=hasher)
    assert manager.allocate_slots(a, 14) is not None
    manager.cache_blocks(a, 14)
    a.num_computed_tokens = 14
    manager.free(a)
    manager.evict_blocks({b.block_id for b in manager.block_pool.blocks
                          if b.block_hash is not None and b.block_hash[-1] == 1})
    b = Request("b", prefix + [42, 43], SamplingParams(max_tokens=1), None, None,
                block_hasher=hasher)
    scheduler.add_request(b)
    output = scheduler.schedule()
    print("1. Mamba hybrid with a SupportsHMA connector:")
    print("   connector asked", recording.ASKED, "scheduled", output.num_scheduled_tokens,
          "block ids", manager.get_block_ids("b"))


def whole_prompt_loaded_on_a_window_hybrid() -> None:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, SlidingWindowSpec)
    from vllm.v1.request import Request

    heads = dict(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=40, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["full"], FullAttentionSpec(**heads)),
        KVCacheGroupSpec(["swa"], SlidingWindowSpec(**heads, sliding_window=5))])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK, enable_caching=True)
    request = Request("r", list(range(16)), SamplingParams(max_tokens=4), None, None,
                      block_hasher=hasher_for(BLOCK))
    blocks, num_hit = manager.get_computed_blocks(request)
    manager.allocate_slots(request, 0, num_new_computed_tokens=num_hit,
                           new_computed_blocks=blocks, num_external_computed_tokens=16,
                           delay_cache_blocks=True)
    print("2. a 16-token prompt loaded whole, window 5, block size 4:")
    print("   block ids", manager.get_block_ids("r"))


def hasher_for(block_size: int):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


def main() -> int:
    load_vllm(DEFAULT_SRC)
    folder = tempfile.mkdtemp(prefix="kvref-hma-")
    Path(folder, "recording_hma_connector.py").write_text(CONNECTOR_MODULE)
    sys.path.insert(0, folder)
    mamba_hybrid_per_group_hit()
    whole_prompt_loaded_on_a_window_hybrid()
    return 0


if __name__ == "__main__":
    sys.exit(main())
