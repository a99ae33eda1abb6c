"""The model runner: one scheduled batch in, the logits of the sequences that sample out.

The engine's steps go through `ModelRunner.execute_model`, which keeps its sequences in
a persistent `InputBatch` (`minipaged.worker.input_batch`, vLLM V1's): each step applies
the scheduler's diff and computes the step's inputs vectorized from the batch's arrays.
`ModelRunner.execute` runs a list of `ScheduledSeq` instead, each whole (a speculative
draft model's steps, which keep their own small batch).

A step is one forward pass over a flat batch of tokens, no padding: each scheduled
sequence contributes its new tokens (a prompt, a chunk of one, or one decode token) at
their positions, and `AttentionMetadata` tells every layer where their keys and values
go and what they attend to (paper §4.3).  Only the last token of a sequence that reached
its end is projected to logits; a chunk that stops mid-prompt samples nothing.  The
rows of a request that asked for its prompt's logprobs are projected too, a chunk at a
time, and scored into the request (`minipaged.sample.prompt_logprobs`).  With speculative
decoding, a sequence's new tokens are its last token and a draft's guesses, and each of
their positions is projected: the target's verdict on every guess, in one pass
(`minipaged.spec_decode`).
With `capture_decode_graphs`, a step of decodes only replays a CUDA graph instead
(`minipaged.worker.cuda_graphs`); with `compile_decode`, on a CPU, it runs the model compiled
by inductor (`minipaged.worker.compiled_decode`).  With `enable_lora`, each token also gets
its adapter's LoRA term (`minipaged.models.lora`): the batch is ordered by adapter slot
within its prefills and its decodes, so each adapter's tokens form few segments.
On a pipeline stage (``pipeline_parallel_size`` > 1) the runner runs the stage's layers
only, micro-batch by micro-batch, receiving and sending the hidden states between
stages (`ModelRunner._execute_stage`).
With a vision model (LLaVA, Qwen2-VL), a step first drops the encoder outputs the scheduler
evicted and encodes the images it scheduled, keeping each image's embeddings by its
hash (`_execute_mm_encoder`), then runs the model from input embeddings in which every
placeholder token the step covers holds its image's embedding (`_gather_mm_embeddings`;
vLLM's GPU model runner's names).  Under Qwen2-VL's M-RoPE a token's position is three
numbers that are not its index from an image on (`_mrope_positions`).
With a KV connector (disaggregated prefill, `set_kv_connector`), a step loads the KV
its scheduler counted as loaded before the forward pass, and each attention layer
waits for its own layer's load before it runs and hands its cache to the connector to
save after it: hooks on the layers, as vLLM's attention layers call the connector from
its forward context, so the model itself knows nothing of it.
"""

from __future__ import annotations

import numpy as np
import torch

from minipaged.core.memory import KVCacheManager
from minipaged.core.memory.block_table import blocks_for
from minipaged.core.sched.output import ScheduledSeq, SchedulerOutput
from minipaged.distributed.parallel_state import TIMELINE
from minipaged.lora_request import LoRARequest
from minipaged.models.attention import (
    AttentionMetadata,
    PagedAttention,
    allocate_kv_caches,
    int_tensor,
    token_positions,
)
from minipaged.models.lora import LoRAModelManager
from minipaged.models.pooler import Pooler
from minipaged.sample.prompt_logprobs import compute_prompt_logprobs
from minipaged.worker.compiled_decode import CompiledDecode
from minipaged.worker.cuda_graphs import DecodeGraphs
from minipaged.worker.input_batch import InputBatch, StepInputs


class ModelRunner:
    def __init__(self, model, block_size: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.graphs: DecodeGraphs | CompiledDecode | None = None
        self.lora: LoRAModelManager | None = None
        self.input_batch: InputBatch | None = None  # `init_input_batch`, or the first step
        self.pooler: Pooler | None = None  # a pooling runner's: no logits, embeddings
        self.kv_connector = None  # the worker's side of a KV connector (`set_kv_connector`)
        self.kv_layer_names: list[str] = []
        # A vision model's encoder outputs, by mm_hash: the tensors the scheduler's
        # `EncoderCacheManager` keeps the books of.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.num_encoded_items = 0  # images run through the encoder, in all

    def set_kv_connector(self, connector) -> None:
        """Load and save KV through ``connector``'s worker side: each attention layer
        waits for its load before it runs and offers its cache for saving after."""
        # Only with a connector: one device without one loads nothing of distributed/.
        from minipaged.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
            ForwardContext,
        )

        self.kv_connector, self._forward_context_type = connector, ForwardContext
        connector.tp = self.model.tp  # which KV heads this rank's cache holds
        layers = [(n, m) for n, m in self.model.named_modules() if isinstance(m, PagedAttention)]
        self.kv_layer_names = [name for name, _ in layers]
        for name, layer in layers:
            layer.register_forward_pre_hook(_wait_for_layer_load(connector, name))
            layer.register_forward_hook(_save_kv_layer(connector, name))

    def init_input_batch(self, max_num_seqs: int, max_model_len: int) -> None:
        """Preallocate the persistent batch for ``max_num_seqs`` rows of
        ``max_model_len`` tokens (it grows if a step ever needs more)."""
        self.input_batch = InputBatch(max_num_seqs, max_model_len, self.block_size, self.device)

    def enable_lora(self, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None:
        """Wrap the model's projections with ``max_loras`` adapter slots."""
        self.lora = LoRAModelManager(self.model, max_loras, max_lora_rank, max_cpu_loras)

    def activate_loras(self, loads: list[tuple[int, LoRARequest]]) -> None:
        """Load each ``(slot, adapter)`` the scheduler asked for into its slot."""
        if loads:
            self.lora.activate(loads)

    def capture_decode_graphs(self, kv_caches, max_num_seqs: int, max_model_len: int) -> None:
        """Record the decode forward as CUDA graphs over ``kv_caches`` (which must
        stay the tensors every later step passes)."""
        with torch.inference_mode():
            self.graphs = DecodeGraphs(
                self.model, kv_caches, self.block_size, max_num_seqs, max_model_len, self.device
            )

    def compile_decode(self, kv_caches) -> None:
        """Compile the decode forward over ``kv_caches`` (which must stay the tensors
        every later step passes)."""
        with torch.inference_mode():
            self.graphs = CompiledDecode(self.model, kv_caches, self.device)

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, kv_caches
    ) -> tuple[list[str], torch.Tensor | None]:
        """Run a step given as the scheduler's diff; returns the ids of the sequences
        that sample and their logits: one row each, and one more per guess it verifies
        (`minipaged.core.sched.output.logit_rows`), in the batch's order."""
        if self.input_batch is None:
            self.init_input_batch(max(1, len(scheduler_output.num_scheduled_tokens)), 1)
        batch = self.input_batch
        batch.update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return [], None
        rows, counts, guesses = batch.order(scheduler_output)
        if self.model.pp.size > 1:
            return self._execute_stage_batch(rows, counts, guesses, kv_caches)
        inputs = batch.prepare(rows, counts, guesses)
        if getattr(self.model, "uses_mrope", False):
            inputs.positions = self._mrope_positions(scheduler_output, rows, counts)
        embeds = None
        if scheduler_output.scheduled_encoder_inputs or self.encoder_cache:
            self._execute_mm_encoder(scheduler_output)
            embeds = self._gather_mm_embeddings(scheduler_output, rows, counts, inputs)
        if embeds is not None:
            hidden = self._run_model(inputs, kv_caches, embeds)
        elif self.kv_connector is None:
            hidden = self._run_model(inputs, kv_caches)
        else:
            hidden = self._run_model_with_kv_transfer(scheduler_output, inputs, kv_caches)
        if self.pooler is not None:  # a pooling runner samples nothing
            self._pool(scheduler_output, rows, counts, hidden)
            return [], None
        if scheduler_output.prompt_logprob_positions:
            self._prompt_logprobs(scheduler_output, rows, counts, hidden)
        if not inputs.sampling_req_ids:
            return [], None
        if not isinstance(inputs.logit_index, slice):  # a slice is all rows: no torch call
            hidden = hidden[inputs.logit_index]
        return inputs.sampling_req_ids, self.model.compute_logits(hidden)

    def _execute_mm_encoder(self, scheduler_output: SchedulerOutput) -> None:
        """Drop the embeddings the scheduler evicted, then encode the images it
        scheduled, all in one batch, and cache each image's embeddings by its hash."""
        for mm_hash in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        scheduled = scheduler_output.scheduled_encoder_inputs
        if not scheduled:
            return
        items = [f.data for f in scheduled.values()]
        self.num_encoded_items += len(scheduled)
        for mm_hash, embeds in zip(scheduled, self.model.get_multimodal_embeddings(items)):
            self.encoder_cache[mm_hash] = embeds

    def _gather_mm_embeddings(self, scheduler_output, rows, counts, inputs) -> torch.Tensor | None:
        """The step's input embeddings with each placeholder token's replaced by its
        image's embedding (vLLM's ``_gather_mm_embeddings``): for every row, the part of
        each image's placeholder range its tokens cover, read from the encoder cache
        (a chunk that splits a placeholder reads the slice it covers); None if no row
        covers any."""
        groups = {s.seq.seq_id: s.group for s in scheduler_output.seqs}
        batch, offset, index, parts = self.input_batch, 0, [], []
        for row, count in zip(rows.tolist(), counts.tolist()):
            start = int(batch.num_computed_tokens[row])
            for feature in groups[batch.req_ids[row]].mm_features:
                span = feature.mm_position.overlap(start, start + count)
                if span is None:
                    continue
                lo, hi = span
                first = feature.mm_position.offset
                parts.append(self.encoder_cache[feature.identifier][lo - first : hi - first])
                index.extend(range(offset + lo - start, offset + hi - start))
            offset += count
        if not parts:
            return None
        rows_index = torch.tensor(index, dtype=torch.long, device=self.device)
        return self.model.get_input_embeddings(inputs.input_ids, rows_index, torch.cat(parts))

    def _mrope_positions(self, scheduler_output, rows, counts) -> torch.Tensor:
        """M-RoPE's positions (`minipaged.models.qwen2_vl`): ``[3, T]`` where a row's
        tokens reach or pass an image, computed from their indices (vLLM's
        ``_calc_mrope_positions``); ``[T]`` when every token's three are equal (text
        only, or decodes: each token's index plus its request's
        ``mrope_position_delta``), which the decode graphs take as they are."""
        groups = {s.seq.seq_id: s.group for s in scheduler_output.seqs}
        batch, offset = self.input_batch, 0
        starts = batch.num_computed_tokens[rows].astype(np.int64)
        index = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
        positions = np.broadcast_to(index, (3, len(index))).copy()
        for row, count in zip(rows.tolist(), counts.tolist()):
            features = groups[batch.req_ids[row]].mm_features
            if features:
                part = slice(offset, offset + count)
                positions[:, part] = self.model.mrope_positions(index[part], features)
            offset += count
        if (positions == positions[0]).all():
            positions = positions[0]
        return torch.from_numpy(positions).to(self.device)

    def _run_model(self, inputs: StepInputs, kv_caches, hidden=None) -> torch.Tensor:
        """The model over a step's prepared inputs (by replay, where a graph fits)."""
        if self.lora is not None:
            self.lora.batch.set(inputs.lora_slots.tolist(), inputs.num_scheduled.tolist())
        out = None
        if self.graphs and hidden is None and inputs.positions.dim() == 1:
            out = self.graphs.run(inputs.input_ids, inputs.positions, inputs.attn)
        if out is None:
            out = self.model(inputs.input_ids, inputs.positions, kv_caches, inputs.attn, hidden)
        return out

    def _run_model_with_kv_transfer(self, scheduler_output, inputs, kv_caches) -> torch.Tensor:
        """`_run_model` between the connector's load (before) and its saves (after)."""
        connector = self.kv_connector
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        try:
            caches = dict(zip(self.kv_layer_names, kv_caches))
            connector.start_load_kv(self._forward_context_type(caches))
            hidden = self._run_model(inputs, kv_caches)
            connector.wait_for_save()
        finally:
            connector.clear_connector_metadata()
        return hidden

    def _prompt_logprobs(self, scheduler_output, rows, counts, hidden) -> None:
        """Score the prompt tokens the step's sequences ask for (every rank projects;
        rank 0, the engine's, keeps them in the requests)."""
        groups = {s.seq.seq_id: s.group for s in scheduler_output.seqs}
        positions = scheduler_output.prompt_logprob_positions
        batch, index, scored, offset = self.input_batch, [], [], 0
        for row, count in zip(rows.tolist(), counts.tolist()):
            req_id = batch.req_ids[row]
            start = int(batch.num_computed_tokens[row])
            for p in positions.get(req_id, ()):
                index.append(offset + p - start)
                scored.append((groups.get(req_id), p + 1))
            offset += count
        compute_prompt_logprobs(self.model, hidden, index, scored)

    def _pool(self, scheduler_output, rows, counts, hidden) -> None:
        """Fold each sequence's rows of the step's hidden states into its request's
        pooled state (`Pooler.add`)."""
        groups = {s.seq.seq_id: s.group for s in scheduler_output.seqs}
        batch, offset = self.input_batch, 0
        for row, count in zip(rows.tolist(), counts.tolist()):
            req_id = batch.req_ids[row]
            start = int(batch.num_computed_tokens[row])
            self.pooler.add(groups[req_id], start, hidden[offset : offset + count])
            offset += count

    @torch.inference_mode()
    def execute(
        self, seqs: list[ScheduledSeq], kv_caches
    ) -> tuple[list[ScheduledSeq], torch.Tensor | None]:
        """Run ``seqs``; returns those that sample, and their logits: one row each, and
        one more per guess it verifies (`minipaged.core.sched.output.logit_rows`)."""
        if not seqs:
            return [], None
        # Prefills first: the trailing run of one-token sequences goes to the decode op.
        seqs = sorted(seqs, key=lambda s: (s.num_new_tokens == 1, s.lora_slot))
        if self.model.pp.size > 1:
            return self._execute_stage(seqs, kv_caches)
        hidden = self._forward(seqs, kv_caches)
        if any(s.prompt_logprob_positions for s in seqs):
            index, scored, offset = [], [], 0
            for s in seqs:
                for p in s.prompt_logprob_positions:
                    index.append(offset + p - s.start)
                    scored.append((s.group, p + 1))
                offset += s.num_new_tokens
            compute_prompt_logprobs(self.model, hidden, index, scored)
        sampling = [s for s in seqs if s.samples]
        if not sampling:
            return [], None
        return sampling, self.model.compute_logits(hidden[sample_rows(seqs, self.device)])

    def _forward(self, seqs: list[ScheduledSeq], kv_caches, hidden=None) -> torch.Tensor:
        """The model over ``seqs``' new tokens (from ``hidden``, the previous pipeline
        stage's output, on a stage but the first): one row per token."""
        starts = [s.start for s in seqs]
        counts = [s.num_new_tokens for s in seqs]
        if self.lora is not None:
            self.lora.batch.set([s.lora_slot for s in seqs], counts)
        attn = AttentionMetadata.build(
            [s.block_table for s in seqs],
            starts,
            counts,
            self.block_size,
            self.device,
            slot_mapping=[slot for s in seqs for slot in s.slot_mapping],
            validate=False,  # the scheduler's tables and counts
        )
        input_ids = int_tensor(
            [t for s in seqs for t in s.input_token_ids()], self.device, torch.long
        )
        positions = token_positions(starts, counts, self.device)
        out = self.graphs.run(input_ids, positions, attn) if self.graphs else None
        return self.model(input_ids, positions, kv_caches, attn, hidden) if out is None else out

    def _execute_stage(
        self, seqs: list[ScheduledSeq], kv_caches
    ) -> tuple[list[ScheduledSeq], torch.Tensor | None]:
        """One pipeline stage's part of the step (GPipe's schedule, Huang et al. 2019):
        the batch cut into one micro-batch per stage, each received from the previous
        stage, run through this stage's layers and sent on while the next one runs, so
        the stages work on different micro-batches at once.  The last stage projects
        the sampled rows and sends their logits to the driver, which returns them."""
        stage, config = self.model.pp, self.model.config
        sends, rows = [], []
        for micro in micro_batches(seqs, stage.size):
            hidden = None
            if not stage.is_first:
                shape = (sum(s.num_new_tokens for s in micro), config.hidden_size)
                hidden = stage.recv(shape, self.model.model.dtype, self.device)
            with TIMELINE.record("forward", self.device):
                hidden = self._forward(micro, kv_caches, hidden)
                if stage.is_last:
                    rows.append(hidden[sample_rows(micro, self.device)])
            if not stage.is_last:
                sends.append(stage.send(hidden))
        stage.wait(sends)
        sampling = [s for s in seqs if s.samples]
        if not sampling:
            return [], None
        if stage.is_last:
            with TIMELINE.record("forward", self.device):
                logits = self.model.compute_logits(torch.cat(rows))
            if logits is not None:  # tensor-parallel rank 0 of the stage
                stage.send_logits(logits)
            return sampling, logits
        if stage.is_first and stage.tp_rank == 0:  # the driver
            rows = sum(s.num_logit_rows for s in sampling)
            return sampling, stage.recv_logits((rows, config.vocab_size), self.device)
        return sampling, None

    def _execute_stage_batch(self, rows, counts, guesses, kv_caches):
        """`_execute_stage` over the persistent batch: the micro-batches are runs of the
        step's rows in order."""
        stage, config = self.model.pp, self.model.config
        sends, logits_rows, req_ids = [], [], []
        bounds = micro_batch_bounds(counts.tolist(), stage.size)
        for k, (first, last) in enumerate(bounds):
            part = slice(first, last)
            inputs = self.input_batch.prepare(rows[part], counts[part], guesses[part], f"{k}")
            req_ids += inputs.sampling_req_ids
            hidden = None
            if not stage.is_first:
                shape = (int(counts[part].sum()), config.hidden_size)
                hidden = stage.recv(shape, self.model.model.dtype, self.device)
            with TIMELINE.record("forward", self.device):
                hidden = self._run_model(inputs, kv_caches, hidden)
                if stage.is_last:
                    logits_rows.append(hidden[inputs.logit_index])
            if not stage.is_last:
                sends.append(stage.send(hidden))
        stage.wait(sends)
        if not req_ids:
            return [], None
        if stage.is_last:
            with TIMELINE.record("forward", self.device):
                logits = self.model.compute_logits(torch.cat(logits_rows))
            if logits is not None:  # tensor-parallel rank 0 of the stage
                stage.send_logits(logits)
            return req_ids, logits
        if stage.is_first and stage.tp_rank == 0:  # the driver
            num_rows = self._num_logit_rows(rows, counts, guesses)
            return req_ids, stage.recv_logits((num_rows, config.vocab_size), self.device)
        return req_ids, None

    def _num_logit_rows(self, rows, counts, guesses) -> int:
        batch = self.input_batch
        starts = batch.num_computed_tokens[rows]
        samples = starts + counts - guesses == batch.num_tokens[rows]
        return int((1 + guesses)[samples].sum())

    @torch.inference_mode()
    def kv_memory_budget(
        self, gpu_memory_utilization: float, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """Bytes of GPU memory left for KV blocks (vLLM's memory profiling).

        Runs the biggest step the scheduler can form (``max_num_batched_tokens`` prompt
        tokens) over a throwaway cache just big enough, to see the activations' peak;
        what ``gpu_memory_utilization`` of the device leaves after that peak, the
        weights and memory outside torch (the CUDA context, other processes) is the budget.
        """
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        lengths = [
            min(max_model_len, max_num_batched_tokens - start)
            for start in range(0, max_num_batched_tokens, max_model_len)
        ]
        num_blocks = sum(blocks_for(length, self.block_size) for length in lengths)
        kv = KVCacheManager(num_blocks, self.block_size)
        prompts = [kv.allocate(str(i), [0] * length) for i, length in enumerate(lengths)]
        config, stage, dtype = self.model.config, self.model.pp, self.model.model.dtype
        caches = allocate_kv_caches(config, num_blocks, self.block_size, dtype, self.device)
        cache_bytes = sum(k.nbytes + v.nbytes for k, v in caches)
        attn = AttentionMetadata.build(
            [p.block_table for p in prompts],
            [0] * len(lengths),
            lengths,
            self.block_size,
            self.device,
            slot_mapping=[slot for p in prompts for slot in p.slot_mapping],
        )
        input_ids = torch.zeros(sum(lengths), dtype=torch.long, device=self.device)
        positions = token_positions([0] * len(lengths), lengths, self.device)
        # A pipeline stage but the first starts from hidden states (any will do here).
        start = None
        if not stage.is_first:
            start = torch.zeros(len(input_ids), config.hidden_size, dtype=dtype, device=self.device)
        stage_caches = caches[: len(self.model.model.stage_layers)]
        hidden = self.model(input_ids, positions, stage_caches, attn, start)
        if stage.is_last:
            self.model.compute_logits(hidden[-len(lengths) :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - cache_bytes
        del caches, stage_caches, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        return int(total * gpu_memory_utilization - peak - outside_torch)


def _wait_for_layer_load(connector, layer_name: str):
    """A pre-hook: the layer's KV is loaded before its attention reads it."""

    def hook(module, args):
        if connector.has_connector_metadata():
            connector.wait_for_layer_load(layer_name)

    return hook


def _save_kv_layer(connector, layer_name: str):
    """A hook: the layer's cache (``args[3]``, its new keys and values written) goes to
    the connector to save, with the step's attention metadata (``args[4]``)."""

    def hook(module, args, output):
        if connector.has_connector_metadata():
            connector.save_kv_layer(layer_name, args[3], args[4])

    return hook


def sample_rows(seqs: list[ScheduledSeq], device: torch.device) -> torch.Tensor:
    """The rows of ``seqs``' hidden states to project: each sampling sequence's last
    token, after those of the guesses it verifies."""
    rows, end = [], 0
    for s in seqs:
        end += s.num_new_tokens
        if s.samples:
            rows += range(end - s.num_logit_rows, end)
    return int_tensor(rows, device, torch.long)


def micro_batches(seqs: list[ScheduledSeq], n: int) -> list[list[ScheduledSeq]]:
    """``seqs`` cut, in order, into at most ``n`` runs of about equal token counts,
    none empty (a step of fewer sequences than stages has fewer micro-batches)."""
    bounds = micro_batch_bounds([s.num_new_tokens for s in seqs], n)
    return [seqs[first:last] for first, last in bounds]


def micro_batch_bounds(counts: list[int], n: int) -> list[tuple[int, int]]:
    """Where `micro_batches` cuts sequences of ``counts`` tokens: ``(first, last)``."""
    total = sum(counts)
    bounds, done = [[0, 0]], 0
    for i, count in enumerate(counts):
        if bounds[-1][1] > bounds[-1][0] and done >= total * len(bounds) / n:
            bounds.append([i, i])
        bounds[-1][1] = i + 1
        done += count
    return [(first, last) for first, last in bounds]
