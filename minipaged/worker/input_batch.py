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
  memory (on a CPU, the tensors are the arrays' own memory: no copy at all);
- a decode step, every step once the prompts are in, names the sequences of the step
  before in the same order: their rows, batch order and ids are the last step's again
  (one comparison of the id lists), its one new token and the new blocks (a row in
  ``block_size`` gets one) land in one fancy-indexed write each, and its inputs skip
  the prefill part (`InputBatch._prepare_decodes`).

The batch's order is the scheduler's, with prefills first and decodes last (the decode
op takes the trailing run of one-token sequences) and, within each, by LoRA slot.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from minipaged.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minipaged.models.attention import AttentionMetadata
from minipaged.worker.cpu_gpu_buffer import CpuGpuBuffers


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


def _one_each(lists: list[list[int]]) -> np.ndarray | None:
    """The items of ``lists`` as an int32 array if each holds exactly one (a decode
    step's new tokens, or its new blocks), else None."""
    if [] in lists:
        return None
    items = itertools.chain.from_iterable(lists)
    flat = np.fromiter(items, np.int32, len(lists))  # none empty: at least that many
    return flat if next(items, None) is None else None


class DeviceBlockTable:
    """Each row's block ids, on the host and on the device, the device's updated from the
    entries that changed (vLLM V1's ``worker/block_table.py``)."""

    def __init__(self, max_num_reqs: int, max_num_blocks: int, device: torch.device) -> None:
        self.device = device
        self._to_device = CpuGpuBuffers(device).to_device
        self.num_blocks = np.zeros(max_num_reqs, np.int32)
        self._allocate(np.zeros((max_num_reqs, max(1, max_num_blocks)), np.int32))
        # The entries written since the last `commit`, as (rows, columns, ids) arrays.
        self._writes: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

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
            ids = np.asarray(block_ids, np.int32)
            self._writes.append((np.full(len(ids), row), np.arange(start, end), ids))

    def set_rows(self, rows: np.ndarray, starts: np.ndarray, block_ids: list[list[int]]) -> None:
        """`set_row` for each of ``rows`` at once: one scatter into the host table (a
        decode step gives a new block to 1 row in ``block_size``, every step)."""
        ids = _one_each(block_ids)
        if ids is not None:  # one block each: a decode step's
            self.ensure(int(rows.max()) + 1, int(starts.max()) + 1)
            self.cpu[rows, starts] = ids
            self.num_blocks[rows] = starts + 1
            if self.device.type != "cpu":
                self._writes.append((rows, starts, ids))
            return
        lens = np.fromiter(map(len, block_ids), np.int64, len(rows))
        ends = starts + lens
        self.ensure(int(rows.max()) + 1, int(ends.max()))
        total = int(lens.sum())
        if total:
            row_of = np.repeat(rows, lens)
            columns = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(total)
            ids = np.fromiter(itertools.chain.from_iterable(block_ids), np.int32, total)
            self.cpu[row_of, columns] = ids
            if self.device.type != "cpu":
                self._writes.append((row_of, columns, ids))
        self.num_blocks[rows] = ends

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Row ``src[i]`` becomes row ``dst[i]`` (condensing), on both sides."""
        self.cpu[dst] = self.cpu[src]
        self.num_blocks[dst] = self.num_blocks[src]
        if self.device.type != "cpu":
            self.commit()  # the writes recorded so far land in the old rows first
            moves = self._to_device("moves", np.array([src, dst], np.int64))
            self.gpu[moves[1]] = self.gpu[moves[0]]

    def gather(
        self, rows: np.ndarray, index: torch.Tensor | None, first: int, last: int, width: int
    ) -> torch.Tensor:
        """Rows ``rows[first:last]`` of the table (``index``: ``rows`` on the device,
        None on a CPU), ``width`` blocks wide.  On a CPU, numpy gathers from the host
        array at a third of torch's cost."""
        if self.device.type == "cpu":
            return torch.from_numpy(self.cpu[rows[first:last], :width])
        return self.gpu[index[first:last], :width]

    def commit(self) -> None:
        """The step's new block ids to the device: one copy of (row, column, id) triples,
        one scatter."""
        if not self._writes:
            return
        packed = np.concatenate([np.stack(w) for w in self._writes], axis=1)
        self._writes.clear()
        packed = self._to_device("writes", packed.astype(np.int64))
        self.gpu[packed[0], packed[1]] = packed[2].to(self.gpu.dtype)


@dataclass
class StepInputs:
    """A step's (or a micro-batch's) tensors, and which of its rows are projected."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    lora_slots: np.ndarray  # each row's adapter slot (-1: none)...
    num_scheduled: np.ndarray  # ... for its tokens
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
        # int64, as positions are: a step's positions are a gather of them, no cast.
        self.num_tokens = np.zeros(max_num_reqs, np.int64)  # tokens known (guesses aside)
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int64)
        self.lora_slot = np.full(max_num_reqs, -1, np.int32)
        self.block_table = DeviceBlockTable(
            max_num_reqs, -(-max_model_len // block_size), self.device
        )
        self._device = CpuGpuBuffers(self.device).to_device
        self._num_holes = 0
        # The last ids looked up and their rows (`rows_of`), and the ids as an object
        # array, to pick a step's by row: both kept until a row is added, freed or moved.
        self._last_ids: list[str] | None = None
        self._last_rows = np.zeros(0, np.int64)
        self._id_array: np.ndarray | None = None
        # A step of decodes only: its rows in batch order, for the last rows looked up.
        self._decode_order: tuple[np.ndarray, np.ndarray] | None = None
        self._empty: tuple[torch.Tensor, torch.Tensor] | None = None  # `_none`

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
        self._rows_changed()
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
            self._rows_changed()
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
            self._rows_changed()
            src, dst = [s for s, _ in moves], [d for _, d in moves]
            for array in (self.num_tokens, self.num_computed_tokens, self.lora_slot):
                array[dst] = array[src]
            width = int(self.num_tokens[dst].max()) + 1
            self.token_ids_cpu[dst, :width] = self.token_ids_cpu[src, :width]
            self.block_table.move_rows(src, dst)
        while self.req_ids and self.req_ids[-1] is None:
            self.req_ids.pop()
        return moves

    def _rows_changed(self) -> None:
        self._last_ids = self._id_array = self._decode_order = None

    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        """The rows of ``req_ids`` (read only).  A decode step names the sequences of
        the step before, in its order: comparing the lists (an identity check per id)
        finds the last answer without a lookup per sequence."""
        if req_ids != self._last_ids:
            index = self.req_id_to_index
            rows = np.fromiter(map(index.__getitem__, req_ids), np.int64, len(req_ids))
            self._last_ids, self._last_rows = list(req_ids), rows
        return self._last_rows

    def _update_cached(self, out: SchedulerOutput) -> None:
        cached = out.scheduled_cached_reqs
        if not cached.req_ids:
            return
        rows = self.rows_of(cached.req_ids)
        self._append_tokens(rows, cached.new_token_ids, cached.num_new_tokens)
        self.num_computed_tokens[rows] = cached.num_computed_tokens
        self._update_block_tables(rows, cached)

    def _append_tokens(self, rows: np.ndarray, flat: list[int], counts: list[int]) -> None:
        """Append each row's tokens sampled since the step before, ``counts[i]`` of
        ``flat`` for row ``rows[i]`` (a decode step's: one each, one fancy-indexed
        write)."""
        starts = self.num_tokens[rows]
        if counts.count(1) == len(rows):
            self._ensure(len(self.req_ids), int(starts.max()) + 2)
            self.token_ids_cpu[rows, starts] = flat
            self.num_tokens[rows] = starts + 1
            return
        lens = np.asarray(counts, np.int64)
        if flat:
            self._ensure(len(self.req_ids), int((starts + lens).max()) + 1)
            ends = np.cumsum(lens)
            columns = np.repeat(starts - (ends - lens), lens) + np.arange(len(flat))
            self.token_ids_cpu[np.repeat(rows, lens), columns] = flat
        self.num_tokens[rows] = starts + lens

    def _update_block_tables(self, rows: np.ndarray, cached: CachedRequestData) -> None:
        """Append each row's new block ids after the blocks it has; a row in
        ``num_kept_blocks`` (a copy-on-write's replaced last block, a rollback) is
        rewritten from there.  A decode step gives new ids to a row in ``block_size``
        and cuts none."""
        new_block_ids, cut = cached.new_block_ids, cached.num_kept_blocks
        changed = np.fromiter(itertools.compress(itertools.count(), new_block_ids), np.int64)
        kept = self.block_table.num_blocks[rows].astype(np.int64)
        if cut:
            index = {req_id: i for i, req_id in enumerate(cached.req_ids)}
            cut_rows = [index[req_id] for req_id in cut]
            kept[cut_rows] = list(cut.values())
            changed = np.union1d(changed, cut_rows)
        if len(changed):
            changed_ids = [new_block_ids[i] or [] for i in changed.tolist()]
            self.block_table.set_rows(rows[changed], kept[changed], changed_ids)

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
        stably from the scheduler's order), their token counts and their guesses (all
        three read only)."""
        ids = out.num_scheduled_tokens
        rows, n = self.rows_of(list(ids)), len(ids)
        if not out.scheduled_spec_decode_tokens and set(ids.values()) == {1}:
            # Decodes only (every step once the prompts are in): by LoRA slot alone.
            return self._decode_rows(rows), np.ones(n, np.int64), np.zeros(n, np.int64)
        counts = np.fromiter(ids.values(), np.int64, n)
        guesses = np.zeros(n, np.int64)
        if out.scheduled_spec_decode_tokens:
            position = {r: i for i, r in enumerate(ids)}
            for req_id, spec in out.scheduled_spec_decode_tokens.items():
                guesses[position[req_id]] = len(spec)
        order = np.lexsort((self.lora_slot[rows], counts == 1))
        return rows[order], counts[order], guesses[order]

    def _decode_rows(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` of a step of decodes only, in batch order: by LoRA slot, stably (the
        last step's answer again for the same rows)."""
        if self._decode_order is None or self._decode_order[0] is not rows:
            slots = self.lora_slot[rows]
            uniform = slots.min() == slots.max()  # one adapter, or none: the scheduler's order
            self._decode_order = rows, rows if uniform else rows[np.argsort(slots, kind="stable")]
        return self._decode_order[1]

    def prepare(
        self, rows: np.ndarray, counts: np.ndarray, guesses: np.ndarray, key: str = ""
    ) -> StepInputs:
        """The inputs of running ``counts[i]`` tokens of row ``rows[i]`` (its last
        ``guesses[i]`` a draft's guesses), vectorized over the rows.  ``key`` names the
        device buffers (a pipeline's micro-batches of one step each have their own)."""
        bs, table = self.block_size, self.block_table
        starts = self.num_computed_tokens[rows]
        total = int(counts.sum())
        if total == len(rows):  # decodes only: a token per row, at its computed count
            return self._prepare_decodes(rows, starts, counts, key)
        ends = np.cumsum(counts)
        token_rows = np.repeat(rows, counts)
        positions = np.repeat(starts - (ends - counts), counts) + np.arange(total)
        input_ids = self.token_ids_cpu[token_rows, positions].astype(np.int64)
        slots = table.cpu[token_rows, positions // bs].astype(np.int64) * bs
        slots += positions % bs
        context_lens = (starts + counts).astype(np.int32)
        split = int(np.count_nonzero(counts != 1))  # the decodes are the trailing rows
        query_start_loc = np.zeros(split + 1, np.int32)
        np.cumsum(counts[:split], out=query_start_loc[1:])
        # The rows on the device, for its block table (a CPU's is the host array).
        row_index = self._device(key + "rows", rows) if self.device.type != "cpu" else None
        num_blocks = table.num_blocks[rows]
        decode_width = int(num_blocks[split:].max()) if split < len(rows) else 1
        attn = AttentionMetadata(
            slot_mapping=self._device(key + "slots", slots),
            num_prefill_tokens=int(ends[split - 1]),
            prefill_block_tables=table.gather(
                rows, row_index, 0, split, int(num_blocks[:split].max())
            ),
            prefill_query_start_loc=self._device(key + "query_start_loc", query_start_loc),
            prefill_context_lens=self._device(key + "prefill_context_lens", context_lens[:split]),
            max_prefill_query_len=int(counts[:split].max()),
            decode_block_tables=table.gather(rows, row_index, split, len(rows), decode_width),
            decode_context_lens=self._device(key + "decode_context_lens", context_lens[split:]),
            max_decode_context_len=int(context_lens[split:].max()) if split < len(rows) else 0,
        )
        # The rows to project: each sampling sequence's last token, after its guesses'.
        samples = starts + counts - guesses == self.num_tokens[rows]
        num_logit_rows = np.where(samples, 1 + guesses, 0)
        cum = np.cumsum(num_logit_rows)
        logit_index = np.repeat(ends - cum, num_logit_rows) + np.arange(int(cum[-1]))
        return StepInputs(
            self._device(key + "input_ids", input_ids),
            self._device(key + "positions", positions),
            attn,
            self.lora_slot[rows],
            counts,
            self._device(key + "logit_index", logit_index),
            self._ids(rows[samples]),
        )

    def _prepare_decodes(
        self, rows: np.ndarray, positions: np.ndarray, counts: np.ndarray, key: str
    ) -> StepInputs:
        """`prepare` of a step of decodes only (every step once the prompts are in): a
        token per row, at ``positions`` (its ``num_computed_tokens``), no prefill part."""
        table = self.block_table
        input_ids = self.token_ids_cpu[rows, positions].astype(np.int64)
        block, offset = np.divmod(positions, self.block_size)
        slots = table.cpu[rows, block].astype(np.int64) * self.block_size + offset
        context_lens = (positions + 1).astype(np.int32)
        row_index = self._device(key + "rows", rows) if self.device.type != "cpu" else None
        width = int(table.num_blocks[rows].max())
        none, no_tables = self._none()
        attn = AttentionMetadata(
            slot_mapping=self._device(key + "slots", slots),
            num_prefill_tokens=0,
            prefill_block_tables=no_tables,
            prefill_query_start_loc=none,
            prefill_context_lens=none,
            max_prefill_query_len=0,
            decode_block_tables=table.gather(rows, row_index, 0, len(rows), width),
            decode_context_lens=self._device(key + "decode_context_lens", context_lens),
            max_decode_context_len=int(context_lens.max()),
        )
        # A row samples unless it is a prompt's chunk of one token short of its end.
        samples = self.num_tokens[rows] == context_lens
        if samples.all():  # every row's logits, as they are
            logit_index, sampling = slice(None), rows
        else:
            logit_index = self._device(key + "logit_index", np.flatnonzero(samples))
            sampling = rows[samples]
        return StepInputs(
            self._device(key + "input_ids", input_ids),
            self._device(key + "positions", positions),
            attn,
            self.lora_slot[rows],
            counts,
            logit_index,
            self._ids(sampling),
        )

    def _none(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty int32 tensors on the device, ``[0]`` and ``[0, 1]``: a decode step's
        prefill fields (made once: each torch call costs microseconds)."""
        if self._empty is None:
            none = torch.empty(0, dtype=torch.int32, device=self.device)
            self._empty = none, none.view(0, 1)
        return self._empty

    def _ids(self, rows: np.ndarray) -> list[str]:
        """The sequence ids of ``rows``, picked from an object array of them (kept
        until a row changes) rather than one list lookup per row."""
        if rows is self._last_rows and self._last_ids is not None:  # looked up last, in order
            return list(self._last_ids)
        if self._id_array is None:
            self._id_array = np.array(self.req_ids, dtype=object)
        return self._id_array[rows].tolist()
