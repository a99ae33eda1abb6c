"""`ServerLimits`: what one request may ask of the server, and how long it waits.

Kept free of the server extra's imports, so the command line can show the defaults
without FastAPI installed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerLimits:
    """What one request may ask for, and how long the server waits (vLLM-like defaults).

    Attributes:
        max_prompts: prompts in one ``/v1/completions`` request.
        max_n: completions per prompt (OpenAI's cap, 128).
        max_logprobs: ``logprobs`` and ``top_logprobs`` (vLLM's ``max_logprobs``, 20).
        max_body_bytes: a request body's size (413 beyond).
        read_timeout_s: the longest pause while a body arrives (408 beyond), and
            the longest a connection waits for a request's head, idle or kept alive.
        shutdown_grace_s: how long running requests may finish after a shutdown
            begins, before the rest are ended with an error.
    """

    max_prompts: int = 256
    max_n: int = 128
    max_logprobs: int = 20
    max_body_bytes: int = 8 * 2**20
    read_timeout_s: float = 30.0
    shutdown_grace_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_prompts", "max_n", "max_logprobs", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("read_timeout_s", "shutdown_grace_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")


# The formats of tool calls in a model's text that ``--tool-call-parser`` may name
# (`minipaged.server.tools`); here, free of the server extra, for the command line.
TOOL_CALL_PARSERS = ("hermes",)
