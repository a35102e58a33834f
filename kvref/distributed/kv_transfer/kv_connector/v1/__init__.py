"""The v1 connector interface and kvref's connectors
(mirrors ``vllm/distributed/kv_transfer/kv_connector/v1/``).

``base.py``: ``KVConnectorBase_V1``, its metadata and output.
``example_connector.py``: ``ExampleConnector``, block files on disk.
``p2p/p2p_connector.py``: ``P2pConnector``, prefill -> decode between processes.
``simple_cpu_offload_connector.py``: ``SimpleCPUOffloadConnector``, a host tier timed as vLLM's.

Adding a connector: ``docs/contributing.md`` lists its files (this folder, the
factory's registry, the tests that run every connector).
"""

from kvref.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole,
    KVConnectorStats, SupportsHMA, supports_hma)

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorOutput",
           "KVConnectorRole", "KVConnectorStats", "SupportsHMA", "supports_hma"]
