"""The docs site as readers see it.

Without a browser: the nav lists every lesson, in order, between the architecture and
the results, the home page's table lists the same, the exercises page every exercise,
and each lesson ends with a link to the next.

In headless Chromium (marked ``site``; `make site-check` runs it on the site that
`make docs-build` built, or it builds one): every page opens without a console error,
every image loads, every internal link answers 200, the math is typeset, and, where
``MINIPAGED_SITE_SCREENSHOTS`` names a folder (`make site-check SCREENSHOTS=DIR`), each
lesson page is screenshotted there at 1280 px for a person to look at (whole pages:
about half the check's time, so `make test` takes none).
"""

import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS = os.environ.get("MINIPAGED_SITE_SCREENSHOTS")


class _Loader(yaml.SafeLoader):
    """mkdocs.yml names Python objects (``!!python/name:``): read them as strings."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)


def nav() -> list:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)["nav"]


def test_nav_is_in_learning_order_and_lists_every_lesson():
    sections = [next(iter(item)) for item in nav()]
    assert sections[:2] == ["Home", "Architecture"]
    order = [s for s in sections if s in ("Architecture", "Lessons", "Results", "API reference")]
    assert order == ["Architecture", "Lessons", "Results", "API reference"]
    (lessons,) = [item["Lessons"] for item in nav() if "Lessons" in item]
    listed = [next(iter(entry.values())) for entry in lessons]
    assert listed == [f"lessons/{path.name}" for path in LESSONS]


def test_the_home_pages_lesson_table_is_the_navs_lessons():
    (lessons,) = [item["Lessons"] for item in nav() if "Lessons" in item]
    home = (ROOT / "docs" / "index.md").read_text()
    table = re.findall(r"^\| \d\d \| \[[^]]+\]\((lessons/[\w.]+\.ipynb)\)", home, re.MULTILINE)
    assert table == [next(iter(entry.values())) for entry in lessons]


def test_the_exercises_page_lists_every_exercise_and_is_in_the_nav():
    from minipaged.commands.check import EXERCISES

    page = (ROOT / "docs" / "exercises.md").read_text()
    rows = re.findall(r"^\| (\d\d) \| `exercises/([\w.]+)` \|", page, re.MULTILINE)
    assert rows == [(e.lesson, e.file) for e in EXERCISES]
    assert "make check LESSON=NN" in page
    assert {"Exercises": "exercises.md"} in nav()


@pytest.mark.parametrize("path", LESSONS[:-1], ids=lambda p: p.stem)
def test_every_lesson_ends_with_a_link_to_the_next(path):
    following = LESSONS[LESSONS.index(path) + 1]
    cells = json.loads(path.read_text())["cells"]
    last = "".join(cells[-1]["source"])
    assert f"]({following.name})" in last, f"{path.name} should end with a link to {following.name}"


# -- in a browser --------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site: ``$MINIPAGED_SITE_DIR`` (as `make site-check` sets), else built
    here."""
    if os.environ.get("MINIPAGED_SITE_DIR"):
        return Path(os.environ["MINIPAGED_SITE_DIR"]).resolve()
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)]
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    return out


@pytest.fixture(scope="module")
def base_url(site):
    """The site served on loopback, as ``make docs`` would."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = _QuietServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    thread.join()


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # a browser that stops reading a response it no longer needs is no error


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        missing = f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
        if os.environ.get("REQUIRE_CHROMIUM"):  # CI: never skip
            pytest.fail(missing)
        pytest.skip(missing)
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


def pages(site: Path) -> list[str]:
    """Every page of the site, as a path below its root ("" is the home page)."""
    found = [p.parent.relative_to(site).as_posix() for p in site.rglob("index.html")]
    return sorted("" if p == "." else p + "/" for p in found)


@pytest.mark.site
def test_every_page_loads_cleanly_in_chromium(site, base_url, browser):
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and errors.append(f"{page.url}: {m.text}"))
    page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))
    # A request the next navigation cancels (net::ERR_ABORTED) is no fault of the site;
    # any other failure, or an answer >= 400, is.
    page.on(
        "requestfailed",
        lambda r: (
            "ERR_ABORTED" not in (r.failure or "")
            and errors.append(f"{page.url}: failed {r.url} ({r.failure})")
        ),
    )
    page.on("response", lambda r: r.status >= 400 and errors.append(f"{r.url}: {r.status}"))
    links: set[str] = set()
    problems: list[str] = []
    assert {"lessons/", "exercises/"} <= {p[: p.find("/") + 1] for p in pages(site)}
    for path in pages(site):
        page.goto(base_url + path, wait_until="load")
        broken = page.evaluate(_BROKEN_IMAGES)
        problems += [f"{path}: image not loaded: {src[:80]}" for src in broken]
        links |= {urldefrag(h)[0] for h in page.eval_on_selector_all("a[href]", _HREFS)}
        if path.startswith("lessons/"):
            problems += _untypeset_math(page, path)
            if SCREENSHOTS:
                shot = Path(SCREENSHOTS) / f"{Path(path).name}.png"
                page.screenshot(path=shot, full_page=True)
    page.close()
    internal = sorted(h for h in links if urlparse(h).netloc == urlparse(base_url).netloc)
    problems += [
        f"link {url} answers {status}" for url in internal if (status := _status(url)) != 200
    ]
    assert not errors, "\n".join(errors)
    assert not problems, "\n".join(problems)


# The images of a page, each awaited: loaded with a width, or not.
_BROKEN_IMAGES = """async () => {
    const images = [...document.images];
    images.forEach(i => { i.loading = "eager"; });
    await Promise.all(images.map(i => i.decode().catch(() => null)));
    return images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src);
}"""
_HREFS = "links => links.map(a => a.href)"


def _untypeset_math(page, path: str) -> list[str]:
    """TeX left as text on a lesson page, or its notebook's equations not typeset."""
    notebook = ROOT / "lessons" / f"{Path(path).name}.ipynb"
    has_math = "$$" in notebook.read_text() if notebook.exists() else False
    try:
        page.wait_for_function(_MATHJAX_DONE, timeout=30_000)
    except Exception as error:  # playwright's TimeoutError
        return [f"{path}: MathJax did not load or finish: {str(error).splitlines()[0]}"]
    raw = re.findall(r"\$\$[^$]{0,40}", page.evaluate("() => document.body.innerText"))
    problems = [f"{path}: TeX shown as text: {r!r}" for r in raw]
    typeset = page.eval_on_selector_all(".MathJax_Display, .MathJax", "e => e.length")
    if has_math and not typeset:
        problems.append(f"{path}: its notebook has equations, none typeset")
    return problems


_MATHJAX_DONE = """() => window.MathJax && MathJax.isReady
    && MathJax.Hub.queue.pending === 0 && MathJax.Hub.queue.running === 0"""


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
