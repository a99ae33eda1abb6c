"""The engine's settings: `LLM`'s keyword arguments, checked once, with vLLM's names.

``EngineConfig`` validates what it can on its own (types and ranges) and raises
``ValueError`` naming the argument; settings that depend on the model or the machine
(``max_model_len`` against the checkpoint, ``"auto"`` device, dtype and backend) are
resolved when the engine loads the model (`minipaged.models.resolve`,
`minipaged.models.loader.resolve_dtype`).

Standard library only.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minipaged.core.memory.contiguous import POLICIES
from minipaged.pooling_params import PoolerConfig

if TYPE_CHECKING:
    import torch

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "cuda", "flash_attn", "flashinfer")
DEVICES = ("auto", "cpu", "cuda")
PREEMPTION_MODES = ("recompute", "swap")
# vLLM's names (fp8 is fp8_e4m3), and our int8 (`minipaged.ops.kv_quant`).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# Weight quantization (`minipaged.models.quantization`): online fp8 and int8, or the
# checkpoint's awq or gptq.
QUANTIZATION_METHODS = ("fp8", "int8", "awq", "gptq")
# How expert parallelism moves tokens (minipaged.models.moe.ALL2ALL_BACKENDS): all-to-all
# exchanges, or vLLM's all-gather + reduce-scatter.
ALL2ALL_BACKENDS = ("alltoall", "allgather_reducescatter")
# How the ranks of tensor_parallel_size > 1 start: spawned by the engine's process
# (vLLM's "mp"), or each started by a launcher such as torchrun, on any host.
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "external_launcher")
# The names of the memory simulation's systems (minipaged.core.memory.simulate.SYSTEMS).
MEMORY_MODES = ("paged", *(f"contiguous-{policy}" for policy in POLICIES))
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# What the model is run for (vLLM's ``runner``): "auto" is "generate" for every
# architecture minipaged loads (all are causal LMs).
RUNNERS = ("auto", "generate", "pooling")
# vLLM's older ``task`` and the runner each one means.
TASKS = {"generate": "generate", "embed": "pooling"}


@dataclass
class EngineConfig:
    """Everything `LLM` takes besides the model path's contents.

    Args:
        model: a local Hugging Face checkpoint directory, a ``.gguf`` file, ``smollm2``
            or a Hugging Face hub id (`minipaged.models.hub.resolve_model`).
        tokenizer: where the tokenizer comes from, as ``model`` names it; None: the model's.
        trust_remote_code: accepted for vLLM's sake and ignored: minipaged runs its own
            model code, never a checkpoint's.
        device: ``"auto"`` (CUDA if available), ``"cuda"`` or ``"cpu"``.
        dtype: ``"auto"`` (the checkpoint's), ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        block_size: token slots per KV block (§4.2).
        kv_cache_dtype: what the KV cache stores: ``"auto"`` (the model's dtype),
            ``"fp8"`` / ``"fp8_e4m3"``, ``"fp8_e5m2"`` (vLLM's, a scale per layer), or
            ``"int8"`` (ours, a scale per token and KV head): a byte per element, so
            the same memory holds twice the blocks of bf16 (`minipaged.ops.kv_quant`).
        quantization: the projections' weights in fewer bits
            (`minipaged.models.quantization`): ``"fp8"`` or ``"int8"``, quantized as a
            16/32-bit checkpoint loads, a scale per output channel; ``"awq"`` or
            ``"gptq"``, a checkpoint quantized to 4 bits in Hugging Face's format (None:
            the checkpoint's ``quantization_config``, if it has one).  Sharded like
            the dense weights under tensor and pipeline parallelism; not with LoRA or
            compilation.
        calculate_kv_scales: fp8 only: set each layer's ``k_scale`` and ``v_scale``
            from the first batch (vLLM's), instead of 1.0.
        num_gpu_blocks: the KV pool's size in blocks; None sizes it from
            ``gpu_memory_utilization`` on CUDA (after a profiling step), or from
            ``cpu_kv_space`` GiB on the CPU, never beyond what ``max_num_seqs`` sequences
            of ``max_model_len`` tokens can use nor half the memory available.
        gpu_memory_utilization: the share of GPU memory the engine may fill, weights,
            activations and KV cache together.
        swap_space: GiB of CPU memory for the swap pool (§4.5), at most what
            ``max_num_seqs`` full-length sequences can use and what the machine has free.
        preemption_mode: ``"recompute"`` or ``"swap"``.
        memory_mode: ``"paged"`` (blocks on demand, §4), or the paper's baseline to
            compare against, Orca's contiguous reservation of the maximum length, the
            final length rounded up to a power of two, or exactly the final length
            (§6.1): ``"contiguous-max"``, ``"contiguous-pow2"``, ``"contiguous-oracle"``.
            The KV stays paged; the reservation only decides when a request is admitted.
        enable_prefix_caching: reuse the KV of cached full prompt blocks (§4.4); on
            by default, as in vLLM V1 (``--no-enable-prefix-caching`` turns it off).
        max_num_seqs: the most sequences in one step.
        max_num_batched_tokens: the most new tokens in one step; longer prompts are
            chunked.  None: ``max(2048, max_num_seqs)``.
        max_model_len: the longest sequence (prompt + output); None: the model's limit.
        attention_backend: ``"auto"`` (the fastest available), ``"torch"``, ``"cpu"``
            (a C++ kernel, built on first use), ``"triton"``, ``"cuda"``, or on a GPU
            where the library is installed ``"flash_attn"`` or ``"flashinfer"``.
        enforce_eager: run every decode step op by op; by default, on CUDA with the
            triton or cuda backend, decode steps replay CUDA graphs captured at start-up.
        compilation_config: torch.compile, as vLLM's: its mode, an int or
            ``{"mode": m}`` (`CompilationConfig`).  Mode 1 (``STOCK_TORCH_COMPILE``):
            on a CPU, decode steps run the model compiled by inductor at start-up
            (`minipaged.worker.compiled_decode`); mode 0 (``NONE``, the default): eager.  vLLM
            compiles by default; minipaged does not, as the compile takes about a
            minute on two cores, for every engine a lesson or test starts.
        seed: seeds the random stream of requests without a seed of their own.
        trace: record an event trace (`minipaged.trace`).
        cpu_kv_space: GiB of KV pool on the CPU when ``num_gpu_blocks`` is None (vLLM's
            ``VLLM_CPU_KVCACHE_SPACE``).
        tensor_parallel_size: processes to split the model over (§4.6), one per GPU on
            CUDA; on a CPU they share its cores.
        pipeline_parallel_size: stages to cut the model's layers into, each holding its
            layers and their KV blocks, each split over ``tensor_parallel_size``
            processes of its own (``tensor_parallel_size * pipeline_parallel_size`` in
            all); a step's activations go stage to stage.
        distributed_executor_backend: how those processes start: ``"mp"``, spawned by
            this one (one machine); ``"external_launcher"``, each started by ``torchrun``
            running the same command, on any number of hosts, which meet in
            ``torch.distributed``'s ``env://`` rendezvous: rank 0 runs the engine, the
            others serve it as workers and exit when it shuts down
            (`minipaged.distributed.launcher`).
        speculative_config: speculative decoding, as vLLM's dict (`SpeculativeConfig`):
            ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}``
            or ``{"model": DRAFT, "num_speculative_tokens": k}``; None: off.  Not with
            beam search or a contiguous ``memory_mode``.
        enable_expert_parallel: a mixture-of-experts model's ranks hold whole experts
            (``num_experts / tensor_parallel_size`` each) rather than a slice of every
            one, and tokens travel to them (`minipaged.models.moe`).
        all2all_backend: how tokens travel under expert parallelism: ``"alltoall"``
            (two all-to-all exchanges per layer) or ``"allgather_reducescatter"``.
        enable_lora: serve LoRA adapters beside the base model (`minipaged.models.lora`),
            a request's ``lora_request`` naming its own.
        max_loras: adapters on the device at once (their slots); a step's batch mixes
            at most this many.
        max_lora_rank: the highest adapter rank served (every slot is this big).
        max_cpu_loras: adapters kept in host memory, read from disk again when evicted;
            None: ``max_loras``.
        runner: ``"generate"`` (``"auto"``) or ``"pooling"``: every request then gets
            one embedding of its prompt (`LLM.embed`, ``/v1/embeddings``) and generates
            nothing (`minipaged.models.pooler`).  Not with tensor or pipeline
            parallelism, speculative decoding, LoRA, a contiguous ``memory_mode`` or a
            KV connector.
        task: vLLM's older name for it: ``"embed"`` is ``runner="pooling"``.
        pooler_config: how a pooling runner pools, as vLLM's dict:
            ``{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}``
            (`PoolerConfig`); None: LAST, normalized.
        kv_transfer_config: disaggregated prefill, as vLLM's dict (`KVTransferConfig`):
            ``{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": DIR}}``; a producer
            saves each prompt's KV, a consumer loads it instead of computing it
            (`minipaged.distributed.kv_transfer`).  None: off.  With tensor
            parallelism each rank moves its own KV heads (the two engines' sizes may
            differ); not with pipeline parallelism, speculative decoding,
            compilation, an fp8 KV cache or a contiguous ``memory_mode``.
        limit_mm_per_prompt: a vision model's most images in one prompt, as vLLM's
            ``{"image": n}``; None: one.
        allowed_local_media_path: the directory a chat's ``image_url`` may name local
            files in (vLLM's); empty: none.  Network URLs are always refused.
        encoder_cache_size: a vision model's encoder cache, in embeddings (image
            tokens) (`minipaged.core.sched.encoder_cache_manager`); None:
            ``max_num_batched_tokens``, or a prompt's most images if more (vLLM
            sizes it so that the largest item fits).  A vision model runs without
            tensor or pipeline parallelism, speculative decoding, LoRA, pooling, a
            contiguous ``memory_mode`` or a KV connector.
        max_num_encoder_input_tokens: a vision model's encoder compute budget per step,
            in encoder tokens (vLLM's): a step encodes images only while they fit, and
            a chunk that reaches an image that does not is cut just before its
            placeholder; None: ``max_num_batched_tokens``, or one image's tokens if
            more (as vLLM raises it).  A value below one image's tokens is refused.
        disable_chunked_mm_input: a vision model's chunks never split an image's
            placeholder tokens (vLLM's): a chunk that would end inside an image stops
            before it, and the image's tokens run whole in a later chunk.  Needs
            ``max_num_batched_tokens`` to hold the largest image's tokens.  (A
            prefix-cache hit may still end inside an image, as in vLLM: the chunk
            after it starts there.)
        structured_outputs_config: structured outputs' grammar engine, as vLLM's dict
            (`StructuredOutputsConfig`): ``{"backend": "xgrammar"}``, ``"guidance"``
            (llguidance) or ``"auto"`` (the default: guidance in minipaged; vLLM's
            picks xgrammar where it supports the request); None: the default.
        async_scheduling: schedule the next step while the model runs this one
            (vLLM's ``async_scheduling``; `LLMEngine.step`).  None (the default) turns
            it on where it runs on a GPU and none of the settings below rules it out,
            off on a CPU, as vLLM 0.14 does (on by default, its CPU backend excluded;
            on an H200 it measured 4% faster end to end, 22% per decode step).  A step
            runs ahead only when every running sequence decodes one token (no
            waiting, swapped or preempted request, no ``n`` > 1, beam search or
            image); any other step waits for the one before it.  Not with tensor or
            pipeline parallelism, speculative decoding, pooling, a KV connector or a
            contiguous ``memory_mode``.
    """

    model: str
    tokenizer: str | None = None
    trust_remote_code: bool = False
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    calculate_kv_scales: bool = False
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4
    preemption_mode: str = "recompute"
    memory_mode: str = "paged"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False
    compilation_config: CompilationConfig | int | dict | None = None
    seed: int = 0
    trace: bool = False
    cpu_kv_space: float = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    speculative_config: SpeculativeConfig | dict | None = None
    enable_expert_parallel: bool = False
    all2all_backend: str = "alltoall"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    runner: str = "auto"
    task: str | None = None
    pooler_config: PoolerConfig | dict | None = None
    kv_transfer_config: KVTransferConfig | dict | None = None
    limit_mm_per_prompt: dict | None = None
    allowed_local_media_path: str = ""
    encoder_cache_size: int | None = None
    max_num_encoder_input_tokens: int | None = None
    disable_chunked_mm_input: bool = False
    structured_outputs_config: StructuredOutputsConfig | dict | None = None
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _choice("device", self.device, DEVICES)
        _choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _choice("memory_mode", self.memory_mode, MEMORY_MODES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("all2all_backend", self.all2all_backend, ALL2ALL_BACKENDS)
        _choice(
            "distributed_executor_backend",
            self.distributed_executor_backend,
            DISTRIBUTED_EXECUTOR_BACKENDS,
        )
        _positive_int("block_size", self.block_size)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        for name in ("num_gpu_blocks", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise the running sequences' decodes alone could exceed a step's budget.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_num_seqs ({self.max_num_seqs})"
            )
        _number(
            "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]", lambda x: 0 < x <= 1
        )
        _number("swap_space", self.swap_space, ">= 0", lambda x: x >= 0)
        _number("cpu_kv_space", self.cpu_kv_space, "> 0", lambda x: x > 0)
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ValueError(f"tokenizer must be a str, a path or None, got {self.tokenizer!r}")
        for name in (
            "trust_remote_code",
            "enable_prefix_caching",
            "enforce_eager",
            "trace",
            "calculate_kv_scales",
            "enable_expert_parallel",
            "enable_lora",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(
                "calculate_kv_scales sets fp8's per-layer scales; kv_cache_dtype "
                f"{self.kv_cache_dtype!r} has none to set"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        self.compilation_config = CompilationConfig.from_value(self.compilation_config)
        if self.enforce_eager and self.compilation_config.mode:
            raise ValueError(
                "enforce_eager=True runs every step eagerly, and compilation_config "
                f"mode {self.compilation_config.mode} compiles: ask for one of them"
            )
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, SpeculativeConfig):
                raise ValueError(
                    f"speculative_config must be a dict or None, got {self.speculative_config!r}"
                )
            if self.memory_mode != "paged":
                # Orca's reservations are sized without a draft's lookahead slots.
                raise ValueError(
                    f"speculative_config needs memory_mode='paged', got {self.memory_mode!r}"
                )
        self.structured_outputs_config = StructuredOutputsConfig.from_value(
            self.structured_outputs_config
        )
        self._check_pipeline()
        self._check_quantization()
        self._check_runner()
        self._check_kv_transfer()
        self._check_multimodal()
        self._check_async_scheduling()

    def _check_async_scheduling(self) -> None:
        """What async scheduling cannot run with in minipaged: its step ahead is a
        decode of every running sequence on one process, one token each."""
        if self.async_scheduling is None:
            return  # `resolve_async_scheduling` decides once the device is known
        if not isinstance(self.async_scheduling, bool):
            got = self.async_scheduling
            raise ValueError(f"async_scheduling must be a bool or None, got {got!r}")
        ruled_out = self._rules_out_async_scheduling() if self.async_scheduling else []
        if ruled_out:
            name = ruled_out[0]
            raise ValueError(
                f"async_scheduling cannot run with {name}={getattr(self, name)!r} in minipaged"
            )

    def _rules_out_async_scheduling(self) -> list[str]:
        """The settings asked for that async scheduling cannot run with."""
        combos = {
            "tensor_parallel_size": self.tensor_parallel_size > 1,
            "pipeline_parallel_size": self.pipeline_parallel_size > 1,
            "speculative_config": self.speculative_config is not None,
            "kv_transfer_config": self.kv_transfer_config is not None,
            "runner": self.runner == "pooling",
            "memory_mode": self.memory_mode != "paged",
        }
        return [name for name, refused in combos.items() if refused]

    def resolve_async_scheduling(self, device: torch.device) -> bool:
        """``async_scheduling`` None made True or False for ``device`` (the engine asks
        once it resolved the device): on a GPU unless a setting rules it out."""
        if self.async_scheduling is None:
            self.async_scheduling = device.type == "cuda" and not self._rules_out_async_scheduling()
        return self.async_scheduling

    def _check_multimodal(self) -> None:
        """The multimodal settings' types (whether the model takes images, and what it
        then cannot run with, is checked once it is loaded: `check_multimodal`)."""
        if self.limit_mm_per_prompt is None:
            self.limit_mm_per_prompt = {"image": 1}
        limits = self.limit_mm_per_prompt
        if not isinstance(limits, dict) or any(
            key != "image" or not isinstance(n, int) or isinstance(n, bool) or n < 0
            for key, n in limits.items()
        ):
            raise ValueError(
                f"limit_mm_per_prompt must be a dict like {{'image': 2}}, got {limits!r}"
            )
        if not isinstance(self.allowed_local_media_path, str):
            raise ValueError(
                f"allowed_local_media_path must be a str, got {self.allowed_local_media_path!r}"
            )
        for name in ("encoder_cache_size", "max_num_encoder_input_tokens"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if not isinstance(self.disable_chunked_mm_input, bool):
            raise ValueError(
                f"disable_chunked_mm_input must be a bool, got {self.disable_chunked_mm_input!r}"
            )

    def check_multimodal(self) -> None:
        """What a vision model cannot run with in minipaged: its encoder runs on one
        device, beside the one-process model runner's forward pass."""
        combos = {
            "tensor_parallel_size": self.tensor_parallel_size > 1,
            "pipeline_parallel_size": self.pipeline_parallel_size > 1,
            "speculative_config": self.speculative_config is not None,
            "enable_lora": self.enable_lora,
            "runner": self.runner == "pooling",
            "memory_mode": self.memory_mode != "paged",
            "kv_transfer_config": self.kv_transfer_config is not None,
        }
        _refuse_combinations("a multimodal model", combos, self)

    def _check_runner(self) -> None:
        """Settle ``runner`` (from ``task`` if given) and ``pooler_config``, and refuse
        what a pooling runner cannot run with in minipaged: the parallel ranks and a
        draft keep no pooled state, LoRA and Orca's reservations are not wired to it."""
        _choice("runner", self.runner, RUNNERS)
        if self.task is not None:
            _choice("task", self.task, tuple(TASKS))
            if self.runner != "auto" and self.runner != TASKS[self.task]:
                raise ValueError(f"task={self.task!r} contradicts runner={self.runner!r}")
            self.runner = TASKS[self.task]
        if self.runner == "auto":
            self.runner = "generate"
        if self.runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError(
                    f"pooler_config needs runner='pooling', got runner={self.runner!r}"
                )
            return
        self.pooler_config = PoolerConfig.from_value(self.pooler_config)
        combos = {
            "tensor_parallel_size": self.tensor_parallel_size > 1,
            "pipeline_parallel_size": self.pipeline_parallel_size > 1,
            "speculative_config": self.speculative_config is not None,
            "enable_lora": self.enable_lora,
            "memory_mode": self.memory_mode != "paged",
            "kv_transfer_config": self.kv_transfer_config is not None,
        }
        _refuse_combinations("runner='pooling'", combos, self)

    def _check_kv_transfer(self) -> None:
        """What a KV connector cannot run with in minipaged: its blocks are whole
        layers, loaded and saved around an eager forward pass on every rank (a
        pipeline stage holds only some layers), with no per-layer scale that differs
        between two engines (fp8's)."""
        self.kv_transfer_config = KVTransferConfig.from_value(self.kv_transfer_config)
        if self.kv_transfer_config is None:
            return
        combos = {
            "pipeline_parallel_size": self.pipeline_parallel_size > 1,
            "distributed_executor_backend": self.distributed_executor_backend != "mp",
            "speculative_config": self.speculative_config is not None,
            "compilation_config": self.compilation_config.mode != 0,
            "kv_cache_dtype": self.kv_cache_dtype.startswith("fp8"),
            "memory_mode": self.memory_mode != "paged",
        }
        _refuse_combinations("kv_transfer_config", combos, self)

    def _check_quantization(self) -> None:
        """What quantized weights cannot run with in minipaged: LoRA's layers read a
        projection's dense weight, inductor's graph packs it."""
        if self.quantization is None:
            return
        _choice("quantization", self.quantization, QUANTIZATION_METHODS)
        combos = {
            "enable_lora": self.enable_lora,
            "compilation_config": self.compilation_config.mode != 0,
        }
        _refuse_combinations(f"quantization={self.quantization!r}", combos, self)

    def _check_pipeline(self) -> None:
        """What pipeline stages cannot run in minipaged (the stages' runners hold no
        adapters, no draft model, no whole expert layers)."""
        if self.pipeline_parallel_size == 1:
            return
        for name in ("speculative_config", "enable_lora", "enable_expert_parallel"):
            if getattr(self, name):
                raise ValueError(
                    f"{name} cannot run with pipeline_parallel_size="
                    f"{self.pipeline_parallel_size} in minipaged"
                )


def _refuse_combinations(what: str, combos: dict[str, bool], config: EngineConfig) -> None:
    """Raise ``ValueError`` naming the first setting of ``combos`` that ``config`` uses
    and ``what`` cannot run with."""
    for name, used in combos.items():
        if used:
            raise ValueError(
                f"{what} cannot run with {name}={getattr(config, name)!r} in minipaged"
            )


# The KV connectors minipaged has (vLLM's names), and the roles an engine plays.
KV_CONNECTORS = ("SharedStorageConnector", "P2pTcpConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# What each connector reads of kv_connector_extra_config: required keys, then optional.
KV_CONNECTOR_EXTRA_KEYS = {
    "SharedStorageConnector": (("shared_storage_path",), ()),
    "P2pTcpConnector": ((), ("connect_timeout_s", "load_timeout_s")),
}


@dataclass
class KVTransferConfig:
    """Disaggregated prefill's settings, with vLLM's ``kv_transfer_config`` keys.

    Args:
        kv_connector: the connector class, by vLLM's name: ``"SharedStorageConnector"``
            (the KV of each prompt in files under a directory both engines see) or
            ``"P2pTcpConnector"`` (pulled from the producer over TCP, host to host:
            the CPU's counterpart of vLLM's ``P2pNcclConnector``).
        kv_role: ``"kv_producer"`` (runs prefills and saves their KV),
            ``"kv_consumer"`` (loads the KV a producer saved) or ``"kv_both"``.
        kv_rank: this engine's rank among the KV-transfer instances (None: unset).
        kv_parallel_size: how many instances take part.
        kv_ip: where a networked connector meets its peer: the producer listens
            there and the consumer connects (unused by the shared-storage connector,
            as in vLLM).
        kv_port: the port at ``kv_ip``.
        kv_buffer_size: the bytes of KV a networked producer keeps for consumers to
            pull; past it the oldest prompts' go first.
        kv_connector_extra_config: the connector's own settings:
            ``{"shared_storage_path": DIR}`` for ``SharedStorageConnector``;
            ``{"connect_timeout_s": S, "load_timeout_s": T}`` (defaults 10 and 30:
            how long a consumer waits for the producer at start-up, and for a
            layer's KV in a step) for ``P2pTcpConnector``.
    """

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: float = 1e9
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _choice("kv_transfer_config 'kv_connector'", self.kv_connector, KV_CONNECTORS)
        _choice("kv_transfer_config 'kv_role'", self.kv_role, KV_ROLES)
        _positive_int("kv_transfer_config 'kv_parallel_size'", self.kv_parallel_size)
        if self.kv_rank is not None and (
            not isinstance(self.kv_rank, int)
            or isinstance(self.kv_rank, bool)
            or not 0 <= self.kv_rank < self.kv_parallel_size
        ):
            raise ValueError(
                f"kv_transfer_config 'kv_rank' must be an int in [0, {self.kv_parallel_size}) "
                f"or None, got {self.kv_rank!r}"
            )
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config 'kv_ip' must be a host, got {self.kv_ip!r}")
        if not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(
                f"kv_transfer_config 'kv_port' must be an int in [1, 65535], got {self.kv_port!r}"
            )
        if isinstance(self.kv_buffer_size, bool) or not (
            isinstance(self.kv_buffer_size, (int, float)) and self.kv_buffer_size > 0
        ):
            raise ValueError(
                f"kv_transfer_config 'kv_buffer_size' must be a number > 0, "
                f"got {self.kv_buffer_size!r}"
            )
        self._check_extra_config()

    def _check_extra_config(self) -> None:
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError(
                f"kv_transfer_config 'kv_connector_extra_config' must be a dict, got {extra!r}"
            )
        required, optional = KV_CONNECTOR_EXTRA_KEYS[self.kv_connector]
        if unknown := [key for key in extra if key not in (*required, *optional)]:
            raise ValueError(
                f"kv_connector_extra_config key {unknown[0]!r} is not supported by "
                f"{self.kv_connector} (it takes {', '.join(required + optional)})"
            )
        for key in required:
            if isinstance(extra.get(key), os.PathLike):
                extra[key] = os.fspath(extra[key])
            if not isinstance(extra.get(key), str) or not extra[key]:
                raise ValueError(
                    f"kv_connector_extra_config {key!r} is required by {self.kv_connector}, "
                    f"got {extra.get(key)!r}"
                )
        for key in ("connect_timeout_s", "load_timeout_s"):
            timeout = extra.get(key, 1)
            if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
                raise ValueError(
                    f"kv_connector_extra_config {key!r} must be a number > 0, got {timeout!r}"
                )
        if self.kv_connector == "P2pTcpConnector" and self.kv_role == "kv_both":
            raise ValueError(
                "kv_transfer_config 'kv_role': P2pTcpConnector takes kv_producer or "
                "kv_consumer (one engine serves, the other pulls), got 'kv_both'"
            )

    @classmethod
    def from_value(cls, value) -> KVTransferConfig | None:
        """vLLM's forms: None, a `KVTransferConfig` or its dict (an unknown key is
        refused, never ignored)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a dict or None, got {value!r}")
        keys = [f.name for f in dataclasses.fields(cls)]
        if unknown := [key for key in value if key not in keys]:
            raise ValueError(
                f"kv_transfer_config key {unknown[0]!r} is not supported by minipaged "
                f"(it takes {', '.join(keys)})"
            )
        return cls(**value)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


# vLLM's structured-output backends that minipaged has, and those it has not.
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")
UNIMPLEMENTED_STRUCTURED_OUTPUTS_BACKENDS = ("outlines", "lm-format-enforcer")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs' settings, with vLLM's ``structured_outputs_config`` keys (its
    backend only).

    Args:
        backend: the grammar engine: ``"guidance"`` (llguidance,
            `minipaged.structured_output.backend_guidance`), ``"xgrammar"``
            (`minipaged.structured_output.backend_xgrammar`) or ``"auto"``.  vLLM's
            ``auto`` prefers xgrammar and falls back to guidance for what xgrammar
            cannot compile; minipaged's ``auto`` is guidance, for every request (the
            engine it was built on).  vLLM's ``"outlines"`` and
            ``"lm-format-enforcer"`` are refused.
    """

    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend in UNIMPLEMENTED_STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"structured_outputs_config 'backend' {self.backend!r} is not supported by "
                f"minipaged (it takes {', '.join(STRUCTURED_OUTPUTS_BACKENDS)})"
            )
        _choice("structured_outputs_config 'backend'", self.backend, STRUCTURED_OUTPUTS_BACKENDS)

    @property
    def resolved_backend(self) -> str:
        """The backend that compiles every grammar: ``auto`` is guidance."""
        return "guidance" if self.backend == "auto" else self.backend

    @classmethod
    def from_value(cls, value) -> StructuredOutputsConfig:
        """vLLM's forms: None (the default), a `StructuredOutputsConfig` or its dict (an
        unknown key is refused, never ignored)."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a dict or None, got {value!r}")
        if unknown := [key for key in value if key != "backend"]:
            raise ValueError(
                f"structured_outputs_config key {unknown[0]!r} is not supported by minipaged "
                "(it takes backend)"
            )
        return cls(**value)


# vLLM's CompilationMode values that minipaged runs: NONE, STOCK_TORCH_COMPILE.
COMPILATION_MODES = (0, 1)


@dataclass(frozen=True)
class CompilationConfig:
    """torch.compile's settings, with vLLM's ``compilation_config`` keys (its mode only).

    Args:
        mode: vLLM's ``CompilationMode``: 0 (``NONE``) runs every step eagerly; 1
            (``STOCK_TORCH_COMPILE``) compiles the decode forward with inductor, on a
            CPU.  vLLM's 2 (``DYNAMO_TRACE_ONCE``) and 3 (``VLLM_COMPILE``: its own
            graph splitting and fusion passes) are refused.
    """

    mode: int = 0

    @classmethod
    def from_value(cls, value) -> CompilationConfig:
        """vLLM's forms: None (the default), a mode, or a dict of keys; an unknown key
        is refused, never ignored."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if isinstance(value, dict):
            if unknown := [key for key in value if key != "mode"]:
                raise ValueError(
                    f"compilation_config key {unknown[0]!r} is not supported by minipaged "
                    "(it takes mode)"
                )
            value = value.get("mode", 0)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(
                f"compilation_config must be a mode (int), a dict or None, got {value!r}"
            )
        _choice("compilation_config mode", value, COMPILATION_MODES)
        return cls(mode=value)


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings, with vLLM's ``speculative_config`` keys.

    Args:
        method: ``"ngram"`` (prompt lookup: guesses copied from where the sequence's
            last tokens occurred before) or ``"draft_model"`` (a smaller model with the
            same vocabulary guesses, greedily, over its own paged KV); vLLM infers the
            latter from ``model``.
        num_speculative_tokens: ``k``, the guesses verified per sequence and step.
        model: the draft checkpoint, as `EngineConfig.model` names one.
        prompt_lookup_max: the longest n-gram the ``ngram`` method matches (vLLM:
            ``prompt_lookup_min`` if unset, and 5 if both are).
        prompt_lookup_min: the shortest (vLLM: ``prompt_lookup_max`` if unset, and 5
            if both are).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        """Check vLLM's dict, naming the key at fault (an unknown one is refused, never
        ignored), and fill in vLLM's defaults."""
        keys = [f.name for f in dataclasses.fields(cls)]
        if unknown := [key for key in config if key not in keys]:
            raise ValueError(
                f"speculative_config key {unknown[0]!r} is not supported by minipaged "
                f"(it takes {', '.join(keys)})"
            )
        config = dict(config)
        if "model" in config and config["model"] in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config 'model' is a checkpoint; for the method write "
                f"'method': {config['model']!r}"
            )
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        method = config.setdefault("method", "draft_model" if "model" in config else None)
        _choice("speculative_config 'method'", method, SPECULATIVE_METHODS)
        _positive_int(
            "speculative_config 'num_speculative_tokens'", config["num_speculative_tokens"]
        )
        if method == "draft_model":
            if not isinstance(config.get("model"), (str, os.PathLike)):
                raise ValueError(
                    f"speculative_config 'model' must name the draft checkpoint, "
                    f"got {config.get('model')!r}"
                )
            config["model"] = os.fspath(config["model"])
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if config.get(key) is not None:
                    raise ValueError(f"speculative_config {key!r} is for method 'ngram' only")
        else:
            if config.get("model") is not None:
                raise ValueError("speculative_config 'model' is for method 'draft_model' only")
            lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo = hi = 5
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            _positive_int("speculative_config 'prompt_lookup_min'", lo)
            _positive_int("speculative_config 'prompt_lookup_max'", hi)
            if lo > hi:
                raise ValueError(
                    f"speculative_config 'prompt_lookup_min' ({lo}) must be <= "
                    f"'prompt_lookup_max' ({hi})"
                )
            config["prompt_lookup_min"], config["prompt_lookup_max"] = lo, hi
        return cls(**config)


def _choice(name, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _positive_int(name, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _number(name, value, rule, ok) -> None:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not ok(value)
    ):
        raise ValueError(f"{name} must be a number {rule}, got {value!r}")
