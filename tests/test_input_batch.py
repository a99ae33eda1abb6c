"""The model runner's persistent batch (minipaged.worker.input_batch) and the scheduler's
diff that feeds it: after any sequence of steps (decodes, prefill chunks, forks, frees,
preemptions), the batch's inputs equal what the definitions give from the scheduler's
own state: each token's position from its sequence's ``num_computed_tokens``, its slot
``table[p // block_size] * block_size + p % block_size`` (paper §4.2) from the KV cache
manager's block table, its token id from the sequence."""

from __future__ import annotations

import random

import numpy as np
import pytest

from minipaged.core.memory import KVCacheManager
from minipaged.core.sched.scheduler import Scheduler
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.worker.input_batch import InputBatch

BLOCK_SIZE = 4


def _group(i: int, rng: random.Random, n: int = 1) -> SequenceGroup:
    prompt = [rng.randrange(100) for _ in range(rng.randrange(1, 12))]
    group = SequenceGroup(f"r{i}", None, prompt, SamplingParams(n=n, max_tokens=50), i)
    group.seqs.append(Sequence(f"r{i}.0", list(prompt), len(prompt)))
    return group


def _expected(out, kv: KVCacheManager):
    """Per scheduled sequence, from the definitions: its positions, slots and tokens."""
    expected = {}
    for s in out.seqs:
        table = kv.block_table(s.seq.seq_id)
        positions = list(range(s.start, s.start + s.num_new_tokens))
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
        expected[s.seq.seq_id] = (positions, slots, s.seq.token_ids[s.start : positions[-1] + 1])
    return expected


def _actual(batch: InputBatch, out):
    rows, counts, guesses = batch.order(out)
    inputs = batch.prepare(rows, counts, guesses)
    actual, offset = {}, 0
    for row, count in zip(rows.tolist(), counts.tolist()):
        part = slice(offset, offset + count)
        actual[batch.req_ids[row]] = (
            inputs.positions[part].tolist(),
            inputs.attn.slot_mapping[part].tolist(),
            inputs.input_ids[part].tolist(),
        )
        offset += count
    return actual, inputs


@pytest.mark.parametrize("seed", range(4))
def test_batch_inputs_match_the_definitions_over_many_steps(seed):
    """Random arrivals, finishes (freeing rows mid-batch, so the batch condenses),
    forks and recompute preemptions on a small pool; every step's inputs checked."""
    rng = random.Random(seed)
    kv = KVCacheManager(16, BLOCK_SIZE)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=24)
    batch = InputBatch(2, 4, BLOCK_SIZE, "cpu")  # small: the arrays must grow
    arrivals, rows_dropped = 0, 0
    for _ in range(120):
        if rng.random() < 0.4:
            scheduler.add(_group(arrivals, rng, n=rng.choice([1, 1, 2])))
            arrivals += 1
        out = scheduler.schedule()
        rows_dropped += sum(r in batch.req_id_to_index for r in out.finished_req_ids)
        batch.update_states(out)
        assert None not in batch.req_ids  # condensed: rows [0, num_reqs) are live
        assert set(batch.req_ids) >= set(out.num_scheduled_tokens)
        if out.seqs:
            actual, inputs = _actual(batch, out)
            assert actual == _expected(out, kv)
            assert inputs.sampling_req_ids == [
                r for r in (batch.req_ids[i] for i in batch.order(out)[0]) if _samples(out, r)
            ]
        # The update phase, by hand: sample, fork a prompt with n = 2, finish some.
        for s in list(out.seqs):
            if not s.samples or s.seq.is_finished:
                continue
            group, seq = s.group, s.seq
            if group.params.n == 2 and len(group.seqs) == 1:
                scheduler.fork(group, seq).append_token(rng.randrange(100), None)
            seq.append_token(rng.randrange(100), None)
            if rng.random() < 0.1:
                for other in group.unfinished_seqs:
                    other.finish_reason = "length"
                    scheduler.free_seq(group, other)
                if group.status is not SequenceStatus.FINISHED:
                    scheduler.retire(group)
    assert rows_dropped and scheduler.num_preemptions  # both paths were taken


def _samples(out, req_id):
    return next(s.samples for s in out.seqs if s.seq.seq_id == req_id)


def test_rows_are_condensed_by_moving_the_last_into_each_hole():
    batch = InputBatch(8, 8, BLOCK_SIZE, "cpu")
    from minipaged.core.sched.output import NewRequestData

    for i in range(5):
        batch.add_request(NewRequestData(f"s{i}", [i] * (i + 1), [10 + i], 0))
    batch.remove_request("s1")
    batch.remove_request("s3")
    assert batch.condense() == [(4, 1)]
    assert batch.req_ids == ["s0", "s4", "s2"]
    assert batch.req_id_to_index == {"s0": 0, "s4": 1, "s2": 2}
    assert batch.token_ids_cpu[1, :5].tolist() == [4] * 5 and batch.num_tokens[1] == 5
    assert batch.block_table.cpu[1, 0] == 14 and batch.block_table.num_blocks[1] == 1
    np.testing.assert_array_equal(batch.num_tokens[:3], [1, 5, 3])
