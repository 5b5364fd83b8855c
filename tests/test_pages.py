"""The README and the pages under docs/ say what is true today: no commit hash, no word of how the project is run,
a README table of one-sentence cells, and every number beside a `benchmarks/results/` file is in that file.

A page cites a run by naming its file, `benchmarks/results/NAME` (or, in a table, the file's name alone as code), in
a paragraph, a list item or a table row: every number with a decimal point in that block (outside inline code) must
be one of the file's numbers, as written or rounded to the page's decimals (1.848 in the file reads 1.85 on the
page).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.DOTALL | re.MULTILINE)
INDENTED_CODE = re.compile(r"(?:^\n)((?: {4}.*\n)+)", flags=re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
HEX_WORD = re.compile(r"(?<![\w.#/-])[0-9a-f]{7,40}(?![\w/-])")
PROJECT_WORDS = re.compile(r"\bissues?\s*#?\d+|\bthe issue's|(?<![\w&])#\d+\b|\bissue's aims?\b", flags=re.IGNORECASE)
CITATION = re.compile(r"benchmarks/results/([\w.-]+)|(?<=[|,;] `)([\w.-]+\.(?:md|txt|jsonl|json|csv))`")
DECIMAL = re.compile(r"(?<![\w.])\d[\d,]*\.(\d+)(?:[eE]([-+]?\d+))?")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def prose(text: str) -> str:
    """The page without its code blocks (fenced or indented) or inline code: what a reader reads as words."""
    text = FENCE.sub("", text)
    text = INDENTED_CODE.sub("\n", text)
    return INLINE_CODE.sub("", text)


def blocks(text: str) -> list[str]:
    """Paragraphs, list items and table rows, each one string."""
    found = []
    for paragraph in re.split(r"\n\s*\n", FENCE.sub("", text)):
        lines = paragraph.splitlines()
        if lines and lines[0].lstrip().startswith("|"):
            found += lines
        else:
            found += re.split(r"\n(?=\s*(?:[-*]|\d+\.)\s)", paragraph)
    return found


def is_commit_hash(word: str) -> bool:
    return bool(re.search(r"\d", word)) and bool(re.search(r"[a-f]", word))


def hashes(text: str) -> list[str]:
    return [word for word in HEX_WORD.findall(prose(text)) if is_commit_hash(word)]


def file_numbers(path: Path) -> list[float]:
    return [float(n.replace(",", "")) for n in NUMBER.findall(path.read_text(encoding="utf-8", errors="replace"))]


def citations(block: str) -> list[str]:
    """The results files a block names: by path anywhere, by name alone as a table cell's code (where a file of
    that name is in benchmarks/results/)."""
    return [path or name for path, name in CITATION.findall(block) if path or (RESULTS / name).is_file()]


def unbacked(block: str) -> list[str]:
    """The decimal numbers of a block that cites results files and that none of those files holds."""
    names = citations(block)
    if not names:
        return []
    numbers = [n for name in names for n in file_numbers(RESULTS / name)]
    words = LINK_TARGET.sub("]", INLINE_CODE.sub("", block))
    missing = []
    for match in DECIMAL.finditer(words):
        written, decimals, exponent = match.group(0), match.group(1), int(match.group(2) or 0)
        value = float(written.replace(",", ""))
        half_unit = 0.5 * 10 ** (exponent - len(decimals))  # 2.41e-06: within 0.005e-06
        if not any(abs(abs(n) - value) <= half_unit + 1e-12 * value for n in numbers):  # a page's sign is a word apart
            missing.append(written)
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_commit_hash(page):
    found = hashes(page.read_text())
    assert not found, f"{page.name}: commit hashes {found}; a page says what is true today, CHANGELOG.md what changed"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_word_of_how_the_project_is_run(page):
    found = PROJECT_WORDS.findall(prose(page.read_text()))
    assert not found, f"{page.name}: {found}: say what the code does, not which issue asked for it"


def test_readme_table_cells_are_a_sentence():
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("|")]
    assert len(rows) > 5, "the README's table of where things are"
    long = []
    for row in rows:
        for cell in re.split(r"(?<!\\)\|", row)[1:-1]:
            words = len(LINK_TARGET.sub("]", cell).split())
            if words > 35:
                long.append(f"{words} words: {cell.strip()[:80]}")
    assert not long, "README cells over 35 words (one sentence and a link):\n" + "\n".join(long)


def test_numbers_beside_a_results_file_are_in_it():
    cited, problems = 0, []
    for page in PAGES:
        for block in blocks(page.read_text()):
            for name in citations(block):
                cited += 1
                if not (RESULTS / name).is_file():
                    problems.append(f"{page.name}: cites benchmarks/results/{name}, which does not exist")
            if all((RESULTS / name).is_file() for name in citations(block)):
                missing = unbacked(block)
                if missing:
                    problems.append(f"{page.name}: {missing} are not in the file it cites: {block.strip()[:100]}")
    assert cited >= 5, "the docs cite the results files behind their numbers"
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_are_for():
    table = "benchmarks/results/h100-2026-11-27-bench_gpu_dcmha-table.md"
    assert unbacked(f"| forward | 1.70x, 3.22x the twin | `{table}` |") == []
    assert unbacked(f"| forward | 1.71x the twin | `{table}` |") == ["1.71"]
    assert unbacked("| forward | 1.71x the twin | `h100-2026-11-27-bench_gpu_dcmha-table.md` |") == ["1.71"]
    assert unbacked(f"| forward | 1.848 ms, 1.85 ms | `{table}` |") != []  # not in that file
    assert hashes("fixed in 5d59802 (see `af1e665`)\n\n```\nbad9033\n```\n") == ["5d59802"]
    assert hashes("2,048 tokens, 0.66-1.04x, deadbeef, 20261127") == []
    assert PROJECT_WORDS.findall("as issue #38 asked, the issue's aims") and not PROJECT_WORDS.findall(
        "a first session"
    )
