"""Qwen2-VL (Wang et al. 2024, "Qwen2-VL: Enhancing Vision-Language Model's Perception
of the World at Any Resolution"): a vision transformer of its own, Qwen2's language
model, and rotary positions in three dimensions.

Two things set it apart from LLaVA (`minipaged.models.llava`):

- **Dynamic resolution.**  An image is not squeezed to one size: it keeps its aspect,
  resized to multiples of ``patch_size * spatial_merge_size`` pixels within the image
  processor's ``min_pixels`` and ``max_pixels``, cut into patches (each a pair of
  frames: a still image is doubled), and every 2x2 block of patches is merged into one
  token.  So an image becomes ``t * h * w / merge_size**2`` tokens, ``image_grid_thw``
  being its grid of patches: a different count per image.  The prompt's
  ``<|vision_start|><|image_pad|><|vision_end|>`` has its one ``<|image_pad|>``
  expanded to that count (`Qwen2VLProcessor`).
- **M-RoPE.**  A token's position is three numbers, time, height and width, and each
  rotates its own share of a head's frequency pairs (``mrope_section``).  A text token
  has all three equal; an image's tokens share the time of the image's first position
  and count rows and columns from it; the text after an image resumes at the largest
  position so far plus one.  So a sequence's positions are not its token indices:
  from the image on they lag behind by a fixed amount per image, and a generated
  token's position is its index plus ``mrope_position_delta`` (vLLM's name), the sum of
  those lags.  `mrope_positions` computes them from the token indices alone, so a
  chunk may start anywhere (in an image, after the prefix cache's blocks, after a
  recompute preemption).

The vision tower (``visual``: patch embedding, blocks and the merger) is transformers'
``Qwen2VisionTransformerPretrainedModel``, as LLaVA's CLIP tower is transformers'; the
language model is `Qwen2ForCausalLM` over the paged cache, its rotary embedding
replaced by `MRotaryEmbedding`.  vLLM: ``model_executor/models/qwen2_vl.py`` and
``MRotaryEmbedding.get_input_positions`` in ``layers/rotary_embedding``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from minipaged.models.interfaces import SupportsMultiModal
from minipaged.models.llama import Qwen2ForCausalLM, rope_frequencies

__all__ = ["MRotaryEmbedding", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"]


def mrope_positions(index: np.ndarray, features: list, merge_size: int) -> np.ndarray:
    """The M-RoPE positions ``[3, len(index)]`` (time, height, width) of the tokens at
    ``index`` in a sequence whose images are ``features`` (in prompt order, each with
    its placeholder range and ``image_grid_thw``), as transformers' ``get_rope_index``
    numbers a whole prompt.  Past the last image, ``index + mrope_position_delta``."""
    positions = np.broadcast_to(index, (3, len(index))).copy()
    shift = 0  # how far the text after the images seen so far lags its index
    for feature in features:
        first, length = feature.mm_position.offset, feature.mm_position.length
        t, h, w = (int(x) for x in feature.data["image_grid_thw"])
        h, w = h // merge_size, w // merge_size
        inside = (index >= first) & (index < first + length)
        k = index[inside] - first
        start = first + shift
        positions[0, inside] = start + k // (h * w)
        positions[1, inside] = start + k // w % h
        positions[2, inside] = start + k % w
        lag = max(h, w) - length  # the next text resumes at the image's largest + 1
        positions[:, index >= first + length] += lag
        shift += lag
    return positions


class MRotaryEmbedding(nn.Module):
    """Multimodal RoPE: cos and sin ``[T, head_dim]`` from positions ``[3, T]``, the
    head's frequency pairs taken from the time, height and width positions by
    ``mrope_section`` (transformers' ``Qwen2VLRotaryEmbedding``).  Positions ``[T]``
    (text only: the three equal) give plain RoPE."""

    def __init__(self, config) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = list(config.rope_parameters["mrope_section"])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, head_dim / 2]
        parts = freqs.split(self.mrope_section, dim=-1)
        freqs = torch.cat([part[i] for i, part in enumerate(parts)], dim=-1)
        angles = torch.cat((freqs, freqs), dim=-1)
        return (
            (angles.cos() * self.attention_scaling).to(dtype),
            (angles.sin() * self.attention_scaling).to(dtype),
        )


class Qwen2VLProcessor:
    """Qwen2-VL's prompt processing (vLLM's prompt update for Qwen2-VL): the checkpoint's
    image processor (dynamic resolution: ``pixel_values`` of all patches and each
    image's ``image_grid_thw``), and each ``<|image_pad|>`` token of the tokenized
    prompt expanded to its image's merged token count.  transformers' own processor
    does the same, but needs torchvision for its video half."""

    image_token = "<|image_pad|>"

    def __init__(self, image_processor, tokenizer) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.merge_size = image_processor.merge_size

    @classmethod
    def from_pretrained(cls, path, tokenizer) -> Qwen2VLProcessor:
        return cls(AutoImageProcessor.from_pretrained(path, local_files_only=True), tokenizer)

    def max_image_tokens(self) -> int:
        """The most tokens an image becomes: ``max_pixels`` of merged patches."""
        p = self.image_processor.patch_size * self.merge_size
        return self.image_processor.size["longest_edge"] // (p * p)

    def __call__(self, text, images, add_special_tokens=True, return_tensors="pt") -> dict:
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        out = {}
        if images:
            out = dict(self.image_processor(images=images, return_tensors=return_tensors))
        counts = iter([int(g.prod()) // self.merge_size**2 for g in out.get("image_grid_thw", [])])
        expanded = []
        for token in ids:
            n = next(counts, 1) if token == self.image_token_id else 1
            expanded += [token] * n
        return {**out, "input_ids": torch.tensor([expanded])}


class Qwen2VLForConditionalGeneration(SupportsMultiModal, Qwen2ForCausalLM):
    """Qwen2-VL: ``visual`` (the vision tower and its merger) beside Qwen2's decoder and
    head, with M-RoPE; checkpoints' ``model.language_model.`` names (transformers 5's)
    map to ``model.``, ``model.visual.`` to ``visual.`` (the Hub's names already are)."""

    uses_mrope = True
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    checkpoint_renames = {"model.language_model.": "model.", "model.visual.": "visual."}

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.image_token_id = config.image_token_id
        self.merge_size = config.vision_config.spatial_merge_size
        self.model.rotary_emb = MRotaryEmbedding(config.text_config)
        self.visual = Qwen2VisionTransformerPretrainedModel._from_config(config.vision_config)

    @staticmethod
    def make_processor(path, tokenizer) -> Qwen2VLProcessor:
        return Qwen2VLProcessor.from_pretrained(path, tokenizer)

    def max_image_tokens(self, processor: Qwen2VLProcessor) -> int:
        return processor.max_image_tokens()

    def mm_items(self, out: dict) -> list[tuple[dict, int]]:
        """The processor's output cut per image: its patches and grid, and its tokens."""
        grids = out["image_grid_thw"]
        sizes = grids.prod(-1).tolist()
        return [
            ({"pixel_values": pixels, "image_grid_thw": grid}, n // self.merge_size**2)
            for pixels, grid, n in zip(out["pixel_values"].split(sizes), grids, sizes)
        ]

    def mrope_positions(self, index: np.ndarray, features: list) -> np.ndarray:
        return mrope_positions(index, features, self.merge_size)

    def get_multimodal_embeddings(self, items: list[dict]) -> list[torch.Tensor]:
        """Each image's patches through the tower and the merger, all images in one
        run (the tower attends within each image only): one ``[tokens, hidden_size]``
        tensor per image."""
        visual = self.visual
        grids = torch.stack([item["image_grid_thw"] for item in items]).to(visual.device)
        pixels = torch.cat([item["pixel_values"] for item in items])
        pixels = pixels.to(visual.device, visual.dtype)
        merged = self.visual(pixels, grid_thw=grids).pooler_output
        return merged.split((grids.prod(-1) // self.merge_size**2).tolist())


MODELS = {"Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration}
