"""`scripts/execute_lessons.py`, which runs the lessons for `make lessons` and (through
`conftest.py`) for `make test`: a kernel that fails to start is started again, and the
lessons' times are reported against the budget, never failed on."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# The notebook machinery is a dev dependency (a GPU machine's environment may lack it).
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
from jupyter_client.manager import AsyncKernelManager  # noqa: E402

from scripts.execute_lessons import (  # noqa: E402
    LESSON_BUDGET_S,
    STARTUP_TRIES,
    LessonClient,
    budget_report,
)


def notebook():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# x"), nbformat.v4.new_code_cell("print(6 * 7)")]
    return nb


class DyingFirstKernels(AsyncKernelManager):
    """The first ``deaths`` kernels exit at once, as one that cannot bind its sockets on a
    loaded machine does: their client waits for an answer that never comes."""

    deaths = 1
    started = 0

    def format_kernel_cmd(self, extra_arguments=None):
        DyingFirstKernels.started += 1
        if DyingFirstKernels.started <= DyingFirstKernels.deaths:
            return [self.kernel_spec.argv[0], "-c", "raise SystemExit(1)"]
        return super().format_kernel_cmd(extra_arguments)


@pytest.fixture
def dying():
    DyingFirstKernels.started = 0
    return DyingFirstKernels


def test_a_kernel_that_dies_at_start_up_is_started_again(dying):
    nb = notebook()
    client = LessonClient(nb, kernel_manager_class=dying, startup_timeout=60)
    client.execute()
    assert nb.cells[1].outputs[0]["text"] == "42\n"
    assert dying.started == 2 and len(client.startup_failures) == 1
    assert "died" in client.startup_failures[0]
    assert [index for index, _ in client.cell_seconds] == [1]


def test_start_up_gives_up_after_its_tries(dying):
    dying.deaths = STARTUP_TRIES
    client = LessonClient(notebook(), kernel_manager_class=dying, startup_timeout=60)
    with pytest.raises(RuntimeError, match="died"):
        client.execute()
    assert dying.started == STARTUP_TRIES == len(client.startup_failures)
    dying.deaths = 1


def test_the_budget_report_names_the_slow_lessons_and_cells_first():
    runs = {
        "05_scheduler": (LESSON_BUDGET_S + 30, [(3, 50.0), (7, 20.0)]),
        "01_block_allocator": (2.0, [(1, 1.5)]),
        "16_mixture_of_experts": (LESSON_BUDGET_S * 3, [(12, 170.0)]),
    }
    lines = budget_report(runs, top=2).splitlines()
    assert lines[0].endswith("2 of 3 over")
    assert lines[1:3] == [
        f"  16_mixture_of_experts: {LESSON_BUDGET_S * 3:.0f} s (over)",
        f"  05_scheduler: {LESSON_BUDGET_S + 30:.0f} s (over)",
    ]
    assert lines[4:] == ["  16_mixture_of_experts cell 12: 170 s", "  05_scheduler cell 3: 50 s"]


def test_lessons_run_two_at_a_time_report_the_times_of_both(tmp_path):
    """Under pytest-xdist (`make test` runs the lessons with ``-n 2``) each worker times
    its own lessons: the report, printed by the controller, has every lesson."""
    for name in ("01_first", "02_second"):
        nbformat.write(notebook(), tmp_path / f"{name}.ipynb")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider"]
    command += ["--nbmake", "-n", "2", str(tmp_path)]
    out = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    report = out.stdout[out.stdout.index("lesson times against") :].splitlines()
    assert report[0].endswith("0 of 2 over")
    assert sorted(line.split(":")[0].strip() for line in report[1:3]) == ["01_first", "02_second"]
    assert sorted(line.split(" cell ")[0].strip() for line in report[4:6]) == [
        "01_first",
        "02_second",
    ]
