"""Host arrays to the device without the host waiting for it (vLLM V1's ``CpuGpuBuffer``,
``vllm/v1/utils.py``: a pinned host tensor beside each device tensor).

A copy to the GPU from ordinary (pageable) host memory makes the host wait until the
stream has run it: CUDA cannot read pageable memory while the host may move it.  From
pinned (page-locked) memory the copy is queued with ``non_blocking=True`` and the host
goes on at once.  So each array the step sends crosses through a pinned buffer kept
under a name, into a device buffer kept beside it; both grow by doubling, so a steady
run allocates nothing.  On a CPU there is nothing to cross: the array's own memory is
the "device" tensor (and a CPU-only torch cannot pin memory at all).

The catch: the host may rewrite a pinned buffer only once the copy out of it has run
on the device, or the device reads the new values (or half of them).  Almost always it
has: a step that samples ends with the sampled ids' copy to the host (``tolist`` in
`minipaged.sample.sampler`, the one wait a step needs), and that copy waits for the
stream, so every copy the step queued has run before the host writes the next step's
values.  With ``async_scheduling`` too: the engine stages step N+1's inputs
(`LLMEngine._launch`) only after step N was sampled (`LLMEngine._step_async`), and N+1
is sampled before N+2 is staged.  Not every step samples, though: a long prompt's middle
chunks sample nothing, and a tensor-parallel worker never samples.  So each buffer
records an event after its copy and, before a rewrite, checks it; if the copy has not
run yet the host waits for the stream, a wait torch's sync debug mode reports (as
``bench throughput --profile-steps`` and the GPU tests watch for), never a silent race.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["CpuGpuBuffers"]


class _Buffer:
    """One name's pinned host buffer, its device buffer, and the event of the last copy."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cpu = torch.empty(size, dtype=dtype, pin_memory=True)
        self.gpu = torch.empty(size, dtype=dtype, device=device)
        self.copied: torch.cuda.Event | None = None


class CpuGpuBuffers:
    """Arrays to ``device`` by name, each through its own pinned buffer (module
    docstring)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffers: dict[str, _Buffer] = {}

    @property
    def crosses(self) -> bool:
        """Whether arrays cross to another memory (not on a CPU)."""
        return self.device.type != "cpu"

    def to_device(self, name: str, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        """``array`` on the device.  On a CPU it is the array's own memory; on a GPU a view
        of the device buffer kept for ``name``, valid until ``name`` is sent again."""
        host = array
        if isinstance(array, np.ndarray):
            host = torch.from_numpy(np.ascontiguousarray(array))
        if not self.crosses:
            return host
        n = host.numel()
        buffer = self._buffers.get(name)
        stream = torch.cuda.current_stream(self.device)
        if buffer is None or buffer.cpu.dtype != host.dtype or buffer.cpu.numel() < n:
            # The old pinned buffer goes back to torch's pinned-memory cache, which hands
            # it out again only after the copies out of it ran.
            size = max(n, 2 * buffer.cpu.numel() if buffer is not None else 256)
            buffer = self._buffers[name] = _Buffer(size, host.dtype, self.device)
        elif buffer.copied is not None and not buffer.copied.query():
            stream.synchronize()  # the last copy out of it has not run yet
        buffer.cpu[:n].copy_(host.reshape(-1))
        buffer.gpu[:n].copy_(buffer.cpu[:n], non_blocking=True)
        if buffer.copied is None:
            buffer.copied = torch.cuda.Event()
        buffer.copied.record(stream)
        return buffer.gpu[:n].view(host.shape)
