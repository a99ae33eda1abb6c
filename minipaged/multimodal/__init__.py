"""Multimodal inputs (vLLM's ``vllm/multimodal``): images decoded, hashed and turned
into the tensors and placeholder ranges a request carries (`inputs`, `processing`)."""
