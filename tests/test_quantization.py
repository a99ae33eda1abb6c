"""Quantized weights end to end (`minipaged.models.quantization`): INT4 checkpoints that
``minipaged quantize`` writes in GPTQ's and AWQ's formats, and fp8/int8 online, each
against Hugging Face's model holding the weights that the scheme stands for.

transformers loads GPTQ and AWQ checkpoints through gptqmodel only, which needs a newer
torch than this project's CPU build and compiles from source, so the oracle is built
here instead: the checkpoint's tensors unpacked by this file's own reading of each
format (not minipaged's), dequantized, and saved as an ordinary float32 checkpoint that
transformers loads.  The online schemes' oracle rounds the weights here, by the rule.
"""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine_helpers import (
    Oracle,
    assert_greedy_matches_hf,
    assert_prompt_logprobs_match_hf,
    make_llm,
    random_prompt,
)
from minipaged.cli import main as cli
from minipaged.config import EngineConfig
from minipaged.models.loader import load_model
from minipaged.models.quantization import formats, quantize, resolve_quantization, weight_bytes
from minipaged.models.quantization.quantize import awq_clip, gptq_quantize, rtn_quantize
from minipaged.ops.quant_linear import IntWeight
from minipaged.sampling_params import BeamSearchParams, SamplingParams

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: slot j of an int32 holds column AWQ_ORDER[j]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [random_prompt(11, seed=1), random_prompt(23, seed=2)]


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., C]`` -> ``[..., C, 8]``: the 4-bit fields, lowest bits first."""
    return torch.stack([(packed >> (4 * j)) & 15 for j in range(8)], dim=-1)


def dequantize_gptq(t: dict, prefix: str) -> torch.Tensor:
    q = (
        nibbles(t[f"{prefix}.qweight"])
        .permute(0, 2, 1)
        .reshape(-1, t[f"{prefix}.qweight"].shape[1])
    )
    zeros = nibbles(t[f"{prefix}.qzeros"]).flatten(-2) + 1  # stored minus one
    g = t[f"{prefix}.g_idx"].long()
    return ((q - zeros[g]) * t[f"{prefix}.scales"].float()[g]).T


def dequantize_awq(t: dict, prefix: str, group_size: int) -> torch.Tensor:
    def columns(packed):
        slots = nibbles(packed)
        out = torch.empty_like(slots)
        out[..., AWQ_ORDER] = slots
        return out.flatten(-2)

    q, zeros = columns(t[f"{prefix}.qweight"]), columns(t[f"{prefix}.qzeros"])
    g = torch.arange(q.shape[0]) // group_size
    return ((q - zeros[g]) * t[f"{prefix}.scales"].float()[g]).T


def dequantized_checkpoint(path, out):
    """``path``'s quantized checkpoint as an ordinary float32 one in ``out``."""
    config = json.loads((path / "config.json").read_text())
    quant = config.pop("quantization_config")
    tensors = load_file(path / "model.safetensors")
    dense = {}
    for name, tensor in tensors.items():
        prefix, kind = name.rsplit(".", 1)
        if kind == "qweight":
            dense[f"{prefix}.weight"] = (
                dequantize_awq(tensors, prefix, quant["group_size"])
                if quant["quant_method"] == "awq"
                else dequantize_gptq(tensors, prefix)
            ).contiguous()
        elif kind not in ("qzeros", "scales", "g_idx"):
            dense[name] = tensor.float()
    out.mkdir()
    save_file(dense, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    for file in path.glob("tokenizer*"):
        (out / file.name).write_bytes(file.read_bytes())
    return out


def random_int4(n: int, k: int, group_size: int, act_order: bool) -> IntWeight:
    """Random 4-bit integers, scales and zero points (1..15: GPTQ stores them minus one)."""
    g = torch.Generator().manual_seed(n * k)
    groups = k // group_size
    g_idx = torch.arange(k) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return IntWeight(
        torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
        torch.rand(n, groups, generator=g) + 0.5,
        torch.randint(1, 16, (n, groups), generator=g, dtype=torch.int16),
        g_idx,
        4,
    )


@pytest.mark.parametrize("mse", [False, True], ids=["min-max", "mse"])
def test_gptq_grids_keep_zero_points_it_can_store(mse):
    """Rows that barely go below 0 would take a zero point of 0 on a zero-point grid;
    for GPTQ's format (``min_zero`` 1) they take 1, their grid's top level still the
    row's largest weight (without the MSE search), every weight within half a step
    of its level, and the other rows keep their grids."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(16, 32, generator=g) * 0.1
    w[8:] -= 0.05  # these rows go well below 0
    w[:8, 0] = -1e-4  # these only just
    plain = rtn_quantize(w, 4, 32, sym=False, mse=mse)
    kept = rtn_quantize(w, 4, 32, sym=False, mse=mse, min_zero=1)
    assert (plain.zeros[:8] == 0).all() and (kept.zeros[:8] == 1).all()
    assert torch.equal(kept.zeros[8:], plain.zeros[8:])
    assert torch.equal(kept.scales[8:], plain.scales[8:])
    back = kept.dequantize()
    if mse:  # the search's first candidate is the full range: never worse than it
        full = rtn_quantize(w, 4, 32, sym=False, min_zero=1).dequantize()
        error = (back - w).abs().pow(2.4).sum(1)
        assert (error <= (full - w).abs().pow(2.4).sum(1) * (1 + 1e-5)).all()
    else:
        torch.testing.assert_close(back[:8].amax(1), w[:8].amax(1))
        assert ((back - w).abs() <= kept.scales[:, [0]] / 2 + 1e-7).all()
    formats.check_gptq_zeros(kept, "w")  # storable


def test_a_zero_point_of_0_is_refused_naming_where():
    """GPTQ's format stores zero points minus one: a zero point of 0 (which asymmetric
    grids can choose) is refused, naming the projection, the output and the group; AWQ's
    format, which stores them as they are, packs it."""
    weight = random_int4(24, 64, 32, act_order=False)
    weight.zeros[5, 1] = 0
    with pytest.raises(ValueError, match=r"^layers\.0\.up_proj: 1 group\(s\) .* output 5, group 1"):
        formats.check_gptq_zeros(weight, "layers.0.up_proj")
    with pytest.raises(ValueError, match="zero points minus one"):
        formats.pack_gptq(weight)
    back = formats.unpack_awq(*formats.pack_awq(weight).values(), 32)
    assert torch.equal(back.zeros, weight.zeros)


@pytest.mark.parametrize(
    "fmt,act_order",
    [("gptq", False), ("gptq", True), ("awq", False)],
    ids=["gptq", "gptq-g_idx", "awq"],
)
def test_packing_matches_an_independent_reading(fmt, act_order):
    """Packed in GPTQ's or AWQ's layout, the integers read back by this file's own
    nibble reader (the order each format documents) give the same weight, and
    unpacking returns them exactly."""
    weight = random_int4(24, 64, 32, act_order)
    packed = formats.pack_gptq(weight) if fmt == "gptq" else formats.pack_awq(weight)
    tensors = {f"w.{kind}": tensor for kind, tensor in packed.items()}
    ours = dequantize_gptq(tensors, "w") if fmt == "gptq" else dequantize_awq(tensors, "w", 32)
    scales = weight.scales.half().float()[:, weight.g_idx]  # the formats store float16
    expected = (weight.q.float() - weight.zeros.float()[:, weight.g_idx]) * scales
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)
    if fmt == "gptq":
        back = formats.unpack_gptq(*(packed[k] for k in ("qweight", "qzeros", "scales", "g_idx")))
    else:
        back = formats.unpack_awq(packed["qweight"], packed["qzeros"], packed["scales"], 32)
    assert torch.equal(back.q, weight.q) and torch.equal(back.zeros, weight.zeros)
    assert torch.equal(back.g_idx, weight.g_idx)


@pytest.fixture(scope="module")
def base(tiny):
    return tiny("llama")[0]


@pytest.fixture(scope="module")
def checkpoints(base, tmp_path_factory):
    """name -> (quantized checkpoint, Oracle on its dequantized weights)."""
    root = tmp_path_factory.mktemp("quantized")
    runs = {  # RTN is written as symmetric GPTQ in order; GPTQ here asymmetric, act-order
        "rtn": ["--method", "rtn"],
        "gptq": ["--method", "gptq", "--desc-act", "--no-sym"],
        "awq": ["--method", "awq"],
        # AWQ's scales folded in, then GPTQ with every option: a plain GPTQ checkpoint.
        "awq-gptq": ["--method", "awq-gptq", "--desc-act", "--mse", "--true-sequential"],
        # The same in AWQ's format: zero points of 0 kept, groups in order (no act-order).
        "awq-gptq-awq": [
            *("--method", "awq-gptq", "--format", "awq", "--no-sym", "--mse"),
            "--true-sequential",
        ],
    }
    out = {}
    for name, flags in runs.items():
        path = root / name
        common = ["--group-size", "32", "--num-samples", "4", "--seq-len", "64"]
        cli(["quantize", str(base), str(path), *flags, *common])
        out[name] = path, Oracle(dequantized_checkpoint(path, root / f"{name}-dense"))
    return out


@pytest.mark.parametrize("name", ["rtn", "gptq", "awq", "awq-gptq", "awq-gptq-awq"])
def test_int4_checkpoint_equals_hf_on_its_dequantized_weights(checkpoints, name):
    path, oracle = checkpoints[name]
    llm = make_llm(path)  # quantization detected from config.json
    assert llm.engine.config.quantization is None
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_greedy_matches_hf(outputs, PROMPTS, oracle, 6, logprobs=3)
    for output in outputs:
        assert_prompt_logprobs_match_hf(output, oracle.hf, 3)


def test_the_checkpoints_carry_their_formats(checkpoints):
    gptq = json.loads((checkpoints["gptq"][0] / "config.json").read_text())
    assert gptq["quantization_config"]["desc_act"] is True
    tensors = load_file(checkpoints["gptq"][0] / "model.safetensors")
    g_idx = tensors["model.layers.0.self_attn.q_proj.g_idx"]
    assert not torch.equal(g_idx, torch.arange(len(g_idx)) // 32)  # act-order reordered
    assert torch.equal(g_idx, tensors["model.layers.0.self_attn.k_proj.g_idx"])
    for name in ("awq", "awq-gptq-awq"):
        awq = load_file(checkpoints[name][0] / "model.safetensors")
        assert awq["model.layers.0.mlp.up_proj.qweight"].shape == (64, 128 // 8)  # [K, N/8]
        assert "model.layers.0.mlp.up_proj.weight" not in awq
        assert "model.layers.0.mlp.up_proj.g_idx" not in awq
    config = json.loads((checkpoints["awq-gptq-awq"][0] / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
    assert config["quantization_config"]["minipaged_method"] == "awq-gptq"


def rounded_checkpoint(base, out, method: str):
    """``base`` with its projections' weights rounded here by ``method``'s rule (int8:
    symmetric per row; fp8: E4M3 per row), saved at ``out`` as a dense checkpoint."""
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rsplit(".", 1)[-1] in PROJECTIONS:
                w = module.weight
                if method == "int8":
                    scale = w.abs().amax(1, keepdim=True) / 127
                    w.copy_(torch.round(w / scale).clamp(-128, 127) * scale)
                else:
                    scale = w.abs().amax(1, keepdim=True) / 448
                    w.copy_((w / scale).to(torch.float8_e4m3fn).float() * scale)
    hf.save_pretrained(out)
    for file in base.glob("tokenizer*"):
        (out / file.name).write_bytes(file.read_bytes())
    return out


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_online_quantization_equals_hf_on_rounded_weights(base, tmp_path, method):
    oracle = Oracle(rounded_checkpoint(base, tmp_path / "rounded", method))
    llm = make_llm(base, quantization=method)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_greedy_matches_hf(outputs, PROMPTS, oracle, 6, logprobs=3)


def test_weight_bytes_int8_a_quarter_int4_about_an_eighth(base, checkpoints):
    dense = load_model(base)
    int8 = load_model(base, quantization="int8")
    int4 = load_model(checkpoints["awq"][0])
    shapes = [
        (m.out_features, m.in_features)
        for n, m in AutoModelForCausalLM.from_pretrained(base).named_modules()
        if n.rsplit(".", 1)[-1] in PROJECTIONS
    ]
    elements = sum(n * k for n, k in shapes)
    rest = weight_bytes(dense) - 4 * elements  # embedding, norms, head: float32 in all
    # int8: a byte a weight and a float32 scale per row.
    assert weight_bytes(int8) - rest == elements + 4 * sum(n for n, _ in shapes)
    # int4 on the CPU op: half a byte a weight, a (scale, zero) pair per 32 weights.
    assert weight_bytes(int4) - rest == elements // 2 + elements // 32 * 2 * 4


def test_gptq_error_feedback_beats_rounding_on_the_layer_output():
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(64, 64, generator=g)
    x = torch.randn(512, 64, generator=g) @ mix  # correlated inputs, as real ones are
    w = torch.randn(32, 64, generator=g)
    h = 2 * x.T @ x / len(x)
    rtn = rtn_quantize(w, 4, 32, sym=True).dequantize()
    for act_order in (False, True):
        gptq = gptq_quantize(w, h, 4, 32, sym=True, act_order=act_order).dequantize()
        gptq_error = ((x @ (gptq - w).T) ** 2).mean()
        assert gptq_error < 0.7 * ((x @ (rtn - w).T) ** 2).mean()


def test_awq_clip_takes_each_groups_best_bound_by_brute_force():
    """AutoAWQ's clipping search against a per-(row, group) loop over the same bounds
    with an asymmetric 4-bit rounding written here."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g) * (0.2 + 3 * torch.rand(32, generator=g))
    w = torch.randn(4, 32, generator=g)
    w[0, 3], w[2, 20] = 9.0, -7.0  # outliers, which clipping should cut
    clipped = awq_clip(w, x, bits=4, group_size=16)

    def rounded(v):
        lo, hi = min(float(v.min()), 0.0), max(float(v.max()), 0.0)
        scale = max((hi - lo) / 15, 1e-10)
        zero = round(-lo / scale)
        return ((v / scale).round() + zero).clamp(0, 15).sub(zero) * scale

    cut = 0
    for row in range(4):
        for start in (0, 16):
            xs, ws = x[:, start : start + 16].double(), w[row, start : start + 16].double()
            errors = {}
            for step in range(10):
                bound = float(ws.abs().max()) * (1 - step / 20)
                errors[bound] = float(
                    ((xs @ rounded(ws.clamp(-bound, bound)) - xs @ ws) ** 2).mean()
                )
            chosen = clipped[row, start : start + 16].double()
            bound = float(chosen.abs().max())
            assert torch.allclose(chosen, ws.clamp(-bound, bound), atol=1e-6)
            mine = float(((xs @ rounded(chosen) - xs @ ws) ** 2).mean())
            assert mine <= min(errors.values()) * (1 + 1e-4) + 1e-9
            cut += bound < float(ws.abs().max()) - 1e-6
    assert cut >= 2  # at least the outliers' groups


# -- refusals ---------------------------------------------------------------------------
class Config:
    def __init__(self, **quantization_config):
        self.quantization_config = quantization_config or None


GPTQ = dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=True)
AWQ = dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm")


@pytest.mark.parametrize(
    "quantization,config,match",
    [
        (None, {**GPTQ, "bits": 8}, "'bits' is 8"),
        (None, {**GPTQ, "group_size": 256}, "'group_size' is 256"),
        (None, {**GPTQ, "checkpoint_format": "gptq_v2"}, "'checkpoint_format'"),
        (None, {**GPTQ, "lm_head": True}, "'lm_head'"),
        (None, {**AWQ, "version": "gemv"}, "'version' is 'gemv'"),
        (None, {**AWQ, "zero_point": False}, "'zero_point'"),
        (None, {**AWQ, "group_size": -1}, "'group_size' is -1"),
        (None, {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ("awq", GPTQ, "quantized with 'gptq'"),
        ("fp8", GPTQ, "already quantized"),
        ("gptq", {}, "no quantization_config"),
        ("int4", {}, "quantization must be one of"),
    ],
)
def test_unsupported_quantization_is_refused_naming_the_key(quantization, config, match):
    with pytest.raises(ValueError, match=match):
        resolve_quantization(quantization, Config(**config))


def test_supported_configs_resolve():
    assert resolve_quantization(None, Config()) is None
    assert resolve_quantization("int8", Config()).method == "int8"
    gptq = resolve_quantization(None, Config(**{**GPTQ, "desc_act": True}))
    assert (gptq.method, gptq.bits, gptq.group_size, gptq.desc_act) == ("gptq", 4, 128, True)


def _rewrite(path, tmp_path, change):
    out = tmp_path / "broken"
    out.mkdir()
    for file in path.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    tensors = load_file(out / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


def test_a_tensor_of_the_wrong_shape_is_refused_naming_it(checkpoints, tmp_path):
    name = "model.layers.1.mlp.down_proj.scales"
    path = _rewrite(
        checkpoints["rtn"][0], tmp_path, lambda t: t.update({name: t[name][:, :-8].clone()})
    )
    with pytest.raises(ValueError, match=f"{name}' has shape"):
        load_model(path)


def test_a_missing_g_idx_is_refused_naming_it(checkpoints, tmp_path):
    name = "model.layers.0.self_attn.v_proj.g_idx"
    path = _rewrite(checkpoints["rtn"][0], tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name):
        load_model(path)


def test_merged_projections_with_different_orders_are_refused(checkpoints, tmp_path):
    name = "model.layers.0.self_attn.k_proj.g_idx"
    path = _rewrite(checkpoints["gptq"][0], tmp_path, lambda t: t.update({name: t[name].flip(0)}))
    with pytest.raises(ValueError, match=f"{name} differs"):
        load_model(path)


@pytest.mark.parametrize("combo", [{"enable_lora": True}, {"compilation_config": 1}])
def test_quantization_refuses_what_it_cannot_run_with(combo):
    with pytest.raises(ValueError, match=f"cannot run with {next(iter(combo))}"):
        EngineConfig(model="m", quantization="int8", **combo)


def rank_slices(config, rank: int, size: int) -> dict[str, tuple[list[slice], slice]]:
    """Each merged projection's rows (per HF part) and input columns that ``rank`` of
    ``size`` holds, from the config: Megatron's split, written out here."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d, inter = config.head_dim, config.intermediate_size

    def rows(total):
        return slice(rank * total // size, (rank + 1) * total // size)

    every = slice(None)
    return {
        "self_attn.qkv_proj": ([rows(heads * d), rows(kv * d), rows(kv * d)], every),
        "self_attn.o_proj": ([every], rows(heads * d)),
        "mlp.gate_up_proj": ([rows(inter), rows(inter)], every),
        "mlp.down_proj": ([every], rows(inter)),
    }


HF_PARTS = {
    "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "self_attn.o_proj": ["self_attn.o_proj"],
    "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.down_proj": ["mlp.down_proj"],
}


@pytest.mark.parametrize("name", ["rtn", "gptq", "awq"])
def test_each_rank_holds_its_slice_of_the_dequantized_weight(checkpoints, name):
    """Under tensor_parallel_size=2 every quantized projection, column- or row-parallel,
    multiplies by exactly its rank's slice of the checkpoint's dequantized weight (the
    row-parallel ranks of the act-order GPTQ checkpoint hold columns of every group)."""
    from minipaged.distributed.parallel_state import TensorParallelGroup

    path, oracle = checkpoints[name]
    dense = load_file(oracle.path / "model.safetensors")
    for rank in range(2):
        model = load_model(path, "float32", tp=TensorParallelGroup(rank=rank, size=2, group=None))
        for merged, (rows, cols) in rank_slices(model.config, rank, 2).items():
            layer = model.get_submodule(f"model.layers.1.{merged}")
            eye = torch.eye(layer.in_features)
            held = layer.quant_method.apply(layer, eye, None).T
            parts = [
                dense[f"model.layers.1.{hf}.weight"][r, cols]
                for hf, r in zip(HF_PARTS[merged], rows, strict=True)
            ]
            torch.testing.assert_close(held, torch.cat(parts), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "scheme,parallel",
    [
        ("gptq", {"tensor_parallel_size": 2}),
        ("int8", {"tensor_parallel_size": 2}),
        ("awq", {"pipeline_parallel_size": 2}),
    ],
)
def test_split_over_processes_equals_one_process(base, checkpoints, scheme, parallel):
    """A quantized model over two ranks (column and row slices with their scales;
    int8's scales computed on each rank's slice) or two pipeline stages generates the
    one-process quantized engine's greedy tokens."""
    path, quantization = (base, scheme) if scheme == "int8" else (checkpoints[scheme][0], None)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    one = make_llm(path, quantization=quantization).generate(prompts, greedy, use_tqdm=False)
    split = make_llm(path, quantization=quantization, **parallel)
    try:
        outputs = split.generate(prompts, greedy, use_tqdm=False)
    finally:
        split.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in one]


def test_quantized_model_with_the_engines_other_features(checkpoints):
    """Prefix caching, chunked prefill, swap preemption and beam search on a GPTQ model
    give what the same model gives without them (the weights' kernels see other batch
    shapes, nothing else changes)."""
    path = checkpoints["gptq"][0]
    a, b = PROMPTS
    prompts = [{"prompt_token_ids": p} for p in (a, b, a + b, b + a, b[::-1])]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    plain = make_llm(path).generate(prompts, greedy, use_tqdm=False)
    busy = make_llm(
        path,
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
        max_num_seqs=16,
        num_gpu_blocks=12,  # they need 5, 8, 11, 11 and 8 blocks of 4
        block_size=4,
        preemption_mode="swap",
    )
    outputs = busy.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert busy.stats()["num_preemptions"] > 0
    beams = make_llm(path).beam_search(prompts[:1], BeamSearchParams(beam_width=2, max_tokens=4))
    assert len(beams[0].sequences) == 2


def _grid_error(v, shrink, sym):
    """``sum |v - Q(v)|^2.4`` for 4-bit rounding on the range ``[min, max]`` (both
    including 0; symmetric about 0 if ``sym``) shrunk by ``shrink``, written here."""
    lo, hi = min(float(v.min()), 0.0), max(float(v.max()), 0.0)
    if sym:
        hi = max(-lo, hi)
        lo = -hi
    lo, hi = lo * shrink, hi * shrink
    scale = max((hi - lo) / 15, 1e-10)
    zero = 8 if sym else round(-lo / scale)
    q = ((v / scale).round() + zero).clamp(0, 15)
    return float(((v - (q - zero) * scale).abs() ** 2.4).sum())


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "zero-points"])
def test_mse_grid_search_is_a_brute_force_search_never_worse_than_min_max(sym):
    """GPTQ's ``mse`` range search: each group's error is the least of the 80 shrunk
    ranges a per-(row, group) loop tries, so never more than min/max rounding's."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=g, dtype=torch.float64)
    w[0, 3], w[4, 40] = 8.0, -6.0  # outliers, where a narrower range pays off
    searched = rtn_quantize(w, 4, 32, sym, mse=True).dequantize().double()
    plain = rtn_quantize(w, 4, 32, sym).dequantize().double()
    shrunk = 0
    for row in range(6):
        for start in (0, 32):
            v = w[row, start : start + 32]
            mine = float(((v - searched[row, start : start + 32]).abs() ** 2.4).sum())
            best = min(_grid_error(v, 1 - i / 100, sym) for i in range(80))
            assert mine == pytest.approx(best, rel=1e-5)
            assert mine <= float(((v - plain[row, start : start + 32]).abs() ** 2.4).sum())
            shrunk += mine < _grid_error(v, 1.0, sym) * (1 - 1e-6)
    assert shrunk > 0  # the search did narrow some ranges


def test_mse_never_raises_any_groups_error_on_random_weights():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 256, generator=g) * torch.rand(1, 256, generator=g) * 3
    for sym in (True, False):
        errors = [
            (rtn_quantize(w, 4, 32, sym, mse=mse).dequantize() - w).abs().pow(2.4)
            for mse in (False, True)
        ]
        plain, searched = (e.reshape(128, -1, 32).sum(-1) for e in errors)
        assert (searched <= plain * (1 + 1e-5)).all() and (searched < plain).float().mean() > 0.3


@pytest.fixture(scope="module")
def calibrated_layer(base):
    """The tiny model's first decoder layer and its inputs on four random prompts."""
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    samples = [torch.tensor(random_prompt(32, seed=s)) for s in range(4)]
    return hf.model.layers[0], quantize._layer_inputs(hf, samples)


def _hessians(monkeypatch, layer, inputs, **options) -> dict:
    """Each projection's Hessian as `quantize_layer` hands it to GPTQ (a copy of
    ``layer`` is quantized), and the quantized weights."""
    seen = {}
    real = quantize.gptq_quantize

    def spy(w, hessian, *args, **kwargs):
        seen[len(seen)] = hessian.clone()
        return real(w, hessian, *args, **kwargs)

    monkeypatch.setattr(quantize, "gptq_quantize", spy)
    layer = copy.deepcopy(layer)
    weights = quantize.quantize_layer(layer, inputs, "gptq", 4, 32, True, False, **options)
    return dict(zip(weights, seen.values())), weights


def test_true_sequential_calibrates_each_group_on_the_quantized_ones_before(
    calibrated_layer, monkeypatch
):
    """AutoGPTQ's ``true_sequential``: q, k, v see what the plain run's see; o sees the
    attention through the quantized q, k, v, which this test recomputes with a forward
    hook on a copy of the layer holding those weights (``2 X^T X / n``)."""
    layer, inputs = calibrated_layer
    plain, _ = _hessians(monkeypatch, layer, inputs)
    sequential, weights = _hessians(monkeypatch, layer, inputs, true_sequential=True)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        torch.testing.assert_close(sequential[name], plain[name], rtol=0, atol=0)
    for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert not torch.allclose(sequential[name], plain[name], rtol=1e-4, atol=1e-6)
    oracle = copy.deepcopy(layer)
    xs = []
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(oracle.self_attn, name).weight
            w.copy_(weights[f"self_attn.{name}"].dequantize(w.dtype))
        hook = oracle.self_attn.o_proj.register_forward_hook(
            lambda m, args, out: xs.append(args[0].reshape(-1, args[0].shape[-1]))
        )
        for hidden, kwargs in inputs:
            oracle(hidden, **kwargs)
        hook.remove()
    x = torch.cat(xs)
    torch.testing.assert_close(sequential["self_attn.o_proj"], 2 * x.T @ x / len(x))


def test_awq_scales_fold_into_the_ops_before_leaving_the_layer_unchanged(calibrated_layer):
    """What awq-gptq writes before rounding: AWQ's scales (searched on a symmetric
    grid, GPTQ's) divided out of the norms and ``up_proj``/``v_proj`` rows and
    multiplied into the projections, so the layer computes the same function."""
    layer, inputs = calibrated_layer
    scaled = copy.deepcopy(layer)
    with torch.no_grad():
        seen = quantize._collect(scaled, inputs)
        quantize._awq_scale(scaled, seen, 4, 32, duo_scaling=True, sym=True)
        assert not torch.allclose(scaled.mlp.down_proj.weight, layer.mlp.down_proj.weight)
        for (hidden, kwargs), (out, _) in zip(inputs, quantize._run_layer(scaled, inputs)):
            expected = layer(hidden, **kwargs)
            expected = expected[0] if isinstance(expected, tuple) else expected
            torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-4)


def test_awq_gptq_is_closer_to_the_unquantized_model_than_rounding(base, checkpoints):
    """The awq-gptq checkpoint, read by this file's own GPTQ reader, against the
    unquantized model on its calibration windows (what GPTQ and AWQ minimise the error
    on; a random model has no other text it models): its logits' error is below plain
    rounding's (RTN's checkpoint) by the margin GPTQ's own test asks."""
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ids = torch.stack(quantize.calibration_samples(checkpoints["rtn"][1].tokenizer, 4, 64))
    with torch.no_grad():
        reference = hf(ids).logits
        errors = {
            name: float((checkpoints[name][1].hf(ids).logits - reference).pow(2).mean())
            for name in ("rtn", "awq-gptq")
        }
    config = json.loads((checkpoints["awq-gptq"][0] / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gptq"
    assert config["quantization_config"]["true_sequential"] is True
    assert errors["awq-gptq"] < 0.7 * errors["rtn"]


@pytest.mark.parametrize(
    "method,option",
    [("awq", "act_order"), ("rtn", "true_sequential"), ("awq", "true_sequential"), ("awq", "mse")],
)
def test_options_of_other_methods_are_refused(base, tmp_path, method, option):
    with pytest.raises(ValueError, match=option):
        quantize.quantize_checkpoint(base, tmp_path, method=method, **{option: True})


@pytest.mark.parametrize(
    "options,match",
    [({"act_order": True}, "act_order"), ({"group_size": -1}, "group_size"), ({}, "one of")],
)
def test_what_awqs_format_cannot_hold_is_refused(base, tmp_path, options, match):
    """AWQ's format has no ``g_idx`` (so no act-order) and no group of a whole row."""
    fmt = "awq" if options else "marlin"
    with pytest.raises(ValueError, match=match):
        quantize.quantize_checkpoint(
            base, tmp_path, method="awq-gptq", checkpoint_format=fmt, **options
        )


def test_awqs_format_keeps_the_zero_points_of_0_gptqs_cannot(calibrated_layer):
    """A projection whose weights are all >= 0 takes zero points of 0 on a zero-point
    grid: AWQ's format keeps them (so awq-gptq written in it loses no level), GPTQ's
    raises them to 1 (`quantize.min_zero_point`)."""
    layer, inputs = calibrated_layer
    zeros = {}
    for fmt in ("awq", "gptq"):
        copied = copy.deepcopy(layer)
        with torch.no_grad():
            copied.mlp.down_proj.weight.abs_()
        weights = quantize.quantize_layer(
            copied, inputs, "awq-gptq", 4, 32, False, False, checkpoint_format=fmt
        )
        zeros[fmt] = weights["mlp.down_proj"].zeros
    assert (zeros["awq"] == 0).float().mean() > 0.5 and zeros["gptq"].min() == 1
    formats.check_gptq_zeros(weights["mlp.down_proj"], "down_proj")


def test_the_commands_methods_are_the_modules():
    from minipaged.commands import quantize as command

    assert command.METHODS == quantize.METHODS
    assert command.FORMATS == quantize.FORMATS
