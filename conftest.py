"""Repository-wide pytest setup: how `--nbmake` runs the lessons, and how long they may
take.

Nothing here imports an optional plugin at module level: a GPU machine's stock Python
(torch, triton, transformers, pytest) has no nbmake, and `make gpu-test` must start there
(`tests/test_stock_machine.py` checks it)."""

import os

import pytest

LESSON_LIMIT_S = float(os.environ.get("MINIPAGED_LESSON_LIMIT_S", 60))
"""A lesson must run in under a minute on a CPU: `make test` fails one that does not."""


def pytest_configure(config):
    # nbmake starts each lesson's kernel through nbclient, over TCP unless configured, and
    # ipykernel then warns that the channel is unencrypted: give it the IPC transport that
    # `make lessons` uses.  Only where nbmake is installed (and so loaded as a plugin).
    if not config.pluginmanager.hasplugin("nbmake"):
        return
    import nbmake.nb_run

    from scripts.execute_lessons import KERNEL_CONFIG

    client = nbmake.nb_run.NotebookClient
    nbmake.nb_run.NotebookClient = lambda nb, **kwargs: client(nb, config=KERNEL_CONFIG, **kwargs)


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
