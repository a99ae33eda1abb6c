"""Models: the Llama family as Hugging Face defines it, and tiny random checkpoints of it."""

from .tiny import make_tiny_model

__all__ = ["make_tiny_model"]
