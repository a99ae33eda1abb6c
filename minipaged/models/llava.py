"""LLaVA (Liu et al. 2023, "Visual Instruction Tuning"; LLaVA-1.5): a CLIP vision tower,
a small MLP projector, and a Llama language model that reads the projected image
features as if they were token embeddings.

An image becomes tokens in three moves: the tower cuts it into patches and encodes
them (the hidden states of ``vision_feature_layer``, the class token dropped under the
``"default"`` strategy); the projector maps each patch's vector to the language model's
hidden size; and the prompt's ``<image>`` placeholder, expanded beforehand to one token
per patch (`minipaged.multimodal.processing`), has its embeddings replaced by them.  From
there on the language model runs as any Llama does, over the paged KV cache.

The tower and the projector are transformers' own (``CLIPVisionModel``,
``LlavaMultiModalProjector``): they run once per image, not per step, and have no KV
cache, so there is nothing paged about them.  The language model is minipaged's
`LlamaForCausalLM`, which this class extends; the engine reads the text config as
``model.config`` and the whole of LLaVA's as ``model.hf_config``.  As vLLM's
``model_executor/models/llava.py``, the model offers ``get_multimodal_embeddings``
(the encoder) and ``get_input_embeddings`` (the merge); the model runner calls them.
"""

from __future__ import annotations

import torch
from transformers import AutoProcessor, CLIPVisionModel
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from minipaged.models.interfaces import SupportsMultiModal
from minipaged.models.llama import LlamaForCausalLM

__all__ = ["LlavaForConditionalGeneration", "num_image_tokens"]


def num_image_tokens(hf_config) -> int:
    """Placeholder tokens per image: one per patch, plus the class token under the
    ``"full"`` strategy."""
    vision = hf_config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + (hf_config.vision_feature_select_strategy == "full")


class LlavaForConditionalGeneration(SupportsMultiModal, LlamaForCausalLM):
    """LLaVA-1.5: ``vision_tower`` and ``multi_modal_projector`` beside the Llama
    decoder and head; checkpoints' ``language_model.model.`` names map to ``model.``."""

    # Both layouts: transformers 5's in memory, and the Hub's (which it still saves).
    checkpoint_renames = {
        "model.language_model.": "model.",
        "model.vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
        "vision_tower.vision_model.": "vision_tower.",
    }

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.image_token_id = config.image_token_index
        self.vision_tower = CLIPVisionModel(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)

    @staticmethod
    def make_processor(path, tokenizer):
        """The checkpoint's ``LlavaProcessor``, over the engine's tokenizer."""
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        processor.tokenizer = tokenizer
        return processor

    def max_image_tokens(self, processor) -> int:
        return num_image_tokens(self.hf_config)

    def mm_items(self, out: dict) -> list[tuple[torch.Tensor, int]]:
        """The processor's output cut per image: its pixels ``[3, H, W]``, its tokens."""
        n = num_image_tokens(self.hf_config)
        return [(pixels, n) for pixels in out["pixel_values"]]

    def get_multimodal_embeddings(self, items: list[torch.Tensor]) -> torch.Tensor:
        """``images x [3, H, W] -> [images, num_image_tokens, hidden_size]``: the
        tower's chosen layer, the class token dropped (``"default"``), projected."""
        config = self.hf_config
        tower = self.vision_tower
        pixel_values = torch.stack(items).to(tower.device, tower.dtype)
        states = tower(pixel_values, output_hidden_states=True).hidden_states
        features = states[config.vision_feature_layer]
        if config.vision_feature_select_strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)


MODELS = {"LlavaForConditionalGeneration": LlavaForConditionalGeneration}
