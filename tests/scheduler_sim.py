"""A scheduler simulator: drives a :class:`Scheduler` the way an engine does, with a fake model.

Written from the scheduler's and the KV cache manager's contracts (not from
``minipaged.engine.llm_engine``), and torch-free.  Each step:

1. ``schedule()``;
2. the step's block operations run on a *shadow* KV store, in the contract's order
   (swap out, swap in, copy-on-write copies), each batch as one gather-then-scatter; then
   every scheduled token's KV is written to the slot its ``ScheduledSeq.slot_mapping``
   gives (the KV cache manager's, checked against its block table).  A slot holds an
   interned id standing for "the KV of this token after exactly this prefix", so equal
   ids mean equal KV;
3. every sequence that holds blocks reads its computed tokens back through its block
   table (running: GPU store, swapped: CPU store).  A wrong swap mapping, a missing or
   wrong copy, a write into another sequence's block or a wrong prefix-cache hit makes
   some sequence read KV that is not its own;
4. the fake model "samples": every scheduled sequence whose tokens reach its end gets the
   deterministic token :func:`model_token` (a request with ``n`` > 1 first forks into
   ``n`` sequences via ``scheduler.fork``, as parallel sampling does); a sequence with
   ``max_tokens`` output tokens finishes ("length") and is freed via
   ``scheduler.free_seq``; a request whose sequences all finished is retired.

With ``check=True`` every step is also checked against the scheduler's stated rules
(see :meth:`SchedulerSim.check_schedule` and :meth:`SchedulerSim.check_state`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from minipaged.core.memory import KVCacheManager
from minipaged.core.sched.output import SchedulerOutput
from minipaged.core.sched.scheduler import Scheduler
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.trace import Trace

VOCAB = 3  # a tiny alphabet, so that prompts and outputs repeat and prefixes get cache hits


def model_token(request_id: str, index: int, position: int) -> int:
    """The fake model's next token for completion ``index`` of a request at ``position``:
    a fixed function, so a recomputed or swapped request must produce the same text."""
    salt = sum(map(ord, request_id))
    return (salt + 2 * index + position) % VOCAB


def expected_tokens(request_id: str, prompt: list[int], index: int, max_tokens: int) -> list[int]:
    """What completion ``index`` of a request must end up holding (prompt + output)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model_token(request_id, index, len(tokens)))
    return tokens


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Before:
    """What the checks need to remember from just before a ``schedule()``."""

    waiting: list[SequenceGroup]
    running: list[SequenceGroup]
    swapped: list[SequenceGroup]
    computed: dict[str, int]
    tables: dict[str, tuple[list[int], bool]]  # seq_id -> (blocks, on the CPU pool)


class SchedulerSim:
    """A scheduler over a KV cache manager, a shadow KV store and a deterministic model."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        preemption_mode: str = "recompute",
        trace: bool = False,
        check: bool = True,
    ) -> None:
        self.kv = KVCacheManager(num_gpu_blocks, block_size, num_cpu_blocks, enable_prefix_caching)
        self.bs = block_size
        self.trace = Trace(enabled=trace)
        self.scheduler = Scheduler(
            self.kv, max_num_seqs, max_num_batched_tokens, preemption_mode, self.trace
        )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.check = check
        self.groups: dict[str, SequenceGroup] = {}
        self.finished: list[SequenceGroup] = []
        self.outputs: list[SchedulerOutput] = []
        self._arrivals = itertools.count()
        self.step_no = 0
        self.counts: Counter[str] = Counter()
        # The shadow KV store: per pool, slot -> interned content id.
        self.store: dict[str, dict[int, int]] = {"gpu": {}, "cpu": {}}
        self._content: dict[tuple[int, int], int] = {}

    # -- requests ---------------------------------------------------------------------
    def add(
        self, request_id: str, prompt: list[int], n: int = 1, max_tokens: int = 4
    ) -> SequenceGroup:
        group = SequenceGroup(
            request_id,
            None,
            list(prompt),
            SamplingParams(n=n, max_tokens=max_tokens),
            next(self._arrivals),
        )
        group.seqs.append(Sequence(f"{request_id}.0", list(prompt), len(prompt)))
        self.groups[request_id] = group
        self.scheduler.add(group)
        return group

    def abort(self, request_id: str) -> SequenceGroup | None:
        group = self.scheduler.abort(request_id)
        if group is not None:
            del self.groups[request_id]
        if self.check:
            self.check_state()
        return group

    # -- the step ---------------------------------------------------------------------
    def step(self) -> SchedulerOutput:
        self.trace.step = self.step_no
        before = self._snapshot()
        out = self.scheduler.schedule()
        self.outputs.append(out)
        self._count(before, out)
        if self.check:
            self.check_schedule(before, out)
        self.execute(out)
        self.read_back()
        self.update(out)
        self.step_no += 1
        if self.check:
            self.check_state()
        return out

    def run(self, arrivals: dict[int, list[tuple]] | None = None, max_steps: int = 1000) -> int:
        """Step until every request (``arrivals``: step -> ``(id, prompt, n, max_tokens)``
        added at the start of that step) has finished; fail after ``max_steps``."""
        arrivals = dict(arrivals or {})
        while arrivals or self.scheduler.has_unfinished():
            if self.step_no >= max_steps:
                q = self.scheduler
                last = [(len(o.seqs), len(o.preempted), len(o.swap_in)) for o in self.outputs[-4:]]
                raise AssertionError(
                    f"no completion after {max_steps} steps (livelock?): waiting="
                    f"{[g.request_id for g in q.waiting]} running="
                    f"{[g.request_id for g in q.running]} swapped="
                    f"{[g.request_id for g in q.swapped]}, free GPU blocks "
                    f"{self.kv.gpu.num_free_blocks}/{self.kv.gpu.num_blocks}, last outputs: "
                    f"{last} (seqs, preempted, swap_in)"
                )
            for spec in arrivals.pop(self.step_no, []):
                self.add(*spec)
            self.step()
        return self.step_no

    def _count(self, before: Before, out: SchedulerOutput) -> None:
        """What the workload exercised so far, for coverage reports."""
        c = self.counts
        c["preempt"] += len(out.preempted)
        c["swap_out"] += bool(out.swap_out)
        c["swap_in"] += bool(out.swap_in)
        c["cow"] += len(out.copies)
        for s in out.seqs:
            c["chunk"] += s.start + s.num_new_tokens < len(s.seq.token_ids)
            c["prefix_hit"] += s.seq.seq_id not in before.tables and s.start > 0

    def execute(self, out: SchedulerOutput) -> None:
        """The cache engine and the forward pass, on the shadow store."""
        gpu, cpu = self.store["gpu"], self.store["cpu"]
        self._copy(out.swap_out, gpu, cpu)
        self._copy(out.swap_in, cpu, gpu)
        self._copy(out.copies, gpu, gpu)
        for s in out.seqs:
            ids = self._content_ids(s.seq.token_ids[: s.start + s.num_new_tokens])
            for p, slot in zip(range(s.start, s.start + s.num_new_tokens), s.slot_mapping):
                gpu[slot] = ids[p]

    def _copy(self, pairs, src, dst) -> None:
        """Block ``a`` of ``src`` -> block ``b`` of ``dst`` for all pairs: gather, then scatter."""
        bs = self.bs
        gathered = [[src.get(a * bs + o) for o in range(bs)] for a, _ in pairs]
        for (_, b), values in zip(pairs, gathered):
            for o, v in enumerate(values):
                dst[b * bs + o] = v

    def _content_ids(self, tokens: list[int]) -> list[int]:
        ids, prev = [], -1
        for t in tokens:
            key = (prev, t)
            if key not in self._content:
                self._content[key] = len(self._content)
            prev = self._content[key]
            ids.append(prev)
        return ids

    def read_back(self) -> None:
        """Every sequence holding blocks finds its own computed tokens' KV in them."""
        q = self.scheduler
        for queue, pool in ((q.running, "gpu"), (q.swapped, "cpu")):
            for group in queue:
                for seq in group.unfinished_seqs:
                    blocks = self.kv.block_table(seq.seq_id)
                    n = seq.num_computed_tokens
                    ids = self._content_ids(seq.token_ids[:n])
                    got = [
                        self.store[pool].get(blocks[p // self.bs] * self.bs + p % self.bs)
                        for p in range(n)
                    ]
                    assert got == ids, (
                        f"step {self.step_no}: {seq.seq_id} reads wrong KV "
                        f"on the {pool} pool at positions "
                        f"{[p for p in range(n) if got[p] != ids[p]]}"
                    )

    def update(self, out: SchedulerOutput) -> None:
        """Sample, fork, finish, free and retire, as an engine does after the forward pass."""
        sampled_groups = []
        for s in out.seqs:
            if not s.samples:
                continue
            group = s.group
            seqs = [s.seq]
            if group.params.n > 1 and len(group.seqs) == 1:
                seqs += [self.scheduler.fork(group, s.seq) for _ in range(group.params.n - 1)]
            for seq in seqs:
                seq.append_token(model_token(group.request_id, seq.index, len(seq.token_ids)), 0.0)
                if seq.num_output_tokens >= group.params.max_tokens:
                    seq.finish_reason = "length"
                    self.scheduler.free_seq(group, seq)
            sampled_groups.append(group)
        for group in dict.fromkeys(sampled_groups):
            if group.is_finished:
                self.scheduler.retire(group)
                group.status = SequenceStatus.FINISHED
                self.finished.append(group)
                del self.groups[group.request_id]

    # -- checks -----------------------------------------------------------------------
    def _snapshot(self) -> Before:
        q, kv = self.scheduler, self.kv
        computed = {
            s.seq_id: s.num_computed_tokens
            for g in q.waiting + q.running + q.swapped
            for s in g.seqs
        }
        tables = {sid: (kv.block_table(sid), kv.is_swapped(sid)) for sid in kv.tables}
        return Before(list(q.waiting), list(q.running), list(q.swapped), computed, tables)

    def check_schedule(self, before: Before, out: SchedulerOutput) -> None:
        """One ``schedule()`` against the rules of the scheduler's docstring."""
        q, kv, bs = self.scheduler, self.kv, self.bs
        step = f"step {self.step_no}"
        # Budgets.
        assert len(out.seqs) <= self.max_num_seqs, f"{step}: {len(out.seqs)} seqs scheduled"
        assert out.num_batched_tokens <= self.max_num_batched_tokens, (
            f"{step}: {out.num_batched_tokens} tokens scheduled"
        )
        assert len({id(s.seq) for s in out.seqs}) == len(out.seqs), f"{step}: a seq twice"
        # Preemption takes the most recently arrived running requests, newest first.
        by_age = sorted(before.running, key=lambda g: g.arrival, reverse=True)
        assert out.preempted == by_age[: len(out.preempted)], f"{step}: wrong victims"
        preempted = set(map(id, out.preempted))
        running_before = set(map(id, before.running))
        waiting_before = set(map(id, before.waiting))
        swapped_before = set(map(id, before.swapped))
        admitted = [g for g in q.running if id(g) in waiting_before]
        resumed = [g for g in q.running if id(g) in swapped_before]
        # FCFS admission, no overtaking; nothing admitted or resumed in a step that
        # preempted; swapped requests come back before any waiting one is admitted.
        assert admitted == before.waiting[: len(admitted)], f"{step}: admission overtook"
        assert resumed == before.swapped[: len(resumed)], f"{step}: resume overtook"
        if out.preempted:
            assert not admitted and not resumed and not out.swap_in, (
                f"{step}: admitted or resumed in a step that preempted"
            )
        if admitted:
            assert not q.swapped, f"{step}: admitted while a request is swapped out"
        # What runs: running or admitted requests, never a swapped or preempted one.
        for s in out.seqs:
            g, seq, sid = s.group, s.seq, s.seq.seq_id
            assert id(g) in running_before or id(g) in waiting_before, f"{step}: {sid} runs"
            assert id(g) not in preempted and g in q.running and not kv.is_swapped(sid)
            assert s.num_new_tokens >= 1
            if id(g) in running_before:  # the next chunk or decode, right where it stopped
                assert s.start == before.computed[sid], f"{step}: {sid} skips or repeats"
            else:  # a first chunk, after a (block-aligned) cached prefix
                assert sid not in before.tables and before.computed[sid] == 0
                assert s.start % bs == 0 and s.start < len(seq.token_ids)
                if not kv.prefix_caching:
                    assert s.start == 0
            assert s.start + s.num_new_tokens <= len(seq.token_ids)
            assert seq.num_computed_tokens == s.start + s.num_new_tokens
            assert kv.num_tokens(sid) == seq.num_computed_tokens
            assert s.block_table == kv.block_table(sid)
            positions = range(s.start, s.start + s.num_new_tokens)  # the slots, by hand (§4.2)
            assert s.slot_mapping == [s.block_table[p // bs] * bs + p % bs for p in positions]
        # Block operations: swaps move exactly the groups' distinct blocks.
        out_groups = [g for g in out.preempted if q.swapped and g in q.swapped]
        self._check_swap(out.swap_out, out_groups, before, on_cpu=True, step=step)
        self._check_swap(out.swap_in, resumed, before, on_cpu=False, step=step)
        # Copy-on-write: a scheduled sequence's last shared block is replaced by a copy.
        for src, dst in out.copies:
            owners = [
                s
                for s in out.seqs
                if dst in s.block_table
                and s.seq.seq_id in before.tables
                and dst not in before.tables[s.seq.seq_id][0]
            ]
            assert len(owners) == 1, f"{step}: copy {src}->{dst} has owners {owners}"
            old = before.tables[owners[0].seq.seq_id][0]
            i = owners[0].block_table.index(dst)
            assert src != dst and i < len(old) and old[i] == src, f"{step}: copy {src}->{dst}"
            assert kv.gpu.ref_count(dst) >= 1 and kv.gpu.ref_count(src) >= 1
        for g in out.preempted:
            if g in q.waiting:  # recompute: no blocks, start over
                for seq in g.unfinished_seqs:
                    assert seq.seq_id not in kv.tables and seq.num_computed_tokens == 0
            else:
                assert g in q.swapped, f"{step}: preempted {g.request_id} is nowhere"

    def _check_swap(self, pairs, groups, before: Before, on_cpu: bool, step: str) -> None:
        """``pairs`` are, group after group (in the order they moved), each group's
        distinct blocks, once each (a block its sequences share moves once and stays
        shared), to distinct new blocks; the tables now point at the new blocks."""
        pairs = list(pairs)
        for g in groups:
            old = {s.seq_id: before.tables[s.seq_id] for s in g.unfinished_seqs}
            distinct = set(b for blocks, _ in old.values() for b in blocks)
            mine, pairs = pairs[: len(distinct)], pairs[len(distinct) :]
            assert sorted(a for a, _ in mine) == sorted(distinct), f"{step}: swap sources"
            assert len({b for _, b in mine}) == len(mine), f"{step}: swap targets repeat"
            mapping = dict(mine)
            for sid, (blocks, was_on_cpu) in old.items():
                assert was_on_cpu != on_cpu
                assert self.kv.block_table(sid) == [mapping[b] for b in blocks]
                assert self.kv.is_swapped(sid) == on_cpu
        assert pairs == [], f"{step}: swap pairs of no swapped request"

    def check_state(self) -> None:
        """Between steps: queues in arrival order and disjoint; where each sequence's KV is."""
        q, kv = self.scheduler, self.kv
        held = set()
        for queue, status in (
            (q.waiting, SequenceStatus.WAITING),
            (q.running, SequenceStatus.RUNNING),
            (q.swapped, SequenceStatus.SWAPPED),
        ):
            arrivals = [g.arrival for g in queue]
            assert arrivals == sorted(arrivals), f"{status} queue out of arrival order"
            for g in queue:
                assert g.status == status and not g.is_finished
                for seq in g.seqs:
                    if seq.is_finished:
                        assert seq.seq_id not in kv.tables
                    elif status is SequenceStatus.WAITING:
                        assert seq.seq_id not in kv.tables and seq.num_computed_tokens == 0
                    else:
                        assert kv.is_swapped(seq.seq_id) == (status is SequenceStatus.SWAPPED)
                        assert kv.num_tokens(seq.seq_id) == seq.num_computed_tokens
                        held.add(seq.seq_id)
        groups = q.waiting + q.running + q.swapped
        assert len(set(map(id, groups))) == len(groups), "a request in two queues"
        assert set(kv.tables) == held, "block tables of sequences no queue runs"
        running = sum(len(g.unfinished_seqs) for g in q.running)
        assert running <= self.max_num_seqs, (
            f"{running} running sequences > max_num_seqs={self.max_num_seqs}"
        )
