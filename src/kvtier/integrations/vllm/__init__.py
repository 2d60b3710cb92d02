"""kvtier for vLLM: `KVTierConnector`, loaded by vLLM from
`"kv_connector_module_path": "kvtier.integrations.vllm"` (in the kvtier clone:
`pip install '.[vllm]'`)."""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
