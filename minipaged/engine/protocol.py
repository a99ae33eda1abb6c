"""The one client API the server reaches an engine through (vLLM's ``EngineClient``,
``vllm/engine/protocol.py``).

The OpenAI server, its data-parallel router and its Ray Serve replicas hold an
`EngineClient`: the engine stepped by a thread of its own (`AsyncEngine`), or N of them
in processes of their own (`DataParallelEngine`).  They queue requests and read their
streams through it, load and unload adapters through it, and learn what the engine
serves from its `EngineFacts`, read once when the engine is built, never from the
engine's parts (its KV cache manager, scheduler or model): those change only on the
engine's thread, and a replica's live in another process.  ``tests/test_layers.py``
holds the server to this module and the `LLMEngine`'s public methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from minipaged.config import EngineConfig
from minipaged.lora_request import LoRARequest
from minipaged.outputs import EmbeddingRequestOutput, RequestOutput
from minipaged.pooling_params import PoolingParams
from minipaged.sampling_params import SamplingParams

# A request for the engine: (request id, prompt token ids, params, prompt text, LoRA
# adapter or None); PoolingParams for a pooling engine (``runner="pooling"``).
# (request id, prompt token ids, params, prompt text, adapter[, images' mm_features]).
Request = tuple[str, list[int], SamplingParams | PoolingParams, str | None, LoRARequest | None]


@dataclass
class EngineFacts:
    """What a client knows of the engine it serves, fixed once the engine is built
    (vLLM's ``get_model_config`` and ``get_tokenizer``): its settings, tokenizer,
    context length, vocabulary, KV pool, and the lines the server's startup log prints
    of it (`describe`)."""

    config: EngineConfig
    tokenizer: object
    max_model_len: int
    vocab_size: int
    num_gpu_blocks: int
    description: list[str]
    image_placeholder: str | None = None  # a vision model's "<image>"; None: text only

    @classmethod
    def of(cls, engine) -> EngineFacts:
        """The facts of an `LLMEngine` (read on the thread that built it)."""
        return cls(
            engine.config,
            engine.tokenizer,
            engine.max_model_len,
            engine.vocab_size,
            engine.kv.num_gpu_blocks,
            describe(engine),
            engine.image_placeholder,
        )


def describe(engine) -> list[str]:
    """What an `LLMEngine` runs, as lines of a startup log: device, KV pool, context."""
    kv, config = engine.kv, engine.config
    dtype = str(engine.model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    return [
        f"device          {engine.device}, {dtype}, attention backend {engine.attention_backend}",
        (
            f"KV cache        {kv.gpu.num_blocks} blocks x {config.block_size} tokens = "
            f"{kv.gpu.num_blocks * config.block_size} tokens; {kv.cpu.num_blocks} swap blocks"
        ),
        (
            f"KV dtype        {config.kv_cache_dtype} "
            f"({str(engine.kv_cache_dtype).removeprefix('torch.')}): "
            f"{engine.block_bytes} bytes a block, "
            f"{kv.gpu.num_blocks * engine.block_bytes / 2**20:.1f} MiB"
        ),
        f"max_model_len   {engine.max_model_len} tokens",
    ]


class EngineClient(ABC):
    """What the server calls on an engine, however many there are and wherever they run.

    ``facts`` says what it serves; ``error`` is set once it can serve nothing more.  Its
    counters for ``/metrics`` are published after every step (`AsyncEngine.stats`, a
    replica's by `DataParallelEngine.replica_stats`), never read off the engine."""

    facts: EngineFacts
    error: BaseException | None

    @abstractmethod
    async def generate(self, requests: list[Request]) -> AsyncIterator[RequestOutput]:
        """Check ``requests`` (``ValueError`` before queueing any) and queue them;
        return one stream of all their outputs.  Leaving it early aborts those still
        running, which frees their blocks."""

    def process_multimodal(
        self, prompt: str, images: list, add_special_tokens: bool
    ) -> tuple[list[int], list]:
        """`LLMEngine.process_multimodal`: a prompt's token ids with its images'
        placeholders expanded, and their ``mm_features`` for the request's sixth
        element; ``ValueError`` where the model takes no images.  Here: a client of
        several replicas, which minipaged sends no images."""
        raise ValueError(
            "image_url: minipaged serves images from one engine only, not with "
            "data_parallel_size > 1"
        )

    async def encode(self, requests: list[Request]) -> AsyncIterator[EmbeddingRequestOutput]:
        """vLLM's ``encode``: queue pooling requests (PoolingParams; the engine must
        run ``runner="pooling"``, ``ValueError`` otherwise) and return one stream of
        their embeddings, one output each.  They travel as any request does."""
        return await self.generate(requests)

    @abstractmethod
    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read an adapter and make it known to the engine before any request uses
        it; ``ValueError`` naming the file if it cannot be served."""

    @abstractmethod
    def remove_lora(self, lora_int_id: int) -> None:
        """Have the engine forget an adapter (once no request uses it)."""

    @abstractmethod
    def end_all(self, message: str) -> None:
        """End every running request now (shutting down)."""

    @property
    @abstractmethod
    def num_requests(self) -> int:
        """Requests with a stream still open."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine(s); again, a no-op."""
