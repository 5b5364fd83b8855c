"""The documentation site builds with `mkdocs build --strict`, its API reference covers every public module, and its
pages read as their source does.

Strict: a broken link, a missing anchor, a page outside the nav or a docstring reference that does not resolve
fails the build. The site goes to a temporary directory: the build writes nothing into the repository.

A page is read as a browser reads it (`RenderedPage`, an HTML parser), not searched as text: what follows a stray
`<script>` is script, not page, and a list without a blank line before it is one paragraph. Where Chromium is
installed, `test_pages_in_a_browser` also opens the pages the reference and the guides most depend on, and checks
what a reader sees: no script error, every entry shown, nothing wider than the text column.
"""

import html
import importlib
import inspect
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
import yaml

import dcinterp

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"


def public_modules() -> list[str]:
    names = [info.name for info in pkgutil.walk_packages(dcinterp.__path__, "dcinterp.")]
    return sorted(name for name in names if not any(part.startswith("_") for part in name.split(".")))


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return [page for item in nav for page in nav_pages(item)]


# Elements whose content a browser does not show as text (raw text, templates, frames): in the article, only where a
# docstring or page let raw HTML through. The theme's own scripts sit outside the article.
SWALLOWING = {"script", "style", "title", "textarea", "template", "iframe", "noscript", "xmp", "noembed", "noframes"}
# Every element a page's article may hold (Markdown's output, mkdocstrings' and the theme's); anything else is a word
# in angle brackets that the browser took for a tag and hid.
ARTICLE_ELEMENTS = set(
    "a abbr b blockquote br caption code col colgroup dd del details div dl dt em figcaption figure h1 h2 h3 h4 h5 "
    "h6 hr i img input ins kbd label li mark ol p path pre q s samp small span strong sub summary sup svg table "
    "tbody td tfoot th thead tr u ul var wbr button nav".split()
)
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr", "path"}
LIST_LINE = re.compile(r"\n[ \t]*(?:[-*]|\d+\.)[ \t]+\S")  # a list item's start, left inside a paragraph
ESCAPE = re.compile(r"\\[|*_`\\<>#\[\]]")  # a Markdown backslash-escape shown literally


class RenderedPage(HTMLParser):
    """One page as a browser parses it: the ids and links it shows, and what its article (the content column)
    holds. Text inside <script> and <style> is not markup (HTMLParser follows the HTML rules for them), so an
    entry swallowed by a stray <script> has no id here."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.article_ids: set[str] = set()
        self.fragment_links: set[str] = set()
        self.title = ""
        self.problems: list[str] = []
        self._article = 0  # depth of <article> elements we are in
        self._open: list[str] = []  # open elements inside the article
        self._paragraph: list[str] | None = None
        self._cell: list[str] | None = None
        self._in_title = False

    @classmethod
    def read(cls, path: Path) -> "RenderedPage":
        page = cls()
        page.feed(path.read_text(encoding="utf-8"))
        page.close()
        return page

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
            if self._article:
                self.article_ids.add(attrs["id"])
        if tag == "a" and (attrs.get("href") or "").startswith("#") and len(attrs["href"]) > 1:
            self.fragment_links.add(html.unescape(attrs["href"][1:]))
        if tag == "title" and not self._article:
            self._in_title = True
        if tag == "article":
            self._article += 1
            return
        if not self._article:
            return
        if tag in SWALLOWING:
            self.problems.append(f"a <{tag}> in the page's text: the browser hides what follows it")
        elif tag not in ARTICLE_ELEMENTS:
            self.problems.append(f"<{tag}> in the page's text is not HTML: the browser hides it (escape it as code)")
        if tag == "p":
            self._paragraph = []
        if tag in ("td", "th"):
            self._cell = []
        if tag not in VOID:
            self._open.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if self._article and self._open and self._open[-1] == tag:
            self._open.pop()

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        if tag == "article" and self._article:
            self._article -= 1
            return
        if not self._article:
            return
        if tag == "p" and self._paragraph is not None:
            text = "".join(self._paragraph)
            if LIST_LINE.search(text):
                self.problems.append(f"a list shown as running text (no blank line before it?): {text[:120]!r}")
            self._paragraph = None
        if tag in ("td", "th") and self._cell is not None:
            text = "".join(self._cell)
            if ESCAPE.search(text):
                self.problems.append(f"a table cell shows a backslash-escape literally: {text[:120]!r}")
            self._cell = None
        if tag in self._open:
            while self._open.pop() != tag:
                pass

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        if self._paragraph is not None:
            self._paragraph.append(data)
        if self._cell is not None:
            self._cell.append(data)


def site_pages(site: Path) -> list[Path]:
    """The site's pages (not the figures' own HTML files, which are not built from docs/)."""
    return sorted(path for path in site.rglob("*.html") if "figures" not in path.relative_to(site).parts)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    before = {path.name for path in ROOT.iterdir()}
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, printed on every build
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site_dir),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert "WARNING" not in result.stderr, result.stderr
    assert {path.name for path in ROOT.iterdir()} == before, "the docs build wrote into the repository"
    return site_dir


def test_every_public_module_has_a_reference_page_in_the_nav():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = set(nav_pages(config["nav"]))
    for module in public_modules():
        page = REFERENCE / f"{module}.md"
        assert page.exists() and f"::: {module}" in page.read_text(), f"write {page.relative_to(ROOT)}: '::: {module}'"
        assert f"reference/{module}.md" in pages, f"add reference/{module}.md to the nav of mkdocs.yml"


def public_functions(module: str) -> list[str]:
    """The module's own public functions and classes: those its reference page must show."""
    return [
        name
        for name, value in vars(importlib.import_module(module)).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module
    ]


def test_site_builds_strictly_with_every_public_function(site):
    for module in public_modules():
        page = RenderedPage.read(site / "reference" / module / "index.html")
        missing = [name for name in public_functions(module) if f"{module}.{name}" not in page.article_ids]
        assert not missing, f"{module}: no entry shown in the API reference for {missing}"
        dangling = sorted(target for target in page.fragment_links if target not in page.ids)
        assert not dangling, f"{module}: links (table of contents) to #{dangling}, which the page does not show"


def test_pages_show_their_figures(site):
    for page in ["index.html", "composition/index.html", "notebooks/index.html"]:
        html = (site / page).read_text()
        for image in re.findall(r'<img[^>]+src="([^"]+)"', html):
            if not image.startswith(("http", "data:")):
                assert (site / page).parent.joinpath(image).resolve().exists(), f"{page}: {image} is not in the site"


def test_plain_text_docstrings_become_markdown():
    sys.path.insert(0, str(ROOT / "docs" / "_build"))
    try:
        from griffe_plaintext import markdown_lists
    finally:
        sys.path.pop(0)
    text = (
        "Options:\n- a: one\n  more of a\n- b: two\nAfter the list.\n"
        "tokens: prompts\n    [batch, pos]\nn_steps, method: as captum\n"
        "Equations:\n    A' = A W\nwith W the map."
    )
    assert markdown_lists(text) == (
        "Options:\n\n- a: one\n  more of a\n- b: two\n\nAfter the list.\n"
        "\n- `tokens`: prompts\n    [batch, pos]\n- `n_steps`, `method`: as captum\n"
        "\nEquations:\n\n    A' = A W\n\nwith W the map."
    )


def test_the_guides_examples_run():
    """The Python blocks of the pages that run on the embedded models, in reading order and one namespace (a later
    page's example uses the `model` and `tokens` of an earlier one), as a reader would paste them."""
    import matplotlib.pyplot as plt

    namespace = {"__name__": "docs_examples"}
    for page in ["getting-started.md", "attribution.md", "composition.md", "circuits.md"]:
        path = ROOT / "docs" / page
        blocks = re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.DOTALL | re.MULTILINE)
        assert blocks, f"{page} has no Python example"
        for block in blocks:
            exec(compile(block, str(path), "exec"), namespace)
    plt.close("all")


# A notebook page's article is nbconvert's HTML (mkdocs-jupyter): its own styles, scripts and copy buttons.
NOTEBOOK_MARKUP = ("a <style>", "a <script>", "<clipboard-copy>")


def test_pages_read_as_their_source(site):
    problems = []
    for path in site_pages(site):
        page = RenderedPage.read(path)
        found = page.problems
        if path.parent.parent == site / "notebooks":
            found = [problem for problem in found if not problem.startswith(NOTEBOOK_MARKUP)]
        problems += [f"{path.relative_to(site)}: {problem}" for problem in found]
        if path.name != "404.html":
            assert page.title.strip(), f"{path.relative_to(site)} has no <title>"
    assert not problems, "\n".join(problems)


def test_notebook_pages_show_their_outputs(site):
    """Each notebook is a page with the outputs of its site copy (docs/notebooks/, `dcinterp.notebooks render`):
    its printed text, its figures inline, the note of how it was run; a reasonable size; its notebook downloadable."""
    from dcinterp.notebooks import RENDERED_DIR, SITE_PARAMETERS

    for name in SITE_PARAMETERS:
        path = site / "notebooks" / name / "index.html"
        page = path.read_text(encoding="utf-8")
        notebook = nbformat.read(RENDERED_DIR / f"{name}.ipynb", as_version=4)
        images = sum("image/png" in o.get("data", {}) for cell in notebook.cells for o in cell.get("outputs", []))
        assert images and page.count('src="data:image/png;base64,') == images, f"{name}: {images} figures"
        outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
        for printed in [o.text.splitlines()[0] for o in outputs if o.output_type == "stream"][:3]:
            assert html.escape(printed, quote=False) in page, f"{name}: its printed output {printed!r} is not shown"
        tables = sum('class="dataframe"' in o.get("data", {}).get("text/html", "") for o in outputs)
        assert page.count('class="dataframe"') == tables, f"{name}: {tables} tables"
        words = re.sub(r'<span class="nowrap">([^<]*)</span>', r"\1", page)  # docs/_build/inline_code.py's spans
        assert "python -m dcinterp.notebooks render" in words and f"dcinterp.notebooks run {name}" in words
        assert path.stat().st_size < 3_000_000, f"{name}: {path.stat().st_size / 1e6:.1f} MB"
        assert (path.parent / f"{name}.ipynb").is_file(), f"{name}: the notebook is not offered for download"


def test_reader_flags_what_a_browser_hides():
    """The checks above can fail: each thing the issue found, in a page of its own."""
    swallowed = RenderedPage()
    swallowed.feed(
        '<article><h2 id="m.a">a</h2><p>safe to inline in a <script>.</p>'
        '<h2 id="m.b">b</h2></article><a href="#m.b">b</a><script>theme()</script>'
    )
    assert "m.a" in swallowed.article_ids and "m.b" not in swallowed.ids and swallowed.problems
    for body in ["<p>Outputs:\n- <code>edges.csv</code>: one row\n- b</p>", "<table><tr><td>a\\|b</td></tr></table>"]:
        page = RenderedPage()
        page.feed(f"<article>{body}</article>")
        assert page.problems, body
    clean = RenderedPage()
    clean.feed("<article><p>x - y</p><ul><li>a</li></ul><table><tr><td><code>a|b</code></td></tr></table></article>")
    assert not clean.problems


def test_interactive_figures_have_a_title(site):
    figures = sorted((site / "figures").glob("*.html"))
    assert figures, "the site carries the figures' interactive pages"
    for path in figures:
        assert RenderedPage.read(path).title.strip(), f"{path.name}: empty <title> (plotting.write_plotly_page)"


def test_api_signatures_are_formatted(site):
    """mkdocstrings wraps a signature only with ruff or black installed; without, each is one line cut off at the
    column's edge. The docs extra brings ruff, and the built signatures are wrapped."""
    docs_extra = re.search(r"^docs = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.MULTILINE | re.DOTALL)
    assert docs_extra and re.search(r"""["'](ruff|black)\b""", docs_extra.group(1)), "add ruff to the docs extra"
    signatures = re.compile(r'<div class="doc-signature[^"]*">(.*?)</div>', re.DOTALL)
    long_lines = []
    for path in sorted((site / "reference").rglob("index.html")):
        for block in signatures.findall(path.read_text(encoding="utf-8")):
            text = html.unescape(re.sub(r"<[^>]+>", "", block))
            if re.match(r"\w+\(", text):  # a function's or class's signature (not a constant's value)
                long_lines += [f"{path.parent.name}: {line}" for line in text.splitlines() if len(line) > 90]
    assert not long_lines, "signatures not formatted:\n" + "\n".join(long_lines)


BROWSER_PAGES = [
    "",  # the home page
    "getting-started",
    "hooked-model",
    "gpu",
    "loading",
    "synthetic-tasks",
    "qk-attribution",
    "notebooks",
    "reference/dcinterp.views",
    "reference/dcinterp.discovery",
    "circuit-discovery",
    "conventions",
    "benchmarks",
    "training",
    "study",
    "training-history",
    # notebook pages: their code cells and wide tables scroll inside their own boxes, as in Jupyter
    "notebooks/case_study",
    "notebooks/circuit_discovery",
]
# Run in each page after it loads (and after the theme's script has added the copy buttons): script errors, entries
# without a box on screen, elements wider than the column (a code block may scroll: it keeps its lines as written),
# code blocks that wrap, inline code broken inside a word or past the column's edge, copy buttons over text, figures
# without the click-to-enlarge link.
MEASURE = """<script>
window.__errors = [];
window.addEventListener("error", (event) => window.__errors.push(String(event.message)));
const textRects = (root) => {
  const rects = [];
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  while (walker.nextNode()) {
    const node = walker.currentNode;
    for (const word of node.textContent.matchAll(/\\S+/g)) {
      const range = document.createRange();
      range.setStart(node, word.index);
      range.setEnd(node, word.index + word[0].length);
      rects.push({word: word[0], rects: [...range.getClientRects()]});
    }
  }
  return rects;
};
const overlap = (a, b) =>  // a (non-empty) and b share some area
  a.left < a.right && a.top < a.bottom && a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
const clip = (a, b) => ({left: Math.max(a.left, b.left), right: Math.min(a.right, b.right),
                         top: Math.max(a.top, b.top), bottom: Math.min(a.bottom, b.bottom)});  // what shows of a in b
const measure = () => {
  const article = document.querySelector("article");
  const wide = [];
  for (const el of article.querySelectorAll("*")) {
    if (el.matches("pre > code")) continue;
    if (el.scrollWidth > el.clientWidth + 8 && getComputedStyle(el).overflowX !== "visible"
        && !el.closest(".jp-InputArea, .jp-OutputArea-output"))
      wide.push(el.tagName + " " + el.scrollWidth + " px: " + el.textContent.trim().slice(0, 60));
  }
  const wrapped = [...article.querySelectorAll("pre > code")]
    .filter((el) => getComputedStyle(el).whiteSpace !== "pre")
    .map((el) => el.textContent.slice(0, 60));
  const broken = [], outside = [];
  const right = article.getBoundingClientRect().right;
  for (const code of article.querySelectorAll(":not(pre) > code"))
    for (const {word, rects} of textRects(code)) {
      if (new Set(rects.map((rect) => Math.round(rect.top))).size > 1) broken.push(word);
      if (!code.closest(".md-typeset__scrollwrap") && rects.some((rect) => rect.right > right + 1)) outside.push(word);
    }
  const covered = [];
  for (const nav of article.querySelectorAll("pre > .md-code__nav")) {
    const box = nav.getBoundingClientRect();
    const code = nav.parentElement.querySelector("code");
    const view = code.getBoundingClientRect();
    for (const {word, rects} of textRects(code))
      if (rects.some((rect) => overlap(clip(rect, view), box))) covered.push(word);
  }
  const buttons = article.querySelectorAll("pre > .md-code__nav").length;
  const unzoomable = [...article.querySelectorAll("img")]
    .filter((img) => !img.closest("a.glightbox")).map((img) => img.getAttribute("src"));
  const hidden = [...article.querySelectorAll("[id]")]
    .filter((el) => /^h[1-6]$/i.test(el.tagName) && el.getClientRects().length === 0).map((el) => el.id);
  const shown = [...article.querySelectorAll("h1[id], h2[id], h3[id], h4[id]")].map((el) => el.id);
  const codeBlocks = article.querySelectorAll("pre > code").length;
  const out = document.createElement("pre");
  out.id = "__measured";
  out.textContent = JSON.stringify({errors: window.__errors, wide, wrapped, broken, outside, covered, buttons,
                                    codeBlocks, unzoomable, hidden, shown, column: article.clientWidth});
  document.body.appendChild(out);
};
window.addEventListener("load", () => setTimeout(measure, 500));
</script>"""


def chromium() -> str | None:
    return next(
        (shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None
    )


@pytest.mark.skipif(chromium() is None, reason="no Chromium installed (optional: apt-get install chromium)")
@pytest.mark.parametrize("page", BROWSER_PAGES)
def test_pages_in_a_browser(site, page, tmp_path):
    """The page in headless Chromium, 1300 px wide: no script error, every public function's entry laid out on
    screen, nothing but a code block wider than the text column, no code block wrapped, no word of inline code
    broken over two lines or past the column, no copy button over a code block's text, every figure clickable to
    enlarge."""
    source = site / page / "index.html"
    probe = source.with_name("__probe.html")  # beside the page, so that its relative links resolve
    probe.write_text(source.read_text(encoding="utf-8").replace("<head>", "<head>" + MEASURE, 1), encoding="utf-8")
    try:
        dom = subprocess.run(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                f"--user-data-dir={tmp_path}",
                "--window-size=1300,2000",
                "--virtual-time-budget=5000",
                "--dump-dom",
                probe.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    finally:
        probe.unlink()
    found = re.search(r'<pre id="__measured">(.*?)</pre>', dom, re.DOTALL)
    assert found, f"{page}: the page did not finish loading in Chromium"
    measured = json.loads(html.unescape(found.group(1)))
    assert not measured["errors"], f"{page}: script errors {measured['errors']}"
    assert not measured["hidden"], f"{page}: headings not laid out {measured['hidden']}"
    assert not measured["wide"], f"{page}: wider than the {measured['column']} px column: {measured['wide']}"
    assert not measured["wrapped"], f"{page}: code blocks that wrap their lines: {measured['wrapped']}"
    assert not measured["broken"], f"{page}: inline code broken inside a word: {measured['broken']}"
    assert not measured["outside"], f"{page}: inline code past the column's edge: {measured['outside']}"
    assert measured["buttons"] == measured["codeBlocks"], (
        f"{page}: {measured['codeBlocks']} code blocks, {measured['buttons']} copy buttons"
    )
    assert not measured["covered"], f"{page}: the copy button covers {measured['covered']}"
    assert not measured["unzoomable"], f"{page}: figures that do not enlarge on a click: {measured['unzoomable']}"
    if page.startswith("reference/"):
        module = page.removeprefix("reference/")
        missing = [name for name in public_functions(module) if f"{module}.{name}" not in measured["shown"]]
        assert not missing, f"{module}: entries not shown in the browser: {missing}"
