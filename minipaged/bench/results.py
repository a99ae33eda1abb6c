"""Where benchmark results go and what every results file holds: the results contract.

A run of ``minipaged bench NAME`` writes ``NAME.json`` and ``NAME.png`` beside it, into
the working directory unless told otherwise (`minipaged.bench.args.add_output_flags`);
the results committed with the code, which the docs show, are
``benchmarks/results/<device-slug>/NAME.json``, written over only on request.  The JSON
records what produced the numbers (device, torch
and triton versions, date, the command line) next to the rows, because a benchmark
number without its machine and versions cannot be compared with anything.
"""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

from minipaged.bench.common import usable_cores

# The committed results of this checkout (with the package imported from it).
COMMITTED_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def device_name(device: torch.device | str) -> str:
    """The name torch reports for ``device``: the GPU model, or the CPU's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or device.type


# The CPU features that choose the engines' kernels (vLLM's and oneDNN's as well as ours).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_facts() -> dict:
    """What a results file says about the CPU: its model and which of `CPU_FLAGS` it has
    (from Linux's ``/proc/cpuinfo``; None elsewhere), and the cores this process may
    use."""
    facts = {"cpu_model": None, "cpu_flags": None}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and facts["cpu_model"] is None:
            facts["cpu_model"] = value
        elif key == "flags" and facts["cpu_flags"] is None:
            facts["cpu_flags"] = [f for f in CPU_FLAGS if f in value.split()]
    return {**facts, "usable_cores": len(usable_cores())}


def device_slug(device: torch.device | str) -> str:
    """A directory name for ``device``: ``"cpu"``, or the first two words of the GPU
    name, e.g. ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100"``.

    Two words keep memory variants (80GB, HBM3, PCIe) of one GPU model together.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return "-".join(device_name(device).lower().split()[:2])


def committed_path(name: str, device: torch.device | str) -> Path:
    """``benchmarks/results/<device-slug>/<name>.json`` of this checkout; ``ValueError``
    where the package is not imported from a checkout (an installed wheel has none)."""
    if not COMMITTED_DIR.is_dir():
        raise ValueError(
            f"--update-committed: no committed results at {COMMITTED_DIR} "
            "(minipaged is not imported from a source checkout)"
        )
    return COMMITTED_DIR / device_slug(device) / f"{name}.json"


def write_results(
    path: str | Path,
    results: list[dict],
    device: torch.device | str,
    command: str,
    figure=None,
    **extra,
) -> Path:
    """Save ``results`` (one dict per row) as JSON at ``path``, with the contract's
    top-level ``device``, ``torch``, ``triton``, ``date`` and ``command``, then the
    ``extra`` keys; a matplotlib ``figure`` goes beside it as a PNG of the same stem.
    Returns the JSON path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        **extra,
        "results": results,
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    if figure is not None:
        figure.savefig(path.with_suffix(".png"), dpi=120, bbox_inches="tight")
    return path


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:  # no Triton wheel for this platform (macOS, Windows)
        return None
    return triton.__version__
