"""Qwen2-VL through the engine, against transformers' ``Qwen2VLForConditionalGeneration``.

The oracle is Hugging Face's model and processor on the same tiny random checkpoint
(its own vision tower, Qwen2's layers, M-RoPE): greedy tokens must be equal for images
of different sizes (a different token count each), two images in one prompt and text
alone, while the engine chunks prompts through and just after an image, reuses
prefix-cached KV, forks ``n`` > 1 completions and preempts by recompute: each of which
starts a step at a token whose M-RoPE position is not its index.  The positions
themselves are checked against transformers' ``get_rope_index``, a chunk at a time.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
)

from engine_helpers import assert_all_blocks_free, make_llm
from minipaged import SamplingParams
from minipaged.distributed.parallel_state import PipelineStage
from minipaged.models import llava as llava_model
from minipaged.models import qwen2_vl as qwen2_vl_model
from minipaged.models.qwen2_vl import mrope_positions
from minipaged.models.tiny import QWEN2_VL_TOKENS, make_tiny_model
from server_helpers import MODEL, in_process_app, openai_client
from test_multimodal import GREEDY, data_url, hf_greedy, mm_prompt, noise_image

V = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"USER: {V}What is in it? ASSISTANT:"
IMAGE_ID = QWEN2_VL_TOKENS["image_token_id"]
# 12-token steps: an image's 6 to 16 tokens are cut by a chunk boundary.
CHUNKED = dict(block_size=4, max_num_batched_tokens=12, max_num_seqs=4)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-vl"), arch="qwen2_vl", seed=0)


@pytest.fixture(scope="module")
def hf(qwen2_vl):
    """transformers' processor and model.  The processor's video half needs torchvision,
    which the CPU environment lacks; only its class check touches it, so it is skipped."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Qwen2VLProcessor, "check_argument_for_proper_class", lambda *a: None)
        processor = Qwen2VLProcessor(
            image_processor=AutoImageProcessor.from_pretrained(qwen2_vl, local_files_only=True),
            tokenizer=AutoTokenizer.from_pretrained(qwen2_vl, local_files_only=True),
        )
    model = Qwen2VLForConditionalGeneration.from_pretrained(
        qwen2_vl, local_files_only=True, dtype=torch.float32
    ).eval()
    return processor, model


@pytest.fixture(scope="module")
def oracle(hf):
    """``oracle(text, images, add_special_tokens=True)``: HF's prompt ids and greedy
    continuation."""
    return hf_greedy(*hf)


@pytest.fixture(scope="module")
def llm(qwen2_vl):
    return make_llm(qwen2_vl, limit_mm_per_prompt={"image": 2}, **CHUNKED)


def assert_matches(outputs, requests, oracle):
    for out, (text, images) in zip(outputs, requests):
        prompt_ids, expected = oracle(text, images)
        assert out.prompt_token_ids == prompt_ids
        assert all(c.token_ids == expected for c in out.outputs)


def test_positions_equal_transformers_get_rope_index_chunk_by_chunk(llm, hf):
    processor, model = hf
    text = f"USER: {V}and {V}: which?"
    images = [noise_image(1), noise_image(2, size=(60, 20))]
    inputs = processor(text=text, images=images, return_tensors="pt")
    expected, delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    expected, delta = expected[:, 0].numpy(), int(delta)
    ids, features = llm.engine.process_multimodal(text, images)
    assert [f.num_embeds for f in features] == [12, 16]  # dynamic resolution: two sizes
    length = len(ids)
    # Chunks of 5 from anywhere (inside an image, across one), then generated tokens.
    chunks = [
        mrope_positions(np.arange(s, min(s + 5, length)), features, 2) for s in range(0, length, 5)
    ]
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), expected)
    after = mrope_positions(np.arange(length, length + 3), features, 2)
    np.testing.assert_array_equal(after, np.tile(np.arange(length, length + 3) + delta, (3, 1)))
    assert delta == -16 and not (expected == np.arange(length)).all()


def record_steps(llm) -> list[dict[str, int]]:
    """Each step's new tokens per sequence, from now on."""
    steps, schedule = [], llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append(dict(out.num_scheduled_tokens))
        return out

    llm.engine.scheduler.schedule = recording
    return steps


def test_greedy_matches_hf_for_images_of_different_sizes_chunked(llm, oracle):
    a, b, c = noise_image(1), noise_image(2, size=(60, 20)), noise_image(3, size=(12, 12))
    requests = [
        (PROMPT, [a]),
        (PROMPT, [b]),
        (PROMPT, [c]),  # below min_pixels: scaled up
        (f"{V} and {V}: which differs?", [b, a]),
        ("no image here, just words", []),
    ]
    steps = record_steps(llm)
    outputs = llm.generate([mm_prompt(t, *i) for t, i in requests], GREEDY, use_tqdm=False)
    assert_matches(outputs, requests, oracle)
    counts = [out.prompt_token_ids.count(IMAGE_ID) for out in outputs]
    assert counts == [12, 16, 4, 28, 0]
    # The two-image prompt's chunks: some end inside an image's placeholder run.
    ids, request_id = outputs[3].prompt_token_ids, outputs[3].request_id
    ran = [n for step in steps for s, n in step.items() if s.split(".")[0] == request_id]
    bounds = np.cumsum(ran).tolist()
    images = np.flatnonzero(np.asarray(ids) == IMAGE_ID)
    runs = [(r[0], r[-1] + 1) for r in np.split(images, np.flatnonzero(np.diff(images) > 1) + 1)]
    assert [hi - lo for lo, hi in runs] == [16, 12]
    assert sum(lo < b < hi for b in bounds for lo, hi in runs) >= 2
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_prefix_cache_n_and_preemption(qwen2_vl, oracle, preemption_mode):
    """A prompt whose blocks the prefix cache holds starts past its image; ``n`` = 2
    forks after the prompt; recompute preemption re-runs prompt and output, swap brings
    them back: each position from its index and the request's images."""
    llm = make_llm(
        qwen2_vl,
        num_gpu_blocks=40,
        preemption_mode=preemption_mode,
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    images = [noise_image(10 + i, size=(40 + 8 * i, 30)) for i in range(3)]
    params = SamplingParams(n=2, max_tokens=8, temperature=0)
    requests = [(PROMPT, [i]) for i in images]
    outputs = llm.generate([mm_prompt(t, *i) for t, i in requests], params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert_matches(outputs, requests, oracle)
    before = llm.engine.kv.gpu.num_hit_tokens
    (again,) = llm.generate(mm_prompt(PROMPT, images[0]), GREEDY, use_tqdm=False)
    hit = llm.engine.kv.gpu.num_hit_tokens - before
    assert hit > again.prompt_token_ids.index(IMAGE_ID) + 12  # past the image
    assert_matches([again], [(PROMPT, [images[0]])], oracle)
    assert_all_blocks_free(llm)


def chat_text(llm, content: str) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def test_chat_with_image_url_parts(llm, oracle):
    a, b = noise_image(20, size=(24, 40)), noise_image(21)
    content = [
        {"type": "image_url", "image_url": {"url": data_url(a)}},
        {"type": "image_url", "image_url": {"url": data_url(b)}},
        {"type": "text", "text": "Compare them."},
    ]
    (out,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    prompt_ids, expected = oracle(
        chat_text(llm, f"{V}\n{V}\nCompare them."), [a, b], add_special_tokens=False
    )
    assert out.prompt_token_ids == prompt_ids and out.outputs[0].token_ids == expected


def test_too_many_images_and_unsupported_combinations_are_refused(llm, qwen2_vl):
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llm.generate(mm_prompt(V * 3, *[noise_image(1)] * 3), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="placeholders for 1 images"):
        llm.generate(mm_prompt("no placeholder", noise_image(1)), GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm)
    with pytest.raises(ValueError, match="a multimodal model cannot run with enable_lora"):
        make_llm(qwen2_vl, enable_lora=True)


@pytest.mark.parametrize(
    "model_class",
    [llava_model.LlavaForConditionalGeneration, qwen2_vl_model.Qwen2VLForConditionalGeneration],
)
def test_both_vision_models_refuse_to_be_split(model_class):
    """Tensor or pipeline parallelism, refused naming the model (before it is built)."""
    with pytest.raises(
        ValueError, match=f"tensor_parallel_size must be 1 for {model_class.__name__}"
    ):
        model_class.check_parallel(None, 2)
    with pytest.raises(
        ValueError, match=f"pipeline_parallel_size must be 1 for {model_class.__name__}"
    ):
        model_class(None, pp=PipelineStage(rank=0, size=2))


def test_chat_completions_with_an_image_matches_hf(qwen2_vl, oracle):
    image = noise_image(30, size=(50, 25))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": "What is it?"},
            ],
        }
    ]
    for base_url, _, _ in in_process_app(qwen2_vl, engine_kwargs={"block_size": 4}):
        with openai_client(base_url) as client:
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0
            )
            with pytest.raises(openai.BadRequestError, match="does not decode"):
                bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}}]
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": bad}], max_tokens=2
                )
    tokenizer = AutoTokenizer.from_pretrained(qwen2_vl, local_files_only=True)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{V}\nWhat is it?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt_ids, expected = oracle(text, [image], add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_disable_chunked_mm_input_with_images_of_different_sizes(qwen2_vl, oracle):
    """Each image's tokens (16 and 12 here) run in one chunk of 16-token steps."""
    with pytest.raises(ValueError, match="up to 16 tokens in one chunk"):
        make_llm(qwen2_vl, disable_chunked_mm_input=True, max_num_batched_tokens=15, max_num_seqs=1)
    llm = make_llm(
        qwen2_vl,
        disable_chunked_mm_input=True,
        max_num_batched_tokens=16,
        max_num_seqs=1,
        block_size=4,
        enable_prefix_caching=False,
        limit_mm_per_prompt={"image": 2},
    )
    steps = record_steps(llm)
    text, images = f"USER: {V} and {V}: which?", [noise_image(60, (60, 20)), noise_image(61)]
    (out,) = llm.generate(mm_prompt(text, *images), GREEDY, use_tqdm=False)
    assert_matches([out], [(text, images)], oracle)
    ids = out.prompt_token_ids
    ends = [b for b in np.cumsum([n for step in steps for n in step.values()]) if b < len(ids)]
    where = np.flatnonzero(np.asarray(ids) == IMAGE_ID)
    runs = [(r[0], r[-1] + 1) for r in np.split(where, np.flatnonzero(np.diff(where) > 1) + 1)]
    assert [hi - lo for lo, hi in runs] == [16, 12]
    assert not any(lo < b < hi for b in ends for lo, hi in runs)
    assert ends[0] == runs[0][0]  # the first chunk stopped before the first image
