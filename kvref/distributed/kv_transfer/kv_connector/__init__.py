"""KV connectors (mirrors ``vllm/distributed/kv_transfer/kv_connector/``).

``factory.py`` builds a connector from a ``KVTransferConfig``; ``v1/`` holds the
interface and the connectors.
"""
