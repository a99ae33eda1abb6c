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
in the notebook's (`tests/test_lessons_committed.py` keeps it under a minute).
"""

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


def execute(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        record_timing=True,
        resources={"metadata": {"path": str(path.parent)}},
        config=KERNEL_CONFIG,
    )
    client.execute()
    drop_widgets(nb)
    record_seconds(nb)
    nbformat.write(nb, path)


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
    for path in lessons:
        start = time.perf_counter()
        execute(path)
        print(f"{path.name}: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
