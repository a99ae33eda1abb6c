"""What a multimodal request carries, as plain data (vLLM's ``vllm/multimodal/inputs.py``).

A prompt with an image holds, in place of the image, a run of placeholder tokens: as
many as the encoder makes embeddings for it.  `PlaceholderRange` says where that run
is; `MultiModalFeatureSpec` is one image of a request: its preprocessed tensor
(``data``, the model runner's input to the encoder), its ``identifier`` (the image's
hash, ``mm_hash``: the encoder cache's key and the prefix cache's extra key) and its
placeholder range.

Standard library only: the scheduler reads these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlaceholderRange:
    """Prompt positions ``[offset, offset + length)`` hold one item's embeddings."""

    offset: int
    length: int

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """The part of ``[start, end)`` that lies in this range, or None."""
        lo, hi = max(start, self.offset), min(end, self.offset + self.length)
        return (lo, hi) if lo < hi else None


@dataclass(frozen=True, eq=False)
class MultiModalFeatureSpec:
    """One item (an image) of a request (vLLM V1's name)."""

    data: Any  # the encoder's input: pixel values [3, H, W]
    modality: str
    identifier: str  # mm_hash: the item's content hash
    mm_position: PlaceholderRange

    @property
    def num_embeds(self) -> int:
        return self.mm_position.length
