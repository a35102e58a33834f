"""Small helpers of the scheduler: when a request stops.

Mirrors ``vllm/v1/core/sched/utils.py`` (``check_stop``); the scheduler calls it
on every sampled token in ``Scheduler.update_from_output``.
"""

from __future__ import annotations

from kvref.request import EngineRequest, RequestStatus


def check_stop(request: EngineRequest, max_model_len: int) -> bool:
    """Set a finished status and return True if the last token ends the request.

    Mirrors ``vllm/v1/core/sched/utils.py::check_stop``, in its order: nothing
    stops before ``min_tokens``; then EOS (unless ``ignore_eos``) and stop
    tokens finish as ``FINISHED_STOPPED``; then a full context or
    ``max_tokens`` finishes as ``FINISHED_LENGTH_CAPPED``.
    """
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if not params.ignore_eos and request.eos_token_id is not None \
            and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= params.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
