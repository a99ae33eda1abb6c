"""The scheduler (paper §4.5): continuous batching, chunked prefill, preemption and swapping.

Oracles, all independent of ``minipaged.core.sched.scheduler``'s code:

* scenarios worked out by hand from the rules in the scheduler's docstring (block counts
  are ``ceil(tokens / block_size)``, computed here), with the expected step of every
  admission, chunk and preemption written out in the test;
* ``ReferenceScheduler`` below: the docstring's rules re-implemented over plain integers
  (tokens computed per request, blocks = ceil(computed / block_size)) for single-sequence
  requests without prefix caching; a hypothesis test runs random workloads through both
  and compares every step's decisions;
* ``scheduler_sim.SchedulerSim``: drives the scheduler as an engine does, with a fake
  deterministic model and a shadow KV store that executes every block operation and
  writes every scheduled token, then checks each sequence reads its own KV back; every
  step is checked against the stated rules (budgets, FCFS, victims, block operations).

Standard library only, like the scheduler itself.
"""

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from minipaged.core.memory import KVCacheManager
from minipaged.core.sched.scheduler import Scheduler
from minipaged.sequence import SequenceStatus
from scheduler_sim import SchedulerSim, ceil_div, expected_tokens


def rids(groups):
    return [g.request_id for g in groups]


def scheduled(out):
    """A step's batch as ``(seq_id, start, num_new_tokens)``."""
    return [(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.seqs]


def check_finished(sim, specs):
    """Every request finished with exactly the model's tokens, and every block is back."""
    done = {g.request_id: g for g in sim.finished}
    assert set(done) == {spec[0] for spec in specs}
    for rid, prompt, n, max_tokens in specs:
        seqs = sorted(done[rid].seqs, key=lambda s: s.index)
        assert [s.token_ids for s in seqs] == [
            expected_tokens(rid, prompt, i, max_tokens) for i in range(n)
        ], rid
        assert all(s.finish_reason == "length" for s in seqs)
    assert sim.kv.tables == {}
    assert sim.kv.gpu.num_free_blocks == sim.kv.gpu.num_blocks  # free, or evictable
    assert sim.kv.cpu.num_free_blocks == sim.kv.cpu.num_blocks


# -- layering and arguments ----------------------------------------------------------------


def test_scheduler_imports_no_torch():
    """The scheduler is standard library only (the layers of docs/architecture.md):
    importing it, the sequences and the trace loads no third-party module, torch least
    of all."""
    code = (
        "import sys, minipaged.core.sched.scheduler, minipaged.sequence, minipaged.trace; "
        "print('\\n'.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    base = "import sys; print('\\n'.join(sorted({m.split('.')[0] for m in sys.modules})))"

    def run(c):
        return set(
            subprocess.run(
                [sys.executable, "-c", c], capture_output=True, text=True, check=True
            ).stdout.split()
        )

    third_party = run(code) - run(base) - set(sys.stdlib_module_names) - {"minipaged"}
    assert third_party == set(), f"the scheduler pulled in {sorted(third_party)}"


def test_unknown_preemption_mode_is_refused():
    """A typo in the preemption mode fails loudly, naming the argument and the value."""
    with pytest.raises(ValueError, match="preemption_mode.*'swapp'"):
        Scheduler(KVCacheManager(4, 4), 4, 16, preemption_mode="swapp")


# -- FCFS admission --------------------------------------------------------------------------


def test_requests_first_run_in_arrival_order():
    """Six requests with 3- and 4-token prompts and a budget of 4 tokens a step, so their
    admissions spread over several steps: each request's first chunk runs no earlier
    than any older request's (first come first served), and while prompts are waiting
    every step uses the whole budget (the pool and the seats are ample)."""
    sim = SchedulerSim(64, 2, max_num_seqs=8, max_num_batched_tokens=4)
    specs = [(f"r{i}", [i % 3] * (3 + i % 2), 1, 2) for i in range(6)]
    for spec in specs:
        sim.add(*spec)
    first = {}
    while sim.scheduler.has_unfinished():
        out = sim.step()
        for s in out.seqs:
            first.setdefault(s.group.request_id, sim.step_no - 1)
        if sim.scheduler.waiting:
            assert out.num_batched_tokens == 4
    order = [spec[0] for spec in specs]
    assert [first[r] for r in order] == sorted(first[r] for r in order)
    check_finished(sim, specs)


def test_admission_stops_at_the_first_request_whose_blocks_are_missing():
    """No overtaking: B (waiting, first chunk 6 blocks) does not fit the 4 free blocks,
    so C (1 block, would fit) waits behind it; when A finishes, B then C are admitted."""
    sim = SchedulerSim(8, 2, max_num_seqs=4, max_num_batched_tokens=32)
    sim.add("A", [0] * 8, max_tokens=2)  # 4 blocks, then 5 with its output
    sim.add("B", [1] * 11, max_tokens=1)  # ceil(11 / 2) = 6 blocks
    sim.add("C", [2], max_tokens=1)  # 1 block
    out = sim.step()
    assert scheduled(out) == [("A.0", 0, 8)]
    assert rids(sim.scheduler.waiting) == ["B", "C"] and sim.kv.gpu.num_free_blocks == 4
    out = sim.step()  # A decodes (a 5th block); B still does not fit, so neither does C
    assert scheduled(out) == [("A.0", 8, 1)]
    assert rids(sim.scheduler.waiting) == ["B", "C"]
    assert sim.finished[0].request_id == "A"
    out = sim.step()  # all 8 blocks free: B (6) and then C (1)
    assert scheduled(out) == [("B.0", 0, 11), ("C.0", 0, 1)]


def test_admission_stops_at_the_first_request_without_seats():
    """No overtaking on seats either: with max_num_seqs=3 and A running, B (n=3 needs 3
    seats) waits, and so does C (n=1) although one seat is free."""
    sim = SchedulerSim(64, 4, max_num_seqs=3, max_num_batched_tokens=64)
    sim.add("A", [0, 1], max_tokens=3)
    sim.step()
    sim.add("B", [1, 2], n=3, max_tokens=1)
    sim.add("C", [2], max_tokens=1)
    out = sim.step()
    assert scheduled(out) == [("A.0", 2, 1)]
    assert rids(sim.scheduler.waiting) == ["B", "C"]
    out = sim.step()  # A's last token: it still holds its seat during this schedule
    assert scheduled(out) == [("A.0", 3, 1)]
    out = sim.step()
    assert scheduled(out) == [("B.0", 0, 2)]  # B takes all 3 seats (forks after its prompt)
    assert len(sim.finished[-1].seqs) == 3
    out = sim.step()
    assert scheduled(out) == [("C.0", 0, 1)]


def test_seats_of_a_request_that_has_not_forked_yet_are_held():
    """A request with n=4 whose prompt is chunked runs as one sequence until the prompt
    is done, then forks into 4.  Its 4 seats are held from admission, so B (n=1) is not
    let in meanwhile and no step ever runs more than max_num_seqs=4 sequences."""
    sim = SchedulerSim(64, 4, max_num_seqs=4, max_num_batched_tokens=4)
    specs = [("A", [0] * 10, 4, 2), ("B", [1] * 2, 1, 3)]
    for spec in specs:
        sim.add(*spec)
    while sim.scheduler.has_unfinished():
        out = sim.step()  # SchedulerSim checks <= 4 scheduled and <= 4 running seqs
        if "A" in sim.groups and len(sim.groups["A"].seqs) == 1:
            assert "B.0" not in [s.seq.seq_id for s in out.seqs]
    check_finished(sim, specs)


# -- budgets and chunked prefill --------------------------------------------------------------


def test_chunked_prefill_shares_steps_with_decodes():
    """Budget 8: A (3-token prompt) and B (30-token prompt) arrive together.  Step 0 runs
    A's prompt and B's first chunk of 8 - 3 = 5; from then on A decodes one token a step
    first (running requests, oldest first) and B's chunks take the other 7, until its
    last chunk of 30 - 26 = 4.  The chunks cover the prompt once, in order, and only the
    last one samples."""
    sim = SchedulerSim(64, 4, max_num_seqs=4, max_num_batched_tokens=8)
    specs = [("A", [0, 1, 2], 1, 10), ("B", [2, 1] * 15, 1, 2)]
    for spec in specs:
        sim.add(*spec)
    outs, b_len = [], []
    for _ in range(5):
        outs.append(sim.step())
        b_len.append(len(sim.groups["B"].seqs[0].token_ids))
    assert scheduled(outs[0]) == [("A.0", 0, 3), ("B.0", 0, 5)]
    for step, start, n in ((1, 5, 7), (2, 12, 7), (3, 19, 7), (4, 26, 4)):
        assert scheduled(outs[step]) == [("A.0", 2 + step, 1), ("B.0", start, n)]
    assert [o.num_batched_tokens for o in outs] == [8, 8, 8, 8, 5]
    b_chunks = [s for o in outs for s in o.seqs if s.group.request_id == "B"]
    assert b_len == [30, 30, 30, 30, 31]  # a token is sampled after the last chunk only
    # Chunks tile [0, 30): each starts where the last one ended.
    assert [s.start for s in b_chunks] == [0, 5, 12, 19, 26]
    assert sum(s.num_new_tokens for s in b_chunks) == 30
    sim.run()
    check_finished(sim, specs)


def test_admission_needs_the_blocks_of_the_first_chunk_only():
    """A request is admitted when its *first chunk*'s blocks can be had, though its
    whole prompt needs more: in a 4-block pool A holds 2 after its decode, and B's first
    chunk is 8 - 1 = 7 tokens = ceil(7 / 4) = 2 blocks, so B is admitted although its
    20-token prompt needs 5 blocks."""
    sim = SchedulerSim(4, 4, max_num_seqs=4, max_num_batched_tokens=8)
    sim.add("A", [0, 0, 0, 0], max_tokens=30)  # 1 block; its first decode takes a 2nd
    sim.step()
    sim.add("B", [1] * 20)
    out = sim.step()
    assert scheduled(out) == [("A.0", 4, 1), ("B.0", 0, 7)]
    assert len(sim.kv.block_table("B.0")) == ceil_div(7, 4)


def test_admission_waits_when_the_first_chunk_does_not_fit():
    """The first chunk's size is set by the token budget, not shrunk to the free blocks:
    with 15 tokens of budget left a 20-token prompt's first chunk is 15 tokens =
    ceil(15 / 4) = 4 blocks, and with 1 free block it is not admitted although a 4-token
    chunk would fit."""
    sim = SchedulerSim(3, 4, max_num_seqs=4, max_num_batched_tokens=16)
    sim.add("A", [0] * 4, max_tokens=2)  # 1 block, then 2
    sim.step()
    sim.add("B", [1] * 20, max_tokens=1)
    out = sim.step()  # budget left 15 -> chunk 15 = 4 blocks > 1 free (A took its 2nd)
    assert scheduled(out) == [("A.0", 4, 1)]
    assert rids(sim.scheduler.waiting) == ["B"]
    out = sim.step()  # A gone: 16-token chunk = 4 blocks > 3: B can never start here
    assert scheduled(out) == []


# -- preemption ------------------------------------------------------------------------------


def preemption_workload(mode, num_cpu_blocks=8):
    """bs=2, 6 GPU blocks.  A (2-token prompt, max_tokens 5) and B (1-token prompt, n=2,
    max_tokens 4).

    By hand: step 0 runs A's prompt (1 block) and B's (1 block); B forks.  Step 1: A
    needs a block (pos 2), B.0 copies the shared partial block (CoW), B.1 writes in
    place: 4 used.  Step 2: A's pos 3 fits; B.0 and B.1 each need a block: 6 used, 0
    free.  Step 3: A needs a block (pos 4) and none is free, so the newest request, B,
    is preempted whole (both sequences, 4 distinct blocks) and A runs.
    """
    sim = SchedulerSim(
        6,
        2,
        num_cpu_blocks,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        preemption_mode=mode,
        trace=True,
    )
    specs = [("A", [0, 0], 1, 5), ("B", [1], 2, 4)]
    for spec in specs:
        sim.add(*spec)
    outs = [sim.step() for _ in range(3)]
    assert not any(o.preempted for o in outs)
    assert outs[1].copies and len(outs[1].copies) == 1
    assert sim.kv.gpu.num_free_blocks == 0
    assert sim.groups["A"].seqs[0].num_computed_tokens == 4  # its next token needs a block
    return sim, specs


def test_recompute_preempts_the_newest_request_whole():
    """Recompute: B (newest) loses all its blocks, both sequences restart at 0 with their
    tokens kept, and B goes back to waiting *ahead of* C, which arrived later.  In the
    preempting step nothing is admitted (C would fit); the next step B still does not
    fit (2 x 2 blocks for 4 tokens each > 3 free) and C may not overtake it."""
    sim, specs = preemption_workload("recompute")
    b = sim.groups["B"]
    tables_before = {s.seq_id: sim.kv.block_table(s.seq_id) for s in b.seqs}
    assert len({x for t in tables_before.values() for x in t}) == 4
    sim.add("C", [2], 1, 1)
    specs.append(("C", [2], 1, 1))
    out = sim.step()  # step 3
    assert rids(out.preempted) == ["B"]
    assert scheduled(out) == [("A.0", 4, 1)]
    assert rids(sim.scheduler.waiting) == ["B", "C"] and b.status is SequenceStatus.WAITING
    for seq in b.seqs:
        assert seq.seq_id not in sim.kv.tables and seq.num_computed_tokens == 0
        assert len(seq.token_ids) == 4 and seq.finish_reason is None
    assert sim.kv.gpu.num_free_blocks == 6 - 3  # A's 3 blocks only
    assert sim.scheduler.num_preemptions == 1
    out = sim.step()  # step 4: A's last token; B needs 4 blocks, 3 free; C waits behind
    assert scheduled(out) == [("A.0", 5, 1)]
    out = sim.step()  # step 5: both of B's sequences recompute all 4 tokens
    assert scheduled(out) == [("B.0", 0, 4), ("B.1", 0, 4)]
    sim.run()
    check_finished(sim, specs)


def test_swap_preempts_the_newest_request_whole_and_resumes_it_first():
    """Swap: B's 4 distinct GPU blocks move to the CPU pool (swap_out pairs, one per
    block); B keeps its computed tokens.  While B is swapped out C is not admitted even
    though it fits; when B's blocks fit again it is swapped in (and runs from the next
    step), and only then is C admitted, in that same step."""
    sim, specs = preemption_workload("swap")
    b = sim.groups["B"]
    gpu_blocks = {s.seq_id: sim.kv.block_table(s.seq_id) for s in b.seqs}
    sim.add("C", [2], 1, 1)
    specs.append(("C", [2], 1, 1))
    out = sim.step()  # step 3
    assert rids(out.preempted) == ["B"] and rids(sim.scheduler.swapped) == ["B"]
    assert sorted(g for g, _ in out.swap_out) == sorted({x for t in gpu_blocks.values() for x in t})
    mapping = dict(out.swap_out)
    for seq in b.seqs:
        assert sim.kv.is_swapped(seq.seq_id)
        assert sim.kv.block_table(seq.seq_id) == [mapping[x] for x in gpu_blocks[seq.seq_id]]
        assert seq.num_computed_tokens == 3
    assert sim.kv.cpu.num_free_blocks == 8 - 4
    assert scheduled(out) == [("A.0", 4, 1)] and out.swap_in == []
    out = sim.step()  # step 4: 3 free < 4 to swap B in; C (1 block) must wait too
    assert scheduled(out) == [("A.0", 5, 1)] and out.swap_in == []
    assert rids(sim.scheduler.waiting) == ["C"]
    out = sim.step()  # step 5: B swapped in, then C admitted
    assert sorted(c for c, _ in out.swap_in) == sorted(mapping.values())
    assert scheduled(out) == [("C.0", 0, 1)]
    assert rids(sim.scheduler.running) == ["B"] and sim.finished[-1].request_id == "C"
    out = sim.step()  # step 6: B decodes where it stopped
    assert scheduled(out) == [("B.0", 3, 1), ("B.1", 3, 1)]
    sim.run()
    check_finished(sim, specs)


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_too_small():
    """B needs 4 CPU blocks; with 3 it is recomputed instead: no swap_out pairs, the CPU
    pool untouched, B waiting with nothing computed, and the trace says so."""
    sim, specs = preemption_workload("swap", num_cpu_blocks=3)
    out = sim.step()
    assert rids(out.preempted) == ["B"] and out.swap_out == []
    assert rids(sim.scheduler.waiting) == ["B"] and sim.scheduler.swapped == []
    assert sim.kv.cpu.num_free_blocks == 3
    assert all(s.num_computed_tokens == 0 for s in sim.groups["B"].seqs)
    preempt = [e for e in sim.trace.of("B") if e.kind == "preempt"]
    assert [e.detail["mode"] for e in preempt] == ["recompute"]
    sim.run()
    check_finished(sim, specs)


def test_a_request_that_needs_blocks_and_is_the_newest_preempts_itself():
    """bs=1, 6 blocks: A (prompt 3) and B (prompt 1, n=2).  Step 1: A takes 1 block
    (1 left); B's two sequences each need a fresh block (2 > 1) and B is the newest, so
    B itself is preempted while A runs."""
    sim = SchedulerSim(6, 1, max_num_seqs=4, max_num_batched_tokens=8)
    specs = [("A", [0, 0, 0], 1, 3), ("B", [1], 2, 2)]
    for spec in specs:
        sim.add(*spec)
    sim.step()
    assert sim.kv.gpu.num_free_blocks == 2
    out = sim.step()
    assert rids(out.preempted) == ["B"] and scheduled(out) == [("A.0", 3, 1)]
    sim.run()
    check_finished(sim, specs)


def test_preemption_stops_as_soon_as_the_older_request_fits():
    """bs=2, 5 blocks, all used after step 0: A (n=2, prompt 2: one full block), B (prompt
    3: 2 blocks), C (1), D (1).  Step 1: A's two sequences each need a new block, 0 are
    free.  Preempting D frees 1 (not enough), C another (enough): victims are D then C,
    newest first, and B, whose next token fits its partial block, is left running."""
    sim = SchedulerSim(5, 2, max_num_seqs=6, max_num_batched_tokens=16)
    specs = [("A", [0, 0], 2, 2), ("B", [1, 1, 1], 1, 3), ("C", [2], 1, 2), ("D", [1, 2], 1, 2)]
    for spec in specs:
        sim.add(*spec)
    sim.step()
    assert sim.kv.gpu.num_free_blocks == 0
    assert [len(sim.kv.block_table(s)) for s in ("A.0", "B.0", "C.0", "D.0")] == [1, 2, 1, 1]
    out = sim.step()
    assert rids(out.preempted) == ["D", "C"]
    assert scheduled(out) == [("A.0", 2, 1), ("A.1", 2, 1), ("B.0", 3, 1)]
    assert rids(sim.scheduler.waiting) == ["C", "D"]
    sim.run()
    check_finished(sim, specs)


# -- block operations --------------------------------------------------------------------------


def test_copy_on_write_after_a_fork():
    """n=3, bs=4, a 5-token prompt: after the fork all three share a partial last block.
    The next step has exactly 2 copies (the last sharer writes in place), each from that
    block to the copying sequence's new last block; the shadow store then checks every
    sequence reads its own KV."""
    sim = SchedulerSim(16, 4, max_num_seqs=4, max_num_batched_tokens=16)
    sim.add("A", [0, 1, 2, 0, 1], n=3, max_tokens=3)
    sim.step()
    shared = sim.kv.block_table("A.0")
    assert [sim.kv.block_table(f"A.{i}") for i in range(3)] == [shared] * 3
    out = sim.step()
    assert len(out.copies) == 2
    for (src, dst), sid in zip(out.copies, ("A.0", "A.1")):
        assert src == shared[1]
        assert sim.kv.block_table(sid) == [shared[0], dst]
    assert sim.kv.block_table("A.2") == shared
    assert len({dst for _, dst in out.copies} | {shared[1]}) == 3


def test_swapping_a_forked_request_moves_each_shared_block_once():
    """bs=2, 7 blocks, swap: B (prompt 3, n=2) shares its full first block between both
    sequences when A's growth preempts it.  swap_out has one pair per distinct block
    (5 blocks for 6 table entries), the CPU tables still share that block, and swap_in
    brings it back as one shared GPU block."""
    sim = SchedulerSim(7, 2, 8, max_num_seqs=4, max_num_batched_tokens=8, preemption_mode="swap")
    specs = [("A", [0, 0], 1, 6), ("B", [1, 1, 1], 2, 4)]
    for spec in specs:
        sim.add(*spec)
    outs = [sim.step() for _ in range(4)]
    assert [rids(o.preempted) for o in outs] == [[], [], [], ["B"]]
    out = outs[-1]
    cpu = {s: sim.kv.block_table(s) for s in ("B.0", "B.1")}
    assert len(out.swap_out) == 5 and sum(map(len, cpu.values())) == 6
    assert cpu["B.0"][0] == cpu["B.1"][0] and sim.kv.cpu.ref_count(cpu["B.0"][0]) == 2
    while not out.swap_in:
        out = sim.step()
    assert len(out.swap_in) == 5
    gpu = {s: sim.kv.block_table(s) for s in ("B.0", "B.1")}
    assert gpu["B.0"][0] == gpu["B.1"][0] and sim.kv.gpu.ref_count(gpu["B.0"][0]) == 2
    assert dict(out.swap_in)[cpu["B.0"][0]] == gpu["B.0"][0]
    sim.run()
    check_finished(sim, specs)


# -- abort -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["waiting", "running", "swapped", "recomputing"])
def test_abort_frees_the_request_wherever_it_is(where):
    """Abort B while it waits (never admitted), runs (forked), is swapped out, or waits
    again after a recompute preemption: it leaves every queue, its sequences end with
    "abort", every block it held is free on both pools (A's alone are held), the trace
    ends with "abort" after one "free" per sequence that held blocks, and A finishes."""
    if where == "waiting":
        sim = SchedulerSim(6, 2, 8, max_num_seqs=4, max_num_batched_tokens=8, trace=True)
        specs = [("A", [0, 0], 1, 5)]
        sim.add(*specs[0])
        sim.step()
        sim.add("B", [1] * 30, n=2)
    else:
        sim, specs = preemption_workload("swap" if where == "swapped" else "recompute")
        if where != "running":
            sim.step()  # B is preempted
    queue = {
        "waiting": sim.scheduler.waiting,
        "running": sim.scheduler.running,
        "swapped": sim.scheduler.swapped,
        "recomputing": sim.scheduler.waiting,
    }[where]
    b = sim.groups["B"]
    assert b in queue
    holding = [s.seq_id for s in b.seqs if s.seq_id in sim.kv.tables]
    assert len(holding) == (2 if where in ("running", "swapped") else 0)
    events_before = len(sim.trace.of("B"))
    assert sim.abort("B") is b
    assert sim.abort("B") is None and sim.scheduler.abort("nope") is None
    assert b not in sim.scheduler.waiting + sim.scheduler.running + sim.scheduler.swapped
    assert all(s.finish_reason == "abort" and s.seq_id not in sim.kv.tables for s in b.seqs)
    a_blocks = len(set(sim.kv.block_table("A.0")))
    assert sim.kv.gpu.num_free_blocks == sim.kv.gpu.num_blocks - a_blocks
    assert sim.kv.cpu.num_free_blocks == sim.kv.cpu.num_blocks
    new = [(e.kind, e.seq_id) for e in sim.trace.of("B")[events_before:]]
    assert new == [("free", sid) for sid in holding] + [("abort", None)]
    sim.run()
    check_finished(sim, [s for s in specs if s[0] != "B"])


# -- the trace ---------------------------------------------------------------------------------


def test_trace_of_a_swapped_request():
    """B's events in the swap scenario, in order and at the steps worked out by hand:
    arrives, gets blocks and runs (step 0), forks, copies on write and runs (steps 1-2),
    is preempted and swapped out (step 3), swapped in (step 5), runs (step 6) and both
    sequences are freed as they finish; every step a running sequence is appended to."""
    sim, specs = preemption_workload("swap")
    sim.run()
    events = [(e.step, e.kind, e.seq_id) for e in sim.trace.of("B") if e.kind != "append"]
    appends = [(e.step, e.seq_id) for e in sim.trace.of("B") if e.kind == "append"]
    assert appends == [(1, "B.0"), (1, "B.1"), (2, "B.0"), (2, "B.1"), (6, "B.0"), (6, "B.1")]
    assert events == [
        (0, "arrive", None),
        (0, "allocate", "B.0"),
        (0, "schedule", "B.0"),
        (0, "fork", "B.1"),
        (1, "cow", "B.0"),
        (1, "schedule", "B.0"),
        (1, "schedule", "B.1"),
        (2, "schedule", "B.0"),
        (2, "schedule", "B.1"),
        (3, "preempt", None),
        (3, "swap_out", None),
        (5, "swap_in", None),
        (6, "schedule", "B.0"),
        (6, "schedule", "B.1"),
        (6, "free", "B.0"),
        (6, "free", "B.1"),
        (6, "finish", None),
    ]
    by_kind = {e.kind: e for e in sim.trace.of("B")}
    assert by_kind["preempt"].detail["mode"] == "swap"
    assert set(by_kind["swap_out"].detail["blocks"]) == {"B.0", "B.1"}
    assert by_kind["allocate"].detail["num_tokens"] == 1
    check_finished(sim, specs)


def test_trace_of_a_recomputed_request():
    """After a recompute preemption the trace shows the blocks freed (one "free" per
    sequence) right after "preempt", and a fresh "allocate" per sequence when B is
    admitted again (step 5)."""
    sim, _ = preemption_workload("recompute")
    sim.run()
    events = [(e.step, e.kind, e.seq_id) for e in sim.trace.of("B") if e.step >= 3]
    assert events[:3] == [(3, "preempt", None), (3, "free", "B.0"), (3, "free", "B.1")]
    assert events[3:5] == [(5, "allocate", "B.0"), (5, "allocate", "B.1")]
    assert all(e.kind != "swap_out" for e in sim.trace.of("B"))


# -- the reference model: every decision, random workloads --------------------------------------


class ReferenceScheduler:
    """The docstring's rules for single-sequence requests without prefix caching, over
    plain numbers: a request holds ceil(computed / block_size) blocks on the pool it is in.
    """

    def __init__(self, num_gpu_blocks, num_cpu_blocks, bs, max_num_seqs, budget, mode):
        self.P, self.C, self.bs = num_gpu_blocks, num_cpu_blocks, bs
        self.max_seqs, self.budget, self.mode = max_num_seqs, budget, mode
        self.reqs = {}  # rid -> dict(arrival, len, prompt_len, max_tokens, computed, where)

    def add(self, rid, prompt, max_tokens):
        self.reqs[rid] = dict(
            arrival=len(self.reqs),
            len=len(prompt),
            prompt_len=len(prompt),
            max_tokens=max_tokens,
            computed=0,
            where="waiting",
        )

    def queue(self, where):
        return sorted(
            (r for r, q in self.reqs.items() if q["where"] == where),
            key=lambda r: self.reqs[r]["arrival"],
        )

    def blocks(self, rid):
        return ceil_div(self.reqs[rid]["computed"], self.bs)

    def free(self, where):
        return {"running": self.P, "swapped": self.C}[where] - sum(
            self.blocks(r) for r in self.queue(where)
        )

    def step(self):
        """Returns ``([(rid, start, n)], [preempted rid])``."""
        budget, batch, preempted = self.budget, [], []
        order, i = self.queue("running"), 0
        while i < len(order) and budget > 0:
            r = self.reqs[order[i]]
            n = min(r["len"] - r["computed"], budget)
            need = ceil_div(r["computed"] + n, self.bs) - ceil_div(r["computed"], self.bs)
            while need > self.free("running"):
                victim = order.pop()
                preempted.append(victim)
                v = self.reqs[victim]
                if self.mode == "swap" and self.blocks(victim) <= self.free("swapped"):
                    v["where"] = "swapped"
                else:
                    v["where"], v["computed"] = "waiting", 0
                if v is r:
                    break
            if r["where"] != "running":
                continue
            batch.append((order[i], r["computed"], n))
            r["computed"] += n
            budget -= n
            i += 1
        if not preempted:
            seats = self.max_seqs - len(self.queue("running"))
            for rid in self.queue("swapped"):
                if seats < 1 or self.blocks(rid) > self.free("running"):
                    break
                self.reqs[rid]["where"] = "running"
                seats -= 1
            if not self.queue("swapped"):
                seats = self.max_seqs - len(self.queue("running"))
                for rid in self.queue("waiting"):
                    r = self.reqs[rid]
                    n = min(r["len"], budget)
                    if budget < 1 or seats < 1 or ceil_div(n, self.bs) > self.free("running"):
                        break
                    r["where"], r["computed"] = "running", n
                    batch.append((rid, 0, n))
                    budget -= n
                    seats -= 1
        for rid, start, n in batch:  # the model samples where a sequence's end was reached
            r = self.reqs[rid]
            if start + n == r["len"]:
                r["len"] += 1
                if r["len"] - r["prompt_len"] >= r["max_tokens"]:
                    r["where"] = "done"
        return batch, preempted


@st.composite
def single_sequence_workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    reqs = []
    for i in range(draw(st.integers(1, 7))):
        prompt = draw(st.lists(st.integers(0, 2), min_size=1, max_size=14))
        reqs.append((draw(st.integers(0, 6)), f"r{i}", prompt, draw(st.integers(1, 8))))
    reqs.sort(key=lambda r: r[0])  # arrival order = step order (ties: as drawn)
    # Like the engine: a request must fit the pool alone (else nothing could ever run it).
    most = max(ceil_div(len(p) + m, bs) for _, _, p, m in reqs)
    max_seqs = draw(st.integers(1, 5))
    return dict(
        bs=bs,
        reqs=reqs,
        gpu=most + draw(st.integers(0, 6)),
        cpu=draw(st.integers(0, 12)),
        max_seqs=max_seqs,
        budget=draw(st.integers(max_seqs, 24)),
        mode=draw(st.sampled_from(["recompute", "swap"])),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(single_sequence_workloads())
def test_every_decision_matches_the_reference_model(w):
    """Random single-sequence workloads (arrivals over several steps, chunked prompts,
    tight pools, both preemption modes, small CPU pools): every step, the scheduler's
    batch (which request, from which token, how many), its victims and all three queues
    equal the reference model's."""
    sim = SchedulerSim(
        w["gpu"],
        w["bs"],
        w["cpu"],
        max_num_seqs=w["max_seqs"],
        max_num_batched_tokens=w["budget"],
        preemption_mode=w["mode"],
    )
    ref = ReferenceScheduler(w["gpu"], w["cpu"], w["bs"], w["max_seqs"], w["budget"], w["mode"])
    pending = list(w["reqs"])
    while pending or sim.scheduler.has_unfinished():
        assert sim.step_no < 500, "no completion after 500 steps (livelock?)"
        while pending and pending[0][0] <= sim.step_no:
            _, rid, prompt, max_tokens = pending.pop(0)
            sim.add(rid, prompt, 1, max_tokens)
            ref.add(rid, prompt, max_tokens)
        out = sim.step()
        batch, victims = ref.step()
        assert [(s.group.request_id, s.start, s.num_new_tokens) for s in out.seqs] == batch
        assert rids(out.preempted) == victims
        for where, queue in (
            ("waiting", sim.scheduler.waiting),
            ("running", sim.scheduler.running),
            ("swapped", sim.scheduler.swapped),
        ):
            assert rids(queue) == ref.queue(where), where
    check_finished(sim, [(rid, p, 1, m) for _, rid, p, m in w["reqs"]])
    record_coverage(sim)


# -- random workloads with forks and prefix caching, run to completion --------------------------

PREFIXES = [[], [0, 1, 2, 0], [1, 1, 1, 1, 1, 1], [2, 0]]


@st.composite
def workloads(draw):
    """2 to 6 requests (n up to 3) arriving over 5 steps, prompts sharing prefixes, a
    GPU pool of at most 2 blocks more than the largest request needs, token budgets down
    to ``max_num_seqs``: tight enough for the two livelocks tested below."""
    bs = draw(st.sampled_from([1, 2, 4]))
    reqs = []
    for i in range(draw(st.integers(2, 6))):
        prompt = draw(st.sampled_from(PREFIXES)) + draw(st.lists(st.integers(0, 2), max_size=9))
        reqs.append(
            (
                draw(st.integers(0, 4)),
                f"r{i}",
                prompt or [0],
                draw(st.integers(1, 3)),
                draw(st.integers(1, 8)),
            )
        )
    most = max(n * ceil_div(len(p) + m, bs) for _, _, p, n, m in reqs)
    max_seqs = draw(st.integers(max(r[3] for r in reqs), 8))
    return dict(
        bs=bs,
        reqs=reqs,
        gpu=most + draw(st.integers(0, 2)),
        cpu=draw(st.integers(0, 24)),
        max_seqs=max_seqs,
        budget=draw(st.integers(max_seqs, 40)),
        mode=draw(st.sampled_from(["recompute", "swap"])),
        prefix_caching=draw(st.booleans()),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_run_to_completion(w):
    """Random workloads through the simulator with every per-step check on (budgets,
    FCFS, victims, swaps, copies, no request runs while swapped, each running and
    swapped sequence's KV cache holds exactly its computed tokens and reads back as its
    own): every request finishes with exactly its tokens and every block is free (or
    evictable) again on both pools."""
    sim = SchedulerSim(
        w["gpu"], w["bs"], w["cpu"], w["prefix_caching"], w["max_seqs"], w["budget"], w["mode"]
    )
    arrivals = {}
    for t, rid, prompt, n, max_tokens in w["reqs"]:
        arrivals.setdefault(t, []).append((rid, prompt, n, max_tokens))
    sim.run(arrivals, max_steps=400)
    check_finished(sim, [(rid, p, n, m) for _, rid, p, n, m in w["reqs"]])
    record_coverage(sim)


def record_coverage(sim):
    """What a workload exercised (shown by ``--hypothesis-show-statistics``)."""
    for what in ("preempt", "swap_out", "cow", "chunk", "prefix_hit"):
        event(f"{what}: {sim.counts[what] > 0}")
    # Steer generation towards workloads that preempt and swap.
    target(float(sim.counts["preempt"]), label="preemptions")
    target(float(sim.counts["swap_out"]), label="swap-outs")


# -- livelocks found by the property test --------------------------------------------------


def test_a_recomputed_forked_request_is_admitted_again():
    """Budget 3, bs 1: B (n=2) is preempted by recompute after both its sequences reach 4
    tokens.  To come back each sequence needs at least one token of a step's budget;
    planning min(4, 3) = 3 for the first would leave 0 for the second, refused forever,
    holding up every later request too (FCFS)."""
    sim = SchedulerSim(10, 1, 0, max_num_seqs=3, max_num_batched_tokens=3)
    specs = [("r0", [0], 1, 4), ("r2", [0], 2, 4), ("r3", [0], 1, 1)]
    sim.run({0: [specs[0], specs[1], specs[2]], 1: [("r1", [0], 1, 1)]}, max_steps=100)
    check_finished(sim, specs + [("r1", [0], 1, 1)])


def test_a_lone_forked_request_that_fits_is_not_preempted():
    """bs=4, 2 GPU blocks, n=2, prompt 2, 2 tokens each: the request alone needs
    2 x ceil(4 / 4) = 2 blocks, exactly the pool.  After the fork both sequences share
    one partial block; their next tokens need 1 copy (the second writes in place) and
    1 block is free.  Nothing should be preempted, and the request finishes."""
    sim = SchedulerSim(2, 4, 4, max_num_seqs=2, max_num_batched_tokens=8, preemption_mode="swap")
    specs = [("A", [0, 1], 2, 2)]
    sim.add(*specs[0])
    sim.run(max_steps=50)
    assert sim.scheduler.num_preemptions == 0
    check_finished(sim, specs)
