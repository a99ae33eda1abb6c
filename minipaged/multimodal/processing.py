"""Images in, a prompt's token ids and its `MultiModalFeatureSpec` items out (vLLM's
``vllm/multimodal/processing.py``, ``hasher.py`` and ``image.py``).

An image comes as a ``PIL.Image`` (`LLM.generate`'s ``multi_modal_data``) or as a URL
(a chat message's ``image_url`` part): a ``data:image/...;base64,`` URL, or a local
file (``file://`` or a plain path) under ``allowed_local_media_path`` (vLLM's flag;
empty: no local file may be read).  Network URLs are refused: minipaged fetches
nothing.  Every failure is a ``ValueError`` naming what was wrong.

The checkpoint's own processor (``LlavaProcessor``: CLIP's resize, crop and
normalization, and the expansion of each ``<image>`` placeholder to the encoder's token
count; Qwen2-VL's: dynamic resolution, a count per image) does the work; this module
checks the counts it made, finds each image's `PlaceholderRange` in the token ids, and
hashes each image's pixels (its ``mm_hash``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path

from PIL import Image

from minipaged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

# The largest image decoded, in pixels: larger ones are refused from their header, before
# decoding (PIL's own limit, for decompression bombs, is far higher).
MAX_IMAGE_PIXELS = 4096 * 4096


def load_image(image, allowed_local_media_path: str = "") -> Image.Image:
    """``image`` (a PIL image, a data URL or a local path) decoded, as RGB."""
    if isinstance(image, Image.Image):
        return _checked(image)
    if not isinstance(image, str):
        raise ValueError(
            f"image must be a PIL.Image, a data: URL or a local file path, "
            f"got {type(image).__name__}"
        )
    if image.startswith(("http://", "https://")):
        raise ValueError(
            f"image_url {image[:60]!r}: minipaged fetches no images over the network; "
            "send a data: URL, or a local file under --allowed-local-media-path"
        )
    if image.startswith("data:"):
        return _decode(_data_url_bytes(image), "image_url data: URL")
    return _decode(_local_file(image, allowed_local_media_path).read_bytes(), image)


def _data_url_bytes(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.startswith("data:image/") or not header.endswith(";base64"):
        raise ValueError(f"image_url must be a data:image/...;base64, URL, got {header[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"image_url data: URL is not valid base64: {error}") from None


def _local_file(name: str, allowed_local_media_path: str) -> Path:
    path = Path(name.removeprefix("file://")).resolve()
    if not allowed_local_media_path:
        raise ValueError(
            f"image_url {name[:60]!r} is a local file, and reading local files needs "
            "allowed_local_media_path (--allowed-local-media-path) to name their directory"
        )
    root = Path(allowed_local_media_path).resolve()
    if not path.is_relative_to(root):
        raise ValueError(
            f"image_url {name[:60]!r} is outside allowed_local_media_path {str(root)!r}"
        )
    if not path.is_file():
        raise ValueError(f"image_url {name[:60]!r}: no such file")
    return path


def _decode(data: bytes, what: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        _checked(image)  # from the header: no pixels decoded yet
        image.load()
    except ValueError:
        raise
    except Exception as error:  # PIL raises many kinds for a broken file
        raise ValueError(f"image ({what[:60]}) does not decode: {error}") from None
    return image


def _checked(image: Image.Image) -> Image.Image:
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS or not width or not height:
        raise ValueError(
            f"image is {width}x{height} pixels; minipaged takes images of 1 to "
            f"{MAX_IMAGE_PIXELS:,} pixels"
        )
    return image


def mm_hash(image: Image.Image) -> str:
    """The image's content hash: its mode, size and pixels (the same picture from a PIL
    image, a data URL or a file hashes the same)."""
    digest = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class MultiModalProcessor:
    """A vision model's processor, with the limits a request is checked against.

    ``processor``: the checkpoint's Hugging Face processor (or the model's own, as
    `minipaged.models.qwen2_vl.Qwen2VLProcessor`); ``image_token_id``: the placeholder
    token; ``num_image_tokens``: the most of it one image becomes (all images alike
    for LLaVA; up to ``max_pixels``' worth under Qwen2-VL's dynamic resolution);
    ``mm_items``: the processor's output cut into one ``(encoder input, tokens)`` per
    image; ``placeholder``: the text a prompt holds where an image goes (None: the
    processor's ``image_token``); ``limit_mm_per_prompt``: vLLM's ``{"image": n}``, the
    most images in one prompt.
    """

    def __init__(
        self,
        processor,
        image_token_id: int,
        num_image_tokens: int,
        mm_items,
        limit_mm_per_prompt: dict[str, int],
        allowed_local_media_path: str = "",
        placeholder: str | None = None,
    ) -> None:
        self.processor = processor
        self.image_token = processor.image_token
        self.placeholder = placeholder or processor.image_token
        self.image_token_id = image_token_id
        self.num_image_tokens = num_image_tokens
        self.mm_items = mm_items
        self.limit = limit_mm_per_prompt.get("image", 1)
        self.allowed_local_media_path = allowed_local_media_path

    def default_cache_size(self, config) -> int:
        """The encoder cache's size when ``encoder_cache_size`` is None: a step's tokens,
        or the embeddings of a prompt's most images if more."""
        return max(config.max_num_batched_tokens, self.limit * self.num_image_tokens)

    def encoder_compute_budget(self, config) -> int:
        """A step's encoder tokens (``max_num_encoder_input_tokens``): by default a
        step's tokens, or one image's if more, so that every image can be encoded
        (vLLM's ``compute_mm_encoder_budget``); a smaller value is refused, since an
        image whose encoder run never fits would never be prefilled."""
        budget = config.max_num_encoder_input_tokens
        if budget is None:
            return max(config.max_num_batched_tokens, self.num_image_tokens)
        if budget < self.num_image_tokens:
            raise ValueError(
                f"max_num_encoder_input_tokens={budget} is less than one image's "
                f"{self.num_image_tokens} encoder tokens: no image could ever be encoded"
            )
        return budget

    def check_unchunked(self, config) -> bool:
        """``disable_chunked_mm_input``, once a step can hold the largest image's
        tokens whole (else such an image's prompt could never run)."""
        step = config.max_num_batched_tokens
        if config.disable_chunked_mm_input and step < self.num_image_tokens:
            raise ValueError(
                f"disable_chunked_mm_input needs max_num_batched_tokens={step} to hold "
                f"an image's up to {self.num_image_tokens} tokens in one chunk"
            )
        return config.disable_chunked_mm_input

    def process(
        self, prompt: str, images: list, add_special_tokens: bool = True
    ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """``prompt``'s token ids, each ``<image>`` expanded, and one item per image."""
        if len(images) > self.limit:
            raise ValueError(
                f"multi_modal_data has {len(images)} images, more than "
                f"limit_mm_per_prompt={{'image': {self.limit}}} allows"
            )
        if prompt.count(self.image_token) != len(images):
            raise ValueError(
                f"prompt has {prompt.count(self.image_token)} {self.image_token} "
                f"placeholders for {len(images)} images; write one per image"
            )
        images = [load_image(image, self.allowed_local_media_path) for image in images]
        out = self.processor(
            text=prompt,
            images=[image.convert("RGB") for image in images] or None,
            add_special_tokens=add_special_tokens,
            return_tensors="pt",
        )
        token_ids = out["input_ids"][0].tolist()
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        items = self.mm_items(out) if images else []
        if len(positions) != sum(n for _, n in items):  # a literal placeholder in the text
            raise ValueError(
                f"prompt must hold the image placeholder only where an image goes; it has "
                f"{len(positions)} placeholder tokens for {len(images)} images of "
                f"{[n for _, n in items]}"
            )
        features, first = [], 0
        for image, (data, n) in zip(images, items):
            features.append(
                MultiModalFeatureSpec(
                    data=data,
                    modality="image",
                    identifier=mm_hash(image),
                    mm_position=PlaceholderRange(positions[first], n),
                )
            )
            first += n
        return token_ids, features
