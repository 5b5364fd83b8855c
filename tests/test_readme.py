"""The README stays short, and its Python example runs as written."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move the details into a page under docs/"


def test_readme_links_point_to_files():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [target for target in targets if "://" not in target]
    assert local, "the README links into the docs"
    missing = [target for target in local if not (README.parent / target).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_example_runs():
    blocks = python_blocks(README.read_text())
    assert len(blocks) == 1, "README.md should hold exactly one Python example"
    example = blocks[0]
    assert len(example.strip().splitlines()) <= 12, "the README example is meant to stay about ten lines"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, str(README), "exec"), {"__name__": "readme_example"})
    printed = out.getvalue()
    # What the example promises: the branch matters for the answer, and the attribution adds up.
    p_food, p_without = map(float, re.search(r"p\(food\) ([\d.]+), without .*: ([\d.]+)", printed).groups())
    assert p_food > 0.9 and p_without < p_food
    assert printed.count("HeadAttribution(") == 1
