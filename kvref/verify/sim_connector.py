"""The simulated KV connector of the recorded connector runs, on kvref's connector API.

No vLLM counterpart: ``tools/record_vllm_scheduler.py`` drives vLLM 0.25.1's
own ``Scheduler`` / ``AsyncScheduler`` with the same behaviour written on
vLLM's ``KVConnectorBase_V1`` (written twice on purpose: the recorder imports
nothing of kvref), and ``scheduler_replay`` drives kvref's scheduler with this
one, so that both are asked the same questions and give the same answers.

A run's configuration holds one plan per request (drawn by the recorder)::

    {"ext": tokens of the prompt the remote side holds, "async": whether its
     load lands in a later step, "delay": worker steps until an asynchronous
     load (or a send) ends, "none": how many times to answer "ask again"
     first, "fail": indices of the loaded blocks whose load fails, "hold":
     worker steps a finished request's blocks stay held for a send (0: none)}

The scheduler half (``SimConnectorPlan``) answers ``get_num_new_matched_tokens``
from the plan (a synchronous hit always leaves the last token to compute; a
request whose load failed is not offered anything again), remembers the loads
``update_state_after_alloc`` starts and the sends ``request_finished`` holds
for, and hands them to the worker in the step's metadata. The worker half
(``SimTransfers``) reports a synchronous load's failed blocks in the same
step, and an asynchronous load (with its failed blocks) or a send ``delay``
(``hold``) worker steps after the step that started it. ``take_events`` hands
out one ``BlockStored`` (medium ``"SIM"``) per load that ended. Every call is
logged, with its arguments and answer, to the list in
``kv_connector_extra_config["calls"]``.
"""

from __future__ import annotations

from typing import Any

from kvref.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvref.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata,
                                                                KVConnectorRole)
from kvref.kv_events import BlockStored
from kvref.math_utils import cdiv

__all__ = ["SimConnector", "SimConnectorPlan", "SimTransfers"]

_NO_PLAN = {"ext": 0, "async": False, "delay": 1, "none": 0, "fail": [], "hold": 0}


class SimConnectorPlan:
    """The scheduler half's decisions, with every call logged to ``calls``."""

    def __init__(self, plans: dict, block_size: int, calls: list) -> None:
        self.plans = plans
        self.block_size = block_size
        self.calls = calls
        self.asks: dict[str, int] = {}            # "ask again" answers given so far
        self.local: dict[str, int] = {}           # the local hit at the last ask
        self.lost: set[str] = set()               # a load failed: nothing offered again
        self.loads: dict[str, list] = {}          # started this step, for the worker
        self.sends: dict[str, int] = {}           # held blocks to send, for the worker
        self.pending: set[tuple[str, str]] = set()   # asynchronous loads and sends not ended
        self.num_landed = 0

    def plan(self, req_id: str) -> dict:
        return self.plans.get(req_id) or _NO_PLAN

    def matched(self, req_id: str, num_tokens: int, num_computed: int
                ) -> tuple[int | None, bool]:
        plan = self.plan(req_id)
        if self.asks.get(req_id, 0) < plan["none"]:
            self.asks[req_id] = self.asks.get(req_id, 0) + 1
            answer: tuple[int | None, bool] = (None, False)
        else:
            ext = 0 if req_id in self.lost else plan["ext"]
            if not plan["async"]:
                ext = min(ext, num_tokens - 1)
            n = max(0, ext - num_computed)
            answer = (n, plan["async"] and n > 0)
        self.local[req_id] = num_computed
        self.calls.append(["get_num_new_matched_tokens", req_id, num_computed, list(answer)])
        return answer

    def after_alloc(self, req_id: str, block_ids: list[list[int]], num_external: int) -> None:
        self.calls.append(["update_state_after_alloc", req_id, block_ids, num_external])
        if num_external == 0:
            return
        plan = self.plan(req_id)
        first = self.local[req_id] // self.block_size
        end = cdiv(self.local[req_id] + num_external, self.block_size)
        loaded = block_ids[0][first:end]
        failed = [loaded[i] for i in plan["fail"] if i < len(loaded)]
        if failed:
            self.lost.add(req_id)
        self.loads[req_id] = [loaded, plan["async"], plan["delay"], failed]
        if plan["async"]:
            self.pending.add(("recv", req_id))

    def meta(self) -> dict:
        meta = {"loads": self.loads, "sends": self.sends}
        self.loads, self.sends = {}, {}
        self.calls.append(["build_connector_meta", meta])
        return meta

    def output(self, sending, recving, invalid) -> None:
        self.num_landed += len(recving or ())
        self.pending -= {("send", r) for r in sending or ()}
        self.pending -= {("recv", r) for r in recving or ()}
        self.calls.append(["update_connector_output", sorted(sending) if sending else None,
                           sorted(recving) if recving else None, sorted(invalid)])

    def finished(self, req_id: str, status: str, block_ids: list[int]
                 ) -> tuple[bool, dict | None]:
        hold = self.plan(req_id)["hold"]
        held = bool(hold and block_ids and status in ("FINISHED_STOPPED",
                                                       "FINISHED_LENGTH_CAPPED"))
        if held:
            self.sends[req_id] = hold
            self.pending.add(("send", req_id))
        answer = (held, {"sent_from": req_id} if held else None)
        self.calls.append(["request_finished", req_id, status, list(block_ids), list(answer)])
        return answer

    def events(self) -> int:
        num, self.num_landed = self.num_landed, 0
        self.calls.append(["take_events", num])
        return num


class SimTransfers:
    """The worker half: which transfers end in this worker step."""

    def __init__(self) -> None:
        self.now = 0
        self.due: list[tuple[int, str, str, list]] = []   # (step, kind, request, failed)

    def step(self, meta: dict | None) -> tuple[set | None, set | None, set[int]]:
        invalid: set[int] = set()
        for req_id, (_, is_async, delay, failed) in (meta or {}).get("loads", {}).items():
            if is_async:
                self.due.append((self.now + delay, "recv", req_id, failed))
            else:
                invalid.update(failed)            # a synchronous load fails in its step
        for req_id, hold in (meta or {}).get("sends", {}).items():
            self.due.append((self.now + hold, "send", req_id, []))
        sending: set[str] = set()
        recving: set[str] = set()
        for item in [d for d in self.due if d[0] <= self.now]:
            self.due.remove(item)
            (recving if item[1] == "recv" else sending).add(item[2])
            invalid.update(item[3])               # reported with the load that ended
        self.now += 1
        return sending or None, recving or None, invalid


class SimMetadata(KVConnectorMetadata):
    def __init__(self, meta: dict) -> None:
        self.meta = meta


class SimConnector(KVConnectorBase_V1):
    """Both halves; ``kv_connector_extra_config``: ``plans``, ``block_size``, ``calls``."""

    def __init__(self, kv_transfer_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(kv_transfer_config, role, kv_cache_config)
        extra = kv_transfer_config.kv_connector_extra_config
        self.sim = SimConnectorPlan(extra["plans"], extra["block_size"], extra["calls"])
        self.transfers = SimTransfers()
        self._invalid: set[int] = set()

    # -- worker side ---------------------------------------------------------------

    def start_load_kv(self, **kwargs: Any) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set[str]):
        sending, recving, self._invalid = self.transfers.step(
            self._get_connector_metadata().meta)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._invalid

    # -- scheduler side ------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self.sim.calls.append(["bind_gpu_block_pool", gpu_block_pool.num_gpu_blocks])

    def on_new_request(self, request) -> None:
        self.sim.calls.append(["on_new_request", request.request_id])

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.sim.matched(request.request_id, request.num_tokens, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.sim.after_alloc(request.request_id, [list(b) for b in blocks.get_block_ids()],
                             num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> SimMetadata:
        return SimMetadata(self.sim.meta())

    def update_connector_output(self, connector_output) -> None:
        self.sim.output(connector_output.finished_sending, connector_output.finished_recving,
                        connector_output.invalid_block_ids)

    def request_finished(self, request, block_ids: list[int]):
        return self.sim.finished(request.request_id, request.status.name, block_ids)

    def get_kv_connector_stats(self):
        self.sim.calls.append(["get_kv_connector_stats"])
        return None

    def take_events(self):
        return [BlockStored(block_hashes=[], parent_block_hash=None, token_ids=[],
                            block_size=self.sim.block_size, lora_id=None, medium="SIM",
                            lora_name=None)
                for _ in range(self.sim.events())]


KVConnectorFactory.register_connector("SimConnector", __name__, "SimConnector")
