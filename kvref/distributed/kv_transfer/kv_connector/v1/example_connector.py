"""A storage connector: every full block's KV in a file named by the block's key.

Mirrors ``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``
(``ExampleConnector``, v0.25.1), the connector vLLM keeps as the readable
example of the interface. Any engine whose prompt starts with blocks another
engine saved loads them instead of computing them::

    engine A: prompt [a b c d | e f g h | i j]  ->  saves <k0>.pt <k1>.pt
    engine B: prompt [a b c d | e f g h | x y z]
              get_num_new_matched_tokens -> (8, False): two blocks on disk
              allocate_slots(..., num_external_computed_tokens=8)
              start_load_kv: <k0>.pt -> block 5, <k1>.pt -> block 6
              forward computes only x y z

A file holds one block for every layer: ``[num_layers, 2, block_size, H, D]``.
Loads are synchronous (they land before the forward of the step that
schedules the request); saves happen layer by layer in ``save_kv_layer`` and
reach the disk in ``wait_for_save`` (written to a temporary name, then renamed,
so a reader never sees half a file).

Where it differs from vLLM's, on purpose:
  * vLLM keys a whole prompt (a hash of its token ids, one folder per prompt:
    a hit is all or nothing); kvref keys each block by a chained hash of the
    tokens up to it (``utils.extend_content_keys``), so a prompt that shares
    two blocks with an earlier one loads those two. The chain starts from a
    fixed seed, not the engine's per-process ``NONE_HASH``, so other
    processes find the same files.
  * vLLM reloads every prompt block, overwriting local prefix hits; kvref
    loads only the blocks after the local hit.
  * A file that is missing or does not fit when the load runs is reported by
    ``get_block_ids_with_load_errors`` (vLLM's example raises).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from kvref.distributed.kv_transfer.kv_connector.utils import (
    RequestBlockTracker, extend_content_keys, yield_req_data)
from kvref.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)

__all__ = ["ExampleConnector", "ExampleConnectorMetadata"]


@dataclass
class ExampleConnectorMetadata(KVConnectorMetadata):
    """This step's block moves: ``(block_id, key)`` pairs."""

    loads: list[tuple[int, str]] = field(default_factory=list)
    saves: list[tuple[int, str]] = field(default_factory=list)


class ExampleConnector(KVConnectorBase_V1):
    """Save every computed full block to ``shared_storage_path``; load any block found there.

    ``kv_connector_extra_config``: ``shared_storage_path`` (a folder, made if missing).
    """

    def __init__(self, kv_transfer_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(kv_transfer_config, role, kv_cache_config)
        path = kv_transfer_config.get_from_extra_config("shared_storage_path", None)
        if not path:
            raise ValueError("ExampleConnector needs kv_connector_extra_config"
                             "['shared_storage_path'] (a folder for the KV files)")
        self.storage_path = str(path)
        os.makedirs(self.storage_path, exist_ok=True)
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        # Keys depend on the layout too: two models never read each other's files.
        self._seed = repr((spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
                           len(kv_cache_config.kv_cache_groups[0].layer_names))).encode()
        # Scheduler side.
        self._requests: dict[str, Any] = {}
        self._keys: dict[str, list[str]] = {}
        self._blocks = RequestBlockTracker()
        self._pending_hit_start: dict[str, int] = {}     # req -> first external block
        self._loads: list[tuple[int, str]] = []
        # Worker side.
        self._saving: dict[str, list[torch.Tensor]] = {}
        self._load_errors: set[int] = set()

    def _path(self, key: str) -> str:
        return os.path.join(self.storage_path, key + ".pt")

    def _request_keys(self, request, num_tokens: int) -> list[str]:
        keys = self._keys.setdefault(request.request_id, [])
        return extend_content_keys(keys, request.all_token_ids[:num_tokens],
                                   self._block_size, self._seed)

    # -- scheduler side ----------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        bs = self._block_size
        first = num_computed_tokens // bs
        # The last known token is always computed (it yields the next token's logits).
        last = (request.num_tokens - 1) // bs
        keys = self._request_keys(request, last * bs)
        num_blocks = 0
        while first + num_blocks < last and os.path.exists(self._path(keys[first + num_blocks])):
            num_blocks += 1
        if num_blocks:
            self._pending_hit_start[request.request_id] = first
        return num_blocks * bs, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        first = self._pending_hit_start.pop(request.request_id, None)
        if num_external_tokens == 0 or first is None:
            return
        block_ids = blocks.get_block_ids()[0]
        num_blocks = num_external_tokens // self._block_size
        keys = self._request_keys(request, (first + num_blocks) * self._block_size)
        self._loads.extend((block_ids[first + i], keys[first + i]) for i in range(num_blocks))

    def build_connector_meta(self, scheduler_output) -> ExampleConnectorMetadata:
        meta = ExampleConnectorMetadata(loads=self._loads)
        self._loads = []
        loaded = {key for _, key in meta.loads}
        saving: set[str] = set()
        bs = self._block_size
        for req_id, new_ids, preempted, num_computed in yield_req_data(scheduler_output):
            # A new request is not tracked yet (request_finished forgets each one), so
            # its whole table extends an empty list; a resumed one's replaces its own.
            block_ids = self._blocks.update(req_id, new_ids, preempted)
            request = self._requests[req_id]
            # Known tokens only: draft tokens may be rejected.
            end = min(num_computed + scheduler_output.num_scheduled_tokens[req_id],
                      request.num_tokens)
            keys = self._request_keys(request, end // bs * bs)
            for i in range(num_computed // bs, end // bs):
                key = keys[i]
                if key in loaded or key in saving or os.path.exists(self._path(key)):
                    continue
                saving.add(key)
                meta.saves.append((block_ids[i], key))
        return meta

    def request_finished(self, request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        for table in (self._requests, self._keys, self._pending_hit_start):
            table.pop(request.request_id, None)
        self._blocks.forget(request.request_id)
        return False, None

    # -- worker side -------------------------------------------------------------

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        caches = list(self.kv_caches.values())
        expected = (len(caches), *caches[0].shape[1:])
        for block_id, key in meta.loads:
            try:
                kv = torch.load(self._path(key), weights_only=True)
            except (OSError, RuntimeError, EOFError):
                kv = None                         # gone or unreadable
            if kv is None or tuple(kv.shape) != expected:
                self._load_errors.add(block_id)
                self.stats.num_failed_blocks += 1
                continue
            for layer, cache in enumerate(caches):
                cache[block_id].copy_(kv[layer])
            self.stats.num_loaded_blocks += 1
            self.stats.bytes_loaded += kv.numel() * kv.element_size()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return                                    # start_load_kv loaded every layer

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        for block_id, key in self._get_connector_metadata().saves:
            self._saving.setdefault(key, []).append(kv_layer[block_id].detach().cpu().clone())

    def wait_for_save(self) -> None:
        num_layers = len(self.kv_caches)
        for key, layers in self._saving.items():
            if len(layers) != num_layers:
                raise RuntimeError(f"block {key}: {len(layers)} of {num_layers} layers saved")
            kv = torch.stack(layers)
            tmp = self._path(key) + f".tmp{os.getpid()}"
            torch.save(kv, tmp)
            os.replace(tmp, self._path(key))
            self.stats.num_saved_blocks += 1
            self.stats.bytes_saved += kv.numel() * kv.element_size()
        self._saving.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
