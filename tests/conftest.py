"""Shared test set-up.

TRITON_INTERPRET must be set before any Triton kernel is defined, so it is set here,
before pytest imports a test module.  Tests marked ``gpu`` skip without CUDA.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-test` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
