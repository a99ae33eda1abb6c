"""The engine: requests in, one step at a time, finished requests out (paper §4, §4.5).

`add_request` checks a request and queues it (`InputProcessor`); then one
`LLMEngine.step()` is the whole serving loop, once:

    schedule -> execute -> sample -> update

- **schedule**: the `Scheduler` picks this step's tokens and the block operations they
  need (swap out, swap in, copy-on-write), preempting if the pool is short;
- **execute**: the `Executor` runs those block operations on the `CacheEngine`, then
  the `ModelRunner`'s forward pass over the batch (with ``tensor_parallel_size`` > 1,
  on every rank of the group, §4.6);
- **sample**: `ParallelSampling` draws each finished sequence's next token (a prompt
  with ``n`` > 1 draws one for each of its ``n`` completions; a structured output's
  logits masked first to what its grammar allows, `StructuredOutputManager`), `BeamSearch` ranks the
  beams' candidates instead (§4.4); both only choose (`StepSamples`);
- **update**: `Scheduler.update_from_output` (vLLM's) applies the choice: it forks,
  appends each new token, checks the stop conditions, frees a finished sequence's
  blocks and retires a finished request; then the `OutputProcessor` builds the step's
  outputs: each finished request's, and what the step added to requests that stream
  (``output_kind``), decoding their text.

With ``async_scheduling`` (vLLM's; on by default on a GPU), the scheduler schedules the
next step while this one's forward pass runs (in a worker thread on a CPU, on the
device on a GPU), its tokens still placeholders; once this step is sampled the next
one starts with the sampled tokens, and this one's update runs after
(`LLMEngine._step_async`).

Everything about memory is the scheduler's (and, under it, the KV cache manager's); the
update only ever asks it to fork, append to or free a sequence, so the event trace,
which the scheduler records, sees every block operation.  The scheduler also owns the
requests (`Scheduler.requests`), from `add_request` until they retire or are aborted.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoTokenizer

from minipaged.config import EngineConfig
from minipaged.core.memory import KVCacheManager
from minipaged.core.memory.lora_slots import LoRASlots
from minipaged.core.sched.encoder_cache_manager import EncoderCacheManager
from minipaged.core.sched.output import ScheduledSeq, SchedulerOutput, StepSamples, logit_rows
from minipaged.core.sched.scheduler import make_scheduler
from minipaged.distributed.parallel_state import NO_PIPELINE, SINGLE
from minipaged.engine.adapters import Adapters
from minipaged.engine.fail_alone import sample_failing_alone
from minipaged.engine.input_processor import InputProcessor, Params
from minipaged.engine.output_processor import OutputProcessor
from minipaged.executor.uniproc_executor import Executor
from minipaged.lora_request import LoRARequest
from minipaged.models.attention import calculate_kv_scales_on_next_batch, head_dim, latent_dim
from minipaged.models.hub import resolve_model
from minipaged.models.loader import load_model, model_class, read_config
from minipaged.models.moe import routing_stats
from minipaged.models.pooler import Pooler
from minipaged.models.resolve import (
    eos_token_ids,
    resolve_backend,
    resolve_device,
    resolve_max_model_len,
)
from minipaged.multimodal.processing import MultiModalProcessor
from minipaged.ops import check_supported, kv_quant
from minipaged.outputs import Output
from minipaged.sample.beam_search import BeamSearch
from minipaged.sample.parallel_sampling import ParallelSampling, StepRows
from minipaged.sequence import SequenceGroup, SequenceStatus
from minipaged.spec_decode.speculator import Speculator, load_draft_model, make_proposer
from minipaged.structured_output import StructuredOutputManager
from minipaged.trace import Trace
from minipaged.worker.cache_engine import block_bytes, fit_max_model_len, pool_sizes
from minipaged.worker.compiled_decode import check_compiled_decode
from minipaged.worker.cuda_graphs import capture_decode_graphs, uses_decode_graphs
from minipaged.worker.model_runner import ModelRunner


class LLMEngine:
    """A model, its KV cache pools, a scheduler over them, and the step loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        path = resolve_model(config.model)
        self.attention_backend = resolve_backend(config.attention_backend, self.device)
        if config.compilation_config.mode:
            check_compiled_decode(config, self.device, self.attention_backend, read_config(path))
        self.workers = start_workers(config, path, self.device, self.attention_backend)
        try:
            self._load_model(path)
            self._build_kv_cache()
            self.kv_connector = make_kv_connectors(self, path)
            self._build_step_parts()
        except BaseException:
            self.shutdown()
            raise

    def _load_model(self, path: Path) -> None:
        """The model (this rank's shard of it, with tensor parallelism), its tokenizer,
        what it settles (EOS tokens, ``max_model_len``), the executor that runs it, and
        a speculative draft model if one is asked for (before the KV pools, whose
        memory its weights share)."""
        config = self.config
        tp, pp = (self.workers.tp, self.workers.pp) if self.workers else (SINGLE, NO_PIPELINE)
        self.model = load_model(
            path,
            config.dtype,
            self.device,
            self.attention_backend,
            tp,
            pp,
            quantization=config.quantization,
        )
        if self.workers:
            self.workers.wait_loaded()
        self.tokenizer = AutoTokenizer.from_pretrained(
            resolve_model(config.tokenizer) if config.tokenizer else path, local_files_only=True
        )
        self.eos_token_ids = eos_token_ids(path, self.model.config, self.tokenizer)
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.model.config)
        self.vocab_size = self.model.config.vocab_size
        self.runner = ModelRunner(self.model, config.block_size, self.device)
        self.mm_processor = make_mm_processor(config, path, self.model, self.tokenizer)
        if config.runner == "pooling":
            self.runner.pooler = Pooler(config.pooler_config, self.model.config)
        if config.enable_lora:
            self.runner.enable_lora(config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        self.executor = (
            self.workers.executor(self.runner, config.calculate_kv_scales)
            if self.workers
            else Executor(self.runner)
        )
        self.draft_model = load_draft_model(
            config.speculative_config,
            self.vocab_size,
            self.max_model_len,
            config.dtype,
            self.device,
            self.attention_backend,
        )

    def _build_kv_cache(self) -> None:
        """The KV pools, as many blocks as the memory allows (§4.5), on every rank, of
        ``kv_cache_dtype`` (a draft model's pool beside them counted in); the KV cache
        manager over their block ids (§4.2); the decode graphs that replay over them
        (CUDA), or the compiled decode forward (CPU)."""
        config, dtype = self.config, self.model.model.embed_tokens.weight.dtype
        self.kv_cache_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, dtype)
        models = [m for m in (self.model, self.draft_model) if m is not None]
        for model in models:
            check_supported(
                self.attention_backend,
                dtype,
                head_dim(model.config),
                config.block_size,
                self.kv_cache_dtype,
            )
        # The pool is sized in bytes: a byte per element (fp8, int8) fits twice the blocks.
        self.block_bytes = block_bytes(
            self.executor.kv_config, config.block_size, self.kv_cache_dtype
        )
        self.draft_block_bytes = (
            block_bytes(self.draft_model.config, config.block_size, self.kv_cache_dtype)
            if self.draft_model
            else 0
        )
        num_gpu_blocks, num_cpu_blocks = pool_sizes(
            config,
            self.max_model_len,
            self.device,
            self.block_bytes,
            lambda: self.executor.kv_memory_budget(config, self.max_model_len),
            self.draft_block_bytes,
        )
        self.max_model_len = fit_max_model_len(
            self.max_model_len, config.max_model_len, num_gpu_blocks, config.block_size
        )
        self.cache_engine = self.executor.allocate(
            num_gpu_blocks, num_cpu_blocks, self.kv_cache_dtype
        )
        self.kv = KVCacheManager(
            num_gpu_blocks, config.block_size, num_cpu_blocks, config.enable_prefix_caching
        )
        self.runner.init_input_batch(
            config.max_num_seqs, self.max_model_len + num_lookahead(config)
        )
        # A replayed graph would skip the KV connector's hooks on the attention layers.
        graphs = config.kv_transfer_config is None
        if graphs and uses_decode_graphs(
            config, self.device, self.attention_backend, self.model.config
        ):
            capture_decode_graphs(
                self.runner, self.cache_engine.gpu_cache, config.max_num_seqs, self.max_model_len
            )
        elif config.compilation_config.mode:
            self.runner.compile_decode(self.cache_engine.gpu_cache)
        if config.calculate_kv_scales:  # after the capture's dummy batches
            for model in models:
                calculate_kv_scales_on_next_batch(model)

    def _build_step_parts(self) -> None:
        """What each phase of a step asks: the scheduler (which records the trace), the
        input processor, the two samplers, the speculator and the output processor."""
        config = self.config
        self.trace = Trace(config.trace)
        self.scheduler = make_scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.preemption_mode,
            self.trace,
            config.memory_mode,
            self.max_model_len,
        )
        if config.enable_lora:
            self.scheduler.lora_slots = LoRASlots(config.max_loras)
        self.scheduler.connector = self.kv_connector
        if self.mm_processor is not None:
            self.scheduler.encoder_cache = EncoderCacheManager(
                config.encoder_cache_size or self.mm_processor.default_cache_size(config)
            )
            self.scheduler.max_num_encoder_input_tokens = self.mm_processor.encoder_compute_budget(
                config
            )
            self.scheduler.disable_chunked_mm_input = self.mm_processor.check_unchunked(config)
        self.adapters = Adapters(
            self.runner.lora, self.scheduler.lora_slots, self.scheduler.requests
        )
        self.structured_output = StructuredOutputManager(
            self.tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            config.max_num_seqs,
            config.structured_outputs_config.resolved_backend,
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            self.scheduler,
            self.device,
            speculative=config.speculative_config is not None,
            pipelined=config.pipeline_parallel_size > 1,
            pooler=self.runner.pooler,
            structured_output=self.structured_output,
        )
        if self.mm_processor is not None:
            self.input_processor.image_token_id = self.mm_processor.image_token_id
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.parallel_sampling = ParallelSampling(self.eos_token_ids, self.generator)
        self._step_rows: StepRows | None = None  # the last sample phase's (`StepRows.of`)
        self.beam_search = BeamSearch(self.eos_token_ids, self.tokenizer)
        self.output_processor = OutputProcessor(self.beam_search)
        self.scheduler.eos_token_ids = self.eos_token_ids
        self.scheduler.pools = self.runner.pooler is not None
        self.scheduler.check_stop_strings = self.output_processor.check_stop_strings
        self.speculator = None
        if spec := config.speculative_config:
            self.speculator = Speculator(
                spec,
                self.eos_token_ids,
                self.generator,
                self.max_model_len,
                make_proposer(
                    spec,
                    self.draft_model,
                    self.kv.num_gpu_blocks,
                    config.block_size,
                    self.kv_cache_dtype,
                    self.device,
                ),
            )
        self.num_steps = 0
        self.num_prompt_tokens = 0  # of every request added
        self.num_generated_tokens = 0  # sampled, by every sequence and beam
        self.failed: dict[str, Exception] = {}  # the last step's, with fail_alone
        # async_scheduling: the thread that runs forward passes on a CPU (a GPU's run on
        # the device once launched: `_launch`), and the step in flight.
        self._forward_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="minipaged-forward")
            if config.resolve_async_scheduling(self.device) and self.device.type == "cpu"
            else None
        )
        self._in_flight: tuple[SchedulerOutput, Future] | None = None
        self.num_steps_ahead = 0  # steps scheduled while the one before them ran

    @property
    def requests(self) -> dict[str, SequenceGroup]:
        """The requests not finished yet, by id (the scheduler's: read, never change)."""
        return self.scheduler.requests

    # -- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Params,
        prompt: str | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list | None = None,
    ) -> None:
        """Queue a request, with ``lora_request``'s adapter if given, and
        ``mm_features``, its images as `process_multimodal` made them.  Raises
        ``ValueError`` (changing nothing) if it is malformed or could never fit the KV
        pool."""
        self.adapters.check(lora_request)
        group = self.input_processor.process(
            request_id, prompt_token_ids, params, prompt, mm_features
        )
        if lora_request is not None:
            self.adapters.add(lora_request)
            group.lora_request = lora_request
        self.scheduler.add(group)
        self.num_prompt_tokens += len(prompt_token_ids)

    def check_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Params,
        lora_request: LoRARequest | None = None,
        mm_features: list | None = None,
    ) -> None:
        """Raise ``ValueError`` if `add_request` would refuse the request."""
        self.adapters.check(lora_request)
        self.input_processor.check(request_id, prompt_token_ids, params, mm_features)

    @property
    def image_placeholder(self) -> str | None:
        """The text a prompt holds where an image goes (LLaVA's ``"<image>"``,
        Qwen2-VL's ``"<|vision_start|><|image_pad|><|vision_end|>"``); None for a
        text-only model."""
        return None if self.mm_processor is None else self.mm_processor.placeholder

    def process_multimodal(
        self, prompt: str, images: list, add_special_tokens: bool = True
    ) -> tuple[list[int], list]:
        """``prompt``'s token ids, each image placeholder expanded to the encoder's
        token count, and its images' ``mm_features`` for `add_request` (vLLM's input
        processing).  ``images``: PIL images, data URLs or local paths.  ``ValueError``
        if this model takes no images, or an image is refused
        (`minipaged.multimodal.processing`)."""
        if self.mm_processor is None:
            raise ValueError(
                f"multi_modal_data: {type(self.model).__name__} is a text-only model "
                "and takes no images"
            )
        return self.mm_processor.process(prompt, images, add_special_tokens)

    # -- adapters (vLLM's names) ------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter and make it known (`list_loras`) before any request uses
        it; False if it was known."""
        return self.adapters.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter that no unfinished request uses (``ValueError`` if one
        does), freeing its slot and host copy; False if it is unknown."""
        return self.adapters.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.adapters.by_id.values())

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (between steps)."""
        self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------
    def step(self, fail_alone: bool = False) -> list[Output]:
        """One iteration of the serving loop (§4.5); returns the requests that finished
        and the news of those that stream (``output_kind`` other than ``FINAL_ONLY``).

        With ``fail_alone`` (a server's choice), a request whose sampling raises fails
        alone: it is aborted, its blocks freed, and its error left in ``failed`` for
        the caller, while the others go on.  Without it (``LLM.generate``) the error
        propagates to the caller."""
        if self.config.async_scheduling:
            return self._step_async(fail_alone)
        if self.speculator:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        self.parallel_sampling.remove(batch.finished_req_ids)
        sampling, logits = self.executor.execute(batch)
        return self._sample_and_update(batch, sampling, logits, fail_alone)

    def _step_async(self, fail_alone: bool) -> list[Output]:
        """`step` with ``async_scheduling`` (vLLM's ``step_with_batch_queue``): while the
        forward pass of step N runs (`_launch`), this thread schedules step N+1 with a
        placeholder for each token N will sample (`Scheduler.schedule_ahead`).  Once N
        is sampled, N+1 starts at once, its placeholders' input tokens those just
        sampled (`Scheduler.write_sampled`), and runs while N is updated (stops, frees)
        and its outputs made: a sequence that finished at N ran one step for nothing,
        its row dropped when N+1 is sampled, as vLLM discards such tokens (and if every
        one finished, N+1 is waited for at once: `_drain`).  A step that cannot be
        scheduled ahead waits for N and is scheduled as usual on the next call."""
        if self._in_flight is None:
            self._launch(self.scheduler.schedule())
        (batch, future), self._in_flight = self._in_flight, None
        ahead = self.scheduler.schedule_ahead(batch)  # while the forward pass runs
        try:
            sampling, logits = drop_aborted(*future.result())
            samples, lost = self._sample_step(sampling, logits, fail_alone)
        except BaseException:
            if ahead is not None:
                self.scheduler.cancel_ahead(ahead)
            raise
        if ahead is not None:
            self.scheduler.write_sampled(ahead, samples)
            self._launch(ahead)
            self.num_steps_ahead += 1
        outputs = self._update(batch, samples, lost, fail_alone)
        if ahead is not None:
            self.scheduler.fill_placeholders(ahead)
            if not self.scheduler.has_unfinished():
                self._drain()
        return outputs

    def _drain(self) -> None:
        """Wait for the step in flight whose sequences all finished meanwhile (its rows
        would all be dropped), so that an idle engine holds no step and its logits."""
        (_, future), self._in_flight = self._in_flight, None
        future.result()

    def _launch(self, batch: SchedulerOutput) -> None:
        """Start ``batch``'s block operations and forward pass.  On a CPU in the worker
        thread, which computes while this one schedules (torch releases the GIL inside
        its ops).  On a GPU here: the launch returns once the kernels are queued and
        the device runs them while this thread schedules; a thread would only take the
        GIL from the scheduler to launch them (measured on an H200, 2026-11-28: 12%
        fewer tokens/s with the thread than with no async scheduling at all)."""
        self.parallel_sampling.remove(batch.finished_req_ids)
        if self._forward_thread is not None:
            future = self._forward_thread.submit(self.executor.execute, batch)
        else:
            future = Future()
            try:
                future.set_result(self.executor.execute(batch))
            except BaseException as error:  # raised where the thread's would be: result()
                future.set_exception(error)
        self._in_flight = batch, future

    def _sample_and_update(
        self,
        batch: SchedulerOutput,
        sampling: list[ScheduledSeq],
        logits: torch.Tensor | None,
        fail_alone: bool,
    ) -> list[Output]:
        """The sample and update phases of ``batch``, whose forward pass gave
        ``logits`` for ``sampling``."""
        samples, lost = self._sample_step(sampling, logits, fail_alone)
        return self._update(batch, samples, lost, fail_alone)

    def _sample_step(
        self, sampling: list[ScheduledSeq], logits: torch.Tensor | None, fail_alone: bool
    ) -> tuple[StepSamples, dict[str, Exception]]:
        """The sample phase, and the requests whose KV never arrived (their rows left
        out); with ``fail_alone``, a request whose sampling raised is left in
        ``failed``."""
        lost = self._lost_kv_loads()
        if lost and sampling:  # their logits came from KV that never arrived
            keep = [i for i, s in enumerate(sampling) if s.group.request_id not in lost]
            sampling, logits = [sampling[i] for i in keep], logits[keep]
        samples, self.failed = StepSamples(), {}
        if sampling and fail_alone:
            samples, self.failed = sample_failing_alone(
                self.sample, sampling, logits, self.generator
            )
        elif sampling:
            samples = self.sample(sampling, logits)
        return samples, lost

    def _update(
        self,
        batch: SchedulerOutput,
        samples: StepSamples,
        lost: dict[str, Exception],
        fail_alone: bool,
    ) -> list[Output]:
        """The update phase of ``batch``: the failed and lost requests aborted, the
        samples applied (`Scheduler.update_from_output`), the outputs made."""
        self.failed.update(lost)
        for request_id in self.failed:
            self.abort_request(request_id)
        groups = self.scheduler.update_from_output(batch, samples)
        outputs = self.output_processor.outputs(groups)
        self.num_generated_tokens += samples.num_appended
        if self.speculator:
            self.speculator.count(samples.verified)
            self.speculator.release(self.scheduler.running)
        self.num_steps += 1
        self.trace.step = self.num_steps  # arrivals and aborts from now on belong to it
        if lost and not fail_alone:
            raise next(iter(lost.values()))
        return outputs

    def _lost_kv_loads(self) -> dict[str, Exception]:
        """The requests holding a block whose KV a connector failed to load this step
        (vLLM's ``kv_load_failure_policy="fail"``), with the error each fails with;
        those blocks leave the prefix cache first, so no later prompt reads them."""
        if self.kv_connector is None:
            return {}
        worker = self.runner.kv_connector
        blocks = worker.get_block_ids_with_load_errors()
        if not blocks:
            return {}
        from minipaged.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
            KVTransferError,
        )

        self.kv.uncache(blocks)
        error = KVTransferError(f"the prompt's KV did not arrive: {worker.load_error()}")
        return {request_id: error for request_id in self.scheduler.requests_holding(blocks)}

    def sample(self, sampling: list[ScheduledSeq], logits: torch.Tensor) -> StepSamples:
        """The sample phase: each sequence of ``sampling`` reached its end; choose its
        next token from its row of ``logits``, or for beam search rank its candidates, or
        verify the guesses it ran (with one more row each, `logit_rows`).  Changes no
        request (`Scheduler.update_from_output` applies the choice)."""
        samples = StepSamples()
        # Only a speculator gives sequences guesses: without one, no row is scanned.
        if self.speculator is not None and any([s.spec_token_ids for s in sampling]):
            rows = logit_rows(sampling)
            spec = [i for i, s in enumerate(sampling) if s.spec_token_ids]
            verifying = [sampling[i] for i in spec]
            spec_logits = [logits[rows[i].start : rows[i].stop] for i in spec]
            self.structured_output.apply_drafts(verifying, spec_logits)  # grammars' masks
            samples.verified = self.speculator.verify(verifying, spec_logits)
            rest = [i for i, s in enumerate(sampling) if not s.spec_token_ids]
            sampling, logits = [sampling[i] for i in rest], logits[[rows[i][0] for i in rest]]
        rows = self._step_rows = StepRows.of(sampling, self._step_rows)
        if rows.plain:
            if rows.structured:
                self.structured_output.apply(sampling, logits, rows.plain)  # grammars' masks
            samples.extend(self.parallel_sampling.step(sampling, logits, rows))
        if rows.beams:
            if rows.structured:
                self.structured_output.apply(sampling, logits, rows.beams)
            samples.extend(self.beam_search.rank(sampling, logits, rows.beams))
        return samples

    def kv_connector_stats(self) -> dict[str, float]:
        """What the KV connector moved: its scheduler side's counters and this rank's
        worker side's (a networked consumer's workers receive the blocks)."""
        if self.kv_connector is None:
            return {}
        return {
            **self.kv_connector.get_kv_connector_stats(),
            **self.runner.kv_connector.get_kv_connector_stats(),
        }

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is
        garbage collected); the engine cannot step afterwards."""
        if self.workers:
            self.workers.shutdown()
        if getattr(self, "_forward_thread", None) is not None:
            self._forward_thread.shutdown()

    def stats(self) -> dict[str, float]:
        """The pools, the queues and the counters (vLLM's names where it has them),
        and where the pool's slots go (``kv.usage()``, which walks every block table)."""
        return {**self.counters(), **self.kv.usage()}

    def counters(self) -> dict[str, float]:
        """The pools' free blocks, the queues and the counters: cheap enough to read
        after every step (a server's ``/metrics``); for a mixture-of-experts model, the
        last step's routing too (`routing_stats`)."""
        return {
            **self.kv.stats(),
            "kv_cache_block_bytes": self.block_bytes,
            # Per token over every layer: what latent attention (MLA) shrinks.
            "kv_cache_bytes_per_token": self.block_bytes // self.config.block_size,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "num_steps": self.num_steps,
            "num_steps_ahead": self.num_steps_ahead,  # 0 without async_scheduling
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            # Prompt tokens run through the model, and those a KV connector loaded.
            "num_computed_prompt_tokens": self.scheduler.num_computed_prompt_tokens,
            "num_external_computed_tokens": self.scheduler.num_external_computed_tokens,
            **self.kv_connector_stats(),
            **(self.speculator.stats() if self.speculator else {}),
            **(self.draft_memory() if self.draft_model else {}),
            **routing_stats(self.model),
            **(self.encoder_stats() if self.mm_processor else {}),
        }

    def encoder_stats(self) -> dict[str, float]:
        """A vision model's encoder cache: images looked up by admitted requests, those
        found cached, the images encoded, and the embeddings the cache holds."""
        cache = self.scheduler.encoder_cache
        return {
            "encoder_cache_queries": cache.num_lookups,
            "encoder_cache_hits": cache.num_hits,
            "encoder_cache_hit_rate": cache.hit_rate,
            "num_encoded_images": self.runner.num_encoded_items,
            "encoder_cache_usage": cache.cache_size - cache.num_free_slots,
        }

    def draft_memory(self) -> dict[str, int]:
        """What a speculative draft model takes on the device: its weights, and a block
        of its own KV pool (which has ``num_gpu_blocks`` too)."""
        return {
            "draft_weight_bytes": sum(p.nbytes for p in self.draft_model.parameters()),
            "draft_kv_cache_block_bytes": self.draft_block_bytes,
        }


def drop_aborted(
    sampling: list[ScheduledSeq], logits: torch.Tensor | None
) -> tuple[list[ScheduledSeq], torch.Tensor | None]:
    """``sampling`` and its rows of ``logits`` without the requests aborted while
    their step ran (with async scheduling, `abort_request` may come then)."""
    finished = SequenceStatus.FINISHED
    if not any([s.group.status is finished for s in sampling]):
        return sampling, logits
    keep = [i for i, s in enumerate(sampling) if s.group.status is not finished]
    return [sampling[i] for i in keep], _rows(logits, keep)


def _rows(logits: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """``logits[keep]`` (``keep`` ascending, one row per sequence) joined from slices:
    indexing a GPU tensor with a list copies the list there from pageable memory,
    which waits for the device (a step's only wait is its sampled tokens')."""
    starts = [i for j, i in enumerate(keep) if j == 0 or keep[j - 1] != i - 1]
    ends = [i + 1 for j, i in enumerate(keep) if j == len(keep) - 1 or keep[j + 1] != i + 1]
    return torch.cat([logits[a:b] for a, b in zip(starts, ends)]) if keep else logits[:0]


def make_mm_processor(config: EngineConfig, path: Path, model, tokenizer):
    """A vision model's `MultiModalProcessor` over the checkpoint's Hugging Face
    processor (None for a text model); first, what such a model cannot run with."""
    if not hasattr(model, "get_multimodal_embeddings"):
        return None
    config.check_multimodal()
    processor = model.make_processor(path, tokenizer)
    return MultiModalProcessor(
        processor,
        model.image_token_id,
        model.max_image_tokens(processor),
        model.mm_items,
        config.limit_mm_per_prompt,
        config.allowed_local_media_path,
        placeholder=getattr(model, "image_placeholder", None),
    )


def num_lookahead(config: EngineConfig) -> int:
    """Token slots a row holds past ``max_model_len``: a draft's guesses."""
    spec = config.speculative_config
    return spec.num_speculative_tokens if spec else 0


def make_kv_connectors(engine: LLMEngine, path: Path):
    """With ``kv_transfer_config``, the scheduler's side of its KV connector (returned)
    and the worker's (given to the model runner), which must agree with the engines
    they exchange KV with on the facts of `KVCacheFacts`; None without one."""
    transfer = engine.config.kv_transfer_config
    if transfer is None:
        return None
    from minipaged.distributed.kv_transfer.kv_connector.factory import (  # noqa: PLC0415
        KVConnectorFactory,
    )
    from minipaged.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
        KVCacheFacts,
        KVConnectorRole,
    )

    config = engine.model.config
    if latent_dim(config):
        raise ValueError(
            "kv_transfer_config cannot run with a latent-attention (MLA) model in minipaged"
        )
    facts = KVCacheFacts(
        model=path.name,
        block_size=engine.config.block_size,
        dtype=str(engine.model.model.embed_tokens.weight.dtype).removeprefix("torch."),
        kv_cache_dtype=str(engine.kv_cache_dtype).removeprefix("torch."),
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim(config),
    )
    scheduler_side = KVConnectorFactory.create_connector(transfer, KVConnectorRole.SCHEDULER, facts)
    worker_side = KVConnectorFactory.create_connector(transfer, KVConnectorRole.WORKER, facts)
    engine.executor.set_kv_connector(worker_side)
    return scheduler_side


def start_workers(config: EngineConfig, path: Path, device: torch.device, attention_backend: str):
    """With ``tensor_parallel_size * pipeline_parallel_size`` N > 1, ranks 1..N-1 of the
    group (§4.6), loading their shards while this process loads its own: spawned here,
    or, with ``distributed_executor_backend="external_launcher"``, started by
    ``torchrun`` (on ranks other than 0 this never returns: they serve as workers, then
    exit).  None on one device, whose path never enters ``minipaged.distributed`` but
    for the group object."""
    if config.distributed_executor_backend == "external_launcher":
        from minipaged.distributed.launcher import join_launched  # noqa: PLC0415

        return join_launched(config, path, device, attention_backend)
    if config.tensor_parallel_size == config.pipeline_parallel_size == 1:
        model_config = read_config(path)  # experts asked to split that are not there
        model_class(model_config).check_parallel(model_config, 1, config.enable_expert_parallel)
        return None
    from minipaged.distributed.executor import start_workers as start  # noqa: PLC0415

    return start(config, path, device, attention_backend)
