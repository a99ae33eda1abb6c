"""The xgrammar backend (vLLM's ``v1/structured_output/backend_xgrammar.py``).

xgrammar compiles a grammar (JSON schema, regex, EBNF or Lark) into a pushdown automaton
over the model's tokenizer, and splits the vocabulary ahead of time into tokens whose
fate does not depend on the automaton's stack (decided once per state, at compile time)
and the few that do (checked each step).  Its bitmask has llguidance's layout (32 tokens
per ``int32``, token ``32 * w + b`` at bit ``b`` of word ``w``), so the same
`apply_grammar_bitmask` applies it.

Where the two differ in what they generate: xgrammar writes a number with a
``minimum`` or ``maximum`` with at most 6 fraction digits, where llguidance allows any
number of them (a model may never stop writing digits); a choice becomes an EBNF
alternation of its strings (vLLM's ``choice_as_grammar``).
"""

from __future__ import annotations

import json

import torch
import xgrammar as xgr

from minipaged.sampling_params import StructuredOutputsParams


class XgrammarBackend:
    """The tokenizer as xgrammar sees it, its compiler, and a pool of threads that fill
    a step's bitmask rows in parallel."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids
        )
        # The manager caches compiled grammars (an LRU); xgrammar's own cache would grow
        # without bound beside it.
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()

    def compile_grammar(self, params: StructuredOutputsParams) -> XgrammarGrammar:
        """``ValueError`` naming the field if xgrammar cannot compile it (a Lark grammar
        using llguidance's extensions, a regex feature xgrammar lacks)."""
        kind, value = params.kind, getattr(params, params.kind)
        try:
            compiled = self._compile(kind, value)
        except (RuntimeError, ValueError, xgr.InvalidJSONError) as error:
            raise ValueError(
                f"structured_outputs.{kind} cannot be compiled by the xgrammar backend: {error}"
            ) from None
        return XgrammarGrammar(compiled)

    def _compile(self, kind: str, value) -> xgr.CompiledGrammar:
        if kind == "json":
            # vLLM's default: any whitespace between tokens (disable_any_whitespace=False).
            return self.compiler.compile_json_schema(value, any_whitespace=True)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
        if kind == "regex":
            return self.compiler.compile_regex(value)
        if kind == "choice":
            # JSON's string escapes are EBNF's (quotes, backslashes, control characters).
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
            return self.compiler.compile_grammar(f"root ::= {alternatives}")
        if "::=" in value:  # GBNF / EBNF, llama.cpp's syntax, rooted at `root`
            return self.compiler.compile_grammar(value)
        return self.compiler.compile_lark(value)

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def fill_bitmask(self, grammars: list[XgrammarGrammar], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)


class XgrammarGrammar:
    """One sequence's matcher: where in the grammar its tokens so far have led."""

    def __init__(self, compiled: xgr.CompiledGrammar, matcher: xgr.GrammarMatcher | None = None):
        self.compiled = compiled
        self.matcher = matcher or xgr.GrammarMatcher(compiled)
        self.refused: int | None = None  # the token that led to a dead end

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (a dead end, for good) if the grammar does not
        allow it, or has ended already."""
        if self.refused is None and self.matcher.accept_token(token_id):
            return True
        self.refused = token_id if self.refused is None else self.refused
        return False

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, from the first, the grammar allows in a row (a
        draft's guesses: the rest are cut); the matcher does not move (it advances
        through them and rolls back, as vLLM's backend does)."""
        accepted = 0
        for token_id in token_ids:
            if not self.matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def fill_draft_bitmask(self, draft: list[int], bitmask: torch.Tensor) -> None:
        """Row ``i`` of ``bitmask`` (``len(draft) + 1`` rows): the tokens allowed after
        the first ``i`` of ``draft``, a verifying step's masks; the matcher advances
        through ``draft`` (cut by `validate_tokens` to what it allows) and rolls back."""
        for i, token_id in enumerate(draft):
            self.matcher.fill_next_token_bitmask(bitmask, i)
            if not self.matcher.accept_token(token_id):
                raise RuntimeError(f"draft token {token_id} was not validated against its grammar")
        self.matcher.fill_next_token_bitmask(bitmask, len(draft))
        if draft:
            self.matcher.rollback(len(draft))

    def is_terminated(self) -> bool:
        """The grammar has ended: it accepted an end-of-sequence token, which it allows
        only once complete."""
        return self.matcher.is_terminated()

    @property
    def error(self) -> str:
        if self.refused is None:
            return ""
        return f"the grammar does not allow token {self.refused} here"

    def fork(self) -> XgrammarGrammar:
        """An independent copy in the same state (a forked sequence's)."""
        fork = XgrammarGrammar(self.compiled, self.matcher.fork())
        fork.refused = self.refused
        return fork
