"""What a vision-language model adds to the language model it extends (vLLM's
``model_executor/models/interfaces.py``, ``SupportsMultiModal``).

LLaVA (`minipaged.models.llava`) and Qwen2-VL (`minipaged.models.qwen2_vl`) are each a
causal language model over the paged cache with a vision tower beside it.  What they
share lives here: both run on one device (the tower runs beside the one-process model
runner's forward pass, so neither tensor nor pipeline parallelism splits them), both
build their language model from the checkpoint's ``text_config`` and keep the whole
config as ``hf_config``, and both merge image features into a step's token embeddings
the same way.  Each model adds its tower, its processor and its encoder
(``get_multimodal_embeddings``).
"""

from __future__ import annotations

import torch

from minipaged.distributed.parallel_state import NO_PIPELINE, SINGLE, PipelineStage

__all__ = ["SupportsMultiModal"]


class SupportsMultiModal:
    """Put first among a vision-language model's bases, before its language model's
    class (``class LlavaForConditionalGeneration(SupportsMultiModal,
    LlamaForCausalLM)``): its ``__init__`` takes the whole checkpoint config."""

    supports_pp = False

    def __init__(
        self,
        config,
        attention_backend: str = "torch",
        tp=SINGLE,
        pp: PipelineStage = NO_PIPELINE,
    ) -> None:
        self.check_parallel(config, tp.size)
        if pp.size > 1:
            raise ValueError(
                f"pipeline_parallel_size must be 1 for {type(self).__name__} "
                "(minipaged runs multimodal models on one device)"
            )
        super().__init__(config.text_config, attention_backend, tp, pp)
        self.hf_config = config

    @classmethod
    def check_parallel(cls, config, size: int, expert_parallel: bool = False) -> None:
        if size != 1 or expert_parallel:
            raise ValueError(
                f"tensor_parallel_size must be 1 for {cls.__name__}, got "
                f"{size} (minipaged runs multimodal models on one device)"
            )

    def get_input_embeddings(
        self, input_ids: torch.Tensor, rows: torch.Tensor, embeddings: torch.Tensor
    ) -> torch.Tensor:
        """The step's token embeddings with ``rows`` (placeholder positions in the
        flat batch) replaced by ``embeddings`` (the image features, in order)."""
        hidden = self.model.embed_tokens(input_ids)
        return hidden.index_copy(0, rows, embeddings.to(hidden.dtype))
