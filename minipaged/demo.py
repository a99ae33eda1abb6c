"""``make demo`` (``minipaged demo``): what paging buys, measured.

1. The engine itself, on the embedded tiny checkpoint: a batch of prompts that share a
   system prompt, each asking for ``n`` completions.  Parallel sampling shares each
   prompt's blocks between its completions copy-on-write, and prefix caching shares
   the system prompt's full blocks between requests (paper §4.4).  The memory report
   is taken at the engine's busiest step and set against the same completions served
   as separate requests with no sharing at all.
2. Where KV memory goes when a ShareGPT-like load is served on a pool the size of
   OPT-13B's KV cache on an A100-40GB, paged vs contiguous reservation (§3, Fig. 2),
   simulated with minipaged's own memory layer.
3. The same two kinds of sharing counted in the memory layer alone, without a model.

Also home to two helpers the command line shares: `cached_checkpoint` (the tiny
checkpoints the demo and the benchmarks write once) and `PeakUsage` with
`memory_report` (the engine's memory at its busiest step, in one paragraph).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .bench.memory import bench_memory, format_table
from .memory import KVCacheManager
from .memory.block_table import blocks_for
from .memory.simulate import OPT13B_A100_SLOTS
from .sampling_params import SamplingParams


SYSTEM_PROMPT = ("You are a helpful assistant who explains how a language model server "
                 "manages GPU memory. Answer in one short sentence.\n")
QUESTIONS = ["What is a KV cache?", "Why cut it into blocks?",
             "What does copy-on-write share?", "When is a block freed?"]
DEMO_BLOCKS = 256  # a small fixed pool: the same numbers on every machine


# -- tiny checkpoints, written once ---------------------------------------------------
def cache_dir() -> Path:
    """Where minipaged keeps what it writes for itself: ``$MINIPAGED_CACHE``, else
    ``$XDG_CACHE_HOME/minipaged``, else ``~/.cache/minipaged``."""
    if os.environ.get("MINIPAGED_CACHE"):
        return Path(os.environ["MINIPAGED_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minipaged"


def cached_checkpoint(name: str, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A tiny seeded checkpoint (`make_tiny_model`) under `cache_dir`, written on first use.

    The directory name carries a hash of everything that decides the weights, so a
    changed definition gets a new checkpoint instead of a stale one; it is written
    beside its final place and renamed, so a run that dies half way leaves nothing.
    """
    from .models import tiny

    recipe = {"arch": arch, "seed": seed, "overrides": overrides, "base": tiny.BASE_CONFIG,
              "archs": tiny.ARCHS, "init_std": tiny.INIT_STD}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir() / f"{name}-{digest}"
    if (path / "model.safetensors").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=path.parent))
    try:
        tiny.make_tiny_model(staging, arch=arch, seed=seed, **overrides)
        os.replace(staging, path)
    except OSError:
        if not (path / "model.safetensors").is_file():  # not a lost race with another run
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


@contextlib.contextmanager
def one_cpu_thread(device):
    """On a CPU, run torch on one thread.  A tiny model's tensors are too small for
    torch's thread pool to help, and where other processes compete for the cores its
    threads wait for each other: 10 to 70 times slower, and erratic."""
    import torch

    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# -- the engine's memory at its busiest step ------------------------------------------
class PeakUsage:
    """`LLMEngine.stats()` at the step that held the most GPU blocks.

    The engine frees every block when a workload ends, so a report taken afterwards
    would show an empty pool; the busiest moment is what the pool must be sized for.
    """

    def __init__(self) -> None:
        self.stats: dict | None = None

    def update(self, stats: dict) -> None:
        if self.stats is None or stats["num_used_gpu_blocks"] > self.stats["num_used_gpu_blocks"]:
            self.stats = dict(stats)

    @classmethod
    @contextlib.contextmanager
    def watch(cls, engine):
        """Record the peak of every ``engine.step()`` made inside the block, whoever
        drives it (``LLM.generate`` and ``LLM.beam_search`` included)."""
        peak, step = cls(), engine.step

        def watched_step():
            outputs = step()
            peak.update(engine.stats())
            return outputs

        engine.step = watched_step  # an instance attribute shadows the method
        try:
            yield peak
        finally:
            del engine.step


def memory_report(engine, peak: PeakUsage) -> str:
    """One paragraph: the pool, its busiest step, and the counters of the run."""
    stats, block_size = engine.stats(), engine.config.block_size
    busiest = peak.stats or stats
    used, wasted = busiest["num_used_gpu_blocks"], busiest["num_wasted_slots"]
    reserved = used * block_size
    return (
        f"Memory: a KV pool of {stats['num_gpu_blocks']} blocks x {block_size} token slots "
        f"on {engine.device.type}. At the busiest step {used} blocks were in use, holding "
        f"{busiest['num_kv_tokens']} tokens; {busiest['num_shared_gpu_blocks']} of them were "
        f"shared by several sequences (copy-on-write forks, cached prefixes, §4.4), and "
        f"{wasted} reserved slots were empty ({wasted / reserved if reserved else 0:.1%}: "
        f"at most each sequence's last block is partly empty, §4.2). "
        f"{stats['num_preemptions']} preemptions, {stats['num_swapped_out_blocks']} blocks "
        f"swapped out, prefix cache hit rate {stats['prefix_cache_hit_rate']:.0%}, "
        f"{stats['num_steps']} engine steps; now {stats['num_free_gpu_blocks']} of "
        f"{stats['num_gpu_blocks']} blocks are free again.")


# -- 1. the engine on the tiny checkpoint ---------------------------------------------
@dataclass
class Served:
    """One run of the demo batch: completions per request, and the pool's peak."""

    completions: list[list[list[int]]]  # [request][completion] -> generated token ids
    texts: list[list[str]]
    peak: dict
    final: dict
    prompt_tokens: int


def serve(path, prompts: list[str], params: list[SamplingParams], prefix_caching: bool,
          seed: int = 0, device: str = "auto") -> Served:
    """Run ``prompts`` through ``LLM.generate``, recording `stats()` after every step."""
    from .llm import LLM

    llm = LLM(str(path), device=device, num_gpu_blocks=DEMO_BLOCKS, swap_space=0,
              enable_prefix_caching=prefix_caching, seed=seed)
    with PeakUsage.watch(llm.engine) as peak:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return Served([[c.token_ids for c in out.outputs] for out in outputs],
                  [[c.text for c in out.outputs] for out in outputs], peak.stats,
                  llm.stats(), sum(len(out.prompt_token_ids) for out in outputs))


def engine_report(n: int = 4, max_tokens: int = 24, seed: int = 0) -> str:
    """The demo batch served twice: with sharing (``n`` completions per request, prefix
    caching) and without (every completion its own request, prefix caching off).
    Completion ``j`` of a request seeded ``s`` draws from ``s + j`` (vLLM's rule), so the
    separate request seeded ``s + j`` produces the very same tokens: only memory differs."""
    import torch

    with one_cpu_thread("cuda" if torch.cuda.is_available() else "cpu"):
        return _engine_report(n, max_tokens, seed)


def _engine_report(n: int, max_tokens: int, seed: int) -> str:
    path = cached_checkpoint("demo-llama")
    prompts = [SYSTEM_PROMPT + q for q in QUESTIONS]
    seeds = [seed + 1000 * i for i in range(len(prompts))]

    def params(n_, s):
        return SamplingParams(n=n_, temperature=0.8, max_tokens=max_tokens, seed=s,
                              ignore_eos=True)

    shared = serve(path, prompts, [params(n, s) for s in seeds], prefix_caching=True,
                   seed=seed)
    separate = serve(path, [p for p in prompts for _ in range(n)],
                     [params(1, s + j) for s in seeds for j in range(n)],
                     prefix_caching=False, seed=seed)
    same = [c for req in shared.completions for c in req] == \
        [req[0] for req in separate.completions]
    lines = [f"The engine on a tiny random Llama: {len(prompts)} prompts sharing a "
             f"{len(SYSTEM_PROMPT)}-character system prompt, n={n} completions each, "
             f"{max_tokens} tokens per completion.",
             "(Its weights are random, so the text is gibberish; the memory accounting is real.)"]
    for prompt, texts in zip(prompts, shared.texts):
        lines.append(f"prompt: ...{prompt[len(SYSTEM_PROMPT):]!r}")
        lines += [f"  [{j}] {text[:60]!r}" for j, text in enumerate(texts)]
    lines += ["", *_sharing_table(shared, separate, n, len(prompts)),
              f"same tokens either way: {'yes' if same else 'NO'}"]
    return "\n".join(lines)


def _sharing_table(shared: Served, separate: Served, n: int, num_prompts: int) -> list[str]:
    hits = round(shared.final["prefix_cache_hit_rate"] * shared.prompt_tokens)
    saved = 1 - shared.peak["num_used_gpu_blocks"] / separate.peak["num_used_gpu_blocks"]
    rows = [("shared", f"{num_prompts} requests, n={n}, prefix caching", shared.peak),
            ("separate", f"{num_prompts * n} requests, n=1, no prefix caching", separate.peak)]
    lines = [f"KV blocks at the busiest step (pool: {DEMO_BLOCKS} blocks):",
             f"{'':<10}{'':<40}{'used':>6}{'shared':>8}{'empty slots':>13}"]
    lines += [f"{name:<10}{what:<40}{p['num_used_gpu_blocks']:>6}"
              f"{p['num_shared_gpu_blocks']:>8}{p['num_wasted_slots']:>13}"
              for name, what, p in rows]
    lines += [f"sharing saves {saved:.0%} of the blocks; the prefix cache served {hits} of "
              f"{shared.prompt_tokens} prompt tokens (hit rate "
              f"{shared.final['prefix_cache_hit_rate']:.0%})"]
    return lines


# -- 2. and 3. the memory layer alone -------------------------------------------------
def waste_report(num_requests: int = 300, seed: int = 0) -> str:
    reports = bench_memory("sharegpt", num_requests, OPT13B_A100_SLOTS, seed=seed)
    return (f"KV memory while serving {num_requests} ShareGPT-like requests on "
            f"{OPT13B_A100_SLOTS} token slots (cf. paper Fig. 2)\n{format_table(reports)}")


def sharing_report(block_size: int = 16) -> str:
    prompt, n, output_len = list(range(200)), 4, 40
    shared = KVCacheManager(1000, block_size)
    shared.allocate("s0", prompt)
    for i in range(1, n):
        shared.fork("s0", f"s{i}")
    separate = KVCacheManager(1000, block_size)
    for i in range(n):
        separate.allocate(f"s{i}", prompt)
    for step in range(output_len):
        for i in range(n):
            shared.append(f"s{i}", [1000 + 10 * step + i])
            separate.append(f"s{i}", [1000 + 10 * step + i])
    used_shared = shared.gpu.num_used_blocks
    used_separate = separate.gpu.num_used_blocks

    system_prompt = list(range(5000, 5160))
    cache = KVCacheManager(1000, block_size, enable_prefix_caching=True)
    for i in range(8):
        cache.allocate(f"r{i}", system_prompt + [i] * 20)
    return "\n".join([
        f"Parallel sampling, n={n}, {len(prompt)}-token prompt, {output_len} tokens each: "
        f"{used_shared} blocks with copy-on-write vs {used_separate} without "
        f"({1 - used_shared / used_separate:.0%} saved)",
        f"Prefix caching, 8 requests sharing a {len(system_prompt)}-token system prompt: "
        f"hit rate {cache.gpu.hit_rate:.0%}, {cache.gpu.num_used_blocks} blocks instead of "
        f"{8 * blocks_for(len(system_prompt) + 20, block_size)}",
    ])
