"""Shared set-up for the LoRA tests: adapters written by PEFT, and PEFT as the oracle.

`make_adapter` has PEFT wrap a Hugging Face model with a LoRA of non-zero random
weights (``init_lora_weights=False``: with PEFT's default, ``B = 0``, an adapter would
change nothing) and save it in PEFT's format; `PeftOracle` loads it back over HF's
model and decodes greedily with ``generate``.  Nothing here runs minipaged.
"""

from __future__ import annotations

import functools

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, path, seed: int, r: int = 8, targets=None, alpha: int = 16, **extra):
    """Write a random LoRA adapter of ``base`` (a checkpoint directory) to ``path``."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_MODULES,
        init_lora_weights=False,
        lora_dropout=0.0,
        **extra,
    )
    get_peft_model(hf, config).save_pretrained(path)
    return path


class PeftOracle:
    """HF's model on ``base`` with one PEFT adapter loaded (or none)."""

    def __init__(self, base, adapter=None) -> None:
        hf = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype=torch.float32)
        self.model = (PeftModel.from_pretrained(hf, adapter) if adapter else hf).eval()

    @functools.cache  # noqa: B019 (one oracle per adapter, kept for the test session)
    def greedy(self, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
            )
        return out[0, len(prompt) :].tolist()

    def next_logprobs(self, tokens: list[int]) -> torch.Tensor:
        """``log_softmax`` of the next-token logits after ``tokens`` (a full forward)."""
        with torch.no_grad():
            return self.model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
