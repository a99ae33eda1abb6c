"""The model runner's persistent batch (vLLM V1's ``InputBatch`` and worker ``BlockTable``).

Rebuilding a step's inputs from Python lists costs the CPU time per sequence per step
(at 256 sequences, most of a step's bookkeeping), though a decode step changes almost
nothing: each sequence gains one token, and a block every ``block_size`` steps.  So the
runner keeps its sequences in preallocated arrays, one *row* each, and applies the
scheduler's diff (`minipaged.core.sched.output.SchedulerOutput`) to them:

- rows are added when a sequence first runs (``scheduled_new_reqs``), updated in place
  (``scheduled_cached_reqs``: the sampled tokens, new block ids, ``num_computed_tokens``),
  and removed when it leaves (``finished_req_ids``); a removal leaves a hole that
  `InputBatch.condense` fills by moving the last row into it, so rows ``[0, num_reqs)``
  are always the live ones;
- the block table lives in a numpy array and, on a GPU, in a device tensor that only the
  changed entries cross to (`DeviceBlockTable.commit`: one copy of the step's new block
  ids, however many sequences ran);
- a step's inputs are computed vectorized from the rows (`InputBatch.prepare`): the
  positions from ``num_computed_tokens``, the token ids gathered from the token array,
  the slot of each token from the block table (paper §4.2: ``block * block_size +
  offset``), and each buffer goes to the device in one non-blocking copy from pinned
  memory (on a CPU, the tensors are the arrays' own memory: no copy at all).

The batch's order is the scheduler's, with prefills first and decodes last (the decode
op takes the trailing run of one-token sequences) and, within each, by LoRA slot.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from minipaged.core.sched.output import NewRequestData, SchedulerOutput
from minipaged.models.attention import AttentionMetadata


def _grown(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``array`` inside a zero array at least ``shape`` (doubling, so growth is rare)."""
    new_shape = tuple(
        max(have, 2 * have if need > have else have, need) for have, need in zip(array.shape, shape)
    )
    if new_shape == array.shape:
        return array
    grown = np.zeros(new_shape, array.dtype)
    grown[tuple(slice(0, s) for s in array.shape)] = array
    return grown


class DeviceBlockTable:
    """Each row's block ids, on the host and on the device, the device's updated from the
    entries that changed (vLLM V1's ``worker/block_table.py``)."""

    def __init__(self, max_num_reqs: int, max_num_blocks: int, device: torch.device) -> None:
        self.device = device
        self.num_blocks = np.zeros(max_num_reqs, np.int32)
        self._allocate(np.zeros((max_num_reqs, max(1, max_num_blocks)), np.int32))
        self._writes: list[tuple[int, int, list[int]]] = []  # (row, first column, ids)

    def _allocate(self, cpu: np.ndarray) -> None:
        self.cpu = cpu
        # On a CPU the "device" table is the host array itself: nothing to copy.
        if self.device.type == "cpu":
            self.gpu = torch.from_numpy(cpu)
        else:
            self.gpu = torch.from_numpy(cpu).to(self.device)

    def ensure(self, num_rows: int, num_blocks: int) -> None:
        if num_rows <= self.cpu.shape[0] and num_blocks <= self.cpu.shape[1]:
            return
        grown = _grown(self.cpu, (num_rows, num_blocks))
        if grown is not self.cpu:
            self._writes.clear()  # the whole table crosses again
            self._allocate(grown)
        self.num_blocks = _grown(self.num_blocks, (grown.shape[0],))

    def set_row(self, row: int, start: int, block_ids: list[int]) -> None:
        """Row ``row``'s table: its first ``start`` blocks kept, then ``block_ids``."""
        end = start + len(block_ids)
        if row >= self.cpu.shape[0] or end > self.cpu.shape[1]:
            self.ensure(row + 1, end)
        self.cpu[row, start:end] = block_ids
        self.num_blocks[row] = end
        if block_ids and self.device.type != "cpu":
            self._writes.append((row, start, block_ids))

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Row ``src[i]`` becomes row ``dst[i]`` (condensing), on both sides."""
        self.cpu[dst] = self.cpu[src]
        self.num_blocks[dst] = self.num_blocks[src]
        if self.device.type != "cpu":
            self.commit()  # the writes recorded so far land in the old rows first
            index = torch.tensor(src, device=self.device)
            self.gpu[torch.tensor(dst, device=self.device)] = self.gpu[index]

    def gather(self, rows: np.ndarray, index: torch.Tensor, width: int) -> torch.Tensor:
        """Rows ``rows`` of the table (``index``: the same ids on the device), ``width``
        blocks wide.  On a CPU, numpy gathers from the host array at a third of torch's
        cost."""
        if self.device.type == "cpu":
            return torch.from_numpy(self.cpu[rows, :width])
        return self.gpu[index, :width]

    def commit(self) -> None:
        """The step's new block ids to the device: one copy of (row, column, id) triples,
        one scatter."""
        if not self._writes:
            return
        rows = [r for r, _, ids in self._writes for _ in ids]
        cols = [c for _, start, ids in self._writes for c in range(start, start + len(ids))]
        vals = [b for _, _, ids in self._writes for b in ids]
        self._writes.clear()
        packed = torch.tensor([rows, cols, vals], dtype=torch.long).pin_memory()
        packed = packed.to(self.device, non_blocking=True)
        self.gpu[packed[0], packed[1]] = packed[2].to(self.gpu.dtype)


@dataclass
class StepInputs:
    """A step's (or a micro-batch's) tensors, and which of its rows are projected."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    lora_slots: list[int]
    num_scheduled: list[int]
    # Rows of the hidden states to project to logits (a slice of all, where all are).
    logit_index: torch.Tensor | slice
    sampling_req_ids: list[str]  # their sequences, in order (one more row per guess)


class InputBatch:
    """The runner's sequences as rows of preallocated arrays (module docstring)."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device
    ) -> None:
        self.block_size, self.device = block_size, torch.device(device)
        self.req_ids: list[str | None] = []  # row -> sequence id (None: a hole)
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int32)  # tokens known (guesses aside)
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int32)
        self.lora_slot = np.full(max_num_reqs, -1, np.int32)
        self.block_table = DeviceBlockTable(
            max_num_reqs, -(-max_model_len // block_size), self.device
        )
        self._pinned: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._num_holes = 0

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # -- the diff -------------------------------------------------------------------
    def update_states(self, out: SchedulerOutput) -> None:
        """Apply one step's diff: drop, condense, add, then update the held rows."""
        for req_id in out.finished_req_ids:
            self.remove_request(req_id)
        self.condense()
        for new in out.scheduled_new_reqs:
            self.add_request(new)
        self._update_cached(out)
        for req_id, spec in out.scheduled_spec_decode_tokens.items():
            # A draft's guesses, after the row's known tokens (never counted in them).
            row = self.req_id_to_index[req_id]
            start = int(self.num_tokens[row])
            self._ensure(row + 1, start + len(spec))
            self.token_ids_cpu[row, start : start + len(spec)] = spec
        self.block_table.commit()

    def add_request(self, new: NewRequestData) -> int:
        row = len(self.req_ids)
        self._ensure(row + 1, len(new.token_ids) + 1)
        self.req_ids.append(new.req_id)
        self.req_id_to_index[new.req_id] = row
        self.token_ids_cpu[row, : len(new.token_ids)] = new.token_ids
        self.num_tokens[row] = len(new.token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.lora_slot[row] = new.lora_slot
        self.block_table.set_row(row, 0, new.block_ids)
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Leave a hole where ``req_id`` was (`condense` fills it); None if not held."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self.req_ids[row] = None
            self._num_holes += 1
        return row

    def condense(self) -> list[tuple[int, int]]:
        """Fill every hole with the last live row, so rows ``[0, num_reqs)`` are the live
        ones; returns the ``(src, dst)`` moves."""
        if not self._num_holes:
            return []
        self._num_holes = 0
        holes = [i for i, r in enumerate(self.req_ids) if r is None]
        moves, last = [], len(self.req_ids) - 1
        for hole in holes:
            while last > hole and self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            moves.append((last, hole))
            req_id = self.req_ids[hole] = self.req_ids[last]
            self.req_ids[last] = None
            self.req_id_to_index[req_id] = hole
            last -= 1
        if moves:
            src, dst = [s for s, _ in moves], [d for _, d in moves]
            for array in (self.num_tokens, self.num_computed_tokens, self.lora_slot):
                array[dst] = array[src]
            width = int(self.num_tokens[dst].max()) + 1
            self.token_ids_cpu[dst, :width] = self.token_ids_cpu[src, :width]
            self.block_table.move_rows(src, dst)
        while self.req_ids and self.req_ids[-1] is None:
            self.req_ids.pop()
        return moves

    def _update_cached(self, out: SchedulerOutput) -> None:
        cached = out.scheduled_cached_reqs
        if not cached.req_ids:
            return
        index = self.req_id_to_index
        rows = np.fromiter(map(index.__getitem__, cached.req_ids), np.int64, len(cached.req_ids))
        lens = np.fromiter(map(len, cached.new_token_ids), np.int64, len(rows))
        total = int(lens.sum())
        if total:
            flat = np.fromiter(itertools.chain.from_iterable(cached.new_token_ids), np.int32, total)
            starts = self.num_tokens[rows].astype(np.int64)
            self._ensure(len(self.req_ids), int((starts + lens).max()) + 1)
            if total == len(rows) and lens.min() == 1:  # one each: a decode step's
                self.token_ids_cpu[rows, starts] = flat
            else:
                ends = np.cumsum(lens)
                columns = np.repeat(starts - (ends - lens), lens) + np.arange(total)
                self.token_ids_cpu[np.repeat(rows, lens), columns] = flat
            self.num_tokens[rows] = starts + lens
        self.num_computed_tokens[rows] = cached.num_computed_tokens
        kept = np.asarray(cached.num_kept_blocks)
        changed = np.fromiter(map(bool, cached.new_block_ids), bool, len(rows)) | (
            kept < self.block_table.num_blocks[rows]
        )
        for i in np.flatnonzero(changed).tolist():
            self.block_table.set_row(int(rows[i]), int(kept[i]), cached.new_block_ids[i])

    def _ensure(self, num_rows: int, num_columns: int) -> None:
        if num_rows > self.token_ids_cpu.shape[0] or num_columns > self.token_ids_cpu.shape[1]:
            self.token_ids_cpu = _grown(self.token_ids_cpu, (num_rows, num_columns))
            for name in ("num_tokens", "num_computed_tokens", "lora_slot"):
                setattr(self, name, _grown(getattr(self, name), (self.token_ids_cpu.shape[0],)))
            self.lora_slot[len(self.req_ids) :] = -1
        self.block_table.ensure(num_rows, -(-num_columns // self.block_size))

    # -- a step's inputs ----------------------------------------------------------------
    def order(self, out: SchedulerOutput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's rows in batch order (prefills, then decodes; each by LoRA slot,
        stably from the scheduler's order), their token counts and their guesses."""
        ids = out.num_scheduled_tokens
        rows = np.fromiter(map(self.req_id_to_index.__getitem__, ids), np.int64, len(ids))
        counts = np.fromiter(ids.values(), np.int64, len(ids))
        guesses = np.zeros(len(ids), np.int64)
        if out.scheduled_spec_decode_tokens:
            position = {r: i for i, r in enumerate(ids)}
            for req_id, spec in out.scheduled_spec_decode_tokens.items():
                guesses[position[req_id]] = len(spec)
        order = np.lexsort((self.lora_slot[rows], counts == 1))
        return rows[order], counts[order], guesses[order]

    def prepare(
        self, rows: np.ndarray, counts: np.ndarray, guesses: np.ndarray, key: str = ""
    ) -> StepInputs:
        """The inputs of running ``counts[i]`` tokens of row ``rows[i]`` (its last
        ``guesses[i]`` a draft's guesses), vectorized over the rows.  ``key`` names the
        device buffers (a pipeline's micro-batches of one step each have their own)."""
        bs = self.block_size
        starts = self.num_computed_tokens[rows].astype(np.int64)
        ends = np.cumsum(counts)
        total = int(ends[-1])
        if total == len(rows):  # decodes only: a token per row, at its computed count
            token_rows, positions = rows, starts
        else:
            token_rows = np.repeat(rows, counts)
            positions = np.repeat(starts - (ends - counts), counts) + np.arange(total)
        input_ids = self.token_ids_cpu[token_rows, positions].astype(np.int64)
        slots = self.block_table.cpu[token_rows, positions // bs].astype(np.int64) * bs
        slots += positions % bs
        context_lens = (starts + counts).astype(np.int32)
        split = int(np.count_nonzero(counts != 1))  # the decodes are the trailing rows
        query_start_loc = np.zeros(split + 1, np.int32)
        np.cumsum(counts[:split], out=query_start_loc[1:])
        row_index = self._device(key + "rows", rows)
        num_blocks = self.block_table.num_blocks[rows]
        table = self.block_table
        prefill_width = int(num_blocks[:split].max()) if split else 1
        decode_width = int(num_blocks[split:].max()) if split < len(rows) else 1
        attn = AttentionMetadata(
            slot_mapping=self._device(key + "slots", slots),
            num_prefill_tokens=int(ends[split - 1]) if split else 0,
            prefill_block_tables=table.gather(rows[:split], row_index[:split], prefill_width),
            prefill_query_start_loc=self._device(key + "query_start_loc", query_start_loc),
            prefill_context_lens=self._device(key + "prefill_context_lens", context_lens[:split]),
            max_prefill_query_len=int(counts[:split].max()) if split else 0,
            decode_block_tables=table.gather(rows[split:], row_index[split:], decode_width),
            decode_context_lens=self._device(key + "decode_context_lens", context_lens[split:]),
            max_decode_context_len=int(context_lens[split:].max()) if split < len(rows) else 0,
        )
        # The rows to project: each sampling sequence's last token, after its guesses'.
        samples = starts + counts - guesses == self.num_tokens[rows]
        if total == len(rows) and samples.all():  # every row samples its one token: all
            logit_index = slice(None)
        else:
            num_logit_rows = np.where(samples, 1 + guesses, 0)
            cum = np.cumsum(num_logit_rows)
            logit_index = self._device(
                key + "logit_index",
                np.repeat(ends - cum, num_logit_rows) + np.arange(int(cum[-1])),
            )
        req_ids = self.req_ids
        return StepInputs(
            self._device(key + "input_ids", input_ids),
            self._device(key + "positions", positions),
            attn,
            self.lora_slot[rows].tolist(),
            counts.tolist(),
            logit_index,
            [req_ids[r] for r in rows[samples].tolist()],
        )

    def _device(self, name: str, array: np.ndarray) -> torch.Tensor:
        """``array`` on the device: on a CPU, the array's own memory; on a GPU, one
        non-blocking copy through a pinned buffer kept for ``name``."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            return tensor
        pinned, device = self._pinned.get(name, (None, None))
        if pinned is None or pinned.numel() < tensor.numel():
            size = max(tensor.numel(), 2 * (pinned.numel() if pinned is not None else 256))
            pinned = torch.empty(size, dtype=tensor.dtype).pin_memory()
            device = torch.empty(size, dtype=tensor.dtype, device=self.device)
            self._pinned[name] = pinned, device
        n = tensor.numel()
        pinned[:n].copy_(tensor)
        device[:n].copy_(pinned[:n], non_blocking=True)
        return device[:n]
