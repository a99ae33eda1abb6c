"""Distributed execution: tensor parallelism over ``torch.distributed`` (paper §4.6).

- `parallel_state`: ranks, the process group, the timed collectives;
- `layers`: column- and row-parallel linear layers, the vocabulary-parallel embedding
  and LM head, which the models build from;
- `worker`: a worker process, one rank's shard of the model and of the KV cache;
- `executor`: how the engine runs a step, on one process or over a group of them.

The first two sit below the models; the last two above the model runner and cache
engine, beside the engine (``docs/architecture.md``).  Import the modules directly.
"""
