"""Speculative decoding in the engine's step: propose, verify, accept, roll back.

Decoding runs the target model once per token, and on a small batch each run costs
about as much for one token as for several: the weights are read either way.  So a
cheap *draft* guesses the next ``k`` tokens, and one forward pass of the target over
the last token and the guesses scores them all at once (Leviathan et al. 2023; Chen et
al. 2023).  Per step, for every running sequence that decodes:

1. **propose** (before scheduling): the draft's up to ``k`` guesses, cut so that the
   sequence cannot pass ``max_tokens`` or ``max_model_len`` even if all are kept;
2. **schedule**: the scheduler runs the last token and the guesses (`Scheduler._plan`),
   which costs ``1 + k`` tokens of the budget and takes ``k`` *lookahead slots* in the
   paged cache (`KVCacheManager.append`), and preempts for them like any tokens;
3. **verify**: the model runner returns the target's logits at all ``1 + k`` positions,
   each with the real tokens and the guesses before it in context; modified rejection
   sampling (`rejection_sample`) keeps a prefix of the guesses and adds one token;
4. **roll back**, in the step's update phase (`OutputProcessor.update_from_output`,
   which applies `Speculator.verify`'s choice): the KV of the kept guesses stays, the
   slots of the rejected ones are given back and blocks they alone filled return to the
   pool (`Scheduler.rollback`);
   then the new tokens are appended one at a time, each checked for a stop exactly as
   without speculation, so no token after a stop is ever kept.

The target's distribution at each position is the sampler's (`processed_logits`,
`target_probs`), with the penalties and ``min_tokens`` of the tokens before it, guesses
included; logprobs are the target's raw logits', as `sample` reports them.  A greedy
request keeps exactly the guesses equal to the target's argmax: the same tokens as
without a draft.  Beam search is not combined with speculation (vLLM does not either).
A structured output's guesses are cut to what its grammar allows, and its target rows
masked by the grammar (`minipaged.structured_output`): the argmax is the masked one.

The rest of the engine is unchanged by a step that verifies: a LoRA request's guesses
run under its adapter in the target (the draft guesses without one, which only costs
acceptance), a mixture-of-experts target routes each of the ``1 + k`` tokens, and an
fp8 cache quantizes them as any tokens (the draft's pool is fp8 too).

Counters, with vLLM's ``spec_decode`` names: drafts verified, tokens guessed, tokens
accepted, and the accepted tokens at each guess position.
"""

from __future__ import annotations

import torch

from minipaged.config import SpeculativeConfig
from minipaged.core.sched.output import ScheduledSeq, Verified
from minipaged.models.hub import resolve_model
from minipaged.models.loader import load_model
from minipaged.models.resolve import resolve_max_model_len
from minipaged.sample.rejection_sampler import rejection_sample
from minipaged.sample.sampler import logprobs_of, processed_logits, target_probs
from minipaged.sequence import SequenceGroup
from minipaged.spec_decode.draft_model import DraftModelProposer
from minipaged.spec_decode.ngram import NgramProposer


def load_draft_model(
    config: SpeculativeConfig | None,
    vocab_size: int,
    max_model_len: int,
    dtype: str,
    device: torch.device,
    attention_backend: str,
) -> torch.nn.Module | None:
    """The draft model ``config`` names, loaded on ``device`` (on rank 0 only, with
    tensor parallelism) before the KV pools are sized, so that its weights count
    against the memory; None without one (no speculation, or the n-gram method).
    Refused (``ValueError`` naming the key) if its vocabulary or length is not the
    target's."""
    if config is None or config.method != "draft_model":
        return None
    model = load_model(resolve_model(config.model), dtype, device, attention_backend)
    if model.config.vocab_size != vocab_size:
        raise ValueError(
            f"speculative_config 'model' {config.model!r} has a vocabulary of "
            f"{model.config.vocab_size} tokens, the target's has {vocab_size}: a draft "
            "must share the target's tokenizer"
        )
    if (draft_len := resolve_max_model_len(None, model.config)) < max_model_len:
        raise ValueError(
            f"speculative_config 'model' {config.model!r} takes {draft_len} tokens, "
            f"fewer than max_model_len={max_model_len}"
        )
    return model


def make_proposer(
    config: SpeculativeConfig,
    draft_model: torch.nn.Module | None,
    num_blocks: int,
    block_size: int,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
) -> NgramProposer | DraftModelProposer:
    """The proposer ``config`` asks for: the n-gram one, or ``draft_model``
    (`load_draft_model`'s) over a pool of ``num_blocks`` blocks of ``kv_cache_dtype``
    of its own, as many as the target's (the engine sized both pools together)."""
    if draft_model is None:
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return DraftModelProposer(draft_model, num_blocks, block_size, kv_cache_dtype, device)


class Speculator:
    """The engine's speculative decoding: the proposer before a step, the verification
    in its update.  ``proposer``: `make_proposer`'s."""

    def __init__(
        self,
        config: SpeculativeConfig,
        eos_token_ids: set[int],
        generator: torch.Generator,
        max_model_len: int,
        proposer: NgramProposer | DraftModelProposer,
    ) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.eos_token_ids = eos_token_ids
        self.generator = generator
        self.max_model_len = max_model_len
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k

    # -- propose ----------------------------------------------------------------------
    def propose(self, groups: list[SequenceGroup]) -> None:
        """Give every decoding sequence of ``groups`` its guesses for the next step."""
        seqs, ks = [], []
        for group in groups:
            for seq in group.seqs:
                seq.spec_token_ids = []
                if seq.finish_reason is not None or seq.num_uncomputed_tokens != 1:
                    continue  # a prompt (chunk) or a recomputation runs first
                if group.is_beam_search or len(group.seqs) < group.params.n:
                    continue  # (a prompt about to fork samples its n first tokens)
                # All kept plus the token after them must stay within both limits.
                room = min(
                    group.params.max_tokens - seq.num_output_tokens,
                    self.max_model_len - len(seq.token_ids),
                )
                if (k := min(self.k, room - 1)) > 0:
                    seqs.append(seq)
                    ks.append(k)
        if seqs:
            for seq, guesses in zip(seqs, self.proposer.propose_batch(seqs, ks)):
                if seq.grammar is not None:  # structured: only what its grammar allows
                    guesses = guesses[: seq.grammar.validate_tokens(guesses)]
                seq.spec_token_ids = guesses

    def release(self, groups: list[SequenceGroup]) -> None:
        """After a step: the proposer lets go of what it holds (a draft model's KV) for
        every sequence but the unfinished ones of ``groups``, the running batch."""
        self.proposer.release({s.seq_id for g in groups for s in g.unfinished_seqs})

    # -- verify -----------------------------------------------------------------------
    def verify(self, sampling: list[ScheduledSeq], logits: list[torch.Tensor]) -> list[Verified]:
        """Accept or reject each sequence's guesses from its ``1 + k`` rows of target
        logits: the tokens each keeps (the accepted guesses and one more), for the update
        phase to apply (`OutputProcessor.update_from_output` rolls back the rest and
        appends them with their stop checks).  Changes no request."""
        rows = [(s, i) for s in sampling for i in range(len(s.spec_token_ids) + 1)]
        params = [s.group.params for s, _ in rows]
        raw = torch.cat(logits).float()
        histories = prompt_lens = None
        if any(p.penalized or p.min_tokens for p in params):
            histories = [s.seq.token_ids + s.spec_token_ids[:i] for s, i in rows]
            prompt_lens = [s.seq.prompt_len for s, _ in rows]
        probs = target_probs(
            processed_logits(raw, params, histories, prompt_lens, self.eos_token_ids), params
        )
        verified, start = [], 0
        for s in sampling:
            end = start + len(s.spec_token_ids) + 1
            generator = s.seq.generator or self.generator
            tokens = rejection_sample(probs[start:end], s.spec_token_ids, None, generator)
            kept = slice(start, start + len(tokens))
            out = logprobs_of(raw[kept], tokens, params[kept])
            verified.append(
                Verified(
                    s.group,
                    s.seq,
                    len(s.spec_token_ids),
                    tokens,
                    list(out.logprobs),
                    list(out.top_logprobs),
                )
            )
            start = end
        return verified

    def count(self, verified: list[Verified]) -> None:
        """Count what the update phase applied (vLLM's acceptance counters)."""
        for v in verified:
            self._count(v.num_guesses, len(v.token_ids) - 1)

    def _count(self, num_guesses: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_guesses
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    def stats(self) -> dict[str, float]:
        """vLLM's ``spec_decode`` counters, and what its logger derives from them."""
        drafts, guessed = self.num_drafts, self.num_draft_tokens
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": guessed,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            **{
                f"spec_decode_num_accepted_tokens_per_pos_{i}": n
                for i, n in enumerate(self.num_accepted_tokens_per_pos)
            },
            "spec_decode_acceptance_rate": self.num_accepted_tokens / guessed if guessed else 0.0,
            # Tokens a verifying step adds, the bonus or corrected one included.
            "spec_decode_mean_acceptance_length": (
                1 + self.num_accepted_tokens / drafts if drafts else 0.0
            ),
        }
