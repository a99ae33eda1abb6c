"""minipaged: PagedAttention and the vLLM serving engine, step by step.

An educational reference implementation of Kwon et al., "Efficient Memory Management for
Large Language Model Serving with PagedAttention" (SOSP 2023).  The layers, bottom up:

- ``minipaged.memory`` - block allocator, block tables, copy-on-write, prefix caching and
  the KV cache manager; blocks and token ids only, standard library only;
- ``minipaged.ops`` - the PagedAttention ops and the contiguous oracle they are tested on;
- ``minipaged.models`` - model code and the tiny seeded checkpoints tests use;
- ``minipaged.sampling_params`` and ``minipaged.sampler`` - what a request asks for, and
  how the next token is drawn from the logits;
- ``minipaged.viz`` and ``minipaged.workloads`` - pictures and synthetic requests for the
  lessons and benchmarks.

Importing the package imports only ``SamplingParams`` and ``BeamSearchParams`` (standard
library only), so ``minipaged.memory`` stays torch-free.
"""

from minipaged.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["BeamSearchParams", "SamplingParams"]
__version__ = "0.1.0"
