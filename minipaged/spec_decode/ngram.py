"""The n-gram proposer: guesses copied from the sequence's own past (prompt lookup).

Text that quotes, edits or summarises its context repeats it.  So a cheap guess at a
sequence's next tokens is what followed the last time its latest tokens occurred:
find the longest n-gram, ``prompt_lookup_max >= n >= prompt_lookup_min``, that ends the
sequence and also occurs earlier in it (prompt and output alike), and propose the up to
``k`` tokens that came after that earlier occurrence (Saxena's prompt lookup decoding;
vLLM's ``NgramProposer``).  Among several earlier occurrences the most recent one is
taken: the nearest context is the likeliest to go on the same way.

No model, no tensors: the guesses are certain from the proposer's point of view, a
draft distribution all on one token, which is what the rejection sampler is told.

Standard library only.
"""

from __future__ import annotations


class NgramProposer:
    """``propose(token_ids, k)``: up to ``k`` guesses at what follows ``token_ids``."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({prompt_lookup_min}) and prompt_lookup_max "
                f"({prompt_lookup_max}) must satisfy 1 <= min <= max"
            )
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose_batch(self, seqs, ks: list[int]) -> list[list[int]]:
        """`propose` for each sequence (anything with ``token_ids``) and its ``k``."""
        return [self.propose(seq.token_ids, k) for seq, k in zip(seqs, ks)]

    def release(self, keep: set[str]) -> None:
        """Nothing to let go of: the proposer holds nothing per sequence."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest
        matching suffix n-gram, at most ``k`` (fewer near the end, none if no n-gram
        of ``prompt_lookup_min`` tokens or more recurs)."""
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n :]
            # Latest start first; the suffix itself (start = length - n) does not count.
            for start in range(length - n - 1, -1, -1):
                if token_ids[start : start + n] == suffix:
                    return token_ids[start + n : start + n + k]
        return []
