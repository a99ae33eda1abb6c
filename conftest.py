"""Repository-wide pytest setup: how `--nbmake` runs the lessons."""

import nbmake.nb_run

from scripts.execute_lessons import KERNEL_CONFIG

# nbmake starts each lesson's kernel through nbclient, over TCP unless configured, and
# ipykernel then warns that the channel is unencrypted: give it the IPC transport that
# `make lessons` uses.
_NotebookClient = nbmake.nb_run.NotebookClient
nbmake.nb_run.NotebookClient = lambda nb, **kwargs: _NotebookClient(
    nb, config=KERNEL_CONFIG, **kwargs
)
