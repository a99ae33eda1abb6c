"""The memory layer: blocks and token ids, never tensors (paper §4.2–4.5).

Pure Python, standard library only, so it can be read, tested and drawn on its own.
"""

from .allocator import BlockAllocator, NoFreeBlocksError
from .block_table import BlockCopy, BlockTable
from .kv_cache_manager import Allocation, KVCacheManager
from .prefix_cache import BlockIdentity, CachedBlock, PrefixCachingBlockAllocator

__all__ = [
    "Allocation",
    "BlockAllocator",
    "BlockCopy",
    "BlockIdentity",
    "BlockTable",
    "CachedBlock",
    "KVCacheManager",
    "NoFreeBlocksError",
    "PrefixCachingBlockAllocator",
]
