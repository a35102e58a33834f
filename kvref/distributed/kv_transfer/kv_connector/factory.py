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
import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KVConnectorFactory", "KVTransferConfig", "VLLM_HMA_OFF_WARNING",
           "resolve_disable_hybrid_kv_cache_manager"]

logger = logging.getLogger(__name__)

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
    def supports_hma_config(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Whether the configured connector implements ``SupportsHMA`` (vLLM's
        ``factory.py:130-145``; kvref has no ``MultiConnector``, whose answer
        there is whether all its children do)."""
        from kvref.distributed.kv_transfer.kv_connector.v1.base import supports_hma

        return supports_hma(cls.get_connector_class(kv_transfer_config))

    @classmethod
    def create_connector(cls, kv_transfer_config: KVTransferConfig, role, kv_cache_config,
                         *, disable_hybrid_kv_cache_manager: bool = True):
        """Build one half of the connector.

        ``disable_hybrid_kv_cache_manager``: the engine's resolved setting
        (``resolve_disable_hybrid_kv_cache_manager``). With the hybrid manager
        on, a connector without ``SupportsHMA`` is refused, as vLLM's
        ``create_connector`` refuses it (``factory.py:54-60``): that happens
        only when the user asked for the manager explicitly, since left to the
        default the engine turns it off for such a connector.
        """
        connector_cls = cls.get_connector_class(kv_transfer_config)
        if not disable_hybrid_kv_cache_manager and not cls.supports_hma_config(
                kv_transfer_config):
            raise ValueError(
                f"{connector_cls.__name__} does not support the hybrid KV cache manager "
                "(no SupportsHMA), but it is enabled: pass "
                "disable_hybrid_kv_cache_manager=True (vLLM: "
                "--disable-hybrid-kv-cache-manager), or leave it unset (None) to let the "
                "engine turn it off")
        return connector_cls(kv_transfer_config, role, kv_cache_config)


# vLLM 0.25.1's warning when a connector turns the hybrid manager off, quoted from
# vllm/config/vllm.py:1539-1550.
VLLM_HMA_OFF_WARNING = (
    "Turning off hybrid kv cache manager because `--kv-transfer-config` selects a KV "
    "connector that does not support it. Impact: hybrid SSM models (e.g. Jamba, Bamba) "
    "require HMA and will fail at startup without it; models with sliding window attention "
    "will run with reduced performance. To add HMA support to a KV connector, subclass "
    "`SupportsHMA` defined in kv_connector/v1/base.py (for MultiConnector, all child "
    "connectors must support HMA).")


def resolve_disable_hybrid_kv_cache_manager(kv_transfer_config: KVTransferConfig | None,
                                            disable_hybrid_kv_cache_manager: bool | None
                                            ) -> bool:
    """The engine's ``disable_hybrid_kv_cache_manager``, decided as vLLM 0.25.1's
    ``VllmConfig.__post_init__`` decides it (``config/vllm.py:1496-1567``):

    * left unset (None): off only for a connector without ``SupportsHMA``,
      with vLLM's warning (logged whether or not the model is hybrid, as
      vLLM's is), and on otherwise;
    * set: kept. ``False`` (an explicit enable) with such a connector is
      refused later, by ``KVConnectorFactory.create_connector``.

    The window layers of a model whose hybrid manager is off then join the
    full-attention group (``kvref.core.kv_cache_utils.unify_hybrid_kv_cache_specs``);
    a Mamba hybrid cannot be unified, and fails to start.

    (vLLM also turns it off for a platform without hybrid support and for
    chunked local attention, and raises at ``config/vllm.py:1553-1562`` when
    those meet an explicit enable; kvref's engine runs neither, so neither
    rule is here.)

        >>> config = KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_consumer")
        >>> resolve_disable_hybrid_kv_cache_manager(config, None)      # SupportsHMA
        False
        >>> resolve_disable_hybrid_kv_cache_manager(None, None)
        False
    """
    if disable_hybrid_kv_cache_manager is not None:
        return disable_hybrid_kv_cache_manager
    if kv_transfer_config is not None and not KVConnectorFactory.supports_hma_config(
            kv_transfer_config):
        # vLLM's warning word for word (vllm/config/vllm.py:1539-1550), then kvref's
        # own line: which connector, and what the warning's "reduced performance" is.
        logger.warning(VLLM_HMA_OFF_WARNING)
        logger.warning(
            "kvref: %s does not implement SupportsHMA; sliding-window layers now keep "
            "every block, as full attention does.", kv_transfer_config.kv_connector)
        return True
    return False
