"""Lesson 17: a decode engine fills its own blocks with a prompt's KV computed elsewhere
(the worker side of vLLM's ``SharedStorageConnector``).

Write ``start_load_kv``, the method of
`minipaged.distributed.kv_transfer.kv_connector.v1.shared_storage_connector.SharedStorageConnector`
that the model runner calls before a step's forward pass.  The scheduler has already
decided what loads (section 4 of the lesson) and put it in the step's plan.  What it
may use:

* ``self._get_connector_metadata().loads``: one `ReqMeta` per sequence that loads, with
  ``block_ids`` (its blocks in *this* engine's cache, in logical order),
  ``stored_blocks`` (the indices of the same logical blocks in the stored tensors) and
  ``layers`` (layer name -> the bytes of that layer's safetensors file, as checked);
* ``forward_context.kv_caches``: layer name -> that layer's cache tensors (keys,
  values, and an int8 cache's scales), each ``[num_blocks, block_size, kv_heads, ...]``;
* ``load(data)`` (safetensors): the bytes as ``{"0": keys, "1": values, ...}``, one
  stored tensor per cache tensor, in the same order, each ``[stored blocks, ...]``;
* ``self._own_heads(stored, cache)``: the slice of a stored tensor's KV heads this
  rank holds (all of them without tensor parallelism).

Check with ``make check LESSON=17`` (or ``minipaged check 17``): the tests run a
producer engine, then consumer engines that load its KV (chunked, with prefix caching,
preemption, n > 1, beam search, an int8 cache) and compare their tokens with a single
engine's and Hugging Face's.

Hint: for each load, each layer, each of its cache tensors: pick the stored blocks
(``stored[str(i)][stored_index]``), take this rank's heads, and copy them into
``cache`` at ``block_ids`` (``index_copy_`` along dim 0).  Refuse (``ValueError``) a
stored tensor whose shape past the first dim or dtype differs from the cache's.
"""

import torch  # noqa: F401  (torch.tensor, index_copy_)
from safetensors.torch import load  # noqa: F401  (the stored bytes as tensors)


def start_load_kv(self, forward_context) -> None:
    """Copy every load of this step's plan into this engine's cache, all layers."""
    raise NotImplementedError("write start_load_kv() in exercises/kv_load.py")
