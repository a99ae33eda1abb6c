"""Lesson 22: a step's grammar bitmask applied to its logits (vLLM's
``apply_grammar_bitmask``, ``v1/structured_output/utils.py``).

Write ``apply_grammar_bitmask``, which the engine's sample phase calls once a step on
the bitmask its structured sequences' matchers filled (one row each), then check with
``make check LESSON=22``: the tests compare your masking with a bit-by-bit loop over
the vocabulary, the engine's greedy tokens under a JSON schema with Hugging Face's
``generate`` masked by a fresh llguidance matcher, and its sampled completions with
Python's ``re`` and the choice list.

Hint: no loop over tokens.  Shift each ``int32`` word right by 0..31 (a tensor of
shifts, broadcast on a new last axis) and ``& 1``: that is ``[rows, words, 32]`` bits,
token ``32 * word + bit``; flatten the last two axes and cut to the logits' width (the
last word runs past the vocabulary).  Index the logits with a tensor of ``rows`` and
``masked_fill`` where a bit is 0.  The logits come from the forward pass under
``torch.inference_mode()``: write to them inside it too.
"""

import torch


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, every logit of ``logits[rows[i]]`` whose token's bit in
    ``bitmask[i]`` is 0; leave every other row of ``logits`` as it is.

    ``logits`` is ``[num_rows, vocab]``; ``bitmask`` is ``[len(rows), ceil(vocab / 32)]``
    ``int32``, bit ``b`` of word ``w`` standing for token ``32 * w + b`` (llguidance's
    and xgrammar's layout; a word's bit 31 is its sign bit).
    """
    raise NotImplementedError("write apply_grammar_bitmask() in exercises/grammar_bitmask.py")
