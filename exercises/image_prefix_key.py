"""Lesson 20: the prefix cache's key for a prompt with images (vLLM's
``generate_block_hash_extra_keys``; the paper's §4.4 prefix sharing, made safe for
images).

An image's placeholder is one token id repeated, whatever the picture, so a block's
token ids cannot tell a cat from a dog: every block the placeholder reaches must be keyed
on the image too.  Write the two functions the prefix cache uses for that:

- ``mm_cache_key``, a request's extra key: its adapter and, for each image in prompt
  order, ``(mm_hash, offset, length)`` (the feature's ``identifier`` and its
  ``mm_position``, the placeholder's `PlaceholderRange`);
- ``block_key``, the key of block ``index``: what its hash chains on, and the extra key
  stored with it, which a lookup compares.

Then check with ``make check LESSON=20``: the tests give a prompt with another image
exactly the blocks before that image, the same image every full block, an adapter none
of another's, and the tiny LLaVA's greedy tokens equal Hugging Face's while the engine
reuses (or must not reuse) prefix-cached blocks.

Hint: a block covers tokens ``[index * block_size, (index + 1) * block_size)``, and an
image ``[offset, offset + length)``: they overlap if each starts before the other ends.
``root_hash(lora_id)`` is what the first block chains on (lesson 04's extra key).
"""

from minipaged.core.memory.prefix_cache import MultiModalKey, root_hash  # noqa: F401


def mm_cache_key(lora_id: int | None, mm_features: list) -> MultiModalKey:
    """The prefix cache's extra key of a request with images: ``MultiModalKey(lora_id,
    items)``, with one ``(identifier, offset, length)`` item per feature of
    ``mm_features`` (`MultiModalFeatureSpec`, in prompt order), read from its
    ``identifier`` (the image's hash) and ``mm_position`` (``offset``, ``length``)."""
    raise NotImplementedError("write mm_cache_key() in exercises/image_prefix_key.py")


def block_key(
    parent_hash: int | None, extra_key, index: int, block_size: int
) -> tuple[int | None, object]:
    """``(chained, own_key)`` for block ``index`` of a prompt whose extra key is
    ``extra_key``; ``parent_hash`` is block ``index - 1``'s hash (None for the first).

    - ``extra_key`` not a `MultiModalKey` (None, or an adapter's id): the first block
      chains on ``root_hash(extra_key)``, every other on ``parent_hash``; its own key is
      ``extra_key`` itself.
    - A `MultiModalKey`: ``chained`` is ``root_hash(extra_key.lora_id)`` for the first
      block, else ``parent_hash``.  ``images`` is the tuple of ``(mm_hash, offset)`` of
      each item of ``extra_key.mm_items`` whose placeholder overlaps the block, in their
      order.  No image: return ``(chained, extra_key.lora_id)``.  Else the block's hash
      chains on the images too: return ``(hash((chained, images)), (extra_key.lora_id,
      images))``.
    """
    raise NotImplementedError("write block_key() in exercises/image_prefix_key.py")
