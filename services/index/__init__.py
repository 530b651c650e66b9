"""The cluster-wide prefix index: which worker holds which chained block hashes.

Torch-free; the frontend imports it.  `open_index` picks the implementation:
Redis when a URL is given (the cluster), in-process otherwise (`splitserve up`).
"""

from __future__ import annotations

from services.index.base import IndexUnavailable, PrefixIndex
from services.index.embedded import EmbeddedPrefixIndex


def open_index(model_id: str, redis_url: str | None = None, **kwargs: float) -> PrefixIndex:
    if redis_url is None:
        return EmbeddedPrefixIndex()
    from services.index.redis_index import RedisPrefixIndex

    return RedisPrefixIndex(redis_url, model_id, **kwargs)


__all__ = ["EmbeddedPrefixIndex", "IndexUnavailable", "PrefixIndex", "open_index"]
