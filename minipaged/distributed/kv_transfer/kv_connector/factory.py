"""The connector a `KVTransferConfig` names (vLLM's ``kv_connector/factory.py``)."""

from __future__ import annotations

from minipaged.config import KVTransferConfig
from minipaged.distributed.kv_transfer.kv_connector.v1.base import (
    KVCacheFacts,
    KVConnectorBase_V1,
    KVConnectorRole,
)
from minipaged.distributed.kv_transfer.kv_connector.v1.p2p_tcp_connector import P2pTcpConnector
from minipaged.distributed.kv_transfer.kv_connector.v1.shared_storage_connector import (
    SharedStorageConnector,
)

CONNECTORS: dict[str, type[KVConnectorBase_V1]] = {
    "SharedStorageConnector": SharedStorageConnector,
    "P2pTcpConnector": P2pTcpConnector,
}


class KVConnectorFactory:
    @staticmethod
    def create_connector(
        config: KVTransferConfig, role: KVConnectorRole, facts: KVCacheFacts
    ) -> KVConnectorBase_V1:
        """One side (``role``) of the connector ``config.kv_connector`` names."""
        return CONNECTORS[config.kv_connector](config, role, facts)
