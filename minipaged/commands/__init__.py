"""The commands of ``minipaged`` other than ``bench``: one module each.

Each module declares its command the way a benchmark of `minipaged.bench` does:
``NAME``, ``HELP`` and ``DESCRIPTION`` (plain string literals, which `minipaged.cli`
reads from the source without importing the module), ``add_arguments(parser)`` and
``main(args)``.

* `make_tiny_model` - ``minipaged make-tiny-model DIR``: a tiny seeded random checkpoint.
* `download` - ``minipaged download [NAME]``: fetch a model into the cache.
* `generate` - ``minipaged generate PROMPT...``: ``LLM.generate`` or ``LLM.beam_search``.
* `demo` - ``minipaged demo``: a real model answers, and the blocks paging saves.
* `serve` - ``minipaged serve MODEL``: the OpenAI-compatible HTTP server.
* `check` - ``minipaged check NN``: a lesson's tests, run on the learner's exercise.
"""
