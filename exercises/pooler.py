"""Lesson 19: a prompt's hidden states made one embedding, chunk by chunk (vLLM's pooler).

Write ``add`` and ``finish``, methods of `minipaged.models.pooler.Pooler`, which the model
runner calls after every step with the final hidden states of the prompt positions a
pooling request ran in it.  What they may use:

* ``self.config.pooling_type``: ``"LAST"``, ``"MEAN"`` or ``"CLS"``; ``self.config.normalize``;
* ``group.prompt_token_ids``, ``group.params`` (its `PoolingParams`: ``dimensions``,
  ``normalize``, None where the request left them to the pooler);
* ``group.pooled`` (None at first) and ``group.num_pooled`` (0 at first): the request's
  running state and how many prompt positions it holds; ``group.embedding``: set it
  (a list of floats) once the prompt's last position is in.

Check with ``make check LESSON=19`` (or ``minipaged check 19``): the tests embed prompts
of several lengths in chunks of 16 tokens, with prefix caching and preemption, and
compare every embedding with Hugging Face's hidden states pooled by hand.

Hint: a chunk covers positions ``[start, start + len(hidden))``.  A preempted request
runs its prompt again from 0: skip positions below ``group.num_pooled``.  MEAN keeps a
running sum (in float32) and divides in ``finish``; CLS keeps row 0's; LAST the
prompt's last row.  ``finish``: divide (MEAN), cut to ``dimensions`` (Matryoshka), then
normalize (the request's choice, else the config's), in that order.
"""

import torch
import torch.nn.functional as F  # noqa: F401  (F.normalize)


def add(self, group, start: int, hidden: torch.Tensor) -> None:
    """Fold the hidden states of ``group``'s prompt positions ``[start, start +
    len(hidden))``, run this step, into its pooled state; once the prompt's last
    position is in, set its ``embedding``."""
    raise NotImplementedError("write add() in exercises/pooler.py")


def finish(self, pooled: torch.Tensor, prompt_len: int, params) -> torch.Tensor:
    """The embedding of a prompt's pooled state: the mean's division, the Matryoshka
    cut, the normalization (in that order)."""
    raise NotImplementedError("write finish() in exercises/pooler.py")
