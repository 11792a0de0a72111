"""pagedkv inside vLLM: a KV connector backed by pagedkv's verified host and disk prefix tiers.

``PagedKVConnector`` (and vLLM) import lazily, so ``import pagedkv.integrations.vllm``
works without vLLM (for :class:`ConnectorConfig` and the codecs)."""
from pagedkv.integrations.vllm_config import STORAGE_FORMATS, ConnectorConfig

__all__ = ["ConnectorConfig", "PagedKVConnector", "PagedKVMetadata", "STORAGE_FORMATS"]  # noqa: F822 (lazy: __getattr__)


def __getattr__(name):
    if name in ("PagedKVConnector", "PagedKVMetadata"):
        from pagedkv.integrations import vllm_connector as connector
        return getattr(connector, name)
    raise AttributeError(name)
