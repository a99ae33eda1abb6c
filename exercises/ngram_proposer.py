"""Lesson 13: the n-gram proposer, a draft with no model (prompt lookup; vLLM's
``{"method": "ngram"}``).

Write ``propose``, the method `minipaged.spec_decode.ngram.NgramProposer` uses to guess
a sequence's next tokens, then check with ``make check LESSON=13``: the tests compare
your guesses with hand-made cases and a brute-force oracle on random sequences, and
the engine's greedy tokens with Hugging Face's, whatever the guesses.

Hint: try the longest suffix first (``self.max_n`` tokens, but fewer than the sequence
has), down to ``self.min_n``; for each length, look for the latest earlier place where
those tokens occur (the suffix itself does not count), and return what followed them
there, at most ``k`` tokens.
"""


def propose(self, token_ids: list[int], k: int) -> list[int]:
    """Up to ``k`` guesses for what follows ``token_ids``: the tokens that followed the
    latest earlier occurrence of the longest suffix n-gram (``self.min_n <= n <=
    self.max_n``) that occurs earlier; fewer near the end of the sequence, and ``[]``
    when no such n-gram recurs.

    >>> tokens = [7, 3, 9, 4, 1, 8, 2, 5, 3, 9, 4]   # ends with 3 9 4, seen at 1..3
    >>> proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    >>> propose(proposer, tokens, k=4)
    [1, 8, 2, 5]
    """
    raise NotImplementedError("write propose() in exercises/ngram_proposer.py")
