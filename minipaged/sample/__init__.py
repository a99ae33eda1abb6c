"""Sampling, as vLLM V1's ``v1/sample``: the sampler, parallel sampling, beam
search, prompt logprobs and speculative decoding's rejection sampler."""
