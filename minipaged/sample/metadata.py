"""What the sampler needs of a step's rows, as tensors (vLLM V1's ``SamplingMetadata``),
and the store that keeps it across steps (the sampling half of vLLM V1's ``InputBatch``).

`SamplingMetadata` is one step's: each row's temperature, top-k, top-p, min-p, penalties
and generator, already as tensors, and flags (``all_greedy``, ``all_random``, a filter
or the penalties off for every row) that let the sampler skip whole passes.

`SamplingInputBatch` keeps those values for every sequence that samples, one row each in
preallocated arrays, written once when the sequence first samples and dropped when it
leaves (`remove`), so a decode step gathers them by row index instead of reading every
request's ``SamplingParams``.  The penalties' token counts are kept the same way: a
sequence's prompt tokens as a mask built once, its output tokens as a count per token
updated with the tokens appended since the step before, never rebuilt from its whole
history.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minipaged.sampling_params import SamplingParams
from minipaged.worker.cpu_gpu_buffer import CpuGpuBuffers

__all__ = ["SamplingMetadata", "SamplingInputBatch"]

# The per-row parameter arrays `SamplingInputBatch` keeps, in their order on the device.
PARAMS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "frequency_penalties",
    "presence_penalties",
    "repetition_penalties",
)


@dataclass
class SamplingMetadata:
    """One step's sampling parameters, row ``i`` for row ``i`` of the logits.

    Attributes:
        temperature: ``[N]`` float32, each row's; None when ``all_greedy``.
        all_greedy / all_random: every row greedy / none greedy.
        random_rows: the rows that are not greedy (all of them when ``all_random``);
            ``random_index``: them on the device where the rows mix greedy and random
            ones (None: the sampler makes it).
        top_k: ``[N]`` the number of tokens each row keeps (the vocabulary when off);
            None when no row uses top-k.  ``top_p``, ``min_p``: ``[N]`` float32, or None
            when no row uses them.
        generators: each row's own generator, or None where it draws from the shared
            one; None when no row has one.
        penalized_rows: the rows with a penalty; ``frequency_penalties``,
            ``presence_penalties``, ``repetition_penalties`` (``[P, 1]``),
            ``output_token_counts`` (``[P, vocab]``, float32) and ``prompt_token_mask``
            (``[P, vocab]``, bool) are theirs, in that order.
        min_tokens_cells: ``(rows, token ids)`` whose logits are -inf this step (the
            stop tokens of rows short of ``min_tokens``); None when there are none.
        logprobs: each row's ``SamplingParams.logprobs`` (None: not asked for); None
            when no row asks.
    """

    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    random_rows: list[int]
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    generators: list[torch.Generator | None] | None = None
    penalized_rows: list[int] | None = None
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    output_token_counts: torch.Tensor | None = None
    prompt_token_mask: torch.Tensor | None = None
    min_tokens_cells: tuple[torch.Tensor, torch.Tensor] | None = None
    logprobs: Sequence[int | None] | None = None
    random_index: torch.Tensor | None = None

    @property
    def no_penalties(self) -> bool:
        return not self.penalized_rows


def min_tokens_cells(
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    eos_token_ids: Collection[int],
    vocab: int,
    device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``(rows, token ids)`` a ``min_tokens`` mask sets to -inf: each row short of
    its ``min_tokens`` output tokens, its ``stop_token_ids`` and, unless ``ignore_eos``,
    ``eos_token_ids``; None if there are none."""
    cells = [
        (i, t)
        for i, p in enumerate(params)
        if p.min_tokens and num_output_tokens[i] < p.min_tokens
        for t in {*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)}
        if t < vocab
    ]
    if not cells:
        return None
    rows, cols = torch.tensor(cells, device=device).T
    return rows, cols


class SamplingInputBatch:
    """Each sampling sequence's parameters as a row of preallocated arrays (module
    docstring), keyed by sequence id; a row freed by `remove` is reused."""

    def __init__(self, vocab_size: int, device: torch.device | str, max_num_reqs: int = 256):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.req_id_to_index: dict[str, int] = {}
        self.seqs: list = []  # row -> the Sequence it holds (None: free)
        self.params: list[SamplingParams | None] = []
        self._free: list[int] = []
        n = max_num_reqs
        self.temperature = torch.zeros(n, dtype=torch.float32)
        self.top_k = torch.zeros(n, dtype=torch.long)  # the vocabulary where off
        self.top_p = torch.ones(n, dtype=torch.float32)
        self.min_p = torch.zeros(n, dtype=torch.float32)
        self.frequency_penalties = torch.zeros(n, dtype=torch.float32)
        self.presence_penalties = torch.zeros(n, dtype=torch.float32)
        self.repetition_penalties = torch.ones(n, dtype=torch.float32)
        # Host flags, to decide what a step's rows need without touching a tensor.
        self.greedy = np.zeros(n, bool)
        self.uses_top_k = np.zeros(n, bool)
        self.uses_top_p = np.zeros(n, bool)
        self.uses_min_p = np.zeros(n, bool)
        self.penalized = np.zeros(n, bool)
        self.min_tokens = np.zeros(n, bool)
        self.seeded = np.zeros(n, bool)
        self.wants_logprobs = np.zeros(n, bool)
        # The penalties' state, allocated when a penalized sequence first samples: its
        # output tokens counted so far (and how many tokens that is), its prompt's mask.
        self.output_token_counts: torch.Tensor | None = None
        self.prompt_token_mask: torch.Tensor | None = None
        self.num_counted = np.zeros(n, np.int64)
        self._device_params: dict[str, torch.Tensor] | None = None
        self._staging = CpuGpuBuffers(self.device)
        self._to_device = self._staging.to_device
        # The last step's sequences (compared by identity) and their rows: a decode
        # step's are the same, so its rows are found without a lookup per sequence.
        self._last_seqs: list | None = None
        self._last_rows = np.zeros(0, np.int64)
        # The last rows' `_draw_metadata` (dropped whenever a row is added or freed).
        self._draw_rows: np.ndarray | None = None
        self._draw: SamplingMetadata | None = None

    def rows(self, seqs: Sequence, params: Sequence[SamplingParams]) -> np.ndarray:
        """The rows of ``seqs`` (each with its request's ``params``), adding those not
        held yet."""
        if seqs == self._last_seqs:  # a decode step's: the last step's, in its order
            return self._last_rows
        index, held = self.req_id_to_index, self.seqs
        rows = []
        for seq, p in zip(seqs, params):
            row = index.get(seq.seq_id)
            if row is None or held[row] is not seq:  # new, or a request id used again
                row = self._add(seq, p)
            rows.append(row)
        self._last_seqs, self._last_rows = list(seqs), np.array(rows, np.int64)
        return self._last_rows

    def remove(self, seq_ids: Collection[str]) -> None:
        """Forget sequences that finished or left the runner (they come back whole)."""
        for seq_id in seq_ids:
            row = self.req_id_to_index.pop(seq_id, None)
            if row is not None:
                self.seqs[row] = self.params[row] = None
                self._free.append(row)
                self._last_seqs = self._draw_rows = None

    def _add(self, seq, p: SamplingParams) -> int:
        self.remove([seq.seq_id])
        row = self._free.pop() if self._free else len(self.seqs)
        if row == len(self.seqs):
            self.seqs.append(None)
            self.params.append(None)
            self._ensure(row + 1)
        self.req_id_to_index[seq.seq_id], self.seqs[row], self.params[row] = row, seq, p
        vocab = self.vocab_size
        self.temperature[row] = p.temperature
        self.top_k[row] = min(p.top_k, vocab) if p.top_k > 0 else vocab
        self.top_p[row], self.min_p[row] = p.top_p, p.min_p
        self.frequency_penalties[row] = p.frequency_penalty
        self.presence_penalties[row] = p.presence_penalty
        self.repetition_penalties[row] = p.repetition_penalty
        self.greedy[row] = p.greedy
        self.uses_top_k[row] = 0 < p.top_k < vocab
        self.uses_top_p[row], self.uses_min_p[row] = p.top_p < 1, p.min_p > 0
        self.penalized[row], self.min_tokens[row] = p.penalized, bool(p.min_tokens)
        self.seeded[row] = seq.generator is not None
        self.wants_logprobs[row] = p.logprobs is not None
        self._device_params = self._draw_rows = None
        if p.penalized:
            self._start_counts(row, seq)
        return row

    def _start_counts(self, row: int, seq) -> None:
        """The row's prompt mask, once; its output counts from zero (`_count_new_tokens`
        adds what it has)."""
        if self.output_token_counts is None:
            shape = (len(self.temperature), self.vocab_size)
            self.output_token_counts = torch.zeros(shape, device=self.device)
            self.prompt_token_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.output_token_counts[row] = 0
        self.prompt_token_mask[row] = False
        prompt = torch.tensor(seq.token_ids[: seq.prompt_len], dtype=torch.long)
        self.prompt_token_mask[row, prompt.to(self.device)] = True
        self.num_counted[row] = seq.prompt_len

    def _count_new_tokens(self, rows: list[int]) -> None:
        """Add to each row's output counts the tokens its sequence gained since (the
        last step's sampled one, or a draft's accepted guesses): one scatter."""
        cells_rows, cells_tokens = [], []
        for row in rows:
            tokens = self.seqs[row].token_ids
            have = int(self.num_counted[row])
            if len(tokens) > have:
                new = tokens[have:]
                cells_rows += [row] * len(new)
                cells_tokens += new
                self.num_counted[row] = len(tokens)
        if cells_rows:
            index = self._to_device("new_tokens", np.array([cells_rows, cells_tokens], np.int64))
            ones = torch.ones(len(cells_rows), device=self.device)
            self.output_token_counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def _ensure(self, num_rows: int) -> None:
        have = len(self.temperature)
        if num_rows <= have:
            return
        size = max(num_rows, 2 * have)
        for name in (*PARAMS, "output_token_counts", "prompt_token_mask"):
            old = getattr(self, name)
            if old is not None:
                new = torch.zeros((size, *old.shape[1:]), dtype=old.dtype, device=old.device)
                new[:have] = old
                setattr(self, name, new)
        for name in (
            "greedy",
            "uses_top_k",
            "uses_top_p",
            "uses_min_p",
            "penalized",
            "min_tokens",
            "seeded",
            "wants_logprobs",
            "num_counted",
        ):
            old = getattr(self, name)
            new = np.zeros(size, old.dtype)
            new[:have] = old
            setattr(self, name, new)

    def _on_device(self) -> dict[str, torch.Tensor]:
        """The parameter arrays on the device, copied again only after a row changed: on
        a GPU one non-blocking copy of all seven as rows of one float32 table (top-k, a
        count up to the vocabulary, is exact in float32 below 2**24); on a CPU the
        arrays themselves."""
        if self._device_params is None:
            host = [getattr(self, name) for name in PARAMS]
            if not self._staging.crosses:
                self._device_params = dict(zip(PARAMS, host))
            else:
                table = self._to_device("params", torch.stack([t.float() for t in host]))
                self._device_params = dict(zip(PARAMS, table))
                self._device_params["top_k"] = table[PARAMS.index("top_k")].long()
        return self._device_params

    def metadata(self, rows: np.ndarray, eos_token_ids: Collection[int] = ()) -> SamplingMetadata:
        """The `SamplingMetadata` of a step whose logits rows are sequences ``rows``."""
        md = self._draw_metadata(rows)
        penalized = np.flatnonzero(self.penalized[rows])
        short = self.min_tokens[rows].any()
        if not len(penalized) and not short:
            return md  # the sampler only reads it: the next step may take it again
        md = copy.copy(md)
        if len(penalized):
            store_rows = rows[penalized]
            self._count_new_tokens(store_rows.tolist())
            params, at = self._on_device(), self._to_device("penalized_rows", store_rows)
            md.penalized_rows = penalized.tolist()
            for name in ("frequency_penalties", "presence_penalties", "repetition_penalties"):
                setattr(md, name, params[name].index_select(0, at)[:, None])
            md.output_token_counts = self.output_token_counts.index_select(0, at)
            md.prompt_token_mask = self.prompt_token_mask.index_select(0, at)
        if short:
            seqs = [self.seqs[r] for r in rows.tolist()]
            md.min_tokens_cells = min_tokens_cells(
                [self.params[r] for r in rows.tolist()],
                [s.num_output_tokens for s in seqs],
                eos_token_ids,
                self.vocab_size,
                self.device,
            )
        return md

    def _draw_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """What `metadata` gives whatever the step (which rows are greedy, the others'
        temperature, filters, generators, logprobs): the last step's again for the same
        ``rows`` array (`rows` returns the same one while the sequences stay)."""
        if rows is self._draw_rows:
            return self._draw
        greedy = self.greedy[rows]
        all_greedy, all_random = bool(greedy.all()), not greedy.any()
        random = None if all_random else np.flatnonzero(~greedy)
        random_rows = list(range(len(rows))) if all_random else random.tolist()
        mixed = not all_random and not all_greedy
        params = self._on_device()
        index = self._to_device("rows", rows)

        def gather(name, used=True):
            return params[name].index_select(0, index) if used else None

        self._draw_rows, self._draw = (
            rows,
            SamplingMetadata(
                gather("temperature", not all_greedy),
                all_greedy,
                all_random,
                random_rows,
                gather("top_k", self.uses_top_k[rows].any()),
                gather("top_p", self.uses_top_p[rows].any()),
                gather("min_p", self.uses_min_p[rows].any()),
                [self.seqs[r].generator for r in rows.tolist()]
                if self.seeded[rows].any()
                else None,
                logprobs=[
                    (self.params[r].logprobs if w else None)
                    for r, w in zip(rows.tolist(), self.wants_logprobs[rows].tolist())
                ]
                if self.wants_logprobs[rows].any()
                else None,
                random_index=self._to_device("random_rows", random) if mixed else None,
            ),
        )
        return self._draw
