"""Pooling models: ``LLM(model, runner="pooling").embed`` against Hugging Face.

The oracle is transformers' base model (``AutoModel``) on the same checkpoint: its last
hidden states, after the final norm, pooled (LAST, MEAN, CLS), cut to ``dimensions``
and normalized here with torch, by hand.  The engine runs every prompt as a prefill,
chunked (a step of 16 tokens takes a 100-token prompt in seven), beside prompts of
other lengths, with prefix caching on, and under preemption by recompute and by swap.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from engine_helpers import as_inputs, assert_all_blocks_free, make_llm, random_prompt
from minipaged import SamplingParams
from minipaged.config import EngineConfig
from minipaged.pooling_params import PoolingParams

# fp32 against HF: only the order of summation differs.
FP32 = dict(atol=1e-4, rtol=1e-4)
LENGTHS = (3, 17, 100, 40, 1)
# A step of 16 tokens: the longer prompts run in chunks, beside the shorter ones.
CHUNKED = dict(max_num_batched_tokens=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny("llama")[0]


@pytest.fixture(scope="module")
def hf(llama):
    return AutoModel.from_pretrained(llama, local_files_only=True, dtype=torch.float32).eval()


def expected(hf, prompt, pooling_type="LAST", normalize=True, dimensions=None) -> torch.Tensor:
    """HF's final hidden states of ``prompt``, pooled, cut and normalized by hand."""
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt])).last_hidden_state[0]
    pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    if dimensions is not None:
        pooled = pooled[:dimensions]
    return F.normalize(pooled, dim=-1) if normalize else pooled


def assert_embeddings(outputs, prompts, hf, **pooling) -> None:
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, out in zip(prompts, outputs):
        assert out.finished
        want = expected(hf, prompt, **pooling)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, **FP32)


@pytest.fixture(scope="module")
def engines(llama):
    """One chunked-prefill pooling engine per pooling type (built on first use)."""
    built = {}

    def get(pooling_type: str):
        if pooling_type not in built:
            built[pooling_type] = make_llm(
                llama,
                runner="pooling",
                pooler_config={"pooling_type": pooling_type},
                num_gpu_blocks=64,
                **CHUNKED,
            )
        return built[pooling_type]

    return get


PROMPTS = [random_prompt(n, seed=n) for n in LENGTHS]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_a_mixed_batch_of_chunked_prompts_matches_hf_pooled(engines, hf, pooling_type):
    llm = engines(pooling_type)
    outputs = llm.embed(as_inputs(PROMPTS), use_tqdm=False)
    assert_embeddings(outputs, PROMPTS, hf, pooling_type=pooling_type)
    assert all(len(o.outputs.embedding) == hf.config.hidden_size for o in outputs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_prefix_caching_keeps_embeddings_right(engines, hf, pooling_type):
    """Prompts sharing a 64-token prefix, each embedded after the other filled the
    cache: LAST reads the cached blocks (its last token always runs), MEAN reads none
    (a cached block has no hidden states), and both match HF."""
    llm = engines(pooling_type)
    prefix = random_prompt(64, seed=7)
    prompts = [prefix + random_prompt(n, seed=8 + n) for n in (5, 20)] + [list(prefix)]
    for prompt in prompts:
        out = llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)
        assert_embeddings(out, [prompt], hf, pooling_type=pooling_type)
    assert (llm.stats()["prefix_cache_hit_rate"] > 0) == (pooling_type == "LAST")
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_neither_loses_nor_double_counts_a_chunk(
    llama, hf, monkeypatch, preemption_mode
):
    """A 100-token prompt preempted after two of its 16-token chunks (the pool reports
    itself full for one step): recomputed, it runs those chunks again; swapped, it goes
    on from its third.  MEAN, which sums every chunk, still matches HF."""
    llm = make_llm(
        llama,
        runner="pooling",
        pooler_config={"pooling_type": "MEAN", "normalize": False},
        num_gpu_blocks=16,
        preemption_mode=preemption_mode,
        **CHUNKED,
    )
    engine, prompt = llm.engine, random_prompt(100, seed=3)
    engine.add_request("long", prompt, PoolingParams())
    assert engine.step() == [] and engine.step() == []
    with monkeypatch.context() as full:
        full.setattr(engine.kv, "can_append_any", lambda *_: False)
        full.setattr(engine.kv, "can_append_all", lambda *_: False)
        assert engine.step() == []
    assert engine.scheduler.num_preemptions == 1
    swapped = llm.stats()["num_swapped_out_blocks"]
    assert swapped > 0 if preemption_mode == "swap" else swapped == 0
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert_embeddings(outputs, [prompt], hf, pooling_type="MEAN", normalize=False)
    assert_all_blocks_free(llm)


def test_normalize_per_request_overrides_the_pooler_config(engines, hf):
    llm = engines("LAST")
    raw, unit = llm.embed(
        as_inputs(PROMPTS[:2]),
        [PoolingParams(normalize=False), PoolingParams(normalize=True)],
        use_tqdm=False,
    )
    assert_embeddings([raw], PROMPTS[:1], hf, normalize=False)
    assert_embeddings([unit], PROMPTS[1:2], hf, normalize=True)
    assert abs(torch.tensor(raw.outputs.embedding).norm() - 1) > 1e-2


def test_matryoshka_dimensions_cut_then_normalize(tiny):
    path = tiny("llama", matryoshka_dimensions=[16, 32])[0]
    model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    llm = make_llm(path, runner="pooling", num_gpu_blocks=16)
    outputs = llm.embed(as_inputs(PROMPTS[:2]), PoolingParams(dimensions=16), use_tqdm=False)
    assert_embeddings(outputs, PROMPTS[:2], model, dimensions=16)
    with pytest.raises(ValueError, match=r"dimensions=20: .*only matryoshka dimensions \[16, 32\]"):
        llm.embed("hi", PoolingParams(dimensions=20), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_dimensions_on_a_model_without_matryoshka_is_refused(engines):
    llm = engines("LAST")
    with pytest.raises(ValueError, match="dimensions=8: the model does not support matryoshka"):
        llm.embed(["a", "b"], PoolingParams(dimensions=8), use_tqdm=False)
    assert_all_blocks_free(llm)  # the good prompt of the call was not queued either


def test_a_pooling_model_does_not_generate_nor_a_generating_one_embed(engines, llama):
    with pytest.raises(ValueError, match="runner='pooling', which makes embeddings"):
        engines("LAST").generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    generating = make_llm(llama, num_gpu_blocks=8)
    with pytest.raises(ValueError, match="runner='generate', which generates text"):
        generating.embed("hi", use_tqdm=False)


def test_task_embed_is_the_pooling_runner(llama):
    assert EngineConfig(llama, task="embed").runner == "pooling"
    assert EngineConfig(llama).runner == "generate"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"runner": "pooling", "pooler_config": {"softmax": True}}, "pooler_config key 'softmax'"),
        ({"runner": "pooling", "pooler_config": {"pooling_type": "STEP"}}, "pooling_type must"),
        ({"pooler_config": {"pooling_type": "MEAN"}}, "pooler_config needs runner='pooling'"),
        ({"runner": "pooling", "tensor_parallel_size": 2}, "runner='pooling' cannot run with"),
        ({"runner": "pooling", "enable_lora": True}, "runner='pooling' cannot run with"),
        ({"runner": "embed"}, "runner must be one of"),
        ({"task": "embed", "runner": "generate"}, "contradicts"),
    ],
)
def test_bad_pooling_settings_are_value_errors(llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(llama, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"dimensions": 0}, "dimensions must be"), ({"normalize": "yes"}, "normalize must")],
)
def test_bad_pooling_params_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolingParams(**kwargs)


def test_smollm2_last_token_embeddings_match_hf(smollm2):
    """SmolLM2's real weights as an embedding model (LAST, normalized)."""
    model = AutoModel.from_pretrained(smollm2, local_files_only=True, dtype=torch.float32).eval()
    llm = make_llm(
        smollm2, runner="pooling", dtype="float32", num_gpu_blocks=32, max_model_len=256, **CHUNKED
    )
    tokenizer = llm.get_tokenizer()
    texts = ["The capital of France is Paris.", "Paged attention stores the KV cache in blocks."]
    prompts = [tokenizer.encode(t) for t in texts]
    outputs = llm.embed(texts, use_tqdm=False)
    assert_embeddings(outputs, prompts, model)


def test_serve_flags_reach_the_pooler_config():
    from minipaged.arg_utils import engine_kwargs
    from minipaged.cli import build_parser
    from minipaged.pooling_params import PoolerConfig

    argv = ["serve", "M", "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}']
    config = EngineConfig(model="M", **engine_kwargs(build_parser().parse_args(argv)))
    assert config.runner == "pooling"
    assert config.pooler_config == PoolerConfig(pooling_type="MEAN", normalize=True)
