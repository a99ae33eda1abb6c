"""LLaVA through the engine, against transformers' ``LlavaForConditionalGeneration``.

The oracle is Hugging Face's model and processor on the same tiny random checkpoint
(a CLIP tower, the projector and a Llama): greedy tokens must be equal, with images in
the prompt, while the engine chunks prompts through the middle of an image's
placeholder, reads repeated images from its encoder cache, reuses (or must not reuse)
prefix-cached KV, forks ``n`` > 1 completions and preempts by recompute.  Bad images and
unsupported combinations are ``ValueError``s naming the cause, and leave nothing behind.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from engine_helpers import assert_all_blocks_free, make_llm
from minipaged import SamplingParams
from minipaged.arg_utils import engine_kwargs
from minipaged.cli import build_parser
from minipaged.config import EngineConfig
from minipaged.core.memory import KVCacheManager
from minipaged.core.memory.prefix_cache import MultiModalKey
from minipaged.models.tiny import EOS_ID, IMAGE_TOKEN_ID, make_tiny_model
from minipaged.multimodal.processing import mm_hash

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PROMPT = "USER: <image>\nWhat is in it? ASSISTANT:"
# A 12-token step: the 16-token placeholder after a 6-token prefix runs over two steps.
CHUNKED = dict(block_size=4, max_num_batched_tokens=12, max_num_seqs=4)


def noise_image(seed: int, size=(40, 30)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llava"), arch="llava", seed=0)


@pytest.fixture(scope="module")
def oracle(llava):
    """``oracle(text, images, add_special_tokens=True)``: HF's greedy continuation."""
    processor = AutoProcessor.from_pretrained(llava, local_files_only=True)
    model = LlavaForConditionalGeneration.from_pretrained(
        llava, local_files_only=True, dtype=torch.float32
    ).eval()
    return hf_greedy(processor, model)


def hf_greedy(processor, model):
    """``greedy(text, images, add_special_tokens=True)``: HF's prompt ids and greedy
    continuation by ``processor`` and ``model``, each asked once."""
    cache = {}

    def greedy(text, images, add_special_tokens=True):
        key = (text, tuple(np.asarray(i).tobytes() for i in images), add_special_tokens)
        if key not in cache:
            inputs = processor(
                text=text,
                images=images or None,
                add_special_tokens=add_special_tokens,
                return_tensors="pt",
            )
            out = model.generate(
                **inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=EOS_ID
            )
            cache[key] = (
                inputs["input_ids"][0].tolist(),
                out[0, inputs["input_ids"].shape[1] :].tolist(),
            )
        return cache[key]

    return greedy


@pytest.fixture(scope="module")
def llm(llava):
    return make_llm(llava, limit_mm_per_prompt={"image": 2}, **CHUNKED)


def mm_prompt(text, *images):
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


def assert_matches(outputs, requests, oracle):
    for out, (text, images) in zip(outputs, requests):
        prompt_ids, expected = oracle(text, images)
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == expected


def test_greedy_matches_hf_with_images_chunked_through_the_placeholder(llm, oracle):
    a, b = noise_image(1), noise_image(2, size=(64, 48))
    requests = [
        (PROMPT, [a]),
        (PROMPT, [b]),
        ("<image> and <image>: which differs?", [b, a]),
        ("no image here, just words", []),
    ]
    outputs = llm.generate([mm_prompt(t, *i) for t, i in requests], GREEDY, use_tqdm=False)
    assert_matches(outputs, requests, oracle)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # images matter
    assert_all_blocks_free(llm)


def test_a_repeated_image_is_encoded_once(llm, oracle):
    image = noise_image(3)
    before = llm.stats()
    requests = [(PROMPT, [image]), ("<image> again", [image]), (PROMPT, [image])]
    outputs = llm.generate([mm_prompt(t, *i) for t, i in requests], GREEDY, use_tqdm=False)
    assert_matches(outputs, requests, oracle)
    after = llm.stats()
    assert after["num_encoded_images"] - before["num_encoded_images"] == 1
    assert after["encoder_cache_queries"] - before["encoder_cache_queries"] == 3
    assert after["encoder_cache_hits"] - before["encoder_cache_hits"] == 2
    # Later, the same picture sent as a data URL (decoded anew) is still a hit.
    out = llm.chat(
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}],
            }
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert llm.stats()["num_encoded_images"] == after["num_encoded_images"]
    text = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "<image>\n"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids, expected = oracle(text, [image], add_special_tokens=False)
    assert out[0].prompt_token_ids == prompt_ids and out[0].outputs[0].token_ids == expected


def test_the_prefix_cache_keys_on_the_image(llava, oracle):
    """The same text before two different images shares only its blocks before the
    image; the same image shares every full block."""
    # An encoder cache of one image: each new image evicts the last.
    llm = make_llm(llava, block_size=4, encoder_cache_size=16)
    a, b = noise_image(4), noise_image(5)
    hits, encoded = [], []
    for image in (a, b, a):
        before = llm.stats()
        (out,) = llm.generate(mm_prompt(PROMPT, image), GREEDY, use_tqdm=False)
        assert_matches([out], [(PROMPT, [image])], oracle)
        after = llm.stats()
        computed = after["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"]
        hits.append(len(out.prompt_token_ids) - computed)
        encoded.append(after["num_encoded_images"] - before["num_encoded_images"])
    placeholder = out.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert hits[1] == placeholder // 4 * 4  # image b after image a: the blocks before it
    assert hits[2] == (len(out.prompt_token_ids) - 1) // 4 * 4  # a again: its full blocks
    # The cached blocks cover a's placeholder whole: its KV needs no encoder run.
    assert encoded == [1, 1, 0]
    # The same image, other text right after it: the hit ends inside the placeholder,
    # whose last embeddings need the encoder again (b evicted a's; the last request
    # needed none).
    other = "USER: <image>Where?"
    before = llm.stats()
    (out,) = llm.generate(mm_prompt(other, a), GREEDY, use_tqdm=False)
    assert_matches([out], [(other, [a])], oracle)
    after = llm.stats()
    computed = after["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"]
    hit = len(out.prompt_token_ids) - computed
    placeholder = out.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert placeholder < hit < placeholder + 16
    assert after["num_encoded_images"] - before["num_encoded_images"] == 1


@pytest.mark.parametrize("block_size, offset", [(4, 8), (4, 9), (16, 3)])
def test_the_kv_cache_manager_shares_the_blocks_before_an_image(block_size, offset):
    """At the memory layer: the same ids with another image find exactly the full blocks
    that end at or before the image's offset; the same image finds every full block; an
    adapter keys every block."""
    kv = KVCacheManager(64, block_size, enable_prefix_caching=True)
    prompt = list(range(100, 100 + offset)) + [IMAGE_TOKEN_ID] * 16 + list(range(7))

    def key(image, lora_id=None):
        return MultiModalKey(lora_id, ((image, offset, 16),))

    kv.allocate("a", prompt, extra_key=key("a"))
    assert kv.num_cached_tokens(prompt, key("b")) == offset // block_size * block_size
    assert kv.num_cached_tokens(prompt, key("a")) == (len(prompt) - 1) // block_size * block_size
    assert kv.num_cached_tokens(prompt, key("a", lora_id=1)) == 0


def test_text_before_an_image_is_shared_across_images(llava, oracle):
    """Blocks are keyed on an image only from the image on (vLLM's per-block extra
    keys): prompts with two full blocks of the same text before different images
    share exactly those blocks, counted by the prefix cache's own hit counter."""
    block_size = 4
    llm = make_llm(llava, block_size=block_size)
    gpu = llm.engine.kv.gpu
    text = "USER: here is a long question about the picture <image>\nWhat? ASSISTANT:"
    a, b = noise_image(6), noise_image(7)
    hits = []
    for image in (a, b, a):
        before = gpu.num_hit_tokens
        (out,) = llm.generate(mm_prompt(text, image), GREEDY, use_tqdm=False)
        assert_matches([out], [(text, [image])], oracle)
        hits.append(gpu.num_hit_tokens - before)
    placeholder = out.prompt_token_ids.index(IMAGE_TOKEN_ID)
    # The block holding the last text tokens and the first image tokens is not shared.
    assert placeholder >= 2 * block_size and placeholder % block_size != 0
    full_blocks = (len(out.prompt_token_ids) - 1) // block_size
    assert hits == [0, placeholder // block_size * block_size, full_blocks * block_size]
    assert_all_blocks_free(llm)


def record_steps(llm) -> list[tuple[int, list[int]]]:
    """Per step from now on: the encoder tokens it runs, and each sequence's new tokens."""
    steps, schedule = [], llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        encoder = sum(f.num_embeds for f in out.scheduled_encoder_inputs.values())
        steps.append((encoder, list(out.num_scheduled_tokens.values())))
        return out

    llm.engine.scheduler.schedule = recording
    return steps


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_n_and_preemption_with_images(llava, oracle, preemption_mode):
    # Three prompts' blocks fill the pool; their completions' blocks do not fit.  An
    # encoder budget of one image a step cuts the prompts admitted together.
    llm = make_llm(
        llava,
        num_gpu_blocks=40,
        preemption_mode=preemption_mode,
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_num_encoder_input_tokens=16,
    )
    steps = record_steps(llm)
    images = [noise_image(10 + i) for i in range(4)]
    params = SamplingParams(n=2, max_tokens=8, temperature=0)
    outputs = llm.generate([mm_prompt(PROMPT, i) for i in images], params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert max(encoder for encoder, _ in steps) == 16
    for out, image in zip(outputs, images):
        _, expected = oracle(PROMPT, [image])
        assert [c.token_ids for c in out.outputs] == [expected, expected]
    assert_all_blocks_free(llm)


def test_the_encoder_cache_budget_evicts_unheld_images(llava, oracle):
    """A cache of two images' embeddings: a third evicts the least recently released."""
    # (No prefix caching: a prompt whose blocks it holds would need no encoder at all.)
    llm = make_llm(
        llava,
        encoder_cache_size=32,
        enable_prefix_caching=False,
        limit_mm_per_prompt={"image": 3},
        **CHUNKED,
    )
    a, b, c = noise_image(20), noise_image(21), noise_image(22)
    for image in (a, b, c, a):
        (out,) = llm.generate(mm_prompt(PROMPT, image), GREEDY, use_tqdm=False)
        assert_matches([out], [(PROMPT, [image])], oracle)
    stats = llm.stats()
    assert stats["num_encoded_images"] == 4 and stats["encoder_cache_hits"] == 0
    assert stats["encoder_cache_usage"] <= 32
    assert set(llm.engine.runner.encoder_cache) == {mm_hash(c), mm_hash(a)}  # b went first
    with pytest.raises(ValueError, match="encoder_cache_size=32"):
        llm.generate(mm_prompt("<image><image><image>", a, b, c), GREEDY, use_tqdm=False)


def test_the_encoder_budget_cuts_a_chunk_before_an_image_that_does_not_fit(llava, oracle):
    """``max_num_encoder_input_tokens`` of one image: a step encodes one, and a chunk
    that reaches a second stops just before its placeholder (vLLM's scheduler)."""
    kwargs = dict(
        block_size=4, max_num_batched_tokens=64, max_num_seqs=4, limit_mm_per_prompt={"image": 2}
    )
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens=15"):
        make_llm(llava, max_num_encoder_input_tokens=15, **kwargs)
    llm = make_llm(llava, max_num_encoder_input_tokens=16, **kwargs)
    steps = record_steps(llm)
    text, a, b = "<image> and <image>: which differs?", noise_image(40), noise_image(41)
    (out,) = llm.generate(mm_prompt(text, a, b), GREEDY, use_tqdm=False)
    assert_matches([out], [(text, [a, b])], oracle)
    ids = out.prompt_token_ids
    image_positions = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID]
    per_image = len(image_positions) // 2
    second = image_positions[per_image]  # where b's placeholder begins
    assert second > image_positions[per_image - 1] + 1 and len(ids) < 64  # one chunk, uncut
    assert steps[:2] == [(per_image, [second]), (per_image, [len(ids) - second])]
    assert all(encoder == 0 for encoder, _ in steps[2:])

    # Two requests in one step: the second's text before its image still runs.
    steps.clear()
    c, d = noise_image(42), noise_image(43)
    outputs = llm.generate([mm_prompt(PROMPT, c), mm_prompt(PROMPT, d)], GREEDY, use_tqdm=False)
    assert_matches(outputs, [(PROMPT, [c]), (PROMPT, [d])], oracle)
    ids = outputs[1].prompt_token_ids
    before = ids.index(IMAGE_TOKEN_ID)
    shared = before // 4 * 4  # its full blocks of text are c's, from the prefix cache
    assert steps[0] == (per_image, [len(ids), before - shared])
    assert steps[1][0] == per_image and steps[1][1][1] == len(ids) - before
    assert_all_blocks_free(llm)


def image_runs(ids) -> list[tuple[int, int]]:
    """``[start, end)`` of each image's placeholder run (adjacent images: 16 each)."""
    where = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID]
    return [(where[i], where[i] + 16) for i in range(0, len(where), 16)]


@pytest.mark.parametrize("disable", [False, True])
def test_disable_chunked_mm_input_keeps_each_image_in_one_chunk(llava, oracle, disable):
    """With ``disable_chunked_mm_input`` no chunk ends inside an image's placeholder
    (the chunk stops before it; the image runs whole in the next); without it, the
    same 20-token steps cut images.  The tokens equal transformers' either way."""
    # One sequence a step, no prefix cache: each prompt's chunks start at 0 and add up.
    kwargs = dict(
        block_size=4, max_num_seqs=1, limit_mm_per_prompt={"image": 2}, enable_prefix_caching=False
    )
    if disable:
        with pytest.raises(ValueError, match="disable_chunked_mm_input needs max_num_batched"):
            make_llm(llava, disable_chunked_mm_input=True, max_num_batched_tokens=15, **kwargs)
    llm = make_llm(llava, disable_chunked_mm_input=disable, max_num_batched_tokens=20, **kwargs)
    requests = [
        ("USER: a longer text before the <image>\nWhat is it? ASSISTANT:", [noise_image(50)]),
        ("USER: <image> and <image>: which differs?", [noise_image(51), noise_image(52)]),
    ]
    inside = 0
    for text, images in requests:  # one at a time: each step's only sequence is its own
        steps = record_steps(llm)
        out = llm.generate(mm_prompt(text, *images), GREEDY, use_tqdm=False)
        assert_matches(out, [(text, images)], oracle)
        ids = out[0].prompt_token_ids
        ends = [b for b in np.cumsum([n for _, (n,) in steps]).tolist() if b <= len(ids)]
        inside += sum(lo < b < hi for b in ends for lo, hi in image_runs(ids))
    assert inside == 0 if disable else inside >= 3
    assert_all_blocks_free(llm)


def test_the_encoder_budget_flag_reaches_the_engine_config():
    args = build_parser().parse_args(
        ["serve", "M", "--max-num-encoder-input-tokens", "32", "--disable-chunked-mm-input"]
    )
    config = EngineConfig(model="M", **engine_kwargs(args))
    assert config.max_num_encoder_input_tokens == 32 and config.disable_chunked_mm_input
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        EngineConfig(model="M", max_num_encoder_input_tokens=0)


def _bad_inputs(tmp_path):
    big = tmp_path / "big.png"
    Image.new("L", (4097, 4097)).save(big)
    return [
        (mm_prompt(PROMPT, "data:image/png;base64,aGVsbG8="), "does not decode"),
        (mm_prompt(PROMPT, "data:image/png;base64,***"), "not valid base64"),
        (mm_prompt(PROMPT, "https://example.com/cat.png"), "network"),
        (mm_prompt(PROMPT, str(big)), "allowed_local_media_path"),
        (mm_prompt(PROMPT, Image.new("L", (4097, 4097))), "4097x4097"),
        (mm_prompt("<image><image><image>", *[noise_image(1)] * 3), "limit_mm_per_prompt"),
        (mm_prompt("no placeholder", noise_image(1)), "0 <image> placeholders"),
        ({"prompt": PROMPT, "multi_modal_data": {"video": []}}, "multi_modal_data"),
        (PROMPT, "1 image placeholder tokens .* for 0 images"),  # text, no image
        ({"prompt_token_ids": [256, 259, 259]}, "2 image placeholder tokens"),
    ]


def test_bad_images_are_value_errors_that_change_nothing(llm, oracle, tmp_path):
    good = mm_prompt(PROMPT, noise_image(1))
    for bad, message in _bad_inputs(tmp_path):
        with pytest.raises(ValueError, match=message):
            llm.generate([good, bad], GREEDY, use_tqdm=False)
        assert_all_blocks_free(llm)
    assert_matches(llm.generate(good, GREEDY, use_tqdm=False), [(PROMPT, [noise_image(1)])], oracle)


def test_a_local_file_under_the_allowed_path(llava, oracle, tmp_path):
    image = noise_image(30)
    image.save(tmp_path / "cat.png")
    llm = make_llm(llava, allowed_local_media_path=str(tmp_path))
    content = [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'cat.png'}"}},
    ]
    (out,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    text = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "<image>\nWhat is it?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt_ids, expected = oracle(text, [image], add_special_tokens=False)
    assert out.prompt_token_ids == prompt_ids and out.outputs[0].token_ids == expected
    with pytest.raises(ValueError, match="outside allowed_local_media_path"):
        llm.generate(mm_prompt(PROMPT, "/etc/hostname"), GREEDY, use_tqdm=False)


def test_beam_search_with_an_image_is_refused(llm):
    from minipaged.sampling_params import BeamSearchParams

    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(
            mm_prompt(PROMPT, noise_image(1)), BeamSearchParams(beam_width=2, max_tokens=4)
        )
    assert_all_blocks_free(llm)


def test_an_image_for_a_text_only_model_is_refused(tiny):
    llm = make_llm(tiny("llama")[0])
    with pytest.raises(ValueError, match="text-only"):
        llm.generate(mm_prompt(PROMPT, noise_image(1)), GREEDY, use_tqdm=False)
    content = [{"type": "image_url", "image_url": {"url": data_url(noise_image(1))}}]
    with pytest.raises(ValueError, match="text-only"):
        llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_lora": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        {"runner": "pooling"},
        {"memory_mode": "contiguous-max"},
    ],
)
def test_unsupported_combinations_name_the_option(llava, kwargs):
    with pytest.raises(
        ValueError, match=f"a multimodal model cannot run with {next(iter(kwargs))}"
    ):
        make_llm(llava, **kwargs)


def record_chunks(llm, evict_preempted: int | None = None) -> list[tuple[int, list[tuple]]]:
    """Per step from now on: the encoder tokens it runs, and per scheduled sequence its
    request id, its chunk's start and end, and its request's image placeholders.
    ``evict_preempted``: when a request of several sequences is first back in the
    waiting queue, the prefix cache keeps only the blocks of that many of its first
    tokens (as if other requests' prompts had evicted the rest)."""
    steps, scheduler = [], llm.engine.scheduler
    schedule, evicted, kv = scheduler.schedule, [], scheduler.kv

    def recording():
        preempted = [g for g in scheduler.waiting if len(g.seqs) > 1]
        if evict_preempted is not None and preempted and not evicted:
            tokens, key = preempted[0].seqs[0].token_ids, preempted[0].cache_key
            kept = kv.gpu.match_prefix(tokens, key)[: evict_preempted // kv.block_size]
            kv.uncache(set(range(kv.num_gpu_blocks)) - {entry.block for entry in kept})
            evicted.append(True)
        out = schedule()
        encoder = sum(f.num_embeds for f in out.scheduled_encoder_inputs.values())
        chunks = [
            (s.group.request_id, s.start, s.start + s.num_new_tokens, image_ranges(s.group))
            for s in out.seqs
        ]
        steps.append((encoder, chunks))
        return out

    scheduler.schedule = recording
    return steps


def image_ranges(group) -> list[range]:
    return [
        range(p.offset, p.offset + p.length) for p in (f.mm_position for f in group.mm_features)
    ]


# Two ways a readmitted request of several sequences meets an image it cannot split: its
# first sequence's chunk stops before the image (24 tokens cannot hold it after 16), or
# starts at it with just its tokens (17 hold it; no budget is kept back for the other
# two sequences, which would leave 15 and the request waiting forever).
READMITTED = {
    "cut-before-the-image": dict(
        max_num_batched_tokens=24, n=2, num_gpu_blocks=34, long=60, wait=30, cached=0, chunk=(0, 16)
    ),
    "cached-up-to-the-image": dict(
        max_num_batched_tokens=17,
        n=3,
        num_gpu_blocks=52,
        long=140,
        wait=100,
        cached=16,
        chunk=(16, 33),
    ),
}


@pytest.mark.parametrize("case", READMITTED.values(), ids=READMITTED)
def test_a_recomputed_sibling_cached_up_to_an_image_runs_nothing_until_it_fits(llava, oracle, case):
    """``n`` completions with ``disable_chunked_mm_input``, preempted by recompute after
    they forked (a long request came first and grows), the prefix cache keeping only
    the first ``cached`` tokens.  Readmitted, the first sequence runs ``chunk``, and its
    blocks cache the others' prompts up to or past the image; those then run no token
    that step (vLLM's ``_try_schedule_encoder_inputs`` cuts them to 0) rather than one
    that splits the image, and the rest on later steps.  No chunk ends inside an image,
    no step encodes past its budget, the engine finishes, and the tokens equal
    transformers'."""
    llm = make_llm(
        llava,
        block_size=4,
        num_gpu_blocks=case["num_gpu_blocks"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
        max_num_seqs=8,
        disable_chunked_mm_input=True,
        encoder_cache_size=32,
    )
    budget = llm.engine.scheduler.max_num_encoder_input_tokens
    steps, engine = record_chunks(llm, evict_preempted=case["cached"]), llm.engine
    # n's image starts at 16, a block boundary (block_size=4).
    n = "USER: see this <image>\nWhat is in it? ASSISTANT:"
    requests = {"long": (PROMPT, noise_image(60)), "n": (n, noise_image(61))}
    params = {
        "long": SamplingParams(max_tokens=case["long"], temperature=0),
        "n": SamplingParams(n=case["n"], max_tokens=8, temperature=0),
    }
    outputs = {}
    for request_id, (text, image) in requests.items():  # n comes ``wait`` steps on
        ids, features = engine.process_multimodal(text, [image])
        engine.add_request(request_id, ids, params[request_id], mm_features=features)
        for _ in range(case["wait"]):
            outputs |= {o.request_id: o for o in engine.step()}
    for _ in range(300):  # far more steps than the two requests need
        outputs |= {o.request_id: o for o in engine.step()}
    assert not engine.has_unfinished_requests()
    assert llm.stats()["num_preemptions"] > 0  # of n, the later request
    for request_id, (text, image) in requests.items():
        _, expected = oracle(text, [image])
        completions = outputs[request_id].outputs
        assert [c.token_ids[:8] for c in completions] == [expected] * len(completions)
    assert max(encoder for encoder, _ in steps) <= budget
    ends = [(b, runs) for _, chunks in steps for _, _, b, runs in chunks]
    assert not [b for b, runs in ends for r in runs if r.start < b < r.stop]
    # The case itself: a step runs one of n's sequences alone, ``chunk``.
    chunks = [[(a, b) for rid, a, b, _ in chunks if rid == "n"] for _, chunks in steps]
    assert [case["chunk"]] in chunks
    assert_all_blocks_free(llm)
