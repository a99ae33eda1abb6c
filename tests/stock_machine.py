"""A GPU machine's stock Python, simulated on this one: `make gpu-test` and every stage of
`benchmarks/run_gpu.sh` must start where only torch, triton, transformers and pytest (and
what they pull in) are installed, as on a GPU machine with its stock image.

`stock_env` gives a subprocess a ``sitecustomize`` that hides the optional packages of
this venv (the ``server``, ``dev``, ``docs`` and ``ray`` extras, and gguf) from its
imports, so ``import fastapi`` fails there as it would on that machine, and turns off
pytest's plugin autoload, which would otherwise load nbmake and pytest-xdist from their
entry points.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Installed here, absent on a GPU machine's stock image (top-level import names).
MISSING = (
    "nbmake",
    "nbclient",
    "nbformat",
    "fastapi",
    "uvicorn",
    "openai",
    "gguf",
    "hypothesis",
    "xdist",
    "prometheus_client",
    "peft",
    "ray",
    "lm_eval",
    "langchain_openai",
    "playwright",
    "mkdocs",
    "accelerate",
    "llguidance",
    "xgrammar",
    "tvm_ffi",
    "jsonschema",
)

SITECUSTOMIZE = """\
import sys
from importlib.machinery import PathFinder

MISSING = frozenset({missing!r})


class StockMachineFinder:
    '''sys.path's finder, blind to MISSING: they import as if not installed.'''

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in MISSING:
            return None
        return PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(*args, **kwargs):
        return PathFinder.find_distributions(*args, **kwargs)

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()


sys.meta_path[:] = [StockMachineFinder if f is PathFinder else f for f in sys.meta_path]
"""


def stock_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a subprocess that runs as on a stock GPU machine: this venv's
    ``python3`` first on PATH, the checkout importable, `MISSING` hidden."""
    site = tmp_path / "stock-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(missing=sorted(MISSING)))
    # Nor what tests/conftest.py sets for this process (the interpreter, the emulator).
    unset = ("TRITON_INTERPRET", "MINIPAGED_CUDA_EMULATE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k not in unset}
    env["PYTHONPATH"] = f"{site}{os.pathsep}{ROOT}"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env
