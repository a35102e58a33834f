"""The numbers each ``allocate_slots`` call weighed, kept for ``kvref explain``.

No vLLM counterpart. ``KVCacheManager.allocate_slots`` (``kvref/core``) decides
exactly as vLLM's does and keeps nothing about how it decided. Its gates are made
of two coordinator calls: ``get_num_blocks_to_allocate`` (once with
``apply_admission_cap=True`` for the full-sequence gate, once for the capacity
gate) and ``remove_skipped_blocks`` (the window's blocks freed between them).
``GateRecordingKVCacheManager`` watches those calls and the pool's free count
while its own ``allocate_slots`` runs, so ``kvref explain`` reads the manager's
own numbers instead of working the gates out a second time::

    manager = GateRecordingKVCacheManager(config, max_model_len=64,
                                          scheduler_block_size=16, hash_block_size=16)
    manager.allocate_slots(request, 64)
    manager.last_allocate_slots.refused_by      # None, "full-sequence" or "capacity"

The subclass changes no answer: it calls the core's ``allocate_slots`` and
returns what that returns.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from kvref.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvref.request import Request, RequestStatus


@dataclass(slots=True)
class AllocateSlotsGates:
    """What one ``allocate_slots`` call weighed, step by step (the steps of its
    docstring). A field the call did not reach stays None (``num_freed_blocks``: 0).
    """

    watermark_blocks: int
    num_free_blocks: int                      # when the call began
    full_sequence_blocks: int | None = None   # step 2: the whole request's blocks
    num_freed_blocks: int = 0                 # step 3: freed left of the window
    num_blocks_needed: int | None = None      # step 4: blocks this call needs
    num_available_blocks: int | None = None   # step 4: free minus reserved
    refused_by: str | None = None             # "full-sequence" or "capacity"


_ALLOCATE_SLOTS = inspect.signature(KVCacheManager.allocate_slots)


class GateRecordingKVCacheManager(KVCacheManager):
    """A ``KVCacheManager`` that keeps each ``allocate_slots`` call's gates in
    ``last_allocate_slots``. A call that raised before reaching its first gate
    (nothing to compute and nothing to load) leaves the previous record there."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.last_allocate_slots: AllocateSlotsGates | None = None
        self._gates: AllocateSlotsGates | None = None     # the call in progress
        self._reserved_blocks = 0
        self._reached = False
        coordinator, pool = self.coordinator, self.block_pool
        count_blocks = coordinator.get_num_blocks_to_allocate
        remove_skipped = coordinator.remove_skipped_blocks

        def counting(*args, **kwargs) -> int:
            needed = count_blocks(*args, **kwargs)
            gates = self._gates
            if gates is not None:
                self._reached = True
                if kwargs.get("apply_admission_cap"):
                    gates.full_sequence_blocks = needed
                else:
                    free = pool.get_num_free_blocks()
                    gates.num_freed_blocks = free - gates.num_free_blocks
                    gates.num_blocks_needed = needed
                    gates.num_available_blocks = free - self._reserved_blocks
            return needed

        def removing(*args, **kwargs) -> None:
            if self._gates is not None:
                self._reached = True
            remove_skipped(*args, **kwargs)

        coordinator.get_num_blocks_to_allocate = counting
        coordinator.remove_skipped_blocks = removing

    def allocate_slots(self, request: Request, num_new_tokens: int, *args,
                       **kwargs) -> KVCacheBlocks | None:
        call = _ALLOCATE_SLOTS.bind(self, request, num_new_tokens, *args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        # The core's watermark rule (step 4 of allocate_slots' docstring).
        waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        gates = AllocateSlotsGates(
            self.watermark_blocks if given["has_scheduled_reqs"] and waiting else 0,
            self.block_pool.get_num_free_blocks())
        self._gates, self._reserved_blocks, self._reached = gates, given["reserved_blocks"], False
        try:
            blocks = super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        finally:
            self._gates = None
            if self._reached:
                self.last_allocate_slots = gates
        if blocks is None:
            gates.refused_by = ("full-sequence" if gates.num_blocks_needed is None
                                else "capacity")
        return blocks
