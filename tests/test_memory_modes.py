"""The engine in Orca's contiguous memory modes, the paper's baseline (§3, §6.1).

``memory_mode="contiguous-max" | "-pow2" | "-oracle"`` admits a request only when a
contiguous range of slots for its whole final length can be placed first-fit in the
pool; the KV stays paged underneath.  Oracles, none of them ``minipaged.core.sched.scheduler``:

* admission scenarios worked out by hand (reservation sizes, first-fit starts, the
  step at which each request is admitted and finishes), run through the scheduler
  simulator of test_scheduler.py (shadow KV store, rule checks at every step);
* a property test: random workloads in every contiguous mode never preempt, never
  hold more blocks than their ranges cover, and leave nothing reserved or held;
* Hugging Face transformers for the tokens: the memory mode changes who runs when,
  never what is computed, so greedy outputs are HF's in every mode.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import (
    as_inputs,
    assert_all_blocks_free,
    assert_greedy_matches_hf,
    make_llm,
    random_prompt,
)
from minipaged import BeamSearchParams, SamplingParams
from minipaged.config import MEMORY_MODES
from minipaged.core.memory import KVCacheManager
from minipaged.core.memory.contiguous import ContiguousReservations
from minipaged.core.memory.simulate import SYSTEMS
from minipaged.core.sched.scheduler import Scheduler, make_scheduler
from scheduler_sim import SchedulerSim, ceil_div

CONTIGUOUS = [m for m in MEMORY_MODES if m != "paged"]


def contiguous_sim(
    mode: str, num_blocks: int, block_size: int, max_model_len: int, **kwargs
) -> SchedulerSim:
    """test_scheduler.py's simulator, with its scheduler in ``mode``."""
    sim = SchedulerSim(num_blocks, block_size, **kwargs)
    sim.scheduler = make_scheduler(
        sim.kv,
        sim.max_num_seqs,
        sim.max_num_batched_tokens,
        trace=sim.trace,
        memory_mode=mode,
        max_model_len=max_model_len,
    )
    return sim


def admission_steps(sim: SchedulerSim, on_step=None) -> dict[str, int]:
    """Run ``sim`` to the end; the step at which each request first ran.  ``on_step``
    is called after every step."""
    first = {}
    while sim.scheduler.has_unfinished():
        out = sim.step()
        for s in out.seqs:
            first.setdefault(s.group.request_id, sim.step_no - 1)
        if on_step:
            on_step(sim)
    return first


def assert_nothing_held(sim: SchedulerSim) -> None:
    reservations = sim.scheduler.reservations
    assert reservations.starts == {}
    assert reservations.allocator.gaps() == [(0, reservations.allocator.num_slots)]
    assert sim.kv.tables == {} and sim.kv.gpu.num_free_blocks == sim.kv.gpu.num_blocks
    assert sim.counts["preempt"] == 0


# -- the modes and their arguments ----------------------------------------------------


def test_memory_modes_are_the_simulations_systems():
    assert (
        MEMORY_MODES
        == SYSTEMS
        == ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
    )


def test_paged_mode_reserves_nothing():
    scheduler = make_scheduler(KVCacheManager(4, 4), 4, 16)
    assert type(scheduler) is Scheduler and not hasattr(scheduler, "reservations")


def test_bad_memory_mode_arguments_are_refused():
    with pytest.raises(ValueError, match="memory_mode.*'contiguous'"):
        make_scheduler(KVCacheManager(4, 4), 4, 16, memory_mode="contiguous")
    with pytest.raises(ValueError, match="max_model_len.*None"):
        make_scheduler(KVCacheManager(4, 4), 4, 16, memory_mode="contiguous-max")
    with pytest.raises(ValueError, match="policy.*'best'"):
        ContiguousReservations("best", 4, 4, 16)
    with pytest.raises(ValueError, match="block_size.*0"):
        ContiguousReservations("max", 4, 0, 16)


@pytest.mark.parametrize(
    "policy, prompt, max_tokens, width, expected",
    [
        # block_size 4, max_len 40.  Oracle: the final length in whole blocks.
        ("oracle", 5, 6, 1, 12),  # 11 tokens -> 3 blocks
        ("oracle", 5, 7, 1, 12),  # 12 tokens -> 3 blocks exactly
        ("oracle", 5, 8, 1, 16),  # 13 tokens -> 4 blocks
        ("oracle", 30, 100, 1, 40),  # cut at max_len: the engine stops it at 40 tokens
        ("pow2", 5, 6, 1, 16),  # 11 -> 16
        ("pow2", 20, 5, 1, 32),  # 25 -> 32
        ("pow2", 20, 20, 1, 40),  # 40 -> 64, capped at max_len 40
        ("max", 1, 1, 1, 40),
        ("oracle", 3, 2, 2, 16),  # n=2: two sequences of 5 tokens, 2 blocks each
        ("max", 1, 1, 3, 120),  # beam_width=3: three full-length ranges side by side
    ],
)
def test_reservation_sizes_by_hand(policy, prompt, max_tokens, width, expected):
    reservations = ContiguousReservations(policy, num_blocks=64, block_size=4, max_len=40)
    assert reservations.num_slots(prompt, max_tokens, width) == expected


def test_whole_blocks_keep_the_blocks_within_the_pool():
    """Block size 16, 3 blocks (48 slots), two requests of 17 tokens: exact ranges
    (17 + 17 = 34 slots) would both fit, yet would touch 2 + 2 = 4 blocks of 3.  In
    whole blocks each reserves 32 slots, and the second waits."""
    reservations = ContiguousReservations("oracle", num_blocks=3, block_size=16, max_len=64)
    size = reservations.num_slots(prompt_len=10, max_tokens=7)
    assert size == 32
    assert reservations.reserve("a", size)
    assert not reservations.reserve("b", size)
    assert reservations.starts == {"a": 0}
    reservations.release("b")  # never admitted: holds nothing, releasing is a no-op
    reservations.release("a")
    assert reservations.reserve("b", size) and reservations.starts == {"b": 0}
    with pytest.raises(ValueError, match="request_id 'b'"):
        reservations.reserve("b", size)


# -- admission worked out by hand ---------------------------------------------------------
#
# Block size 1 (the ranges are exactly Orca's), 64 slots, max_model_len 40, a budget of
# 64 tokens and 8 seats (never the limit).  A request admitted at step s runs its prompt
# and samples its first token at step s, one more token each step after, so with
# max_tokens m it finishes at the end of step s + m - 1 and its range is free at s + m.

A, B, C = ("A", [0] * 10, 1, 10), ("B", [1] * 4, 1, 20), ("C", [2] * 8, 1, 12)


@pytest.mark.parametrize(
    "mode, admitted, starts",
    [
        # Final lengths 20, 24, 20.  Oracle: 20 + 24 + 20 = 64 slots, all at step 0,
        # at 0, 20 and 44.
        ("contiguous-oracle", {"A": 0, "B": 0, "C": 0}, {"A": 0, "B": 20, "C": 44}),
        # Pow2: 32 each.  A at 0, B at 32, the pool is full; A finishes at the end of
        # step 9, C takes its range at step 10.
        ("contiguous-pow2", {"A": 0, "B": 0, "C": 10}, {"A": 0, "B": 32, "C": 0}),
        # Max: 40 each.  A at 0; B does not fit the 24 slots left, and C waits behind it
        # (first come, first served).  B runs at 10 (A done), C at 10 + 20 = 30.
        ("contiguous-max", {"A": 0, "B": 10, "C": 30}, {"A": 0, "B": 0, "C": 0}),
    ],
)
def test_three_requests_by_hand(mode, admitted, starts):
    sim = contiguous_sim(mode, 64, 1, max_model_len=40, max_num_seqs=8, max_num_batched_tokens=64)
    for spec in (A, B, C):
        sim.add(*spec)
    seen = {}

    def record_starts(sim):
        seen.update(sim.scheduler.reservations.starts)

    assert admission_steps(sim, record_starts) == admitted
    assert seen == starts
    assert_nothing_held(sim)


def test_paged_mode_admits_the_three_at_once():
    """The same pool paged: the three prompts take 10 + 4 + 8 = 22 one-slot blocks."""
    sim = SchedulerSim(64, 1, max_num_seqs=8, max_num_batched_tokens=64)
    for spec in (A, B, C):
        sim.add(*spec)
    assert admission_steps(sim) == {"A": 0, "B": 0, "C": 0}


def test_external_fragmentation_by_hand():
    """Oracle, 64 slots: A (20 tokens) at 0, B (24) at 20, C (16) at 44, leaving a gap
    of 4.  D (24) waits.  C finishes at the end of step 7 and A at the end of step 9;
    from step 10 on 40 slots are free, in two gaps of 20 at 0 and 44, neither big
    enough for D: external fragmentation.  B finishes at the end of step 19 and D is
    placed at 0 at step 20."""
    sim = contiguous_sim(
        "contiguous-oracle", 64, 1, max_model_len=40, max_num_seqs=8, max_num_batched_tokens=64
    )
    for spec in (A, B, ("C", [2] * 8, 1, 8), ("D", [3] * 12, 1, 12)):
        sim.add(*spec)
    gaps = {}

    def record_gaps(sim):
        gaps[sim.step_no] = sim.scheduler.reservations.allocator.gaps()

    admitted = admission_steps(sim, record_gaps)
    assert admitted == {"A": 0, "B": 0, "C": 0, "D": 20}
    assert gaps[1] == [(60, 4)]  # after step 0
    assert gaps[8] == [(44, 20)]  # after step 7: C's 16 slots and the 4 merge
    assert all(gaps[s] == [(0, 20), (44, 20)] for s in range(10, 20))
    assert gaps[21] == [(24, 40)]  # D at 0, everything else free
    assert_nothing_held(sim)


def test_parallel_sampling_reserves_width_times_the_size():
    """Block size 2, 16 blocks = 32 slots, oracle.  P (n=3, 3 + 5 tokens: 4 blocks a
    sequence) reserves 3 * 8 = 24 slots; Q (1 sequence of 4 + 6 = 10 tokens, 5
    blocks) needs 10 more than the 8 left, so it waits until P finishes at the end of
    step 4, and is placed at 0 at step 5."""
    sim = contiguous_sim(
        "contiguous-oracle", 16, 2, max_model_len=32, max_num_seqs=8, max_num_batched_tokens=64
    )
    sim.add("P", [0, 1, 2], n=3, max_tokens=5)
    sim.add("Q", [1] * 4, max_tokens=6)
    sim.step()
    assert sim.scheduler.reservations.starts == {"P": 0}
    assert sim.scheduler.reservations.allocator.gaps() == [(24, 8)]
    assert admission_steps(sim)["Q"] == 5
    assert_nothing_held(sim)


def test_abort_releases_the_range():
    """Max, 64 slots of block size 1, max_model_len 32: A at 0, B at 32, C waits.
    Aborting B (running) frees its range and its blocks, and C takes it next step;
    aborting a waiting request releases nothing, as it held nothing."""
    sim = contiguous_sim(
        "contiguous-max", 64, 1, max_model_len=32, max_num_seqs=8, max_num_batched_tokens=64
    )
    for rid in "ABCD":
        sim.add(rid, [0] * 4, max_tokens=20)
    sim.step()
    reservations = sim.scheduler.reservations
    assert reservations.starts == {"A": 0, "B": 32}
    sim.abort("D")
    assert reservations.starts == {"A": 0, "B": 32}
    sim.abort("B")
    assert reservations.starts == {"A": 0} and reservations.allocator.gaps() == [(32, 32)]
    assert not any(s.startswith("B") for s in sim.kv.tables)
    sim.step()
    assert reservations.starts == {"A": 0, "C": 32}
    sim.abort("A")
    sim.abort("C")
    assert_nothing_held(sim)


# -- the invariant: ranges cover every block, so nothing is ever preempted ----------------


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_len = draw(st.integers(4, 24))
    # From one full-length range to a few: requests must wait for each other.
    num_blocks = ceil_div(draw(st.integers(max_len, 4 * max_len)), block_size)
    requests = []
    for i in range(draw(st.integers(1, 8))):
        prompt = draw(st.integers(1, max_len - 1))
        max_tokens = draw(st.integers(1, max_len - prompt))
        n = draw(st.integers(1, 3))
        requests.append((draw(st.integers(0, 12)), (f"r{i}", [i % 3] * prompt, n, max_tokens)))
    return draw(st.sampled_from(CONTIGUOUS)), block_size, num_blocks, max_len, requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_contiguous_modes_never_preempt(workload):
    """Random workloads (n up to 3: forks and copy-on-write) in every contiguous mode:
    every step, each running request holds no more blocks than its range covers and
    only running requests hold ranges; nothing is preempted; at the end nothing is
    reserved or held.  (Requests whose range exceeds the pool are dropped, as
    ``check_request`` would refuse them.)"""
    mode, block_size, num_blocks, max_len, requests = workload
    sim = contiguous_sim(
        mode, num_blocks, block_size, max_len, max_num_seqs=8, max_num_batched_tokens=32
    )
    reservations = sim.scheduler.reservations
    arrivals = {}
    for step, (rid, prompt, n, max_tokens) in requests:
        if reservations.num_slots(len(prompt), max_tokens, n) <= num_blocks * block_size:
            arrivals.setdefault(step, []).append((rid, prompt, n, max_tokens))
    sim.step = checked(sim, sim.step)
    sim.run(arrivals, max_steps=2000)
    assert_nothing_held(sim)


def checked(sim, step):
    def run():
        out = step()
        assert not out.preempted
        q, reservations = sim.scheduler, sim.scheduler.reservations
        assert set(reservations.starts) == {g.request_id for g in q.running}
        for g in q.running:
            blocks = {b for s in g.unfinished_seqs for b in sim.kv.block_table(s.seq_id)}
            size = reservations.num_slots(len(g.prompt_token_ids), g.params.max_tokens, g.width)
            assert len(blocks) <= ceil_div(size, sim.bs)
        return out

    return run


# -- the engine: same tokens in every mode ------------------------------------------------

MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("mode", MEMORY_MODES)
def test_greedy_equals_hf_in_every_memory_mode(tiny, mode):
    """Six prompts (one stops at EOS) on 24 blocks of 4 = 96 slots, max_model_len 64:
    every mode decodes HF's greedy tokens.  Max reserves 64 slots a request, so it runs
    them one at a time; paged runs several at once; no contiguous mode preempts."""
    path, oracle = tiny("llama")
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 16, 23, 40)]
    prompts.append(oracle.eos_prompt(MAX_TOKENS))
    llm = make_llm(path, block_size=4, num_gpu_blocks=24, max_model_len=64, memory_mode=mode)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    outputs, most_running = {}, 0
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
        most_running = max(most_running, len(engine.scheduler.running))
    assert_greedy_matches_hf(
        [outputs[str(i)] for i in range(len(prompts))], prompts, oracle, MAX_TOKENS
    )
    if mode == "contiguous-max":
        assert most_running == 1  # 96 // 64
    if mode == "paged":
        assert most_running > 1
    else:
        assert engine.stats()["num_preemptions"] == 0
        assert engine.scheduler.reservations.starts == {}
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", CONTIGUOUS)
def test_sampling_and_beams_equal_paged(tiny, mode):
    """Seeded parallel sampling (n=3) and beam search (width 3) give the paged mode's
    outputs: each request reserves one range for all its sequences."""
    path, _ = tiny("llama")
    prompts = as_inputs([random_prompt(n, seed=n) for n in (3, 11, 20)])
    sampling = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    results = {}
    for m in ("paged", mode):
        llm = make_llm(path, block_size=4, num_gpu_blocks=40, max_model_len=48, memory_mode=m)
        sampled = llm.generate(prompts, sampling, use_tqdm=False)
        searched = llm.beam_search(prompts, beams)
        results[m] = (
            [[c.token_ids for c in o.outputs] for o in sampled],
            [[s.tokens for s in o.sequences] for o in searched],
            [s.cum_logprob for o in searched for s in o.sequences],
        )
        assert llm.stats()["num_preemptions"] == 0 or m == "paged"
        assert_all_blocks_free(llm)
    assert results[mode][:2] == results["paged"][:2]
    # Different batches sum in a different order: equal up to float rounding.
    assert results[mode][2] == pytest.approx(results["paged"][2], rel=1e-5, abs=1e-5)


def test_abort_in_the_engine_frees_blocks_and_range(tiny):
    path, _ = tiny("llama")
    llm = make_llm(
        path, block_size=4, num_gpu_blocks=16, max_model_len=32, memory_mode="contiguous-max"
    )
    engine = llm.engine
    for rid in "abc":
        engine.add_request(rid, random_prompt(5, seed=1), GREEDY)
    engine.step()
    assert engine.scheduler.reservations.starts == {"a": 0, "b": 32}  # 64 slots: c waits
    for rid in "bca":
        engine.abort_request(rid)
    assert engine.scheduler.reservations.starts == {}
    assert_all_blocks_free(llm)


def test_a_max_model_len_larger_than_the_pool_is_refused_at_start_up(tiny):
    """Max would reserve max_model_len = 64 slots; a pool of 12 blocks of 4 has 48, so
    no request could ever be admitted: the engine refuses to start (vLLM's check),
    naming both numbers, in every memory mode."""
    path, _ = tiny("llama")
    for mode in ("contiguous-max", "paged"):
        with pytest.raises(ValueError, match="max_model_len=64 does not fit.*has 12 \\(48 tokens"):
            make_llm(path, block_size=4, num_gpu_blocks=12, max_model_len=64, memory_mode=mode)


def test_llm_refuses_an_unknown_memory_mode(tiny):
    path, _ = tiny("llama")
    with pytest.raises(ValueError, match="memory_mode.*'orca'"):
        make_llm(path, memory_mode="orca")
