"""Disaggregated prefill: moving a prompt's KV between engines (vLLM V1's KV connector
API, ``vllm/distributed/kv_transfer/``).

A *producer* engine runs prompts (``max_tokens=1``) and saves their KV through a
connector; a *consumer* engine, asked the same prompts, loads that KV into its own
blocks instead of computing it, and decodes.  Each connector has two halves, as in
vLLM: the scheduler's (how many prompt tokens exist elsewhere, which blocks receive
them, what the workers must load and save this step, as metadata) and the worker's
(load before attention needs a layer, save each layer after it is written).

- `kv_connector.v1.base`: the API (`KVConnectorBase_V1`, its role and metadata);
- `kv_connector.v1.shared_storage_connector`: `SharedStorageConnector`, the KV in files;
- `kv_connector.v1.p2p_tcp_connector`: `P2pTcpConnector`, the same entries pulled from
  the producer over TCP, host to host;
- `kv_connector.factory`: the connector a `KVTransferConfig` names.

One device runs it beside the scheduler and the model runner (neither imports it: the
engine builds the connectors and hands each side its own).  Import the modules directly.
"""
