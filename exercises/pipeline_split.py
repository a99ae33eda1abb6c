"""Lesson 12: cutting a model and a step for pipeline parallelism (GPipe, Huang et al.
2019, §2; vLLM's ``get_pp_indices``).

Write ``pp_layer_counts``, which `minipaged.distributed.parallel_state` uses to give each
stage its decoder layers, and ``micro_batches``, which the model runner uses to cut a
step's sequences into the micro-batches that flow through the stages, then check with
``make check LESSON=12``: the tests compare your split with vLLM's documented
partitions, and your micro-batches with what the pipeline needs (every sequence once,
in order, none empty, no more than the stages).

Hint: ``pp_layer_counts``: start from ``num_layers // size`` each, then hand the
remainder out one layer at a time to the stages *before* the last, from the
second-to-last backwards (the last stage also runs the norm, the LM head and the
sampling).  ``micro_batches``: walk the sequences in order, adding each to the current
micro-batch, and open a new one once the tokens placed so far reach the next
``1 / n`` share of the step's total.
"""


def pp_layer_counts(num_layers: int, size: int) -> list[int]:
    """How many of ``num_layers`` decoder layers each of ``size`` stages holds, first
    stage first: an even share, and the remainder one each on the stages before the
    last, counting back.

    >>> pp_layer_counts(22, 4)
    [5, 6, 6, 5]
    """
    raise NotImplementedError("write pp_layer_counts() in exercises/pipeline_split.py")


def micro_batches(seqs: list, n: int) -> list[list]:
    """``seqs`` (each with ``num_new_tokens``, the tokens it runs this step) cut, in
    order, into at most ``n`` runs of about equal token counts, none empty: a step of
    fewer sequences than stages has fewer micro-batches."""
    raise NotImplementedError("write micro_batches() in exercises/pipeline_split.py")
