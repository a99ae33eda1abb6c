"""Lesson 10: stop strings, found in the text as it streams (vLLM's ``stop``).

Write ``stop_string``, which the engine's output processor
(`minipaged.engine.output_processor`) calls after each step on every sequence whose request
has stop strings, then check with ``make check LESSON=10``: the tests run the engine,
and the server, with stop strings that straddle tokens, and compare the text with a
Hugging Face greedy oracle's, cut where the stop string begins.

Hint: only the last ``num_new`` characters are new, but a stop string completed by them
may begin up to ``len(stop) - 1`` characters before them: search from there
(``str.find`` takes a start), not from the beginning (an older occurrence would have
stopped the sequence already), and cut ``seq.output_text`` at the match.
"""


def stop_string(seq, stops: list[str], num_new: int) -> str | None:
    """The first of ``stops`` (in their order) that the last ``num_new`` characters of
    ``seq.output_text`` completed, or None.  On a match, ``seq.output_text`` is cut
    where the stop string begins (the stop string itself is not part of the text).
    ``num_new`` 0: no new text, no stop."""
    raise NotImplementedError("write stop_string() in exercises/stop_strings.py")
