"""What a request asks of the sampler: vLLM's ``SamplingParams`` and ``BeamSearchParams``.

The names, defaults and meanings follow vLLM, so a script written for ``vllm.LLM`` runs
here unchanged.  Both classes check every argument on construction and raise
``ValueError`` naming the argument and the bad value: a request that fails validation is
refused before it reaches the engine, so it can change no engine state.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any

# vLLM's _SAMPLING_EPS: a temperature below it means greedy.  Dividing logits by a
# vanishing temperature would only approach argmax while risking inf/nan on the way.
SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step` returns for a request (vLLM's names).

    ``FINAL_ONLY``: one output, when it finishes (what ``LLM.generate`` wants).
    ``CUMULATIVE``: after every step that adds tokens, everything so far.
    ``DELTA``: after every step that adds tokens, only what is new (what a server
    streams).  Unlike vLLM, minipaged defaults to ``FINAL_ONLY``: building outputs
    nobody reads would cost every step.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a completion to a grammar (vLLM's ``StructuredOutputsParams``).

    Exactly one of:

    Args:
        json: a JSON schema (a dict, or its JSON text) the completion must validate
            against.
        regex: a regular expression (Rust ``regex`` syntax) the completion must match
            in full.
        choice: a non-empty list of strings; the completion is one of them.
        grammar: a context-free grammar, in Lark or GBNF syntax.
        json_object: True: any JSON object.

    Each is compiled by llguidance (vLLM's ``guidance`` backend) when constructed, so
    a schema it cannot compile, an invalid regex or grammar, or an empty choice list is
    a ``ValueError`` naming the field.  `minipaged.structured_output` turns it into a
    matcher per sequence, with the engine's backend (``structured_outputs_config``):
    one the xgrammar backend cannot compile (a Lark grammar with llguidance's
    ``%llguidance`` directive, say) is a ``ValueError`` naming the field when the
    request is added.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got {given or 'none'}"
            )
        if error := _grammar_error(self.llguidance_grammar()):
            raise ValueError(f"structured_outputs.{self.kind} cannot be compiled: {error}")

    @property
    def kind(self) -> str:
        """Which field is set; checks its type."""
        kind = next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        ok = {
            "json": isinstance(value, (dict, str)),
            "regex": isinstance(value, str),
            "choice": isinstance(value, (list, tuple))
            and len(value) > 0
            and all(isinstance(c, str) for c in value),
            "grammar": isinstance(value, str) and value.strip() != "",
            "json_object": value is True,
        }[kind]
        if not ok:
            rule = {
                "json": "a JSON schema (dict or str)",
                "regex": "a str",
                "choice": "a non-empty list of str",
                "grammar": "a non-empty Lark or GBNF grammar str",
                "json_object": "True",
            }[kind]
            raise ValueError(f"structured_outputs.{kind} must be {rule}, got {value!r}")
        return kind

    def key(self) -> tuple[str, str]:
        """What identifies the grammar: the compiled-grammar cache's key."""
        value = getattr(self, self.kind)
        if not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        return self.kind, value

    def llguidance_grammar(self) -> str:
        """The spec as an llguidance grammar (not yet checked)."""
        from llguidance import grammar_from  # noqa: PLC0415 (only structured requests need it)

        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            try:
                return grammar_from("json_schema", value)
            except ValueError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
        if kind == "json_object":
            return grammar_from("json_schema", '{"type": "object"}')
        if kind == "choice":
            return grammar_from("choice", list(value))
        if kind == "regex":
            return grammar_from("regex", value)
        try:  # Lark, or GBNF converted to Lark
            return grammar_from("grammar", value)
        except ValueError as error:
            raise ValueError(f"structured_outputs.grammar cannot be compiled: {error}") from None


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _grammar_error(grammar: str) -> str:
    from llguidance import LLMatcher  # noqa: PLC0415

    return LLMatcher.validate_grammar(grammar)


@dataclass
class SamplingParams:
    """How to pick each new token of a request, and when to stop.

    Args:
        n: completions to generate for the prompt (parallel sampling, paper §4.4).
        temperature: divides the logits; 0 means greedy (argmax).
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose
            probability reaches ``top_p``; 1 keeps all.
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 keeps all.
        min_p: drop tokens less likely than ``min_p`` times the most likely one.
        repetition_penalty: divides the positive logits and multiplies the negative ones
            of every token already in the prompt or the output (Hugging Face's and
            vLLM's meaning); 1 is off, above 1 discourages repeats.
        presence_penalty: subtracted from the logit of every token already in the
            output (OpenAI's meaning, the prompt not counted); in [-2, 2], 0 is off.
        frequency_penalty: subtracted once per occurrence in the output; in [-2, 2].
        seed: seeds this request's own random stream, so its output does not depend on
            what else is in the batch.
        max_tokens: the most new tokens to generate per completion.
        min_tokens: the end-of-sequence token and ``stop_token_ids`` cannot be sampled,
            and stop strings are not checked, before this many new tokens.
        stop: strings that end a completion when generated (not included in its text);
            a single string is turned into a one-element list, None into ``[]``.
        stop_token_ids: token ids that end a completion (``[]`` if None).
        ignore_eos: keep generating after the end-of-sequence token.
        logprobs: return the log-probabilities of this many most likely tokens at each
            step, plus the sampled token's; None returns none.
        prompt_logprobs: return, for every prompt token after the first, its
            log-probability given the tokens before it and the ``prompt_logprobs`` most
            likely tokens there (`RequestOutput.prompt_logprobs`); None returns none.
            Such a request does not read the prefix cache (vLLM's choice: a cached
            block has no logits), though it fills it for others.
        output_kind: when `LLMEngine.step` reports this request (`RequestOutputKind`).
        best_of: accepted only as None or equal to ``n``: minipaged does not generate
            extra completions to keep the ``n`` most likely (vLLM removed it too).
        structured_outputs: constrain each completion to a JSON schema, regex, choice
            or grammar (`StructuredOutputsParams`); a dict of its fields is accepted.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    best_of: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, low=1)
        _check_float("temperature", self.temperature, "a finite number >= 0", lambda t: t >= 0)
        _check_float("top_p", self.top_p, "a number in (0, 1]", lambda p: 0 < p <= 1)
        if self.top_k not in (0, -1):
            _check_int("top_k", self.top_k, low=1, hint=" (or 0 or -1 for off)")
        _check_float("min_p", self.min_p, "a number in [0, 1]", lambda p: 0 <= p <= 1)
        _check_float(
            "repetition_penalty", self.repetition_penalty, "a finite number > 0", lambda r: r > 0
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), "a number in [-2, 2]", lambda x: -2 <= x <= 2)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=2**64 - 1, hint=" or None")
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int(
            "min_tokens", self.min_tokens, low=0, high=self.max_tokens, hint=" (at most max_tokens)"
        )
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of must be None or equal to n={self.n} (minipaged does "
                f"not rank extra completions), got {self.best_of!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, hint=" or None")
        _check_bool("ignore_eos", self.ignore_eos)
        self.stop = _string_list(self.stop)
        self.stop_token_ids = _token_id_list(self.stop_token_ids)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured_outputs in minipaged (the "
                f"grammar decides where a completion may end), got min_tokens={self.min_tokens}"
            )

    @property
    def greedy(self) -> bool:
        """Pick the most likely token every step (temperature below ``SAMPLING_EPS``)."""
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (any penalty is on)."""
        return (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )


@dataclass
class BeamSearchParams:
    """vLLM's beam search: keep the ``beam_width`` best partial sequences every step.

    A finished sequence's score is ``cum_logprob / len ** length_penalty``, ``len``
    counting prompt and generated tokens, as in vLLM; a larger ``length_penalty`` favours
    longer sequences.

    Args:
        beam_width: how many partial sequences to keep, and to return.
        max_tokens: the most new tokens per sequence.
        length_penalty: the exponent of the length normalisation above.
        ignore_eos: keep extending beams after the end-of-sequence token.
        structured_outputs: hold every beam to a grammar, as `SamplingParams`' field
            does (a minipaged extension: vLLM's beam search takes none): each beam's
            candidates are the tokens its own matcher allows, ranked by logprobs
            renormalised over them.
    """

    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, low=1)
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("length_penalty", self.length_penalty, "a finite number")
        _check_bool("ignore_eos", self.ignore_eos)
        self.structured_outputs = _structured_outputs(self.structured_outputs)


def _structured_outputs(value: Any) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = set(value) - set(STRUCTURED_OUTPUT_KINDS)
        if unknown:
            raise ValueError(
                f"structured_outputs has unsupported fields {sorted(unknown)} (minipaged "
                f"takes {', '.join(STRUCTURED_OUTPUT_KINDS)})"
            )
        return StructuredOutputsParams(**value)
    raise ValueError(
        f"structured_outputs must be a StructuredOutputsParams or a dict, got {value!r}"
    )


def _is_int(value) -> bool:
    # bool is an int to Python, but True tokens or beams are a caller's mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name, value, low, high=None, hint="") -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bound}{hint}, got {value!r}")


def _check_float(name, value, rule, ok=None) -> None:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or (ok is not None and not ok(value))
    ):
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def _check_bool(name, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _string_list(stop) -> list[str]:
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a non-empty str or a list of them, got {stop!r}")
    return list(stop)


def _token_id_list(ids) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
    return list(ids)
