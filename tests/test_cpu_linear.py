"""Projections through oneDNN's packed weights (`minipaged.models.cpu_linear`): the
same logits and greedy tokens as ``F.linear`` in float32, each row's result independent
of the batch around it and of the thread count, bfloat16 within a stated bound of
Hugging Face in float32, and the run-time test for native bfloat16."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from minipaged import LLM, SamplingParams
from minipaged.distributed.layers import linear
from minipaged.models import cpu_linear, load_model, make_tiny_model
from test_models import FP32, SCHEDULE, PagedRunner, hf_logits, random_tokens, run_schedule

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch was built without oneDNN"
)
# bfloat16 keeps 8 bits of mantissa: a logit of magnitude ~10 moves by a few hundredths
# per rounding, and 2 layers of them add up; 5% of the largest logit bounds it with room
# (the bound test_models holds the unpacked bfloat16 path to).
BF16_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=0)


def projections(model):
    return [m for m in model.modules() if isinstance(m, cpu_linear.PACKED_LAYERS)]


def test_every_projection_is_packed_on_a_cpu_unless_asked_not_to(tiny_llama):
    packed, plain = load_model(tiny_llama), load_model(tiny_llama, pack_weights=False)
    layers = packed.config.num_hidden_layers
    # q/k/v, o, gate/up, down per layer, and the LM head (tied: the embedding stays plain)
    assert sum(m.packed_weight is not None for m in projections(packed)) == 4 * layers + 1
    assert all(m.packed_weight is None for m in projections(plain))


def test_packed_logits_equal_f_linear_over_chunked_prefills_and_decodes(tiny_llama):
    sequences = {"A": random_tokens(17, seed=2), "B": random_tokens(13, seed=3)}
    results = [
        run_schedule(
            PagedRunner(load_model(tiny_llama, pack_weights=pack), block_size=4), sequences
        )
        for pack in (False, True)
    ]
    assert len(results[0]) == sum(len(step) for step in SCHEDULE)
    for (*_, expected), (*_, actual) in zip(*results):
        torch.testing.assert_close(actual, expected, **FP32)
        assert torch.equal(actual.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_depends_on_neither_its_batch_nor_the_thread_count(dtype):
    if not cpu_linear.can_pack(torch.empty(0, dtype=dtype)):
        pytest.skip(f"oneDNN does not run {dtype} on this CPU")
    layer = torch.nn.Linear(96, 200, bias=False).to(dtype)
    layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
        layer.weight.detach(), cpu_linear.BATCH_HINT
    )
    x = torch.randn(40, 96).to(dtype)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(2)
            whole, alone = linear(x, layer), linear(x[5:6], layer)
            torch.set_num_threads(1)
            one_thread = linear(x, layer)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole[5:6], alone) and torch.equal(whole, one_thread)
    reference = F.linear(x.double(), layer.weight.double())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (whole.double() - reference).abs().max() <= tolerance * reference.abs().max()


def test_bfloat16_packed_stays_within_the_bound_of_hf_in_float32(tiny_llama):
    if not cpu_linear.can_pack(torch.empty(0, dtype=torch.bfloat16)):
        pytest.skip("oneDNN does not run bfloat16 on this CPU")
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    model = load_model(tiny_llama, dtype="bfloat16")
    assert model.lm_head.packed_weight is not None
    tokens = random_tokens(24, seed=7)
    (actual,) = PagedRunner(model, block_size=8).step([("A", tokens, 0)])
    expected = hf_logits(hf, tokens)
    assert (actual - expected).abs().max() <= BF16_TOLERANCE * expected.abs().max()


def test_engine_greedy_tokens_equal_with_and_without_packing(tiny_llama, monkeypatch):
    prompts = [{"prompt_token_ids": random_tokens(n, seed=n)} for n in (5, 11, 3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for pack in (True, False):
        if not pack:
            monkeypatch.setattr(cpu_linear, "can_pack", lambda weight: False)
        llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_gpu_blocks=64)
        layer = llm.engine.model.model.layers[0].self_attn.qkv_proj
        assert (layer.packed_weight is not None) == pack
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs[pack] = [r.outputs[0].token_ids for r in results]
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize(
    "flags, native",
    [({"avx2", "avx512f"}, False), ({"avx512f", "avx512_bf16"}, True), ({"amx_bf16"}, True)],
)
def test_native_bf16_reads_the_cpus_flags(monkeypatch, flags, native):
    monkeypatch.setattr(cpu_linear, "cpu_flags", lambda: frozenset(flags))
    assert cpu_linear.native_bf16() is native


def test_cpu_flags_are_read_from_the_os():
    flags = cpu_linear.cpu_flags()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        assert flags == frozenset()
        return
    if "flags" in text:
        assert "fpu" in flags or "avx2" in flags or "sse2" in flags
