"""Point-to-point KV transfer between a prefill and a decode engine (``p2p_connector.py``)."""
