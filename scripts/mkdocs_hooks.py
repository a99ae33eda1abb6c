"""mkdocs hooks: links between lessons that work on the site as in Jupyter, and MathJax
served by the site itself.

A lesson links to the next as ``[...](05_scheduler.ipynb)``, which is right in Jupyter
and on GitHub; it links a docs page as ``[...](../docs/glossary.md#...)``, likewise.
mkdocs-jupyter renders each notebook as a page of its own folder
(``lessons/05_scheduler/``) but leaves its links as written, so on the site they would
point at a file that is not there.  This hook rewrites them to the pages.
"""

import re
import shutil
from pathlib import Path

_NOTEBOOK_LINK = re.compile(r'href="(?:\./)?([\w-]+)\.ipynb(#[^"]*)?"')
_DOCS_LINK = re.compile(r'href="\.\./docs/([\w-]+)\.md(#[^"]*)?"')


# The MathJax that jupyter-server-mathjax ships has the STIX-Web fonts only: say so
# before MathJax starts, or it asks for its default TeX fonts, which are not there.  Its
# placeholder font is fetched from about:blank, which Chromium refuses with a console
# error: name a local font that does not exist instead (the same empty placeholder).
_MATHJAX_FONTS = """<script type="text/x-mathjax-config">
MathJax.Hub.Config({"HTML-CSS": {
  availableFonts: [], webFont: "STIX-Web", imageFont: null,
  styles: {"@font-face": {"font-family": "MathJax_Blank", src: "local('MathJax_Blank')"}}
}});
</script>
<!-- Load mathjax -->"""


def on_post_page(output: str, page, config) -> str:
    if not page.file.src_uri.endswith(".ipynb"):
        return output
    output = output.replace("<!-- Load mathjax -->", _MATHJAX_FONTS, 1)
    output = _DOCS_LINK.sub(lambda m: f'href="../../{m[1]}/{m[2] or ""}"', output)
    return _NOTEBOOK_LINK.sub(lambda m: f'href="../{m[1]}/{m[2] or ""}"', output)


def on_post_build(config) -> None:
    """Copy MathJax into the site (mkdocs-jupyter's ``custom_mathjax_url`` points
    there): the lessons' equations render without reaching another host."""
    import jupyter_server_mathjax

    static = Path(jupyter_server_mathjax.__file__).parent / "static"
    target = Path(config["site_dir"]) / "javascripts" / "mathjax"
    shutil.copytree(static, target, dirs_exist_ok=True)
