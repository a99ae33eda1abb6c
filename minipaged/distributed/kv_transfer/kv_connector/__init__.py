"""The KV connectors (vLLM's ``kv_transfer/kv_connector/``)."""
