"""Tiny seeded random checkpoints in the Hugging Face format.

No machine this project runs on can download weights, yet the engine must be checked
against a real model.  So minipaged writes its own: a directory with ``config.json``,
``model.safetensors``, ``generation_config.json`` and a byte-level tokenizer
(``tokenizer.json`` + ``tokenizer_config.json`` with a chat template), laid out exactly
like a checkpoint from the Hub.  Tests, lessons and the demo load these; transformers
loads them too, which makes it the oracle (same weights: same greedy tokens).  With a
real checkpoint on disk, point ``model=`` at it instead.

The weights are random, so the text is gibberish, but what sets the architectures apart
is all there: GQA, RoPE, q/k/v biases, q/k norms, an explicit head_dim, tied and untied
LM heads, a padded vocabulary, experts (top-2 of 5 to 7), latent attention (DeepSeek-V2).
The same seed always writes byte-identical weights::

    path = make_tiny_model("/tmp/tiny-qwen3", arch="qwen3", seed=0)
    # or: minipaged make-tiny-model /tmp/tiny-qwen3 --arch qwen3 --seed 0
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from minipaged.models.hub import cache_dir, materialize

# The tokenizer: ids 0..255 are the 256 byte values, so any text round-trips (after NFC
# normalisation: "e" + combining accent becomes "é"); then the special tokens.
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
# Zephyr-style: role markers are plain text, every turn ends with EOS, so a reply stops there.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Shapes shared by every architecture: small enough for CPU tests, with 2 query heads per
# KV head (GQA).  Real checkpoints pad the vocabulary to a round size (Qwen2: 151,936 rows
# for ~151,650 tokens); so do we (259 -> 272), so the engine meets ids no text encodes to.
BASE_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    vocab_size=272,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    torch_dtype="float32",
)
# What makes each architecture itself.  Qwen2's q/k/v biases are implied by its model_type;
# Qwen3's head_dim (32) is deliberately not hidden_size / num_heads (16), as in Qwen3-0.6B,
# so a loader that derives it gets the shapes wrong.  One model ties its LM head to the
# embedding (the checkpoint then has no lm_head.weight), the others do not.
ARCHS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        attention_bias=False,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        use_sliding_window=False,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        attention_bias=False,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    # Mixtures of experts, top-2 of an expert count that 2 or 4 ranks cannot split
    # evenly (expert parallelism must cope); each expert's MLP is 32 wide.
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=5,
        num_experts_per_tok=2,
        intermediate_size=32,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        num_experts=7,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        norm_topk_prob=False,
        use_sliding_window=False,
        tie_word_embeddings=False,
    ),
    "olmoe": dict(
        architectures=["OlmoeForCausalLM"],
        model_type="olmoe",
        num_experts=6,
        num_experts_per_tok=2,
        intermediate_size=32,
        norm_topk_prob=False,
        tie_word_embeddings=False,
    ),
    # Multi-head latent attention (a 24-value latent and an 8-value RoPE key per token
    # where the 4 heads' keys and values would be 128) and DeepSeekMoE: top-2 of 6
    # routed experts beside a shared one, after a first dense layer.
    "deepseek_v2": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        num_key_value_heads=4,
        kv_lora_rank=24,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=6,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        topk_method="greedy",
        routed_scaling_factor=1.0,
        tie_word_embeddings=False,
    ),
}
# LLaVA-1.5 (`minipaged.models.llava`): a CLIP vision tower (32x32 pixels in 8x8 patches:
# 16 patch tokens, the class token dropped), a two-layer GELU projector, and the Llama
# above as its language model.  Its image placeholder is one more special token.
IMAGE_TOKEN, IMAGE_TOKEN_ID = "<image>", 259
LLAVA_VISION_CONFIG = dict(
    model_type="clip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
    projection_dim=32,
    hidden_act="quick_gelu",
)
LLAVA_CONFIG = dict(
    architectures=["LlavaForConditionalGeneration"],
    model_type="llava",
    image_token_index=IMAGE_TOKEN_ID,
    image_seq_length=16,
    vision_feature_layer=-2,
    vision_feature_select_strategy="default",
    projector_hidden_act="gelu",
    tie_word_embeddings=False,
)
# Qwen2-VL (`minipaged.models.qwen2_vl`): its own vision transformer over 4x4 patches,
# pairs of frames (a still image is doubled) and 2x2 patches merged into one token, and
# Qwen2's layers with M-RoPE (the 8 frequency pairs of a 16-value head split 2 + 3 + 3
# between time, height and width).  Dynamic resolution: an image keeps its aspect,
# resized to multiples of 8 pixels within 256 to 1024 pixels (4 to 16 tokens).
QWEN2_VL_TOKENS = {
    "vision_start_token_id": 259,
    "vision_end_token_id": 260,
    "image_token_id": 261,
    "video_token_id": 262,
}
QWEN2_VL_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN2_VL_VISION_CONFIG = dict(
    depth=2,
    embed_dim=32,
    hidden_size=BASE_CONFIG["hidden_size"],
    mlp_ratio=2,
    num_heads=4,
    in_channels=3,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
QWEN2_VL_CONFIG = dict(
    architectures=["Qwen2VLForConditionalGeneration"],
    model_type="qwen2_vl",
    **QWEN2_VL_TOKENS,
    tie_word_embeddings=False,
)
QWEN2_VL_IMAGE_PIXELS = (16 * 16, 32 * 32)  # min_pixels, max_pixels
VISION_ARCHS = ("llava", "qwen2_vl")
# Far larger than the usual 0.02: at 0.02 a 64-wide model's logits are nearly flat (top
# token ~1%), greedy picks hinge on rounding noise and some models repeat one token forever.
# At 0.3 the top token holds ~25%: greedy choices are clear, sampling still varies.
INIT_STD = 0.3


def make_tiny_model(path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a tiny random ``arch`` checkpoint to directory ``path`` and return it.

    ``arch`` is one of :data:`ARCHS`; ``overrides`` replace config values
    (e.g. ``num_hidden_layers=4``).
    """
    if arch not in (*ARCHS, *VISION_ARCHS):
        raise ValueError(f"arch must be one of {sorted([*ARCHS, *VISION_ARCHS])}, got {arch!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if arch == "llava":
        text = {**BASE_CONFIG, **ARCHS["llama"], **overrides}
        del text["architectures"]
        config = {**LLAVA_CONFIG, "text_config": text, "vision_config": LLAVA_VISION_CONFIG}
    elif arch == "qwen2_vl":
        text = {**BASE_CONFIG, **ARCHS["qwen2"], "tie_word_embeddings": False, **overrides}
        text.update(model_type="qwen2_vl_text", rope_scaling=_mrope(text))
        del text["architectures"]
        vision = QWEN2_VL_VISION_CONFIG
        config = {**QWEN2_VL_CONFIG, "text_config": text, "vision_config": vision}
    else:
        text = config = {**BASE_CONFIG, **ARCHS[arch], **overrides}
    _write_json(path / "config.json", config)
    _write_json(
        path / "generation_config.json",
        {k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    _write_weights(path, seed)
    _write_tokenizer(
        path,
        model_max_length=text["max_position_embeddings"],
        image_tokens={"llava": [IMAGE_TOKEN], "qwen2_vl": QWEN2_VL_SPECIAL}.get(arch, []),
    )
    if arch == "llava":
        _write_llava_processor(path)
    if arch == "qwen2_vl":
        _write_qwen2_vl_processor(path)
    return path


def _mrope(text: dict) -> dict:
    """M-RoPE's sections: a head's frequency pairs split between time, height and width
    as Qwen2-VL's 16/24/24 of 64 (here 2/3/3 of 8)."""
    pairs = text["head_dim"] // 2
    height = width = pairs * 3 // 8
    return {"type": "mrope", "mrope_section": [pairs - height - width, height, width]}


def _write_json(file: Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_weights(path: Path, seed: int) -> None:
    """Fill every parameter of the model ``config.json`` describes with seeded noise."""
    # Heavy imports live in the functions that need them, so the CLI starts fast.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    # On the meta device the model has names and shapes but no storage and no init cost;
    # transformers itself thus decides which tensors a checkpoint of this config holds.
    config = AutoConfig.from_pretrained(path)
    vision = config.model_type in VISION_ARCHS
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    # named_parameters() lists a tied weight once, so a tied lm_head is left out, as on the Hub.
    for name, param in model.named_parameters():
        # Norm scales near 1 rather than exactly 1, so a loader that forgets them is caught.
        mean = 1.0 if "norm" in name or "layrnorm" in name else 0.0
        tensors[name] = torch.empty(param.shape).normal_(mean, INIT_STD, generator=generator)
    # Under the names the Hub's checkpoints use: transformers 5 fuses each MoE layer's
    # experts into one tensor in memory, but saves (and reads) one tensor per expert.
    tensors = revert_weight_conversion(model, tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _write_tokenizer(path: Path, model_max_length: int, image_tokens: list[str] = ()) -> None:
    """A byte-level BPE tokenizer with no merges: one token per UTF-8 byte, plus specials
    (and ``image_tokens``, a vision model's placeholder first, after them)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    # Byte-level BPE (GPT-2, Llama 3, Qwen) names each byte by a printable character.
    byte_names = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={byte_names[b]: b for b in range(256)}, merges=[]))
    # transformers 5 loads any model_type "qwen2" tokenizer as its Qwen2Tokenizer, which
    # NFC-normalises; doing the same everywhere keeps all our checkpoints tokenising alike.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS.values()) + list(image_tokens))
    # Like Llama's tokenizer, encoding a prompt prepends BOS.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    # Written by hand rather than by save_pretrained(), whose output differs between
    # transformers 4 and 5; both load this one.  No unknown token: every byte has one
    # (and Qwen2Tokenizer would otherwise add "<|endoftext|>" for it).
    _write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **SPECIAL_TOKENS,
            "unk_token": None,
            "model_max_length": model_max_length,
            "chat_template": CHAT_TEMPLATE,
            **(_image_token_names(image_tokens) if image_tokens else {}),
        },
    )


def _image_token_names(image_tokens: list[str]) -> dict:
    """The tokenizer's ``image_token`` (and Qwen2-VL's ``video_token``), by which the
    processors find their placeholders."""
    names = {"image_token": image_tokens[0]}
    if "<|image_pad|>" in image_tokens:
        names = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    return {"extra_special_tokens": names}


def _write_qwen2_vl_processor(path: Path) -> None:
    """Qwen2-VL's processor files: its image processor's dynamic resolution (resize to
    multiples of patch x merge pixels between ``min_pixels`` and ``max_pixels``, cut
    into patches), and the processor that expands each ``<|image_pad|>`` to the
    image's merged token count."""
    vision = QWEN2_VL_VISION_CONFIG
    low, high = QWEN2_VL_IMAGE_PIXELS
    _write_json(
        path / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor",
            "min_pixels": low,
            "max_pixels": high,
            "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"],
            "merge_size": vision["spatial_merge_size"],
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_convert_rgb": True,
            "do_resize": True,
            "resample": 3,
        },
    )
    _write_json(path / "processor_config.json", {"processor_class": "Qwen2VLProcessor"})


def _write_llava_processor(path: Path) -> None:
    """LLaVA's processor files: CLIP's image preprocessing (resize, center crop,
    normalize) to the tower's 32x32, and how many placeholder tokens an image gets."""
    size = LLAVA_VISION_CONFIG["image_size"]
    _write_json(
        path / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": size},
            "do_center_crop": True,
            "crop_size": {"height": size, "width": size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_convert_rgb": True,
            "resample": 3,
        },
    )
    _write_json(
        path / "processor_config.json",
        {
            "processor_class": "LlavaProcessor",
            "patch_size": LLAVA_VISION_CONFIG["patch_size"],
            "vision_feature_select_strategy": LLAVA_CONFIG["vision_feature_select_strategy"],
            "image_token": IMAGE_TOKEN,
            "num_additional_image_tokens": 1,
        },
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from byte to character: printable bytes stand for themselves, the
    others (control characters, space, ...) borrow characters from 256 upwards."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def cached_checkpoint(name: str, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A tiny seeded checkpoint (`make_tiny_model`) under `cache_dir`, written on first use.

    The directory name carries a hash of everything that decides the weights, so a
    changed definition gets a new checkpoint instead of a stale one; it is written
    beside its final place and renamed (`materialize`), so a run that dies half way
    leaves nothing.
    """
    recipe = {
        "arch": arch,
        "seed": seed,
        "overrides": overrides,
        "base": BASE_CONFIG,
        "archs": ARCHS,
        "init_std": INIT_STD,
        **({"llava": [LLAVA_CONFIG, LLAVA_VISION_CONFIG]} if arch == "llava" else {}),
        **(
            {"qwen2_vl": [QWEN2_VL_CONFIG, QWEN2_VL_VISION_CONFIG, QWEN2_VL_IMAGE_PIXELS]}
            if arch == "qwen2_vl"
            else {}
        ),
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return materialize(
        cache_dir() / f"{name}-{digest}",
        lambda staging: make_tiny_model(staging, arch=arch, seed=seed, **overrides),
    )
