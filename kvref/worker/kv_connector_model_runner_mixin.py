"""The runner's side of a KV connector: the calls around one forward pass.

Mirrors ``vllm/v1/worker/kv_connector_model_runner_mixin.py``
(``KVConnectorModelRunnerMixin._get_kv_connector_output``, lines 78-112 in
v0.25.1). vLLM mixes it into ``GPUModelRunner``; kvref has two runners
(``gpu_model_runner.GPUModelRunner`` and ``model_free_runner.ModelFreeRunner``),
so the seam is one function both call, and both drive a connector the same way.
No torch.
"""

from __future__ import annotations

from kvref.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorOutput)


def execute_with_connector(connector: KVConnectorBase_V1 | None, scheduler_output, execute):
    """One runner step with the connector's WORKER half around the forward pass.

    ``execute(scheduler_output)`` is the runner's own step (it returns a
    ``ModelRunnerOutput``). As vLLM's ``_get_kv_connector_output``:
    bind the step's metadata, start the loads, run the forward, wait for the
    saves (a step without a forward saves nothing), then report what ended in
    ``output.kv_connector_output``. Both runners (``GPUModelRunner`` and the
    model-free one) call this, so they drive a connector the same way.
    """
    if connector is None:
        return execute(scheduler_output)
    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    connector.start_load_kv()
    output = execute(scheduler_output)
    if scheduler_output.total_num_scheduled_tokens > 0:
        connector.wait_for_save()
    sending, recving = connector.get_finished(scheduler_output.finished_req_ids)
    kv_connector_output = KVConnectorOutput(
        finished_sending=sending, finished_recving=recving,
        invalid_block_ids=connector.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=connector.build_connector_worker_meta())
    connector.clear_connector_metadata()
    # (vLLM's runner returns no KVConnectorOutput at all from a step without a
    # forward that has nothing to report, ``vllm/v1/outputs.py:284-294``, so its
    # scheduler skips ``update_connector_output`` there; kvref's runners always
    # report, and kvref's CPU tier counts on one call per step.)
    output.kv_connector_output = kv_connector_output
    return output

