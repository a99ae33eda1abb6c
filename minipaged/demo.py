"""``make demo`` (``minipaged demo``): a real model answers, and paging is measured.

1. SmolLM2-135M-Instruct (real trained weights, `minipaged.models.hub`) answers one
   chat question, streamed token by token as the engine steps (``output_kind=DELTA``).
2. The same model answers a batch of questions that share a system prompt, ``n``
   completions each.  Parallel sampling shares each prompt's blocks between its
   completions copy-on-write, and prefix caching shares the system prompt's full blocks
   between requests (paper §4.4).  The memory at the engine's busiest step is set
   against the same completions served as separate requests with no sharing at all,
   and the batch's throughput is printed.
3. Where KV memory goes when a ShareGPT-like load is served on a pool the size of
   OPT-13B's KV cache on an A100-40GB, paged vs contiguous reservation (§3, Fig. 2),
   simulated with minipaged's own memory layer.

Also home to `PeakUsage` with `memory_report` (the engine's memory at its busiest step,
in one paragraph), which `minipaged generate` prints too.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

from .core.memory.simulate import OPT13B_A100_SLOTS, simulate_systems
from .core.memory.workloads import MEMORY_NUM_REQUESTS, synthetic_requests
from .sampling_params import RequestOutputKind, SamplingParams

DEMO_MODEL = "smollm2"
SYSTEM_PROMPT = "You are a helpful assistant. Answer in one or two short sentences."
STREAMED_QUESTION = "What is a cache, in computing?"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Give me a tip for writing clear code.",
]
DEMO_BLOCKS = 256  # a small fixed pool: the same block numbers on every machine


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
        f"{stats['num_gpu_blocks']} blocks are free again."
    )


# -- the real model ---------------------------------------------------------------------
def chat_prompt(tokenizer, question: str, system: str | None = SYSTEM_PROMPT) -> dict:
    """``question`` in the model's chat template, as ``LLM.generate`` takes it: the
    template adds the special tokens itself, so the text is encoded without more."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def stream_answer(llm, question: str, max_tokens: int, out=None) -> tuple[str, int, float]:
    """Answer ``question`` greedily, printing each step's new text as the engine makes
    it to ``out`` (default stdout); returns the answer, its token count and the
    seconds it took."""
    out = out or sys.stdout
    engine = llm.engine
    prompt = chat_prompt(engine.tokenizer, question)
    engine.add_request(
        "stream",
        prompt["prompt_token_ids"],
        SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA),
    )
    text, num_tokens, start = [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                print(completion.text, end="", flush=True, file=out)
                text.append(completion.text)
                num_tokens += len(completion.token_ids)
    print(file=out)
    return "".join(text), num_tokens, time.perf_counter() - start


@dataclass
class Served:
    """One run of the demo batch: completions per request, the pool's peak, the time."""

    completions: list[list[list[int]]]  # [request][completion] -> generated token ids
    texts: list[list[str]]
    peak: dict
    final: dict
    prompt_tokens: int
    seconds: float

    @property
    def num_generated(self) -> int:
        return sum(len(c) for request in self.completions for c in request)


def serve(llm, prompts: list, params: list[SamplingParams]) -> Served:
    """Run ``prompts`` through ``llm.generate``, recording `stats()` after every step."""
    start = time.perf_counter()
    with PeakUsage.watch(llm.engine) as peak:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return Served(
        [[c.token_ids for c in out.outputs] for out in outputs],
        [[c.text for c in out.outputs] for out in outputs],
        peak.stats,
        llm.stats(),
        sum(len(out.prompt_token_ids) for out in outputs),
        time.perf_counter() - start,
    )


def demo_llm(model: str, enable_prefix_caching: bool, seed: int):
    from .llm import LLM

    return LLM(
        model,
        num_gpu_blocks=DEMO_BLOCKS,
        swap_space=0,
        enable_prefix_caching=enable_prefix_caching,
        seed=seed,
    )


def run(
    model: str = DEMO_MODEL,
    n: int = 2,
    max_tokens: int = 48,
    seed: int = 0,
    num_requests: int = MEMORY_NUM_REQUESTS,
    out=None,
) -> None:
    """``make demo``: the three parts of the module docstring, printed to ``out``
    (default stdout)."""
    out = out or sys.stdout
    waste = waste_report(num_requests, seed)  # checks its flags before the model loads
    separate_llm = demo_llm(model, enable_prefix_caching=False, seed=seed)
    print(_model_line(separate_llm), file=out)
    print(
        f"\n== 1. One question, streamed token by token ==\nuser: {STREAMED_QUESTION}\nassistant: ",
        end="",
        file=out,
    )
    _, num_tokens, seconds = stream_answer(separate_llm, STREAMED_QUESTION, 2 * max_tokens, out)
    print(
        f"[{num_tokens} tokens in {seconds:.1f} s: {num_tokens / seconds:.1f} tokens/s, "
        "one request]",
        file=out,
    )
    print(
        f"\n== 2. A batch: {len(QUESTIONS)} questions sharing a system prompt, n={n} "
        f"answers each ==",
        file=out,
    )
    print(batch_report(model, separate_llm, n, max_tokens, seed), file=out)
    print(f"\n== 3. Where KV memory goes, paged vs contiguous ==\n{waste}", file=out)


def batch_report(model: str, separate_llm, n: int, max_tokens: int, seed: int) -> str:
    """The demo batch served twice: with sharing (``n`` completions per request, prefix
    caching) and without (every completion its own request, prefix caching off).
    Completion ``j`` of a request seeded ``s`` draws from ``s + j`` (vLLM's rule), so the
    separate request seeded ``s + j`` produces the very same tokens: only memory differs."""
    shared_llm = demo_llm(model, enable_prefix_caching=True, seed=seed)
    prompts = [chat_prompt(shared_llm.get_tokenizer(), q) for q in QUESTIONS]
    seeds = [seed + 1000 * i for i in range(len(prompts))]

    def params(n_, s):
        return SamplingParams(n=n_, temperature=0.7, top_p=0.9, max_tokens=max_tokens, seed=s)

    shared = serve(shared_llm, prompts, [params(n, s) for s in seeds])
    separate = serve(
        separate_llm,
        [p for p in prompts for _ in range(n)],
        [params(1, s + j) for s in seeds for j in range(n)],
    )
    same = [c for req in shared.completions for c in req] == [
        req[0] for req in separate.completions
    ]
    lines = [f"system: {SYSTEM_PROMPT}"]
    for question, texts in zip(QUESTIONS, shared.texts):
        lines.append(f"user: {question}")
        lines += [f"  [{j}] {' '.join(text.split())}" for j, text in enumerate(texts)]
    lines += [
        "",
        *_sharing_table(shared, separate, n, len(prompts)),
        f"same tokens either way: {'yes' if same else 'NO'}",
        f"throughput: {shared.num_generated} tokens in {shared.seconds:.1f} s = "
        f"{shared.num_generated / shared.seconds:.1f} tokens/s for the batch "
        f"({len(prompts) * n} completions decoded together)",
    ]
    return "\n".join(lines)


def _model_line(llm) -> str:
    engine, config = llm.engine, llm.engine.model.config
    dtype = engine.model.model.embed_tokens.weight.dtype
    return (
        f"model: {engine.config.model} ({config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads), "
        f"on {engine.device.type}, {str(dtype).removeprefix('torch.')}, attention "
        f"backend {engine.attention_backend}, KV pool {DEMO_BLOCKS} blocks of "
        f"{engine.config.block_size} slots"
    )


def _sharing_table(shared: Served, separate: Served, n: int, num_prompts: int) -> list[str]:
    hits = round(shared.final["prefix_cache_hit_rate"] * shared.prompt_tokens)
    saved = 1 - shared.peak["num_used_gpu_blocks"] / separate.peak["num_used_gpu_blocks"]
    rows = [
        ("shared", f"{num_prompts} requests, n={n}, prefix caching", shared.peak),
        ("separate", f"{num_prompts * n} requests, n=1, no prefix caching", separate.peak),
    ]
    lines = [
        f"KV blocks at the busiest step (pool: {DEMO_BLOCKS} blocks):",
        f"{'':<10}{'':<40}{'used':>6}{'shared':>8}{'empty slots':>13}",
    ]
    lines += [
        f"{name:<10}{what:<40}{p['num_used_gpu_blocks']:>6}"
        f"{p['num_shared_gpu_blocks']:>8}{p['num_wasted_slots']:>13}"
        for name, what, p in rows
    ]
    lines += [
        f"sharing saves {saved:.0%} of the blocks; the prefix cache served {hits} of "
        f"{shared.prompt_tokens} prompt tokens (hit rate "
        f"{shared.final['prefix_cache_hit_rate']:.0%})"
    ]
    return lines


# -- the memory layer alone -----------------------------------------------------------
def waste_report(num_requests: int = MEMORY_NUM_REQUESTS, seed: int = 0) -> str:
    """The share of the KV pool each system fills with tokens, and its mean batch, on
    ShareGPT-like requests (`memory.simulate`, the simulation ``bench memory`` runs)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    requests = synthetic_requests("sharegpt", num_requests, seed=seed)
    reports = simulate_systems(requests, OPT13B_A100_SLOTS)
    paged = next(r.max_batch for r in reports if r.system == "paged")
    lines = [
        f"KV memory while serving {num_requests} ShareGPT-like requests on "
        f"{OPT13B_A100_SLOTS} token slots, simulated (cf. paper Fig. 2)",
        "| system            | tokens | reserved | internal | external | free "
        "| batch | paged/this |",
        "| :---------------- | -----: | -------: | -------: | -------: | ---: "
        "| ----: | ---------: |",
    ]
    lines += [
        f"| {r.system:<17} | {r.token_share:>6.1%} | {r.reserved_share:>8.1%} "
        f"| {r.internal_share:>8.1%} | {r.external_share:>8.1%} | {r.free_share:>4.1%} "
        f"| {r.max_batch:>5.1f} "
        f"| {paged / r.max_batch:>9.1f}x |"
        for r in reports
    ]
    return "\n".join(lines)
