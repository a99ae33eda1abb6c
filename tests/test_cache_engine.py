"""The cache engine: the KV tensors and the block operations the scheduler orders (§4.3-4.5).

Oracles: a per-block reference written here (clone the pools, then copy one block at a
time in a Python loop), the tensors' own ``nbytes``, and, end to end, the scheduler
simulator (``scheduler_sim``) driving a real `CacheEngine`: every scheduled token's
keys and values are written into the real tensors, and every sequence must read its own
back through its block table after swaps and copy-on-write copies.

Every block of the pools is filled with distinct values first, so a copy from the
wrong block, to the wrong block, in the wrong layer or in the wrong order shows up.
"""

import random

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from minipaged.core.sched.output import SchedulerOutput
from minipaged.models.tiny import make_tiny_model
from minipaged.worker.cache_engine import CacheEngine, block_bytes
from scheduler_sim import SchedulerSim, expected_tokens

CPU = torch.device("cpu")
BS = 4


def tiny_config(num_layers=3, kv_heads=2, head_dim=8):
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=64,
    )


def filled_engine(num_gpu=8, num_cpu=6, dtype=torch.float32, seed=0):
    """An engine whose every GPU and CPU block (each layer, keys and values) holds
    distinct random values."""
    engine = CacheEngine(tiny_config(), num_gpu, num_cpu, BS, dtype, CPU)
    gen = torch.Generator().manual_seed(seed)
    for pool in (engine.gpu_cache, engine.cpu_cache):
        for layer in pool:
            for cache in layer:
                cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    return engine


def snapshot(pool):
    return [[c.clone() for c in layer] for layer in pool]


def copy_one_by_one(src_pool, dst_pool, pairs):
    """The reference: ``dst[d] = src[s]`` per pair, block by block, layer by layer, from
    the pools as they were before the batch (``src_pool`` and ``dst_pool`` are clones)."""
    before = snapshot(src_pool)
    for s, d in pairs:
        for layer_before, layer_dst in zip(before, dst_pool):
            for c_before, c_dst in zip(layer_before, layer_dst):
                c_dst[d] = c_before[s]


def assert_pools_equal(actual, expected):
    for i, (layer_a, layer_e) in enumerate(zip(actual, expected, strict=True)):
        for kind, a, e in zip(("key", "value"), layer_a, layer_e, strict=True):
            bad = [b for b in range(a.shape[0]) if not torch.equal(a[b], e[b])]
            assert not bad, f"layer {i} {kind} cache differs in blocks {bad}"


# -- layout and sizes --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_block_bytes_is_what_a_block_takes_in_the_tensors(dtype):
    """block_bytes equals the real nbytes of one block over all layers, keys and values."""
    config = tiny_config(num_layers=3, kv_heads=2, head_dim=8)
    engine = CacheEngine(config, 5, 3, BS, dtype, CPU)
    real = sum(c[0].nbytes for layer in engine.gpu_cache for c in layer)
    assert block_bytes(config, BS, dtype) == real == 2 * 3 * BS * 2 * 8 * dtype.itemsize
    per_pool = sum(c.nbytes for layer in engine.gpu_cache for c in layer)
    assert per_pool == 5 * real


def test_block_bytes_reads_an_explicit_head_dim(tmp_path):
    """A checkpoint whose head_dim is not hidden_size / num_heads (tiny qwen3: 32 vs 16),
    loaded through transformers: block_bytes still matches the tensors."""
    config = AutoConfig.from_pretrained(make_tiny_model(tmp_path / "qwen3", arch="qwen3"))
    assert config.head_dim != config.hidden_size // config.num_attention_heads
    engine = CacheEngine(config, 2, 1, BS, torch.float32, CPU)
    assert engine.gpu_cache[0][0].shape == (2, BS, config.num_key_value_heads, config.head_dim)
    real = sum(c[0].nbytes for layer in engine.gpu_cache for c in layer)
    assert block_bytes(config, BS, torch.float32) == real


def test_pools_have_the_contract_layout():
    """Per layer a (key, value) pair of [num_blocks, block_size, num_kv_heads, head_dim],
    on both pools, in the requested dtype; the GPU pool starts zeroed."""
    engine = CacheEngine(tiny_config(num_layers=2), 7, 3, BS, torch.float16, CPU)
    for pool, n in ((engine.gpu_cache, 7), (engine.cpu_cache, 3)):
        assert len(pool) == 2
        for key, value in pool:
            assert key.shape == value.shape == (n, BS, 2, 8)
            assert key.dtype == value.dtype == torch.float16
            assert key.data_ptr() != value.data_ptr()
    assert all(not c.any() for layer in engine.gpu_cache for c in layer)


# -- swaps and copies ----------------------------------------------------------------------------


def test_swap_out_then_in_restores_every_layer_exactly():
    """Three GPU blocks go to the CPU pool, the GPU blocks are then overwritten (reused by
    others), and the blocks come back to three *other* GPU blocks: every layer's keys and
    values are bit-identical to what was swapped out, and nothing else changed."""
    engine = filled_engine()
    original = snapshot(engine.gpu_cache)
    cpu_before = snapshot(engine.cpu_cache)
    out_pairs = [(1, 4), (5, 0), (6, 2)]
    engine.execute(SchedulerOutput(swap_out=out_pairs))
    for layer, layer_orig, layer_cpu in zip(engine.cpu_cache, original, cpu_before):
        for c, c_orig, c_cpu in zip(layer, layer_orig, layer_cpu):
            for gpu, cpu in out_pairs:
                assert torch.equal(c[cpu], c_orig[gpu])
            for untouched in (1, 3, 5):
                assert torch.equal(c[untouched], c_cpu[untouched])
    assert_pools_equal(engine.gpu_cache, original)  # a swap-out only reads the GPU pool
    for layer in engine.gpu_cache:  # the blocks are reused: garbage now
        for c in layer:
            c[[1, 5, 6]] = -7.0
    engine.execute(SchedulerOutput(swap_in=[(4, 3), (0, 7), (2, 1)]))
    for layer, layer_orig in zip(engine.gpu_cache, original):
        for c, c_orig in zip(layer, layer_orig):
            for old, new in ((1, 3), (5, 7), (6, 1)):
                assert torch.equal(c[new], c_orig[old])
            for untouched in (0, 2, 4):
                assert torch.equal(c[untouched], c_orig[untouched])


def test_cow_copies_copy_the_right_blocks_in_every_layer():
    """copies [(2, 5), (2, 6), (0, 3)]: blocks 5, 6 become block 2 and block 3 becomes
    block 0 in every layer, keys and values; every other block (the sources included)
    and the CPU pool are untouched."""
    engine = filled_engine()
    gpu, cpu = snapshot(engine.gpu_cache), snapshot(engine.cpu_cache)
    pairs = [(2, 5), (2, 6), (0, 3)]
    engine.execute(SchedulerOutput(copies=pairs))
    for layer, layer_before in zip(engine.gpu_cache, gpu):
        for c, c_before in zip(layer, layer_before):
            for s, d in pairs:
                assert torch.equal(c[d], c_before[s])
            for b in set(range(8)) - {5, 6, 3}:
                assert torch.equal(c[b], c_before[b])
    assert_pools_equal(engine.cpu_cache, cpu)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_pairs_equals_copying_one_block_at_a_time(seed, dtype):
    """Random batches of swap-out, swap-in and copy pairs (distinct destinations, none a
    source of the same batch, as the scheduler produces them) give exactly the pools that
    copying each block on its own gives, op by op in the contract's order."""
    rng = random.Random(seed)
    num_gpu, num_cpu = 12, 9
    engine = filled_engine(num_gpu, num_cpu, dtype, seed)
    gpu, cpu = snapshot(engine.gpu_cache), snapshot(engine.cpu_cache)

    def pairs(src_ids, dst_ids, k):
        src = rng.sample(src_ids, k)
        return list(zip(src, rng.sample([d for d in dst_ids if d not in src], k)))

    swap_out = pairs(range(num_gpu), range(num_cpu), rng.randint(1, 4))
    swap_in = pairs(
        list(set(range(num_cpu)) - {c for _, c in swap_out}), range(num_gpu), rng.randint(1, 3)
    )
    copies = pairs(range(num_gpu), range(num_gpu), rng.randint(1, 3))
    copies = [(s, d) for s, d in copies if d not in {g for _, g in swap_in}] or copies[:0]
    engine.execute(SchedulerOutput(swap_out=swap_out, swap_in=swap_in, copies=copies))
    copy_one_by_one(gpu, cpu, swap_out)
    copy_one_by_one(cpu, gpu, swap_in)
    copy_one_by_one(gpu, gpu, copies)
    assert_pools_equal(engine.gpu_cache, gpu)
    assert_pools_equal(engine.cpu_cache, cpu)


def test_execute_runs_swap_out_then_swap_in_then_copies():
    """One step where order matters at every stage.  GPU block 2 is swapped out to CPU 0
    and in the same step reused: CPU block 1 is swapped into it, and then copied (CoW)
    to GPU block 4.  In the contract's order CPU 0 gets the old GPU 2, GPU 2 gets CPU 1,
    and GPU 4 gets CPU 1 too.  Any other order gives some block other contents."""
    engine = filled_engine()
    gpu, cpu = snapshot(engine.gpu_cache), snapshot(engine.cpu_cache)
    engine.execute(SchedulerOutput(swap_out=[(2, 0)], swap_in=[(1, 2)], copies=[(2, 4)]))
    for layer_g, layer_c, g0, c0 in zip(engine.gpu_cache, engine.cpu_cache, gpu, cpu):
        for cg, cc, g_before, c_before in zip(layer_g, layer_c, g0, c0):
            assert torch.equal(cc[0], g_before[2])
            assert torch.equal(cg[2], c_before[1])
            assert torch.equal(cg[4], c_before[1])
            assert not torch.equal(cg[4], g_before[2])


def test_execute_with_nothing_to_do_changes_nothing():
    """An empty step (decodes only) leaves both pools as they were."""
    engine = filled_engine()
    gpu, cpu = snapshot(engine.gpu_cache), snapshot(engine.cpu_cache)
    engine.execute(SchedulerOutput())
    assert_pools_equal(engine.gpu_cache, gpu)
    assert_pools_equal(engine.cpu_cache, cpu)


# -- end to end: the scheduler's operations on real tensors ----------------------------------------


class TensorSim(SchedulerSim):
    """The scheduler simulator with a real `CacheEngine`: each scheduled token's keys and
    values (a value standing for "this token after this prefix", distinct per layer and
    for keys and values) are written into the real tensors, and every sequence holding
    blocks reads its own back from them after every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine = CacheEngine(
            tiny_config(num_layers=2),
            self.kv.gpu.num_blocks,
            self.kv.cpu.num_blocks,
            self.bs,
            torch.float32,
            CPU,
        )
        for pool in (self.engine.gpu_cache, self.engine.cpu_cache):
            for layer in pool:
                for c in layer:
                    c.fill_(-1.0)  # "nothing written here"

    @staticmethod
    def value(content_id, layer, kind):
        return float(4 * content_id + 2 * layer + kind)  # exact in float32

    def execute(self, out):
        super().execute(out)  # the shadow store
        self.engine.execute(out)
        for s in out.seqs:
            ids = self._content_ids(s.seq.token_ids[: s.start + s.num_new_tokens])
            for p in range(s.start, s.start + s.num_new_tokens):
                block, offset = s.block_table[p // self.bs], p % self.bs
                for i, layer in enumerate(self.engine.gpu_cache):
                    for kind, c in enumerate(layer):
                        c[block, offset] = self.value(ids[p], i, kind)

    def read_back(self):
        super().read_back()
        q = self.scheduler
        for queue, pool in ((q.running, self.engine.gpu_cache), (q.swapped, self.engine.cpu_cache)):
            for group in queue:
                for seq in group.unfinished_seqs:
                    blocks = self.kv.block_table(seq.seq_id)
                    ids = self._content_ids(seq.token_ids[: seq.num_computed_tokens])
                    for p, cid in enumerate(ids):
                        block, offset = blocks[p // self.bs], p % self.bs
                        for i, layer in enumerate(pool):
                            for kind, c in enumerate(layer):
                                assert torch.all(c[block, offset] == self.value(cid, i, kind)), (
                                    f"step {self.step_no}: {seq.seq_id} position {p} layer {i}"
                                )


def test_a_block_swapped_out_and_reused_as_a_cow_destination_in_one_step():
    """From the scheduler itself: bs=4, 4 GPU blocks, swap.  After step 0, A (n=3, prompt
    2) shares one partial block between its three sequences and B (prompt 11) holds the
    other 3 blocks: none is free.  A's next tokens need 2 copy-on-write blocks, so B is
    swapped out and A's copies land in blocks B just left, in the same step.  Swapping
    out first keeps B's KV: both requests read their own keys and values from the real
    tensors at every step, and finish with the right tokens."""
    sim = TensorSim(4, 4, 4, max_num_seqs=4, max_num_batched_tokens=16, preemption_mode="swap")
    sim.add("A", [0, 1], n=3, max_tokens=2)
    sim.add("B", [1, 2, 0] * 3 + [1, 1], n=1, max_tokens=3)
    sim.step()
    b_blocks = sim.kv.block_table("B.0")
    assert len(b_blocks) == 3 and sim.kv.gpu.num_free_blocks == 0
    out = sim.step()
    assert [g.request_id for g in out.preempted] == ["B"]
    assert sorted(g for g, _ in out.swap_out) == sorted(b_blocks)
    assert len(out.copies) == 2 and {d for _, d in out.copies} <= set(b_blocks)
    sim.run(max_steps=20)
    assert sorted(g.request_id for g in sim.finished) == ["A", "B"]
    for group in sim.finished:
        for seq in group.seqs:
            assert seq.token_ids == expected_tokens(
                group.request_id, group.prompt_token_ids, seq.index, group.params.max_tokens
            )


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_busy_workload_reads_its_own_kv_from_the_real_tensors(mode):
    """A 17-token prompt and six short requests (every other one n=2) arriving over three
    steps, on a 12-block pool with a 10-token budget: chunked prefill, forks, copies and
    preemptions (swaps, in swap mode) all happen, and after every step every sequence
    reads exactly its own keys and values, every layer, from the real tensors.  (Sized
    clear of the known scheduler livelocks in test_scheduler.py.)"""
    sim = TensorSim(12, 2, 16, max_num_seqs=6, max_num_batched_tokens=10, preemption_mode=mode)
    rng = random.Random(4)
    arrivals = {0: [("long", [rng.randrange(3) for _ in range(17)], 1, 3)]}
    for i in range(6):
        prompt = [rng.randrange(3) for _ in range(rng.choice([1, 3, 5]))]
        arrivals.setdefault(i // 2, []).append((f"r{i}", prompt, 1 + i % 2, rng.randint(2, 3)))
    specs = [spec for step in arrivals.values() for spec in step]
    sim.run(arrivals, max_steps=200)
    assert sim.counts["preempt"] >= 2 and sim.counts["cow"] and sim.counts["chunk"]
    assert mode != "swap" or sim.counts["swap_out"] >= 2
    assert sorted(g.request_id for g in sim.finished) == sorted(s[0] for s in specs)
    for group in sim.finished:
        for seq in group.seqs:
            assert seq.token_ids == expected_tokens(
                group.request_id, group.prompt_token_ids, seq.index, group.params.max_tokens
            )
