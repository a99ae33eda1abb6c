"""mkdocs hooks: links between lessons that work on the site as in Jupyter.

A lesson links to the next as ``[...](05_scheduler.ipynb)``, which is right in Jupyter
and on GitHub.  mkdocs-jupyter renders each notebook as a page of its own folder
(``lessons/05_scheduler/``) but leaves its links as written, so on the site they would
point at a file that is not there.  This hook rewrites them to the pages.
"""

import re

_NOTEBOOK_LINK = re.compile(r'href="(?:\./)?([\w-]+)\.ipynb(#[^"]*)?"')


def on_post_page(output: str, page, config) -> str:
    if not page.file.src_uri.endswith(".ipynb"):
        return output
    return _NOTEBOOK_LINK.sub(lambda m: f'href="../{m[1]}/{m[2] or ""}"', output)
