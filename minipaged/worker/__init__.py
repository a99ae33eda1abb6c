"""The worker, as vLLM V1's ``v1/worker``: the model runner, the KV cache tensors
(`cache_engine`), CUDA graphs and the compiled decode path."""
