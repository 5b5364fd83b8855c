"""No measurement in dcinterp/'s code, comments or docstrings: they say what and why. Dates, cards, timings and
speed-ups live in benchmarks/results/ and the docs' benchmarks page (docs/benchmarks.md), which names the file behind
each number."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dcinterp"
NUMBER = r"\d(?:[\d,.]*\d)?(?:-\d(?:[\d,.]*\d)?)?"  # 12, 2,048, 0.7, 2.2-3.3
CARDS = r"H100|H200|A100|A10G?|A6000|A5000|L4|L40S?|V100|T4|RTX ?\d{4}|MI\d{3}X?|GH200|B200"
MEASUREMENTS = {
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "a card": re.compile(rf"\b(?:{CARDS})\b"),
    "a timing": re.compile(rf"\b{NUMBER} ?(?:ms|µs|us|ns|sec|seconds?|milliseconds?|minutes?|hours?)\b"),
    "a speed-up": re.compile(
        rf"\b{NUMBER} ?(?:x|times) (?:faster|slower|the time|less time|more time|as fast|as long)\b", re.IGNORECASE
    ),
}


def measurements(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, line) of every measurement in a file's text."""
    return [
        (number, kind, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        for kind, pattern in MEASUREMENTS.items()
        if pattern.search(line)
    ]


def test_the_scan_finds_each_kind():
    text = "on 2026-11-27\non an H100\n0.70 ms against 1.1\n2.2-3.3x faster\n3 µs a block\n"
    assert [kind for _, kind, _ in measurements(text)] == ["a date", "a card", "a timing", "a speed-up", "a timing"]
    shapes = "W [t, 1, s]; expand(-1, -1, s); 4 warps, 2,048 keys; 4 times the queries' bytes; --every 300s or 5m\n"
    assert measurements(shapes) == []


def test_no_measurement_in_the_package():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {kind}: {line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, kind, line in measurements(path.read_text(encoding="utf-8"))
    ]
    assert not found, "measurements belong in benchmarks/results and docs/benchmarks.md:\n" + "\n".join(found)
