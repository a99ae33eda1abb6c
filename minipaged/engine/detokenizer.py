"""Incremental detokenization: a growing completion's text, a few tokens at a time.

A server streams text, and stop strings are found in text, so the engine needs each
completion's text after every step.  Decoding the whole completion each time costs
O(length) per token, O(length²) per request.  Decoding each new token alone is wrong:
tokens are not characters.  A byte-level tokenizer splits "é" into two tokens that are
not text on their own, and a SentencePiece tokenizer drops a token's leading space when
it starts the decoded string.

So, as vLLM does, decode a short *window*: the tokens from the last boundary
(``prefix_offset``) to the end.  The tokens before ``read_offset`` were already emitted;
their decoding is the window's known prefix, and what the window adds beyond it is the
new text.  While the window ends in U+FFFD (a character still incomplete) nothing is
emitted: the next token may complete it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INCOMPLETE = "\ufffd"  # what decoding a partial UTF-8 character yields


@dataclass
class IncrementalDetokenizer:
    """The decoding state of one completion (its output tokens, prompt excluded)."""

    tokenizer: Any
    prefix_offset: int = 0
    read_offset: int = 0

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """The text that ``token_ids`` (the completion so far; earlier calls saw a
        prefix of it) adds.  ``final``: the completion has ended, so emit a trailing
        incomplete character too, as a full decode would."""
        prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
        window = self._decode(token_ids[self.prefix_offset :])
        if len(window) <= len(prefix) or (window.endswith(INCOMPLETE) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return window[len(prefix) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""
