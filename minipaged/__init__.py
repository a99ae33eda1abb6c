"""minipaged: PagedAttention and the vLLM serving engine, step by step.

An educational reference implementation of Kwon et al., "Efficient Memory Management for
Large Language Model Serving with PagedAttention" (SOSP 2023).  Its parts are vLLM V1's,
bottom up:

- ``minipaged.core.memory`` - block allocator, block tables, copy-on-write, prefix
  caching and the KV cache manager; blocks and token ids only, standard library only;
- ``minipaged.ops`` - the PagedAttention ops and the contiguous oracle they are tested on;
- ``minipaged.models`` - model code and the tiny seeded checkpoints tests use;
- ``minipaged.sampling_params`` and ``minipaged.sample`` - what a request asks for, and
  how the next token is drawn from the logits;
- ``minipaged.sequence`` and ``minipaged.core.sched`` (with the paper's baseline,
  ``contiguous_scheduler``) - requests and which of their tokens run each step;
- ``minipaged.worker`` (the KV tensors, the forward pass), ``minipaged.executor`` (where
  a step runs), ``minipaged.engine`` (requests in, the step loop, outputs out) and
  ``minipaged.llm`` (the ``LLM`` API);
- ``minipaged.distributed`` - tensor parallelism (§4.6): the parallel layers the models
  are built from, and the executor that runs a step over a group of processes;
- ``minipaged.viz`` and ``minipaged.core.memory.workloads`` - pictures and synthetic
  requests for the lessons and benchmarks.

Importing the package imports only ``SamplingParams``, ``StructuredOutputsParams`` and
``BeamSearchParams`` (standard library only; llguidance is imported when a structured
output is asked for), so ``minipaged.core.memory`` stays torch-free; ``LLM`` (torch,
transformers) is imported on first use.
"""

from minipaged.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "BeamSearchParams", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name):  # PEP 562: `from minipaged import LLM` loads the engine then
    if name == "LLM":
        from minipaged.llm import LLM

        return LLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"
