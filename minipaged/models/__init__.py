"""Models: the Llama family as Hugging Face defines it, and tiny random checkpoints of it.

``load_model(path)`` reads a local HF checkpoint into one of the model classes; a step
runs ``model(input_ids, positions, kv_caches, attn)`` then ``model.compute_logits``, with
``attn`` an ``AttentionMetadata`` and ``kv_caches`` from ``allocate_kv_caches``.
"""

import importlib

from .tiny import make_tiny_model

# The model code needs torch and transformers (seconds to import); the CLI needs only
# ``tiny``.  So these names are imported on first use (PEP 562).
_LAZY = {
    "AttentionMetadata": "attention",
    "PagedAttention": "attention",
    "allocate_kv_caches": "attention",
    "token_positions": "attention",
    "MODELS": "llama",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "load_model": "loader",
}

__all__ = ["make_tiny_model", *_LAZY]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
