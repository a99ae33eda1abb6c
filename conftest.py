"""Repository-wide pytest setup: how `--nbmake` runs the lessons, and what their times
are measured against.

A lesson fails under `make test` on an error, a wrong output (a failed assert) or a cell
that hangs (``--nbmake-timeout``, several times the budget); its time is a measurement:
the run ends with the lessons and cells that took longest against the minute a lesson
should take (`scripts/execute_lessons.py`'s `budget_report`), gathered from every
pytest-xdist worker when the lessons run two at a time (`-n 2`).  nbmake is imported only
when `--nbmake` is given, so the tests run where it is not installed: a GPU machine's
stock Python (torch, triton, transformers, pytest) has none of the optional plugins, and
`make gpu-test` must start there (`tests/test_run_gpu.py` checks it).
"""

import json
import time

import pytest

_RUNS = {}  # lesson name -> (seconds, [(cell index, seconds)])
_CLIENTS = []  # the lesson clients made during the current lesson


def pytest_configure(config):
    if not config.getoption("nbmake", default=False):
        return
    import nbmake.nb_run

    from scripts.execute_lessons import LessonClient

    # nbmake builds a plain NotebookClient: ours adds the IPC transport that `make lessons`
    # uses (ipykernel warns about unencrypted TCP), retries a failed kernel start-up, and
    # times each cell.
    def client(nb, **kwargs):
        _CLIENTS.append(LessonClient(nb, **kwargs))
        return _CLIENTS[-1]

    nbmake.nb_run.NotebookClient = client


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if item.path.suffix != ".ipynb":
        return (yield)
    _CLIENTS.clear()
    start = time.perf_counter()
    try:
        return (yield)
    finally:
        cells = [cell for client in _CLIENTS for cell in client.cell_seconds]
        _RUNS[item.path.stem] = (time.perf_counter() - start, cells)


def pytest_sessionfinish(session):
    # A pytest-xdist worker hands its lessons' times to the controller (`workeroutput`
    # goes back with the worker's end; execnet sends strings, not tuples of tuples).
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and _RUNS:
        workeroutput["minipaged_lesson_runs"] = json.dumps(_RUNS)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent where xdist is
def pytest_testnodedown(node, error):
    runs = json.loads(getattr(node, "workeroutput", {}).get("minipaged_lesson_runs", "{}"))
    _RUNS.update({name: (s, [tuple(c) for c in cells]) for name, (s, cells) in runs.items()})


def pytest_terminal_summary(terminalreporter):
    if _RUNS:
        from scripts.execute_lessons import budget_report

        terminalreporter.write_sep("-", "lesson times")
        terminalreporter.write_line(budget_report(_RUNS))
