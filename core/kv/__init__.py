"""The paged KV cache as the scheduler sees it: block allocation and prefix caching."""
from .block_pool import NULL_BLOCK_ID
from .coordinator import KVCacheCoordinator, PrefixHit

__all__ = ["KVCacheCoordinator", "NULL_BLOCK_ID", "PrefixHit"]
