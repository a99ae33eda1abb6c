"""Lesson 04: prefix caching's chained block hashes, and the lookup (paper §4.4).

Write ``hash_block`` and ``match_prefix`` (a method of
`minipaged.core.memory.prefix_cache.PrefixCachingBlockAllocator`; ``self`` is the pool).
``match_prefix`` may use:

* ``self.block_size``;
* ``self._by_hash``: a dict from block hash to its `CachedBlock` entry, which has
  ``block_hash``, ``token_ids`` (a tuple), ``entry_id`` and ``parent_id``;
* ``ROOT_ID``: the ``parent_id`` of every prompt's first block.

Check with ``make check LESSON=04``.
"""

from minipaged.core.memory.prefix_cache import ROOT_ID, CachedBlock, block_key  # noqa: F401  (use them)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The hash that names a full block: its tokens, chained with the hash of the block
    before it (``None`` for a prompt's first block), so that it stands for the whole
    prefix up to and including this block.  Python's ``hash`` of a tuple will do."""
    raise NotImplementedError("write hash_block() in exercises/prefix_hashing.py")


def match_prefix(self, token_ids: list[int], extra_key=None) -> list[CachedBlock]:
    """The longest chain of cached full blocks that begins ``token_ids`` under
    ``extra_key`` (what besides its tokens sets a prompt's KV apart: its LoRA adapter,
    or None; with images, a `MultiModalKey`).

    Walk the prompt one full block at a time, looking each up by its chained hash:
    ``block_key(parent_hash, extra_key, index, self.block_size)`` gives the hash block
    ``index`` chains on (``root_hash(extra_key)`` for the first, the previous block's
    hash after it, each mixed with the images the block overlaps) and the block's own
    extra key (``extra_key`` itself for a prompt without images).  A hash only *finds*
    a candidate: accept it only if its ``token_ids`` equal the block's, its
    ``parent_id`` is the ``entry_id`` matched one block earlier (``ROOT_ID`` for the
    first) and its ``extra_key`` is the block's own, so that a collision costs a miss,
    never wrong KV.
    Stop at the first miss.  The prompt's last token is never served from the cache
    (its logits must be computed), so at most ``(len(token_ids) - 1) // block_size``
    blocks match.  Changes nothing.
    """
    raise NotImplementedError("write match_prefix() in exercises/prefix_hashing.py")
