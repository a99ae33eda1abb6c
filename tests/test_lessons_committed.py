"""The lessons are committed with their outputs, which the docs site shows as they are:
each was executed top to bottom in one run (`make lessons`), and no cell failed.  (How
long each takes is measured where `make test` runs them, and reported: `conftest.py`.)"""

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
