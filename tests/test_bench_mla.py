"""``minipaged bench mla``: the bytes per token worked out by hand from the config.json
values it cites, and a small decode run through the command (timings are not checked;
the two decode forms' outputs are checked against each other inside it)."""

import json

import pytest
import torch

from cli_helpers import run_main
from minipaged.bench.mla import memory_rows, paper_anchor


def test_bytes_per_token_and_sequences_from_the_configs():
    rows = {r["cache"]: r for r in memory_rows(budget_gib=16, seq_len=4096, dtype=torch.bfloat16)}
    latent = 27 * (512 + 64) * 2  # layers x (kv_lora_rank + qk_rope_head_dim) x bf16
    mha = 27 * 16 * ((128 + 64) + 128) * 2  # 16 heads of a 192-wide key and 128-wide value
    qwen = 48 * 8 * 2 * 128 * 2  # 48 layers, 8 KV heads of 128, keys and values
    expected = {
        "DeepSeek-V2-Lite, latent (MLA)": latent,
        "DeepSeek-V2-Lite, 16 KV heads (MHA)": mha,
        "DeepSeek-V2-Lite, 8 KV heads (GQA)": mha // 2,
        "DeepSeek-V2-Lite, 2 KV heads (GQA)": mha // 8,
        "Qwen2.5-14B, 8 KV heads (GQA)": qwen,
    }
    assert {name: r["bytes_per_token"] for name, r in rows.items()} == expected
    for name, per_token in expected.items():
        assert rows[name]["sequences"] == 16 * 2**30 // (per_token * 4096)
        assert rows[name]["latent_share"] == latent / per_token


def test_the_papers_reduction_against_deepseek_67b():
    """The paper's 93.3%: DeepSeek-V2's 60 layers of 512 + 64 latent values at 6 bits
    an element, against DeepSeek 67B's 95 layers of 8 KV heads of 128 in bfloat16."""
    anchor = paper_anchor()
    gqa = 95 * 8 * 128 * 2 * 2  # layers x KV heads x head_dim x (key, value) x bf16
    assert anchor["deepseek_67b_bytes_per_token"] == gqa
    assert anchor["deepseek_v2_bytes_per_token"] == 60 * 576 * 2
    assert anchor["deepseek_v2_deployed_bytes_per_token"] == 60 * 576 * 6 / 8
    assert anchor["reduction_deployed"] == pytest.approx(0.933, abs=5e-4)
    assert anchor["reduction_bfloat16"] == pytest.approx(1 - 60 * 576 * 2 / gqa)


def test_the_command_writes_both_tables(tmp_path, capsys):
    argv = ["bench", "mla", "--batch", "2", "--context-lens", "20", "--out", str(tmp_path)]
    assert run_main(argv) in (0, None)
    doc = json.loads((tmp_path / "mla.json").read_text())
    assert doc["paper_anchor"] == paper_anchor()
    rows = doc["results"]
    decode = [r for r in rows if "form" in r]
    assert [r["form"] for r in decode] == ["absorbed", "unabsorbed"]
    assert decode[0]["kernel_bytes"] == 2 * 20 * (512 + 64) * 4
    assert decode[1]["kernel_bytes"] == 2 * 20 * 2 * 16 * (128 + 64) * 4
    assert decode[0]["speedup"] > 0
    assert (tmp_path / "mla.png").is_file()
    out = capsys.readouterr().out
    assert "absorbed speedup" in out and "93.3% smaller (the paper: 93.3%)" in out
