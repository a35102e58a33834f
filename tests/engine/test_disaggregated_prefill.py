"""Disaggregated prefill across two OS processes: a prefill engine pushes KV to this one.

The test starts the prefill engine (``kvref.entrypoints.disagg_prefill``'s
command line) in a second process; this process is the decode engine. They meet over a gloo
process group and move each request's KV block by block (``P2pConnector``).
The decode engine must produce the same greedy tokens as an engine that
computed everything, computing only each prompt's last token. Killing the
prefill engine mid-transfer leaves the decode engine working: under
"recompute" its outputs are still equal, under "fail" the requests that lost
blocks finish with an error; either way no block leaks and the invariants hold
after every step.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import time

import pytest

from kvref.entrypoints import disagg_prefill
from kvref.distributed.kv_transfer.kv_connector.factory import KVTransferConfig
from kvref.engine import LLM, SamplingParams
from kvref.math_utils import cdiv

from .hf_models import llama
from .test_kv_connectors import assert_all_blocks_free, check_scheduler
from .test_llm import shared_prefix_prompts

OPTIONS = dict(block_size=4, max_model_len=64, num_gpu_blocks=80)
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    llama().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(96)[:6]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    llm = LLM(str(model_dir), **OPTIONS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefillEngine:
    """``python -m kvref.entrypoints.disagg_prefill ...`` in a forked process.

    Forked rather than a fresh interpreter: the child starts with torch and the
    model code already imported (seconds instead of tens of seconds on a busy
    machine); it runs the command line's ``main`` with its stdout on a pipe.
    """

    def __init__(self, model_dir, prompts, port: int, tmp_path, stall: int | None = None):
        requests = tmp_path / "requests.json"
        requests.write_text(json.dumps([{"request_id": str(i), "prompt": p}
                                        for i, p in enumerate(prompts)]))
        argv = ["--model", str(model_dir), "--port", str(port), "--requests", str(requests),
                "--block-size", "4", "--max-model-len", "64", "--num-gpu-blocks", "80"]
        if stall is not None:
            argv += ["--stall-after-blocks", str(stall)]
        self._read, write = os.pipe()
        self.process = multiprocessing.get_context("fork").Process(
            target=_prefill_main, args=(argv, write), daemon=True)
        self.process.start()
        os.close(write)

    def finish(self, timeout: float = 60) -> list[dict]:
        """Wait for a clean exit; the JSON lines it printed."""
        self.process.join(timeout)
        assert self.process.exitcode == 0, f"the prefill engine exited with {self.process.exitcode}"
        with os.fdopen(self._read) as f:
            return [json.loads(line) for line in f.read().splitlines()]

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()                   # SIGKILL: no cleanup, as a crash
        self.process.join(30)


def _prefill_main(argv: list[str], write_fd: int) -> None:
    os.dup2(write_fd, 1)
    sys.stdout = os.fdopen(1, "w")
    disagg_prefill.main(argv)
    sys.stdout.flush()


def decode_engine(model_dir, port: int, policy: str = "recompute") -> LLM:
    config = KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_consumer",
                              kv_load_failure_policy=policy,
                              kv_connector_extra_config={"p2p_port": port, "timeout_s": 60})
    llm = LLM(str(model_dir), kv_transfer_config=config, **OPTIONS)
    llm.after_step.append(check_scheduler)
    return llm


def decode_params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS,
                          extra_args={"kv_transfer_params": {"do_remote_prefill": True}})


def run_to_end(llm: LLM, outputs: dict, deadline: float) -> None:
    while llm.scheduler.has_requests():
        assert time.monotonic() < deadline, "the decode engine did not finish"
        step_outputs = llm.step()
        outputs.update((o.request_id, o) for o in step_outputs)
        if not llm.scheduler.running:
            time.sleep(0.002)                     # only transfers in flight: do not spin


def test_the_decode_engine_computes_only_each_prompts_last_token(model_dir, prompts,
                                                                 reference, tmp_path):
    port = free_port()
    prefill = PrefillEngine(model_dir, prompts, port, tmp_path)
    try:
        decode = decode_engine(model_dir, port)
        outputs = decode.generate(prompts, decode_params())
        assert [o.outputs[0].token_ids for o in outputs] == reference
        stats = decode.stats
        assert stats.prompt_tokens_computed == len(prompts)          # one token each
        assert stats.prompt_tokens_external == sum(len(p) - 1 for p in prompts)
        assert stats.prompt_tokens_cached == 0
        worker = decode.model_runner.kv_connector
        assert worker.num_blocks_received == sum(cdiv(len(p), 4) for p in prompts)
        assert_all_blocks_free(decode)
        first = {line["request_id"]: line["token_ids"] for line in prefill.finish()}
        assert [first[str(i)] for i in range(len(prompts))] == [r[:1] for r in reference]
    finally:
        prefill.kill()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_killing_the_prefill_engine_mid_transfer(model_dir, prompts, reference, tmp_path,
                                                policy):
    port = free_port()
    prefill = PrefillEngine(model_dir, prompts, port, tmp_path, stall=3)
    try:
        decode = decode_engine(model_dir, port, policy)
        for i, prompt in enumerate(prompts):
            decode.add_request(prompt, decode_params(), request_id=str(i))
        worker = decode.model_runner.kv_connector
        outputs: dict = {}
        deadline = time.monotonic() + 60
        while worker.num_blocks_received < 3:        # the stalled producer sent 3 blocks
            assert time.monotonic() < deadline, "no block arrived"
            outputs.update((o.request_id, o) for o in decode.step())
            time.sleep(0.002)
        assert decode.scheduler.skipped_waiting, "every transfer ended before the kill"
        prefill.kill()
        run_to_end(decode, outputs, deadline)
    finally:
        prefill.kill()

    assert decode.stats.num_kv_load_failures == len(prompts)      # each lost blocks
    got = [outputs[str(i)].outputs[0] for i in range(len(prompts))]
    if policy == "recompute":
        assert [c.token_ids for c in got] == reference
        # Request 0 kept the three blocks that landed and recomputed from there.
        assert decode.stats.prompt_tokens_external == 3 * 4
    else:
        assert [c.finish_reason for c in got] == ["error"] * len(prompts)
        assert all(c.token_ids == [] for c in got)
    assert_all_blocks_free(decode)
