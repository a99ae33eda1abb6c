"""The engine: requests in, one step at a time, finished requests out (paper §4, §4.5).

One `LLMEngine.step()` is the whole serving loop, once:

    schedule -> execute -> sample -> update

- **schedule**: the `Scheduler` picks this step's tokens and the block operations they
  need (swap out, swap in, copy-on-write), preempting if the pool is short;
- **execute**: the `CacheEngine` runs those block operations, then the `ModelRunner`
  runs one forward pass over the batch (the `Executor` does both; with
  ``tensor_parallel_size`` > 1, on every rank of the group, §4.6);
- **sample**: the sampler picks each finished sequence's next token (beam search ranks
  candidates instead);
- **update**: new tokens are appended, sequences forked where a request branches
  (``n`` > 1 completions after their shared prompt, beams that keep more than one
  child, §4.4); the `OutputProcessor` detokenizes, checks stop conditions, frees
  finished sequences' blocks and builds the outputs.

`step()` returns each finished request's output, and, for requests that asked to
stream (``SamplingParams.output_kind``), what each step added.

Everything about memory is the scheduler's (and, under it, the KV cache manager's); the
engine only ever asks it to fork, append to or free a sequence, so the event trace,
which the scheduler records, sees every block operation.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import torch
from transformers import AutoTokenizer

from minipaged.batch import ScheduledSeq
from minipaged.beam_search import BeamSearch
from minipaged.cache_engine import CacheEngine, block_bytes, pool_sizes
from minipaged.config import EngineConfig
from minipaged.contiguous_scheduler import make_scheduler
from minipaged.detokenizer import IncrementalDetokenizer
from minipaged.fail_alone import update_failing_alone
from minipaged.distributed.executor import (Executor, TensorParallelExecutor, WorkerGroup,
                                            on_all_ranks)
from minipaged.distributed.parallel_state import SINGLE
from minipaged.distributed.worker import rank_kv_config
from minipaged.memory import KVCacheManager
from minipaged.model_runner import ModelRunner
from minipaged.models.attention import head_dim
from minipaged.models.hub import resolve_model
from minipaged.models.llama import check_tensor_parallel, sliding_window
from minipaged.models.loader import load_model, read_config
from minipaged.models.resolve import (eos_token_ids, resolve_backend, resolve_device,
                                      resolve_max_model_len)
from minipaged.ops import check_supported
from minipaged.output_processor import OutputProcessor
from minipaged.outputs import Output
from minipaged.sampler import make_generator, sample
from minipaged.sampling_params import BeamSearchParams, SamplingParams
from minipaged.sequence import Sequence, SequenceGroup
from minipaged.trace import Trace

Params = SamplingParams | BeamSearchParams


class LLMEngine:
    """A model, its KV cache pools, a scheduler over them, and the step loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        path = resolve_model(config.model)
        self.attention_backend = resolve_backend(config.attention_backend, self.device)
        self.workers = self._start_workers(path)
        try:
            self._build(path)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, path: Path) -> None:
        config = self.config
        tp = self.workers.tp if self.workers else SINGLE
        self.model = load_model(path, config.dtype, self.device, self.attention_backend, tp)
        if self.workers:
            self.workers.wait_loaded()
        self.tokenizer = AutoTokenizer.from_pretrained(
            resolve_model(config.tokenizer) if config.tokenizer else path, local_files_only=True)
        self.eos_token_ids = eos_token_ids(path, self.model.config, self.tokenizer)
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.model.config)
        self.vocab_size = self.model.config.vocab_size
        self.runner = ModelRunner(self.model, config.block_size, self.device)
        dtype = self.model.model.embed_tokens.weight.dtype
        check_supported(self.attention_backend, dtype, head_dim(self.model.config),
                        config.block_size)
        kv_config = rank_kv_config(self.model.config, tp.size)  # this rank's KV heads
        num_gpu_blocks, num_cpu_blocks = pool_sizes(
            config, self.max_model_len, self.device, block_bytes(kv_config, config.block_size,
                                                                 dtype), self._kv_memory_budget)
        self.cache_engine = CacheEngine(kv_config, num_gpu_blocks, num_cpu_blocks,
                                        config.block_size, dtype, self.device)
        self.executor = (TensorParallelExecutor(self.runner, self.cache_engine, self.workers)
                         if self.workers else Executor(self.runner, self.cache_engine))
        self.kv = KVCacheManager(num_gpu_blocks, config.block_size, num_cpu_blocks,
                                 config.enable_prefix_caching)
        if self._uses_cuda_graphs():
            self._capture_cuda_graphs()
        self.trace = Trace(config.trace)
        self.scheduler = make_scheduler(self.kv, config.max_num_seqs,
                                        config.max_num_batched_tokens, config.preemption_mode,
                                        self.trace, config.memory_mode, self.max_model_len)
        self.beam_search = BeamSearch(self.scheduler, self.eos_token_ids, self.max_model_len,
                                      self.tokenizer)
        self.requests: dict[str, SequenceGroup] = {}
        self.output_processor = OutputProcessor(self.scheduler, self.beam_search,
                                                self.eos_token_ids, self.max_model_len,
                                                self.requests)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.num_prompt_tokens = 0  # of every request added
        self.num_generated_tokens = 0  # sampled, by every sequence and beam
        self.failed: dict[str, Exception] = {}  # the last step's, with fail_alone

    # -- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Params,
                    prompt: str | None = None) -> None:
        """Queue a request.  Raises ``ValueError`` (changing nothing) if it is malformed
        or could never fit the KV pool."""
        self.check_request(request_id, prompt_token_ids, params)
        group = SequenceGroup(request_id, prompt, list(prompt_token_ids), params,
                              next(self._arrivals))
        wants_logprobs = getattr(params, "logprobs", None) is not None
        detokenizer = None if group.is_beam_search else IncrementalDetokenizer(self.tokenizer)
        group.seqs.append(Sequence(f"{request_id}.0", list(prompt_token_ids),
                                   len(prompt_token_ids), logprobs=[] if wants_logprobs else None,
                                   generator=self._generator(params, 0),
                                   detokenizer=detokenizer))
        self.requests[request_id] = group
        self.scheduler.add(group)
        self.num_prompt_tokens += len(prompt_token_ids)

    def check_request(self, request_id: str, prompt_token_ids: list[int], params: Params) -> None:
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params must be SamplingParams or BeamSearchParams, "
                             f"got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        bad = next((t for t in prompt_token_ids if not isinstance(t, int)
                    or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids must be ints in [0, {self.vocab_size}), "
                             f"got {bad!r}")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        self.scheduler.check_fits(len(prompt_token_ids), params)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (between steps)."""
        group = self.scheduler.abort(request_id)
        if group is not None:
            del self.requests[request_id]

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
        self.failed = {}
        batch = self.scheduler.schedule()
        sampling, logits = self.executor.execute(batch)
        if sampling and fail_alone:
            self.failed = update_failing_alone(self, sampling, logits)
        elif sampling:
            self._update(sampling, logits)
        groups = dict.fromkeys(s.group for s in batch.seqs)
        outputs = self.output_processor.outputs(
            [g for g in groups if g.request_id not in self.failed])
        self.num_steps += 1
        self.trace.step = self.num_steps  # arrivals and aborts from now on belong to it
        return outputs

    def _update(self, sampling: list[ScheduledSeq], logits: torch.Tensor) -> None:
        """Each row of ``logits`` is a sequence that reached its end: sample its next
        token, or for beam search rank its candidates."""
        plain = [i for i, s in enumerate(sampling) if not s.group.is_beam_search]
        beams = [i for i, s in enumerate(sampling) if s.group.is_beam_search]
        if plain:
            self._sample(sampling, logits, plain)
        if beams:
            self.num_generated_tokens += self.beam_search.rank(sampling, logits, beams)

    def _sample(self, sampling: list[ScheduledSeq], logits: torch.Tensor,
                rows: list[int]) -> None:
        """Draw one token per sequence; a prompt with ``n`` > 1 first forks into ``n``
        sequences, all drawing from its one row of logits."""
        logit_rows, groups, seqs = [], [], []
        for i in rows:
            group, seq = sampling[i].group, sampling[i].seq
            branch = [seq]
            if group.params.n > 1 and len(group.seqs) == 1:
                branch += [self._fork(group, seq) for _ in range(group.params.n - 1)]
            logit_rows += [i] * len(branch)
            groups += [group] * len(branch)
            seqs += branch
        out = sample(logits[logit_rows], [g.params for g in groups], [s.generator for s in seqs],
                     self.generator, [s.token_ids for s in seqs], [s.prompt_len for s in seqs],
                     self.eos_token_ids)
        self.num_generated_tokens += len(seqs)
        for group, seq, token, logprob, top in zip(groups, seqs, out.token_ids, out.logprobs,
                                                   out.top_logprobs):
            self.scheduler.append_token(group, seq, token, logprob)
            if seq.logprobs is not None:
                seq.logprobs.append(top)
            self.output_processor.check_stop(group, seq)

    def _fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        child = self.scheduler.fork(group, parent)
        child.generator = self._generator(group.params, child.index)
        child.output_text = parent.output_text
        child.detokenizer = dataclasses.replace(parent.detokenizer)
        return child

    # -- CUDA graphs ------------------------------------------------------------------
    def _uses_cuda_graphs(self) -> bool:
        """On CUDA, unless ``enforce_eager``: with the kernel backends (the torch
        reference's data-dependent shapes cannot be captured) and without a sliding
        window (its check reads the positions on the host)."""
        return (self.device.type == "cuda" and not self.config.enforce_eager
                and self.config.tensor_parallel_size == 1  # collectives are not captured
                and self.attention_backend in ("triton", "cuda")
                and sliding_window(self.model.config) is None)

    def _capture_cuda_graphs(self) -> None:
        try:
            self.runner.capture_decode_graphs(self.cache_engine.gpu_cache,
                                              self.config.max_num_seqs, self.max_model_len)
        except RuntimeError as error:
            raise RuntimeError(f"capturing the decode CUDA graphs failed ({error}); "
                               "enforce_eager=True (--enforce-eager) runs without them"
                               ) from error

    # -- tensor parallelism (§4.6) -----------------------------------------------------
    def _start_workers(self, path: Path) -> WorkerGroup | None:
        """With ``tensor_parallel_size`` N > 1, ranks 1..N-1 (this process is rank 0),
        once the model is known to split N ways."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return None
        check_tensor_parallel(read_config(path), size)
        if self.device.type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, torch sees "
                             f"{torch.cuda.device_count()}")
        return WorkerGroup.start(size, path, self.config.dtype, self.device,
                                 self.attention_backend, self.config.block_size)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is
        garbage collected); the engine cannot step afterwards."""
        if self.workers:
            self.workers.shutdown()

    # -- memory -----------------------------------------------------------------------
    def _generator(self, params: Params, index: int) -> torch.Generator | None:
        """Completion ``index`` of a seeded request draws from ``seed + index`` (vLLM)."""
        seed = getattr(params, "seed", None)
        return None if seed is None else make_generator(seed + index, self.device)

    def _kv_memory_budget(self) -> int:
        # Every rank profiles its own GPU; the tightest sets the blocks of all.
        config = self.config
        return min(on_all_ranks(self.workers, self.runner, "kv_memory_budget",
                                config.gpu_memory_utilization, config.max_num_batched_tokens,
                                self.max_model_len))

    def stats(self) -> dict[str, float]:
        """The pools, the queues and the counters (vLLM's names where it has them),
        and where the pool's slots go (``kv.usage()``, which walks every block table)."""
        return {**self.counters(), **self.kv.usage()}

    def counters(self) -> dict[str, float]:
        """The pools' free blocks, the queues and the counters: cheap enough to read
        after every step (a server's ``/metrics``)."""
        return {
            **self.kv.stats(),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "num_steps": self.num_steps,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
        }
