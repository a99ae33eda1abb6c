"""The model layer against Hugging Face transformers on the same weights (the oracle).

Every step runs through a paged KV cache whose physical blocks are shuffled and whose
unwritten slots hold NaN, so reading a wrong slot cannot go unnoticed.
"""

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach the Hub

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from minipaged.core.memory import KVCacheManager
from minipaged.core.memory.block_table import slot_mapping
from minipaged.models import (
    MODELS,
    AttentionMetadata,
    allocate_kv_caches,
    load_model,
    make_tiny_model,
    token_positions,
)
from minipaged.models.llama import rope_frequencies
from minipaged.ops import fused

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
VOCAB = 272
# fp32 against HF: only the order of summation differs (fused q/k/v and gate/up matmuls,
# attention in another kernel), for logits of magnitude ~10.
FP32 = dict(atol=1e-4, rtol=1e-5)


def random_tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(arch, **config_overrides) -> (path, hf_model, our_model)``, built once each."""
    cache = {}

    def get(arch, **overrides):
        key = (arch, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            path = make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, seed=0, **overrides)
            hf = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=torch.float32
            )
            cache[key] = path, hf.eval(), load_model(path)
        return cache[key]

    return get


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


class PagedRunner:
    """The least an engine does: a KV cache manager over a shuffled pool gives each
    sequence its blocks and slots, one step's metadata is built from them, the model
    runs, and the logits are split per sequence."""

    def __init__(self, model, block_size, num_blocks=64, seed=0, prefix_caching=False):
        self.model, self.block_size = model, block_size
        self.forward = model  # what runs a step (`test_compiled_decode` puts its own)
        dtype = model.model.embed_tokens.weight.dtype
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, dtype, "cpu")
        for layer in self.kv_caches:  # (key_cache, value_cache), or a latent cache (MLA)
            for cache in layer:
                cache.fill_(float("nan"))
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        # Take every block, then give them back in a random order: the pool hands them
        # out shuffled, so no sequence's blocks are neighbours.
        for i in range(num_blocks):
            self.kv.allocate(f"shuffle{i}", [1000 + i])
        for i in torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)):
            self.kv.free(f"shuffle{i}")

    def step(self, chunks):
        """``chunks``: ``(seq, new_tokens, num_cached)`` each -> logits ``[n_new, vocab]``
        each.  A sequence's first chunk is its prompt: with prefix caching, only what
        follows the cached prefix runs (and gets logits)."""
        tables, num_cached, num_new, slots, ids = [], [], [], [], []
        for seq, tokens, cached in chunks:
            if self.kv.has_block_table(seq):
                allocation = self.kv.append(seq, tokens)
            else:
                allocation = self.kv.allocate(seq, tokens)
                cached, tokens = (
                    allocation.num_cached_tokens,
                    tokens[allocation.num_cached_tokens :],
                )
            tables.append(allocation.block_table)
            num_cached.append(cached)
            num_new.append(len(tokens))
            slots += allocation.slot_mapping
            ids += tokens
        attn = AttentionMetadata.build(
            tables, num_cached, num_new, self.block_size, slot_mapping=slots
        )
        with torch.no_grad():
            positions = token_positions(num_cached, num_new)
            hidden = self.forward(torch.tensor(ids), positions, self.kv_caches, attn)
            return self.model.compute_logits(hidden).split(num_new)


# Two sequences: A prefilled in two chunks (the second over a cached prefix), then decoding
# while B's prompt is prefilled in chunks in the same steps; then both decode.
SCHEDULE = [
    [("A", 0, 8)],
    [("A", 8, 13)],
    [("B", 0, 6), ("A", 13, 14)],
    [("B", 6, 11), ("A", 14, 15)],
    [("A", 15, 16), ("B", 11, 12)],
    [("A", 16, 17), ("B", 12, 13)],
]


def run_schedule(runner, sequences):
    """Run ``SCHEDULE`` feeding ``sequences``' tokens; returns ``(seq, start, end, logits)``."""
    results = []
    for step in SCHEDULE:
        chunks = [(seq, sequences[seq][start:end], start) for seq, start, end in step]
        for (seq, start, end), logits in zip(step, runner.step(chunks)):
            results.append((seq, start, end, logits))
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_equal_hf(models, arch):
    _, hf, ours = models(arch)
    assert type(ours) is MODELS[type(hf).__name__]
    tokens = random_tokens(40, seed=1)
    (logits,) = PagedRunner(ours, block_size=16).step([("A", tokens, 0)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **FP32)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_torch_reference_ops_equal_hf_too(models, arch):
    """The path CUDA runs (`fused.reference_ops`: the norms, residual adds, rotary and
    SiLU as torch ops), prefill then decode, against HF."""
    _, hf, ours = models(arch)
    tokens = random_tokens(20, seed=2)
    runner = PagedRunner(ours, block_size=16)
    with fused.reference_ops():
        (prefill,) = runner.step([("A", tokens[:-1], 0)])
        (decode,) = runner.step([("A", tokens[-1:], len(tokens) - 1)])
    expected = hf_logits(hf, tokens)
    torch.testing.assert_close(prefill, expected[:-1], **FP32)
    torch.testing.assert_close(decode, expected[-1:], **FP32)


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_in_one_pass_equals_hf_per_prompt(models, arch):
    _, hf, ours = models(arch)
    prompts = [random_tokens(n, seed=n) for n in (5, 23, 1, 16)]
    outs = PagedRunner(ours, block_size=8).step([(i, p, 0) for i, p in enumerate(prompts)])
    for prompt, logits in zip(prompts, outs):
        torch.testing.assert_close(logits, hf_logits(hf, prompt), **FP32)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_in_mixed_batches_equal_hf(models, arch):
    _, hf, ours = models(arch)
    sequences = {"A": random_tokens(17, seed=2), "B": random_tokens(13, seed=3)}
    full = {seq: hf_logits(hf, tokens) for seq, tokens in sequences.items()}
    for seq, start, end, logits in run_schedule(PagedRunner(ours, block_size=4), sequences):
        torch.testing.assert_close(
            logits,
            full[seq][start:end],
            **FP32,
            msg=lambda m, seq=seq, start=start, end=end: f"{seq}[{start}:{end}]: {m}",
        )


def test_prefix_cache_hit_reads_the_shared_blocks(models):
    _, hf, ours = models("qwen3")
    a = random_tokens(13, seed=4)
    b = a[:8] + random_tokens(6, seed=5)  # shares A's first two blocks of 4
    runner = PagedRunner(ours, block_size=4, prefix_caching=True)
    runner.step([("A", a, 0)])
    (logits,) = runner.step([("B", b, 0)])  # the manager serves A's two blocks
    assert runner.kv.block_table("B")[:2] == runner.kv.block_table("A")[:2]
    torch.testing.assert_close(logits, hf_logits(hf, b)[8:], **FP32)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_greedy_decoding_equals_hf_generate(models, arch, block_size):
    _, hf, ours = models(arch)
    prompts = [random_tokens(n, seed=10 + n) for n in (7, 19, 1)]
    runner = PagedRunner(ours, block_size=block_size, num_blocks=128, seed=block_size)
    outs = runner.step([(i, p, 0) for i, p in enumerate(prompts)])
    generated = [[int(logits[-1].argmax())] for logits in outs]
    for step in range(19):
        chunks = [(i, [g[-1]], len(p) + step) for i, (p, g) in enumerate(zip(prompts, generated))]
        for g, logits in zip(generated, runner.step(chunks)):
            g.append(int(logits[-1].argmax()))
    for prompt, ours_new in zip(prompts, generated):
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False
        )
        hf_new = out[0, len(prompt) :].tolist()  # shorter if HF stopped at EOS
        assert hf_new and ours_new[: len(hf_new)] == hf_new


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("variant", sorted(ROPE_SCALINGS))
def test_rope_scaling_variants_equal_hf(models, variant):
    _, hf, ours = models("llama", rope_scaling=ROPE_SCALINGS[variant], max_position_embeddings=256)
    params = ours.config.rope_parameters
    assert {k: params[k] for k in ROPE_SCALINGS[variant]} == ROPE_SCALINGS[variant]
    rotary = ours.model.rotary_emb
    torch.testing.assert_close(rotary.inv_freq, hf.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert rotary.attention_scaling == hf.model.rotary_emb.attention_scaling
    plain = rope_frequencies(models("llama")[2].config)[0]
    # "dynamic" equals plain RoPE up to max_position_embeddings; the others never do.
    assert torch.equal(rotary.inv_freq, plain) == (variant == "dynamic")
    tokens = random_tokens(70, seed=6)  # past original_max_position_embeddings
    (logits,) = PagedRunner(ours, block_size=16).step([("A", tokens, 0)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), **FP32)


def test_unsupported_rope_type_raises(tmp_path):
    path = make_tiny_model(
        tmp_path,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 256,
        },
    )
    with pytest.raises(ValueError, match="rope_type'\\] must be one of .* got 'longrope'"):
        load_model(path)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_backend_equals_torch(models, backend):
    """Chunked prefills, prefix continuations and decodes (``SCHEDULE``) give the torch
    backend's logits, which the tests above hold to HF's."""
    path, _, ours = models("llama")
    other = load_model(path, attention_backend=backend)
    sequences = {"A": random_tokens(17, seed=2), "B": random_tokens(13, seed=3)}
    expected = run_schedule(PagedRunner(ours, block_size=4), sequences)
    actual = run_schedule(PagedRunner(other, block_size=4), sequences)
    for (*_, logits), (*_, reference) in zip(actual, expected):
        torch.testing.assert_close(logits, reference, **FP32)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 0.01), (torch.bfloat16, 0.05)])
def test_half_precision_runs_close_to_fp32(models, dtype, tolerance):
    path, _, fp32 = models("qwen3")
    half = load_model(path, dtype=dtype)
    assert {p.dtype for p in half.parameters()} == {dtype}
    tokens = random_tokens(24, seed=7)
    (expected,) = PagedRunner(fp32, block_size=8).step([("A", tokens, 0)])
    (actual,) = PagedRunner(half, block_size=8).step([("A", tokens, 0)])
    assert actual.dtype == torch.float32 and torch.isfinite(actual).all()
    assert (actual - expected).abs().max() <= tolerance * expected.abs().max()
    agree = (actual.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree >= 0.9


def test_dtype_auto_follows_the_config(tmp_path):
    path = make_tiny_model(tmp_path, arch="qwen2", torch_dtype="bfloat16")
    assert load_model(path).lm_head.weight.dtype == torch.bfloat16
    assert load_model(path, dtype="float16").lm_head.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype must be 'auto', one of .* got torch.float64"):
        load_model(path, dtype=torch.float64)


def test_tied_head_is_the_embedding(models):
    _, _, tied = models("qwen2")
    _, _, untied = models("llama")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_sliding_window_within_it_equals_hf_beyond_it_raises(models):
    _, hf, ours = models("mistral", sliding_window=8)
    tokens = random_tokens(9, seed=8)
    (logits,) = PagedRunner(ours, block_size=4).step([("A", tokens[:8], 0)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens[:8]), **FP32)
    with pytest.raises(ValueError, match="9 tokens exceeds the model's sliding window of 8"):
        PagedRunner(ours, block_size=4).step([("A", tokens, 0)])


def build(tables, num_cached, num_new, block_size):
    """The metadata of ``tables`` by hand, with the slots the memory layer gives."""
    slots = [
        slot
        for table, c, n in zip(tables, num_cached, num_new)
        for slot in slot_mapping(table, block_size, c, c + n)
    ]
    return AttentionMetadata.build(tables, num_cached, num_new, block_size, slot_mapping=slots)


def test_metadata_splits_prefills_from_the_trailing_decodes():
    # Sequence 0: 3 cached + 3 new (a chunk), 1: a 2-token prompt, 2 and 3: decodes.
    attn = build([[7, 2], [5], [1, 4, 6], [3]], [3, 0, 8, 0], [3, 2, 1, 1], block_size=4)
    assert attn.slot_mapping.tolist() == [
        7 * 4 + 3,
        2 * 4,
        2 * 4 + 1,
        5 * 4,
        5 * 4 + 1,
        6 * 4,
        3 * 4,
    ]
    assert attn.num_prefill_tokens == 5 and attn.max_prefill_query_len == 3
    assert attn.prefill_block_tables.tolist() == [[7, 2], [5, 0]]
    assert attn.prefill_query_start_loc.tolist() == [0, 3, 5]
    assert attn.prefill_context_lens.tolist() == [6, 2]
    assert attn.decode_block_tables.tolist() == [[1, 4, 6], [3, 0, 0]]
    assert attn.decode_context_lens.tolist() == [9, 1] and attn.max_decode_context_len == 9
    assert attn.prefill_block_tables.dtype == attn.decode_context_lens.dtype == torch.int32
    assert token_positions([3, 0, 8, 0], [3, 2, 1, 1]).tolist() == [3, 4, 5, 0, 1, 8, 0]
    # A step of decodes only (its own short path): one token each, at its cached count.
    assert token_positions([3, 0, 8], [1, 1, 1]).tolist() == [3, 0, 8]
    assert token_positions([3, 5], [0, 2]).tolist() == [5, 6]  # sum == count, not all 1


def test_metadata_without_prefills_or_decodes_is_empty_on_that_side():
    only_decodes = build([[0], [1]], [2, 3], [1, 1], block_size=4)
    assert only_decodes.num_prefill_tokens == 0
    assert tuple(only_decodes.prefill_block_tables.shape) == (0, 1)
    assert only_decodes.prefill_query_start_loc.tolist() == [0]
    only_prefill = build([[0, 1]], [0], [5], block_size=4)
    assert only_prefill.num_prefill_tokens == 5 and only_prefill.max_decode_context_len == 0
    assert tuple(only_prefill.decode_block_tables.shape) == (0, 1)


def test_metadata_takes_the_kv_cache_managers_slots_as_given():
    manager = KVCacheManager(num_gpu_blocks=6, block_size=4)
    prompt = manager.allocate("A", list(range(6)))
    manager.allocate("B", [1])
    decode = manager.append("B", [2])
    tables = [manager.block_table("A"), manager.block_table("B")]
    slots = prompt.slot_mapping + decode.slot_mapping
    oracle = [tables[0][p // 4] * 4 + p % 4 for p in range(6)] + [tables[1][0] * 4 + 1]
    assert slots == oracle
    given = AttentionMetadata.build(tables, [0, 1], [6, 1], 4, slot_mapping=slots)
    assert given.slot_mapping.tolist() == slots
    with pytest.raises(
        ValueError, match="slot_mapping must have one slot per new token \\(7\\), got 6"
    ):
        AttentionMetadata.build(tables, [0, 1], [6, 1], 4, slot_mapping=slots[:6])


@pytest.mark.parametrize(
    "args, message",
    [
        (([[0]], [0], [5], 4), "block_tables\\[0\\] has 1 blocks of 4 slots, too few for its 5"),
        (([[0]], [0], [0], 4), "num_new >= 1 and num_cached >= 0, got num_new\\[0\\] = 0"),
        (([[0]], [0, 1], [1], 4), "one entry per sequence, got lengths 1, 2 and 1"),
        (([[0]], [0], [1], 0), "block_size must be a positive int, got 0"),
    ],
)
def test_metadata_rejects_bad_sequences(args, message):
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(*args, slot_mapping=[0] * sum(args[2]))


def test_allocate_kv_caches_follows_the_layout_contract(models):
    _, _, qwen3 = models("qwen3")
    caches = allocate_kv_caches(
        qwen3, num_blocks=5, block_size=16, dtype=torch.float16, device="cpu"
    )
    assert len(caches) == qwen3.config.num_hidden_layers
    for key_cache, value_cache in caches:
        assert key_cache.shape == value_cache.shape == (5, 16, 2, 32)  # head_dim from config
        assert key_cache.dtype == torch.float16 and key_cache is not value_cache
    assert allocate_kv_caches(qwen3.config, 1, 1, torch.float32, "cpu")[0][0].shape == (1, 1, 2, 32)
    with pytest.raises(ValueError, match="num_blocks must be a positive int, got 0"):
        allocate_kv_caches(qwen3, 0, 16, torch.float32, "cpu")


def test_forward_needs_one_cache_pair_per_layer(models):
    _, _, ours = models("llama")
    attn = build([[0]], [0], [1], 4)
    caches = allocate_kv_caches(ours, 1, 4, torch.float32, "cpu")[:1]
    with pytest.raises(
        ValueError, match="one \\(key_cache, value_cache\\) pair per layer \\(2\\), got 1"
    ):
        ours(torch.tensor([1]), torch.tensor([0]), caches, attn)


def test_sharded_checkpoint_loads_identically(models, tmp_path):
    path, _, single = models("llama")
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, shard in shards.items():
        save_file({n: tensors[n] for n in shard}, tmp_path / file, metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {}, "weight_map": {n: f for f, shard in shards.items() for n in shard}}
        )
    )
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    sharded = load_model(tmp_path)
    assert sharded.state_dict().keys() == single.state_dict().keys()
    for name, value in single.state_dict().items():
        assert torch.equal(sharded.state_dict()[name], value), name


def rewrite_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"),
            "lacks 1 weights Qwen2ForCausalLM needs: model.layers.1.self_attn.k_proj.bias$",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}),
            "has 1 weights Qwen2ForCausalLM does not use: model.layers.0.self_attn.o_proj.bias$",
        ),
        (
            lambda t: t.update({"model.norm.weight": torch.ones(65)}),
            "'model.norm.weight' has shape \\(65,\\), the model expects \\(64,\\)",
        ),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_loader_names_missing_unexpected_and_misshapen_weights(tmp_path, edit, message):
    path = make_tiny_model(tmp_path, arch="qwen2")
    rewrite_weights(path, edit)
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_tied_checkpoint_may_also_store_a_copy_of_the_head(tmp_path):
    path = make_tiny_model(tmp_path, arch="qwen2")

    def copy_head(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    rewrite_weights(path, copy_head)
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_loader_rejects_unsupported_architectures_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(tmp_path)
    path = make_tiny_model(tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaModel"]}))
    with pytest.raises(
        ValueError, match="config.architectures must name one of .*got \\['LlamaModel'\\]"
    ):
        load_model(path)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="attention_backend must be one of .* got 'flash'"):
        load_model(path, attention_backend="flash")
    (path / "model.safetensors").unlink()
    with pytest.raises(
        FileNotFoundError, match="has neither model.safetensors nor model.safetensors.index.json"
    ):
        load_model(path)
