"""Build a connector from its config.

Mirrors ``vllm/distributed/kv_transfer/kv_connector/factory.py``
(``KVConnectorFactory``) and ``vllm/config/kv_transfer.py`` (``KVTransferConfig``,
v0.25.1: same field names, same default failure policy ``"fail"``)::

    >>> config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
    ...     kv_connector_extra_config={"shared_storage_path": "/tmp/kv"})
    >>> config.is_kv_producer, config.is_kv_consumer, config.kv_load_failure_policy
    (True, True, 'fail')
    >>> KVTransferConfig(kv_connector="Nope", kv_role="kv_both")
    Traceback (most recent call last):
    ...
    ValueError: unknown kv_connector 'Nope'; kvref has [...]
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KVConnectorFactory", "KVTransferConfig"]

# name -> (module, class); imported on use (P2pConnector pulls in torch.distributed).
_REGISTRY = {
    "ExampleConnector": ("kvref.distributed.kv_transfer.kv_connector.v1.example_connector",
                         "ExampleConnector"),
    "P2pConnector": ("kvref.distributed.kv_transfer.kv_connector.v1.p2p.p2p_connector",
                     "P2pConnector"),
    "SimpleCPUOffloadConnector": (
        "kvref.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
        "SimpleCPUOffloadConnector"),
}

_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """Which connector, in which role, and what to do when a load fails.

    ``kv_role``: ``"kv_producer"`` (saves / sends), ``"kv_consumer"`` (loads /
    receives) or ``"kv_both"``. ``kv_load_failure_policy``: ``"recompute"``
    (recompute from the first failed block) or ``"fail"`` (the request finishes
    with ``FINISHED_ERROR``). ``kv_connector_extra_config``: per-connector options.
    """

    kv_connector: str
    kv_role: str
    kv_load_failure_policy: str = "fail"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in _REGISTRY:
            raise ValueError(f"unknown kv_connector {self.kv_connector!r}; kvref has "
                             f"{sorted(_REGISTRY)}")
        if self.kv_role not in _ROLES:
            raise ValueError(f"kv_role must be one of {_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be 'recompute' or 'fail', got "
                             f"{self.kv_load_failure_policy!r}")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


class KVConnectorFactory:
    """``create_connector(config, role, kv_cache_config)``: the named connector class."""

    @staticmethod
    def register_connector(name: str, module_path: str, class_name: str) -> None:
        """Make ``kv_connector=name`` build ``module_path.class_name`` (vLLM's hook for
        connectors outside the tree; kvref's tests register fault-injecting ones)."""
        if name in _REGISTRY and _REGISTRY[name] != (module_path, class_name):
            raise ValueError(f"connector {name!r} is already registered as {_REGISTRY[name]}")
        _REGISTRY[name] = (module_path, class_name)

    @staticmethod
    def get_connector_class(kv_transfer_config: KVTransferConfig) -> type:
        module, name = _REGISTRY[kv_transfer_config.kv_connector]
        return getattr(importlib.import_module(module), name)

    @classmethod
    def create_connector(cls, kv_transfer_config: KVTransferConfig, role, kv_cache_config):
        return cls.get_connector_class(kv_transfer_config)(kv_transfer_config, role,
                                                           kv_cache_config)
