"""Execute lessons in place, so that the committed notebooks carry their outputs.

The docs site shows these outputs as they are (mkdocs-jupyter with ``execute: false``),
so run this after changing a lesson or the code it imports:

    python scripts/execute_lessons.py                  # every lesson
    python scripts/execute_lessons.py lessons/05_scheduler.ipynb

The lessons run against this checkout's ``minipaged``, each in a fresh kernel started
in ``lessons/``.  What is written depends only on what the cells print and draw, and
how long each cell took: no execution timestamps, cell ids kept, so re-running
unchanged code changes little (what the cells print about time, and the timings).
Each code cell's seconds are in its metadata (``minipaged.seconds``), the lesson's total
in the notebook's, and the run ends with `budget_report`: the lessons and cells that took
longest, against the minute a lesson should take on a laptop's CPU.  That budget is a
measurement, not a test: a busy or slower machine takes longer, and `make test` (which
runs the lessons with nbmake, `conftest.py`) prints the same report and fails a lesson
only on an error or a cell that hangs (`CELL_TIMEOUT_S`).
"""

import atexit
import contextlib
import os
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from traitlets.config import Config

ROOT = Path(__file__).resolve().parents[1]
# The kernel talks to its client over local Unix sockets (TCP would make ipykernel warn
# that the channel is unencrypted).  Their names are absolute paths, as the kernel runs in
# lessons/ and the client elsewhere, and carry our process id, as other runs may share
# the folder.  `conftest.py` gives nbmake's kernels the same.
_SOCKETS = Path(tempfile.gettempdir()) / f"minipaged-kernel-{os.getpid()}"
KERNEL_CONFIG = Config({"KernelManager": {"transport": "ipc", "ip": str(_SOCKETS)}})

LESSON_BUDGET_S = 60.0
"""What a lesson should take on a laptop's CPU: reported against, never failed on."""
CELL_TIMEOUT_S = 5 * LESSON_BUDGET_S
"""A cell still running after this long hangs: the one timing that fails a lesson."""
STARTUP_TRIES = 3
"""Kernel start-ups tried before a lesson fails: on a loaded machine one can fail (a ZMQ
socket error, a kernel that dies before it answers) with nothing wrong in the lesson."""
STARTUP_TIMEOUT_S = 180
"""How long a kernel may take to answer its first message (nbclient's default is 60 s)."""


class LessonClient(NotebookClient):
    """nbclient's client with the lessons' kernel settings, a kernel start-up retried
    (`STARTUP_TRIES`), and each code cell's seconds in ``cell_seconds`` (index, s)."""

    def __init__(self, nb, **kwargs):
        kwargs.setdefault("config", KERNEL_CONFIG)
        kwargs.setdefault("startup_timeout", STARTUP_TIMEOUT_S)
        super().__init__(nb, **kwargs)
        self.cell_seconds: list[tuple[int, float]] = []
        self.startup_failures: list[str] = []

    async def async_start_new_kernel(self, **kwargs) -> None:
        from jupyter_client.kernelspec import NoSuchKernel

        self._start_kwargs = kwargs
        for attempt in range(1, STARTUP_TRIES + 1):
            try:
                return await super().async_start_new_kernel(**kwargs)
            except NoSuchKernel:  # no retry brings a kernel spec back
                raise
            except Exception as error:  # a ZMQError, an OSError, a timeout alike
                await self._discard_kernel()
                if not self._try_again(error, attempt):
                    raise

    async def async_start_new_kernel_client(self):
        for attempt in range(1, STARTUP_TRIES + 1):
            try:
                return await super().async_start_new_kernel_client()
            except Exception as error:  # a kernel that died, or never answered
                await self._discard_kernel()  # nbclient has shut it down: what is left
                if not self._try_again(error, attempt):
                    raise
                await self.async_start_new_kernel(**self._start_kwargs)

    def _try_again(self, error: Exception, attempt: int) -> bool:
        """Note a failed start-up; whether to try again (then with a fresh manager)."""
        self.startup_failures.append(f"{type(error).__name__}: {error}")
        print(f"kernel start-up failed ({self.startup_failures[-1]})", file=sys.stderr)
        if attempt == STARTUP_TRIES:
            atexit.unregister(self._cleanup_kernel)  # nothing is left to clean up at exit
            return False
        self.km = self.create_kernel_manager()
        return True

    async def _discard_kernel(self) -> None:
        """Shut down what a failed start-up left."""
        if self.km is not None:
            with contextlib.suppress(Exception):  # the kernel may be half started
                await self._async_cleanup_kernel()
        self.kc = self.km = None

    async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
        start = time.perf_counter()
        try:
            return await super().async_execute_cell(cell, cell_index, *args, **kwargs)
        finally:
            if cell.cell_type == "code":
                self.cell_seconds.append((cell_index, time.perf_counter() - start))


def budget_report(runs: dict[str, tuple[float, list[tuple[int, float]]]], top: int = 5) -> str:
    """Lines on the lessons' times against `LESSON_BUDGET_S`: ``runs`` maps a lesson's
    name to its seconds and its code cells' ``(index, seconds)``."""
    if not runs:
        return ""
    over = sum(seconds > LESSON_BUDGET_S for seconds, _ in runs.values())
    lines = [
        f"lesson times against the {LESSON_BUDGET_S:.0f} s budget (a measurement, not a "
        f"test; this machine's load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
        f"CPUs): {over} of {len(runs)} over"
    ]
    slowest = sorted(runs.items(), key=lambda item: -item[1][0])[:top]
    lines += [
        f"  {name}: {s:.0f} s" + (" (over)" if s > LESSON_BUDGET_S else "")
        for name, (s, _) in slowest
    ]
    cells = sorted(
        ((s, name, index) for name, (_, cells) in runs.items() for index, s in cells),
        reverse=True,
    )[:top]
    lines.append("slowest cells (their index in the notebook):")
    lines += [f"  {name} cell {index}: {s:.0f} s" for s, name, index in cells]
    return "\n".join(lines)


def execute(path: Path) -> list[tuple[int, float]]:
    """Run the lesson at ``path`` and write it back with its outputs; its code cells'
    ``(index, seconds)``."""
    nb = nbformat.read(path, as_version=4)
    client = LessonClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        record_timing=True,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    drop_widgets(nb)
    record_seconds(nb)
    nbformat.write(nb, path)
    return client.cell_seconds


def record_seconds(nb) -> None:
    """Replace nbclient's timestamps by each code cell's duration, and the total."""
    total = 0.0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        stamps = cell.metadata.pop("execution", {})
        start, end = stamps.get("iopub.execute_input"), stamps.get("shell.execute_reply")
        seconds = (_time(end) - _time(start)).total_seconds() if start and end else 0.0
        cell.metadata["minipaged"] = {"seconds": round(seconds, 1)}
        total += seconds
    nb.metadata["minipaged"] = {"seconds": round(total, 1)}


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def drop_widgets(nb) -> None:
    """Remove widget outputs (tqdm's progress bars): the site cannot show them without
    their state, and their ids are random, so every run would change the file."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [
                o
                for o in cell.outputs
                if "application/vnd.jupyter.widget-view+json" not in o.get("data", {})
            ]


def main(paths: list[str]) -> None:
    # The kernel inherits our environment: put this checkout first on its path.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    lessons = [Path(p).resolve() for p in paths] or sorted((ROOT / "lessons").glob("*.ipynb"))
    runs = {}
    for path in lessons:
        start = time.perf_counter()
        cells = execute(path)
        runs[path.stem] = (time.perf_counter() - start, cells)
        print(f"{path.name}: {runs[path.stem][0]:.0f} s", flush=True)
    print(budget_report(runs))


if __name__ == "__main__":
    main(sys.argv[1:])
