"""Benchmarks behind ``minipaged bench ...``.

Each benchmark is one module that measures, prints a table (`common.format_table`), and
saves its rows with `results.write_results`: JSON plus a PNG, so every figure in the docs
can be traced to the run, machine and versions that made it.  Each module also declares
its command, ``minipaged bench NAME`` (``NAME``, ``HELP``, ``add_arguments`` and
``main``), with the engine's flags (`minipaged.arg_utils`) and the results flags of
`args`.  A run writes into the working directory; the committed results under
``benchmarks/results/<device>/`` are written over only with ``--update-committed``.

What several benchmarks share is a small library beside them: `presets` (the presets'
devices and synthetic models, ShareGPT-like workloads and their prompts),
`hf_baselines` (the same requests through transformers), `overhead` (the engine's own
time per step, with the model stubbed), `common` (timing, a system's row, tables) and
`results`.

* `memory` - where the KV cache goes, paged vs contiguous reservations (paper §3,
  Fig. 2 and 13): counts from a simulation, no model.
* `sharing` - KV blocks saved by parallel sampling and beam search (paper §4.4,
  Fig. 15): counts from the engine on the tiny checkpoint.
* `prefix` - a few-shot prefix shared by every request, prefix caching off vs on
  (paper §6.4): hit rate, prefill tokens computed, throughput.
* `blocksize` - fragmentation and throughput against the block size (paper §7.2,
  Fig. 18b).
* `preemption` - swap vs recompute per block size (paper §7.3, Fig. 19).
* `latency` - normalized latency against request rate, paged vs contiguous memory
  modes of the engine (paper §6.2, Fig. 12).
* `moe` - a mixture of experts shaped like OLMoE, scaled down, against a dense model
  with the same active parameters: step time ratio and the experts' load.
* `attention` - the attention ops per backend against the GPU's own read bandwidth
  (paper §5.1, Fig. 18a).
* `throughput` - offline serving throughput, minipaged vs Hugging Face ``generate``
  (paper §6.2), and the engine's own CPU time per step.
* `spec` - speculative decoding with the n-gram proposer on and off: time per token,
  throughput and acceptance, on a workload that repeats its context and a ShareGPT-like
  one.
* `kv_cache_dtype` - a quantized KV cache (fp8, int8) against ``auto``: blocks and
  requests/s under one KV budget, the C++ kernel's dequantization cost; and its
  quality on SmolLM2 (`kv_quality`: prompt logprobs, greedy agreement, the lm-eval
  test's multiple-choice accuracy).
* `serve` - online serving latency (TTFT, TPOT, ITL, E2EL) against a running
  OpenAI-compatible server (paper §6).
* `lora` - a decode step mixing LoRA adapters against the base model's, and a workload
  spread over 1, 4 and 16 adapters (Punica, S-LoRA).
* `cpu_step` - a decode step on a CPU at several batch sizes, its projections through
  ``F.linear`` and through weights packed for oneDNN, against a square matmul's rate.
* `mla` - DeepSeek-V2-Lite's latent KV cache in bytes per token against per-head and
  GQA caches, and one layer's decode absorbed against unabsorbed on the CPU.
* `embed` - a pooling model's embeddings: requests/s of ``LLM.embed`` against Hugging
  Face's batched forward, and how far apart their vectors are.
* `mm` - a multimodal workload whose images repeat: images encoded, the encoder cache's
  hit rate and requests/s with a cache for every image against one for a single image.
* `structured` - structured outputs (a JSON schema held by llguidance) on against off:
  time per output token at batch 1 and 32, and the schema's compile time apart.
* `disagg` - disaggregated prefill (a prefill engine and a decode engine, the KV
  moved by `P2pTcpConnector`) against one engine with chunked prefill, on the same
  cores: decode ITL p99 during bursts of long prompts against without, TTFT, the KV
  bytes moved and their rate against loopback TCP's.
* `structured_acceptance` - 50 JSON schemas sent to ``minipaged serve`` through the
  official openai client and LangChain: how many answers parse and validate.
"""
