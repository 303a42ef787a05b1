"""The paged KV cache as the scheduler sees it: block allocation and prefix caching."""
from .block_pool import NULL_BLOCK_ID
from .manager import KVCacheManager, PrefixHit

__all__ = ["KVCacheManager", "NULL_BLOCK_ID", "PrefixHit"]
