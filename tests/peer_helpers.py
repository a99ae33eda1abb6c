"""A fake vLLM peer for the tests of `bench.vllm_peer` and `bench.vllm_quant`: a
virtual environment whose Python is this one, running a driver script of the test's."""

from __future__ import annotations

import sys

from minipaged.bench import vllm_peer


def install_fake_peer(tmp_path, monkeypatch, module, driver_text: str):
    """Point ``MINIPAGED_VLLM_VENV`` at a fake environment and ``module.DRIVER`` at a
    script holding ``driver_text``; returns the script's path."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    driver = tmp_path / "fake_driver.py"
    driver.write_text(driver_text)
    monkeypatch.setenv(vllm_peer.VENV_VARIABLE, str(tmp_path / "venv"))
    monkeypatch.setattr(module, "DRIVER", driver)
    return driver
