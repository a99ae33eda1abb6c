"""Distributed execution: tensor and pipeline parallelism over ``torch.distributed``
(paper §4.6; GPipe for the stages).

- `parallel_state`: ranks, the process groups, the timed collectives, a pipeline
  stage's point-to-point ops and the timeline they record;
- `layers`: column- and row-parallel linear layers, the vocabulary-parallel embedding
  and LM head, which the models build from;
- `worker`: a worker process, one rank's shard of the model and of the KV cache;
- `executor`: the driver's side, running each step over the group of processes.
- `kv_transfer`: disaggregated prefill, vLLM V1's KV connectors, which move a prompt's
  KV from one engine to another (one device runs them, with ``kv_transfer_config``).

The first two sit below the models; the last two above the model runner and cache
engine, beside the engine (``docs/architecture.md``).  One device runs nothing here but
the parallel layers (plain layers then) and passes the group object (`parallel_state`)
around; its executor is `minipaged.executor.uniproc_executor`.  Import the modules directly.
"""
