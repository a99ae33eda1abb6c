"""The lessons are committed with their outputs, which the docs site shows as they are:
each was executed top to bottom in one run (`make lessons`), no cell failed, and the
run took under a minute (the cells' seconds are recorded as they execute)."""

import json
from pathlib import Path

import pytest

LESSONS = sorted((Path(__file__).resolve().parents[1] / "lessons").glob("*.ipynb"))


@pytest.mark.parametrize("path", LESSONS, ids=lambda path: path.stem)
def test_lesson_is_committed_executed_without_errors(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name} was not committed as one full run: execute it with `make lessons`"
    )
    errors = [
        f"cell {n}: {o['ename']}: {o['evalue']}"
        for n, c in enumerate(cells, 1)
        for o in c["outputs"]
        if o["output_type"] == "error"
    ]
    assert not errors, f"{path.name} has error outputs: {errors}"


@pytest.mark.parametrize("path", LESSONS, ids=lambda path: path.stem)
def test_lesson_runs_in_under_a_minute(path):
    nb = json.loads(path.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    seconds = [c["metadata"].get("minipaged", {}).get("seconds") for c in cells]
    assert None not in seconds, f"{path.name} has no cell timings: execute it with `make lessons`"
    total = nb["metadata"]["minipaged"]["seconds"]
    slowest = max(range(len(cells)), key=lambda i: seconds[i])
    assert total < 60, f"{path.name} took {total:.0f} s (cell {slowest + 1}: {seconds[slowest]} s)"
