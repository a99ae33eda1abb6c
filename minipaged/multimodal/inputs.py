"""What a multimodal request carries, as plain data (vLLM's ``vllm/multimodal/inputs.py``).

A prompt with an image holds, in place of the image, a run of placeholder tokens: as
many as the encoder makes embeddings for it.  `PlaceholderRange` says where that run
is; `MultiModalFeatureSpec` is one image of a request: its preprocessed tensor
(``data``, the model runner's input to the encoder), its ``identifier`` (the image's
hash, ``mm_hash``: the encoder cache's key and the prefix cache's extra key) and its
placeholder range.  `split_images` reads a chat's OpenAI content parts (``LLM.chat``
and ``/v1/chat/completions`` both).

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


def split_images(conversation: list[dict], placeholder: str | None) -> tuple[list[dict], list[str]]:
    """A conversation whose messages' content may be lists of OpenAI content parts
    (``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url":
    ...}}``), as plain-text messages with the model's image ``placeholder`` where each
    image was, and the images' URLs in order.  As vLLM places them for LLaVA, a
    message's images come first, each placeholder on a line of its own."""
    messages, images = [], []
    for message in conversation:
        content = message["content"]
        if not isinstance(content, list):
            messages.append(message)
            continue
        texts, urls = [], []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url" and isinstance(part.get("image_url"), dict):
                urls.append(part["image_url"].get("url"))
            else:
                raise ValueError(
                    f"messages: a content part must be {{'type': 'text', 'text': str}} or "
                    f"{{'type': 'image_url', 'image_url': {{'url': str}}}}, got {part!r:.80}"
                )
        if urls and placeholder is None:
            raise ValueError(
                "messages: image_url parts need a multimodal model; this one is text-only"
            )
        images += urls
        text = "\n".join(texts)
        messages.append({**message, "content": "".join(f"{placeholder}\n" for _ in urls) + text})
    return messages, images
