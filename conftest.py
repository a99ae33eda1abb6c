"""Repository-wide pytest setup: how `--nbmake` runs the lessons, and how long they may
take."""

import os

import nbmake.nb_run
import pytest

from scripts.execute_lessons import KERNEL_CONFIG

# nbmake starts each lesson's kernel through nbclient, over TCP unless configured, and
# ipykernel then warns that the channel is unencrypted: give it the IPC transport that
# `make lessons` uses.
_NotebookClient = nbmake.nb_run.NotebookClient
nbmake.nb_run.NotebookClient = lambda nb, **kwargs: _NotebookClient(
    nb, config=KERNEL_CONFIG, **kwargs
)


LESSON_LIMIT_S = float(os.environ.get("MINIPAGED_LESSON_LIMIT_S", 60))
"""A lesson must run in under a minute on a CPU: `make test` fails one that does not."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    is_lesson = item.path.suffix == ".ipynb"
    if is_lesson and call.when == "call" and report.passed and call.duration > LESSON_LIMIT_S:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.path.name} ran for {call.duration:.0f} s, over the {LESSON_LIMIT_S} s a "
            "lesson may take: `make lessons` records each cell's seconds in its metadata "
            "(minipaged.seconds), which show the slow ones"
        )
    return report
