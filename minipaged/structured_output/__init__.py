"""Structured outputs: completions held to a JSON schema, regex, choice or grammar
(vLLM's ``v1/structured_output``).

A grammar is a state machine over *tokens*: in each state some tokens of the vocabulary
may come next and the rest may not.  Each step, every structured sequence's matcher
writes its allowed tokens as one row of bits of a preallocated ``int32`` bitmask
(`StructuredOutputManager.grammar_bitmask`); the rows are applied to the step's logits
in one operation before sampling (`apply_grammar_bitmask`), so whatever the sampler
draws, greedy or random, is a token the grammar accepts.  The update phase then feeds
each appended token to its sequence's matcher (`GuidanceGrammar.accept_token`, from
`Scheduler.check_stop`): the matcher's state is a function of the sequence's tokens
alone, so it survives preemption (recompute and swap keep the tokens), prefix caching
and chunked prefill (which only change how the prompt's KV is computed), and a fork for
``n`` > 1 or a beam kept twice copies it (`Sequence.fork`); beam search masks each
beam's row before ranking its candidates.

With speculative decoding (vLLM's way), a draft's guesses are cut to the longest
prefix the grammar allows when proposed (`GuidanceGrammar.validate_tokens`, from
`Speculator.propose`), and each of the ``1 + k`` rows a verifying step scores is masked
by the grammar advanced through the guesses before it, then rolled back
(`StructuredOutputManager.apply_drafts`): the update phase advances the matcher by the
tokens kept, one at a time, as without a draft.

The grammar engine is llguidance (vLLM's ``guidance`` backend, `backend_guidance`) or
xgrammar (`backend_xgrammar`), as ``structured_outputs_config``'s ``backend`` says; both
fill the same bitmask layout, and each sequence's matcher has the same methods
(`GuidanceGrammar`, `XgrammarGrammar`).  minipaged's ``"auto"`` is guidance, where
vLLM's prefers xgrammar.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from minipaged.core.sched.output import ScheduledSeq
from minipaged.sampling_params import StructuredOutputsParams
from minipaged.structured_output.utils import apply_grammar_bitmask

if TYPE_CHECKING:  # a backend is imported by the first structured request, not before:
    # an engine that never gets one runs where it is not installed (a GPU's stock image)
    from minipaged.structured_output.backend_guidance import GuidanceBackend, GuidanceGrammar
    from minipaged.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar

    Backend = GuidanceBackend | XgrammarBackend
    Grammar = GuidanceGrammar | XgrammarGrammar

__all__ = ["StructuredOutputManager", "apply_grammar_bitmask"]


class StructuredOutputManager:
    """Compiles each spec once (an LRU cache of ``cache_size`` grammars) and masks a
    step's logits (vLLM's ``StructuredOutputManager``).

    Args:
        tokenizer: the model's Hugging Face (fast) tokenizer.
        vocab_size: the logits' width (the model's vocabulary, padding rows included).
        eos_token_ids: the tokens that end a completion: the ones a finished grammar
            allows.
        max_num_seqs: the most sequences a step samples: the bitmask's rows.
        backend: ``"guidance"`` (llguidance) or ``"xgrammar"``.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: set[int],
        max_num_seqs: int,
        backend: str = "guidance",
        cache_size: int = 256,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.backend_name = backend
        self.cache_size = cache_size
        self._backend: Backend | None = None  # built on the first structured request
        self._compiled: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._bitmask: torch.Tensor | None = None

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            if self.backend_name == "xgrammar":
                from minipaged.structured_output.backend_xgrammar import (  # noqa: PLC0415
                    XgrammarBackend as backend,
                )
            else:
                from minipaged.structured_output.backend_guidance import (  # noqa: PLC0415
                    GuidanceBackend as backend,
                )
            self._backend = backend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._backend

    def grammar_init(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for one sequence: a copy of the spec's compiled grammar,
        compiled on its first use.  ``ValueError`` naming the field if the grammar does
        not compile against this tokenizer."""
        key = params.key()
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.backend.compile_grammar(params)
            self._compiled[key] = compiled
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return compiled.fork()

    @property
    def num_compiled(self) -> int:
        """Grammars in the cache."""
        return len(self._compiled)

    def grammar_bitmask(self, grammars: list[Grammar]) -> torch.Tensor:
        """Row ``i`` of the result: the tokens ``grammars[i]`` allows next, one bit per
        token (a view of the preallocated bitmask, valid until the next call).  A
        matcher at a dead end (no token allowed) gets a row that allows every token:
        whatever is drawn then fails the matcher's ``accept_token``, and the update
        phase finishes the sequence, saying why."""
        if self._bitmask is None:
            self._bitmask = self.backend.allocate_token_bitmask(self.max_num_seqs)
        bitmask = self._bitmask[: len(grammars)]
        self.backend.fill_bitmask(grammars, bitmask)
        bitmask[(bitmask == 0).all(dim=1)] = -1
        return bitmask

    def apply(self, sampling: list[ScheduledSeq], logits: torch.Tensor, rows: list[int]) -> None:
        """Mask, in place, the rows of ``logits`` (one per sequence of ``sampling``,
        those of ``rows`` being sampled) whose sequences are structured: the sample
        phase's one hook."""
        structured = [i for i in rows if sampling[i].seq.grammar is not None]
        if not structured:
            return
        bitmask = self.grammar_bitmask([sampling[i].seq.grammar for i in structured])
        apply_grammar_bitmask(logits, bitmask, structured)

    def apply_drafts(self, verifying: list[ScheduledSeq], logits: list[torch.Tensor]) -> None:
        """Mask, in place, the ``1 + k`` rows of ``logits[i]`` at which
        ``verifying[i]``'s guesses are checked, if it is structured: row ``j`` to what
        its grammar allows after its tokens and the first ``j`` guesses.  Rejection
        sampling then keeps a guess only where the masked target would (a greedy one:
        the masked argmax), so the tokens are those of decoding without a draft."""
        for s, rows in zip(verifying, logits):
            if s.seq.grammar is None:
                continue
            bitmask = self.backend.allocate_token_bitmask(len(s.spec_token_ids) + 1)
            s.seq.grammar.fill_draft_bitmask(s.spec_token_ids, bitmask)
            bitmask[(bitmask == 0).all(dim=1)] = -1  # a dead end: see `grammar_bitmask`
            apply_grammar_bitmask(rows, bitmask, list(range(len(rows))))
