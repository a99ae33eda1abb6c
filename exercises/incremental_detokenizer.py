"""Lesson 09: a completion's text, a few tokens at a time (vLLM's incremental
detokenization).

Write ``update``, the method of `minipaged.engine.detokenizer.IncrementalDetokenizer`
that the output processor calls after every step with the completion's token ids so
far, and that returns the text they add.  What it may use:

* ``self._decode(token_ids)``: the tokenizer's decode of a list of ids, special tokens
  skipped (``""`` for an empty list);
* ``self.prefix_offset`` and ``self.read_offset``: where the last window began, and how
  many tokens were already turned into text (both start at 0);
* ``INCOMPLETE``: U+FFFD, what decoding half of a UTF-8 character gives.

Check with ``make check LESSON=09`` (or ``minipaged check 09``): the tests stream random
token ids, multi-byte characters and SentencePiece words through your ``update`` and
compare the joined text with the tokenizer's decode of the whole completion.

Hint: decode two lists, ``token_ids[prefix_offset:read_offset]`` (text already emitted)
and ``token_ids[prefix_offset:]`` (the same, plus the new tokens).  The new text is what
the second adds beyond the first; emit nothing while it adds nothing or ends in
``INCOMPLETE`` (unless ``final``), and when you emit, move the offsets on: the old
``read_offset`` becomes ``prefix_offset``, and every token is now read.
"""

from minipaged.engine.detokenizer import INCOMPLETE  # noqa: F401  (compare with it)


def update(self, token_ids: list[int], final: bool = False) -> str:
    """The text that ``token_ids`` (the completion so far; earlier calls saw a prefix
    of it) adds.  ``final``: the completion has ended, so emit a trailing incomplete
    character too, as a full decode would."""
    raise NotImplementedError("write update() in exercises/incremental_detokenizer.py")
