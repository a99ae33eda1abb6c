"""Tiny random checkpoints: Hugging Face transformers must load them as real ones (offline)."""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach the Hub

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.core_model_loading import revert_weight_conversion

from minipaged.models import make_tiny_model
from minipaged.models.tiny import BOS_ID, EOS_ID, PAD_ID

ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
TEXT = "héllo 世界 🙂\n\tspaces  and tabs"


@pytest.fixture(scope="module", params=sorted(ARCH_CLASSES))
def checkpoint(request, tmp_path_factory):
    arch = request.param
    return arch, make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, seed=0)


def tensors(path):
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def load_model(path):
    model, info = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, output_loading_info=True
    )
    return model.eval(), info


def load_tokenizer(path):
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_checkpoint_has_the_hub_files(checkpoint):
    _, path = checkpoint
    assert {p.name for p in path.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_transformers_loads_every_weight(checkpoint):
    arch, path = checkpoint
    assert AutoConfig.from_pretrained(path, local_files_only=True).architectures == [
        ARCH_CLASSES[arch]
    ]
    model, info = load_model(path)
    assert type(model).__name__ == ARCH_CLASSES[arch]
    # Nothing left to transformers' random init: every weight came from our file.
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    saved = tensors(path)
    # Under the Hub's names: transformers 5 fuses a MoE layer's experts in memory.
    loaded = revert_weight_conversion(
        model, {name: param.detach() for name, param in model.named_parameters()}
    )
    assert loaded.keys() == saved.keys()
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)


def test_forward_gives_finite_logits(checkpoint):
    _, path = checkpoint
    model, _ = load_model(path)
    ids = load_tokenizer(path)(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_hf_greedy_generate_runs_and_varies(checkpoint):
    _, path = checkpoint
    model, _ = load_model(path)
    ids = load_tokenizer(path)("Once upon a time", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    assert new and len(new) <= 12  # at least one token, at most max_new_tokens
    assert all(0 <= t < model.config.vocab_size for t in new)
    assert len(set(new)) > 1 or new == [EOS_ID]  # not stuck on one token: logits are not flat


def test_tokenizer_round_trips_utf8_bytes(checkpoint):
    _, path = checkpoint
    tokenizer = load_tokenizer(path)
    ids = tokenizer(TEXT).input_ids
    assert ids == [BOS_ID, *TEXT.encode()]  # BOS, then one token per UTF-8 byte
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    # Text is NFC-normalised first: "e" + combining acute accent encodes as "é".
    assert tokenizer.decode(tokenizer("e\u0301").input_ids, skip_special_tokens=True) == "é"


def test_special_tokens_agree_with_the_config(checkpoint):
    _, path = checkpoint
    tokenizer = load_tokenizer(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    generation = GenerationConfig.from_pretrained(path, local_files_only=True)
    for source in (tokenizer, config, generation):
        assert (source.bos_token_id, source.eos_token_id, source.pad_token_id) == (
            BOS_ID,
            EOS_ID,
            PAD_ID,
        )
    assert tokenizer.unk_token is None
    assert len(tokenizer) == 259 < config.vocab_size  # the vocabulary is padded, like real ones


def test_chat_template_renders_messages(checkpoint):
    _, path = checkpoint
    tokenizer = load_tokenizer(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi!</s>\n<|assistant|>\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(BOS_ID) == 1 and ids.count(EOS_ID) == 2


def test_architecture_specific_tensors(checkpoint):
    arch, path = checkpoint
    saved = tensors(path)
    config = json.loads((path / "config.json").read_text())
    head_dim = 32 if arch == "qwen3" else 16
    assert config["head_dim"] == head_dim
    attn = "model.layers.0.self_attn"
    assert saved[f"{attn}.q_proj.weight"].shape == (4 * head_dim, 64)
    assert saved[f"{attn}.k_proj.weight"].shape == (2 * head_dim, 64)  # GQA: 2 KV heads
    has_bias = arch in ("qwen2", "qwen2_moe")
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert (f"{attn}.{proj}.bias" in saved) == has_bias
    assert f"{attn}.o_proj.bias" not in saved
    has_qk_norm = arch in ("qwen3", "olmoe")  # per head in Qwen3, over all heads in OLMoE
    assert (f"{attn}.q_norm.weight" in saved) == has_qk_norm
    assert (f"{attn}.k_norm.weight" in saved) == has_qk_norm
    # A tied LM head is the embedding matrix, so the checkpoint leaves it out.
    assert ("lm_head.weight" in saved) == (not config["tie_word_embeddings"])
    assert config["tie_word_embeddings"] == (arch == "qwen2")
    # Experts are stored one tensor per expert and projection, as on the Hub.
    moe = {"mixtral": ("block_sparse_moe", "w1", 5), "qwen2_moe": ("mlp", "gate_proj", 7)}
    moe["olmoe"] = ("mlp", "gate_proj", 6)
    if arch in moe:
        block, gate, experts = moe[arch]
        assert saved[f"model.layers.0.{block}.gate.weight"].shape == (experts, 64)
        assert saved[f"model.layers.0.{block}.experts.{experts - 1}.{gate}.weight"].shape == (
            32,
            64,
        )


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", arch="qwen3", seed=7)
    b = make_tiny_model(tmp_path / "b", arch="qwen3", seed=7)
    c = make_tiny_model(tmp_path / "c", arch="qwen3", seed=8)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    first, other = tensors(a), tensors(c)
    assert first.keys() == other.keys()
    assert all(not torch.equal(first[name], other[name]) for name in first)


def test_overrides_change_the_config(tmp_path):
    path = make_tiny_model(tmp_path, arch="llama", num_hidden_layers=3, hidden_size=32)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    assert (config.num_hidden_layers, config.hidden_size) == (3, 32)
    assert tensors(path)["model.layers.2.mlp.down_proj.weight"].shape == (32, 128)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"arch": "gpt2"},
            "arch must be one of ['deepseek_v2', 'llama', 'llava', 'mistral', 'mixtral', 'olmoe', "
            "'qwen2', 'qwen2_moe', 'qwen2_vl', 'qwen3'], got 'gpt2'",
        ),
        ({"seed": -1}, "seed must be a non-negative int, got -1"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as error:
        make_tiny_model(tmp_path / "never", **kwargs)
    assert str(error.value) == message
    assert not (tmp_path / "never").exists()
