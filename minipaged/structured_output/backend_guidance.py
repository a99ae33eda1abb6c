"""The llguidance backend (vLLM's ``v1/structured_output/backend_guidance.py``).

llguidance compiles a grammar (JSON schema, regex, choice, Lark) into a lazy
token-level parser over the model's own tokenizer: at each step it computes which
vocabulary tokens keep the output a prefix of some string of the grammar, whatever
bytes each token spans (the token boundaries rarely match the grammar's lexemes).
"""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from minipaged.sampling_params import StructuredOutputsParams


class GuidanceBackend:
    """The tokenizer as llguidance sees it, and a pool of threads that fill a step's
    bitmask rows in parallel."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids
        )
        self.executor = llguidance.LLExecutor()

    def compile_grammar(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, params.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(
                f"structured_outputs.{params.kind} cannot be compiled: {matcher.get_error()}"
            )
        return GuidanceGrammar(matcher)

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return torch.full(
            llguidance.torch.get_bitmask_shape(max_num_seqs, self.vocab_size), -1, dtype=torch.int32
        )

    def fill_bitmask(self, grammars: list[GuidanceGrammar], bitmask: torch.Tensor) -> None:
        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(g.matcher, i) for i, g in enumerate(grammars)], bitmask
        )


class GuidanceGrammar:
    """One sequence's matcher: where in the grammar its tokens so far have led."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (a dead end, for good) if the grammar does not
        allow it (or it is at one already: a matcher in error accepts nothing more)."""
        return self.matcher.consume_token(token_id) and not self.matcher.is_error()

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, from the first, the grammar allows in a row (a
        draft's guesses: the rest are cut); the matcher does not move."""
        return self.matcher.validate_tokens(token_ids)

    def fill_draft_bitmask(self, draft: list[int], bitmask: torch.Tensor) -> None:
        """Row ``i`` of ``bitmask`` (``len(draft) + 1`` rows): the tokens allowed after
        the first ``i`` of ``draft``, a verifying step's masks (vLLM's
        ``StructuredOutputManager.grammar_bitmask`` with speculative tokens).  The
        matcher advances through ``draft`` (which `validate_tokens` has cut to what it
        allows) and is rolled back: the update phase advances it by the tokens kept."""
        for i, token_id in enumerate(draft):
            llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, i)
            if not self.matcher.consume_token(token_id):
                raise RuntimeError(f"draft token {token_id} was not validated against its grammar")
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, len(draft))
        self.matcher.rollback(len(draft))

    def is_terminated(self) -> bool:
        """The grammar is complete: only an end-of-sequence token may follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def fork(self) -> GuidanceGrammar:
        """An independent copy in the same state (a forked sequence's)."""
        return GuidanceGrammar(self.matcher.deep_copy())
