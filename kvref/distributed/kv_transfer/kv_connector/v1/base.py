"""The KV connector interface: two halves of one object, and what crosses between them.

Mirrors ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``
(``KVConnectorBase_V1``, v0.25.1), with ``KVConnectorOutput`` from
``vllm/v1/outputs.py``. A connector moves KV between kvref's paged blocks and
somewhere else (a file, another engine, host memory). vLLM builds it twice:
once in the scheduler (role SCHEDULER: it decides what to load and save) and
once in each worker (role WORKER: it moves the bytes). One step::

    scheduler side                                  worker side
    --------------                                  -----------
    get_num_new_matched_tokens(req, n_local)
        -> (n_external, load_async)
    allocate_slots(..., n_external, delay_cache_blocks=load_async)
    update_state_after_alloc(req, blocks, n_external)
    build_connector_meta(sched_out) -> meta  ---->  bind_connector_metadata(meta)
                                                    start_load_kv()        before the forward
                                                    wait_for_layer_load(l) before layer l
                                                    save_kv_layer(l, kv)   after layer l
                                                    wait_for_save()        after the forward
                                                    get_finished(finished_ids)
                                                    get_block_ids_with_load_errors()
    update_connector_output(out)  <---------------  KVConnectorOutput
    request_finished(req, block_ids)
        -> (hold_blocks, kv_transfer_params)        (once, when the request ends)

A load is *synchronous* when it lands inside the step that schedules the
request (the worker copies before the forward), *asynchronous* when it lands
in a later step: the request then waits in ``WAITING_FOR_REMOTE_KVS`` holding
its blocks uncached (``delay_cache_blocks``) until ``get_finished`` reports it
in ``finished_recving``. A producer that returns ``True`` from
``request_finished`` keeps the request's blocks until ``get_finished`` reports
it in ``finished_sending``.

Hybrid models (vLLM 0.25.1, ``config/vllm.py:1530-1567``,
``kv_connector/factory.py:54-60, 130-145``): a connector that also subclasses
``SupportsHMA`` keeps the hybrid KV cache manager and its groups; the block ids
it is given (``update_state_after_alloc``, the ``SchedulerOutput``) hold one
list per group, and a finished request goes to ``request_finished_all_groups``.
For any other connector the engine, left to its default, turns the hybrid
manager off with a warning, and the window layers join the full-attention
group (``FullAttentionSpec(sliding_window=W)``: every block kept), so such a
connector always sees one group; asked explicitly for the hybrid manager, the
engine refuses to build it. kvref's ``P2pConnector`` (vLLM's NIXL and Mooncake
connectors have ``SupportsHMA``) and ``SimpleCPUOffloadConnector`` support it;
``ExampleConnector`` does not, as vLLM's does not.

A new connector subclasses ``KVConnectorBase_V1``; ``docs/contributing.md``
("Adding a KV connector") lists the other files it touches.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorOutput",
           "KVConnectorRole", "KVConnectorStats", "SupportsHMA",
           "supports_hma"]


class SupportsHMA(ABC):
    """A connector that works with the hybrid KV cache manager (HMA): it takes
    a request's blocks per KV cache group (``vllm/distributed/kv_transfer/
    kv_connector/v1/base.py:85-114``, v0.25.1).

    A mixin beside ``KVConnectorBase_V1``. With one, vLLM keeps the hybrid
    manager and its groups (sliding-window, Mamba) when a connector is set;
    without one it turns the manager off (``config/vllm.py:1530-1552``), so
    every layer shares one group. Per-group block ids reach such a connector
    through ``update_state_after_alloc`` and the ``SchedulerOutput`` (as
    always: ``KVCacheBlocks`` and block-id tuples hold one list per group), and
    a finished request goes to ``request_finished_all_groups`` instead of
    ``request_finished`` (``v1/core/sched/scheduler.py:2377-2385``).
    """

    @abstractmethod
    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finishes, before its blocks are freed in any
        group; ``block_ids[g]`` are group ``g``'s blocks of its computed tokens
        (a window group's blocks already out of the window are the null block, 0).

        Returns ``(hold, kv_transfer_params)`` as ``request_finished`` does.
        """


def supports_hma(connector: Any) -> bool:
    """Whether a connector class, or a connector, implements ``SupportsHMA``
    (``base.py:117-121``)."""
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    return isinstance(connector, SupportsHMA)


class KVConnectorRole(enum.Enum):
    """Which half of the connector an instance is."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:  # noqa: B903 - a marker base, as in vLLM
    """What the scheduler half tells the worker half for one step (subclassed per connector)."""


class KVConnectorWorkerMetadata(ABC):
    """What a worker half tells the scheduler half for one step, beyond the request
    ids (subclassed per connector); the workers' reports of one step are merged
    with ``aggregate`` (``vllm/distributed/kv_transfer/kv_connector/v1/base.py:150-168``)."""

    @abstractmethod
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """This report merged with another worker's."""


@dataclass
class KVConnectorStats:
    """What a connector's worker half moved (kvref's counters; vLLM's connectors
    report their own). The hit rate is the scheduler's: ``connector_prefix_cache_stats``."""

    num_loaded_blocks: int = 0
    num_saved_blocks: int = 0
    num_failed_blocks: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0


@dataclass
class KVConnectorOutput:
    """What the worker half reports after a step (``vllm/v1/outputs.py``).

    ``finished_sending``: requests whose held blocks may now be freed.
    ``finished_recving``: requests whose asynchronous load ended (landed or failed).
    ``invalid_block_ids``: blocks whose load failed; requests holding them
    recompute from the first one. ``kv_connector_worker_meta``: the connector's
    own report (``build_connector_worker_meta``), or None.
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_worker_meta: KVConnectorWorkerMetadata | None = None

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.kv_connector_worker_meta)


class KVConnectorBase_V1(ABC):
    """Both halves of a connector; ``role`` says which one this instance is.

    Args:
        kv_transfer_config: the connector's settings (``KVTransferConfig``).
        role: SCHEDULER or WORKER.
        kv_cache_config: the KV cache pool the engine allocates from.
    """

    def __init__(self, kv_transfer_config, role: KVConnectorRole, kv_cache_config) -> None:
        if len(kv_cache_config.kv_cache_groups) != 1 and not supports_hma(self):
            # kvref's check, made early: vLLM never builds this (it turns the hybrid
            # manager off for such a connector, or refuses in the factory), and would
            # only assert at request_finished (scheduler.py:2377-2383).
            raise ValueError(
                f"{type(self).__name__} does not implement SupportsHMA, so it takes one "
                f"KV cache group, got {len(kv_cache_config.kv_cache_groups)}: build the "
                "engine with disable_hybrid_kv_cache_manager=True (or unset), which puts "
                "every attention layer in one group")
        self._kv_transfer_config = kv_transfer_config
        self._role = role
        self._kv_cache_config = kv_cache_config
        self._block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self._connector_metadata: KVConnectorMetadata | None = None
        self.stats = KVConnectorStats()

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # -- worker side -------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The runner hands over this step's metadata before the forward."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """The runner drops the metadata after the forward."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError(f"{type(self).__name__}: no connector metadata is bound "
                               "(the runner calls bind_connector_metadata first)")
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """The worker's KV cache tensors, by layer name:
        ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` each."""
        self.kv_caches = dict(kv_caches)

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Start loading this step's external KV into the paged blocks (before the forward).

        (vLLM passes its forward context; kvref's connectors need only the
        registered caches and the bound metadata.)
        """

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV is loaded (layer-by-layer pipelining)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Start saving ``layer_name``'s KV (called after the layer wrote it)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until every save of this step is done (the blocks may be reused after)."""

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """``(finished sending, finished receiving)`` request ids.

        ``finished_req_ids``: requests that finished in the scheduler since the
        last step (a producer starts or keeps sending for those).
        """
        return None, None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's report for the scheduler half, asked after ``get_finished``
        (``vllm/v1/worker/kv_connector_model_runner_mixin.py:109``); None by default."""
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed, reported no later than the step in which
        ``get_finished`` reports the request (asynchronous loads) or in the step
        that loaded them (synchronous loads)."""
        return set()

    def shutdown(self) -> None:
        """Release what the connector holds (connections, threads)."""

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What the connector counted since the last call, or None (the default).
        The scheduler asks after every ``update_from_output``
        (``vllm/v1/core/sched/scheduler.py:1788-1799``)."""
        return None

    # -- scheduler side ----------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        """The engine's ``BlockPool``, handed over once, after the scheduler built
        its KV cache manager (``scheduler.py:278-280``); a connector that tracks
        per-block state keeps it. Does nothing by default."""

    def on_new_request(self, request) -> None:
        """A request was just queued (``add_request``, ``scheduler.py:2031-2032``).
        Does nothing by default."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """``(n, load_async)``: ``n`` more tokens beyond the ``num_computed_tokens``
        of the local hit can be loaded (``None``: ask again next step);
        ``load_async``: they land in a later step. Free of side effects that
        matter if the request is then not scheduled."""

    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """The request got ``blocks`` (all its blocks, ``KVCacheBlocks``); the
        external tokens go into the blocks after the local hit."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """This step's loads and saves for the worker; resets the per-step state.
        Must not modify ``scheduler_output``."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """What the worker side reported for the last step."""

    def request_finished(self, request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finishes, before its blocks are freed.

        Returns ``(hold, kv_transfer_params)``: ``hold`` keeps the blocks
        allocated until ``get_finished`` reports the request as sent.
        """
        return False, None

    def reset_cache(self) -> bool | None:
        """Forget the connector's own cached KV (the scheduler's
        ``reset_prefix_cache(reset_connector=True)``); False if it could not. The
        default does nothing and returns None, which the scheduler counts as done
        (vLLM's base, ``base.py:691-703``)."""
        return None

    def take_events(self) -> Iterable:
        """KV cache events the connector produced since the last call. The scheduler
        takes them after every ``update_from_output`` and publishes them with the
        KV cache manager's in one batch (``scheduler.py:1801-1816``)."""
        return ()

    def has_pending_push_work(self) -> bool:
        """Whether the engine must keep stepping for the connector's sake with no
        request left (a producer's push still in flight): ``has_requests`` asks
        (``scheduler.py:2190-2194``). False by default."""
        return False
