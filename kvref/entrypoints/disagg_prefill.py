"""Run a prefill engine: ``python -m kvref.entrypoints.disagg_prefill``.

The producer half of disaggregated prefill, as its own OS process: the role
vLLM's ``vllm serve --kv-transfer-config '{"kv_role": "kv_producer", ...}'``
plays (``vllm/entrypoints/cli/serve.py``), so it lives with the entry points. It prefills each prompt (``max_tokens=1``, as vLLM's disaggregation
proxy asks of a prefill engine), pushes every request's KV to the decode engine
listening on ``--port`` with ``P2pConnector``, keeps stepping until every send
ended, and prints one JSON line per request: its id and the token it sampled::

    python -m kvref.entrypoints.disagg_prefill --model DIR --port 29555 \\
        --block-size 4 --requests requests.json     # [{"request_id": ..., "prompt": [...]}]

``--stall-after-blocks k`` stops sending after ``k`` blocks and prints
``{"stalled": k}`` (a test kills the process there, mid-transfer).
``run_prefill_engine`` is the same without the command line (the tests fork
a process that runs it, which skips a second interpreter's imports).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["main", "run_prefill_engine"]


def run_prefill_engine(model, requests: list[dict], port: int, *, block_size: int = 16,
                       max_model_len: int | None = None, num_gpu_blocks: int | None = None,
                       stall_after_blocks: int | None = None, emit=None) -> None:
    """Prefill ``requests`` (``[{"request_id": ..., "prompt": [...]}]``) and push their
    KV to the decode engine on ``port``; returns once every send ended.

    ``emit(dict)`` gets ``{"request_id", "token_ids"}`` per finished prefill and
    ``{"stalled": n}`` when ``stall_after_blocks`` stopped the sends.
    """
    import torch

    from kvref.distributed.kv_transfer.kv_connector.factory import KVTransferConfig
    from kvref.entrypoints.llm import LLM
    from kvref.sampling_params import SamplingParams

    emit = emit or (lambda record: print(json.dumps(record), flush=True))
    torch.set_num_threads(1)
    extra = {"p2p_port": port}
    if stall_after_blocks is not None:
        extra["stall_after_blocks"] = stall_after_blocks
    llm = LLM(model, block_size=block_size, max_model_len=max_model_len,
              num_gpu_blocks=num_gpu_blocks,
              kv_transfer_config=KVTransferConfig(kv_connector="P2pConnector",
                                                  kv_role="kv_producer",
                                                  kv_connector_extra_config=extra))
    params = SamplingParams(max_tokens=1,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    for request in requests:
        llm.add_request(request["prompt"], params, request_id=request["request_id"])
    connector = llm.model_runner.kv_connector
    stalled = False
    while llm.scheduler.has_requests():
        for output in llm.step():
            emit({"request_id": output.request_id, "token_ids": output.outputs[0].token_ids})
        if not llm.scheduler.has_unfinished_requests():
            if stall_after_blocks is not None and not stalled \
                    and connector.num_blocks_sent >= stall_after_blocks:
                emit({"stalled": connector.num_blocks_sent})
                stalled = True
            time.sleep(0.005)                     # only sends left: do not spin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--requests", required=True,
                        help='a JSON file: [{"request_id": "r0", "prompt": [1, 2, 3]}, ...]')
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    parser.add_argument("--stall-after-blocks", type=int, default=None)
    args = parser.parse_args(argv)
    with open(args.requests) as f:
        requests = json.load(f)
    run_prefill_engine(args.model, requests, args.port, block_size=args.block_size,
                       max_model_len=args.max_model_len, num_gpu_blocks=args.num_gpu_blocks,
                       stall_after_blocks=args.stall_after_blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
