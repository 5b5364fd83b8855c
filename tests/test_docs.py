"""The documentation site builds with `mkdocs build --strict`, and its API reference covers every public module.

Strict: a broken link, a missing anchor, a page outside the nav or a docstring reference that does not resolve
fails the build. The site goes to a temporary directory: the build writes nothing into the repository.
"""

import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

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


def test_site_builds_strictly_with_every_public_function(site):
    for module in public_modules():
        html = (site / "reference" / module / "index.html").read_text()
        mod = importlib.import_module(module)
        functions = [
            name
            for name, value in vars(mod).items()
            if not name.startswith("_")
            and (inspect.isfunction(value) or inspect.isclass(value))
            and value.__module__ == module
        ]
        missing = [name for name in functions if f'id="{module}.{name}"' not in html]
        assert not missing, f"{module}: no entry in the API reference for {missing}"


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
