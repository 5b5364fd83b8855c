"""The released file format: JSON lines of {"task_id": "taskN", "texts": "..."}.

``texts`` is ``"\\n" + "\\n".join(lines) + "\\n"``; the first PLAIN_LINES lines end with their
answer written plain, every later line ends with `` [ answer ]``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

LINES_PER_SAMPLE = 8
PLAIN_LINES = 2
RECORD_KEYS = ("task_id", "texts")

_BRACKETED_ANSWER = re.compile(r"\[ ([^\[\]\n]+?) \]")


class DatasetError(ValueError):
    """A dataset file cannot be read; the message names the file and line."""


def join_lines(lines: list[str]) -> str:
    """The texts field of a record from its lines.

    Args:
        lines: the sample's lines, without newlines.

    Returns:
        The lines joined by newlines, with one newline before the first and after the last.
    """
    return "\n" + "\n".join(lines) + "\n"


def sample_lines(texts: str) -> list[str]:
    """The lines of a texts field, without its framing newlines.

    Args:
        texts: a record's texts field.

    Returns:
        Its lines, in order.
    """
    return texts.removeprefix("\n").removesuffix("\n").split("\n")


def bracket(answer: str) -> str:
    """An answer as a bracketed line writes it.

    Args:
        answer: the answer's text.

    Returns:
        `[ answer ]`.
    """
    return f"[ {answer} ]"


def unbracket(texts: str) -> tuple[str, list[tuple[int, int, str, int]]]:
    """Removes the answer brackets of a texts field.

    The plain text is what ``texts.replace("[ ", "").replace(" ]", "")`` gives for well-formed texts.

    Args:
        texts: a record's texts field.

    Returns:
        The plain text and, per answer, (start, end, answer, k_shot) with `plain_text[start:end] == answer` and k_shot
        the number of lines before the answer's line (2..7 for lines 3..8).

    Raises:
        ValueError: a stray or unclosed bracket, naming its text line.
    """
    leading_newline = 1 if texts.startswith("\n") else 0
    pieces: list[str] = []
    spans: list[tuple[int, int, str, int]] = []
    plain_length = 0
    cursor = 0
    for match in _BRACKETED_ANSWER.finditer(texts):
        before = texts[cursor : match.start()]
        _reject_stray_brackets(before, texts, cursor)
        answer = match.group(1)
        start = plain_length + len(before)
        spans.append((start, start + len(answer), answer, texts.count("\n", 0, match.start()) - leading_newline))
        pieces += [before, answer]
        plain_length = start + len(answer)
        cursor = match.end()
    _reject_stray_brackets(texts[cursor:], texts, cursor)
    pieces.append(texts[cursor:])
    return "".join(pieces), spans


def _reject_stray_brackets(piece: str, texts: str, offset: int) -> None:
    stray = re.search(r"[\[\]]", piece)
    if stray:
        line_number = texts.count("\n", 0, offset + stray.start()) + (0 if texts.startswith("\n") else 1)
        raise ValueError(f"text line {line_number}: {stray.group()!r} is not part of a '[ answer ]'")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Reads a dataset file.

    Args:
        path: a JSON-lines file of {"task_id", "texts"} records.

    Returns:
        The records, in file order.

    Raises:
        DatasetError: the file cannot be read, is empty, or a line is not such a record; the message names the file
            and line of the first problem.
    """
    try:
        raw_lines = Path(path).read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{path}: cannot read: {getattr(error, 'strerror', None) or error}") from error
    if raw_lines[-1] == "":
        raw_lines.pop()  # the newline that ends the last record
    if not raw_lines:
        raise DatasetError(f"{path}: no records")
    return [_parse_record(raw, path, number) for number, raw in enumerate(raw_lines, 1)]


def _parse_record(raw: str, path: str | os.PathLike, number: int) -> dict:
    where = f"{path}: line {number}"
    if not raw.strip():
        raise DatasetError(f"{where}: empty line")
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as error:
        raise DatasetError(f"{where}: invalid JSON ({error.msg} at column {error.colno})") from error
    if not isinstance(record, dict) or any(not isinstance(record.get(key), str) for key in RECORD_KEYS):
        raise DatasetError(f"{where}: expected an object with string fields 'task_id' and 'texts'")
    return record


def write_jsonl(records: list[dict], path: str | os.PathLike) -> None:
    """Writes records in the released style; the file appears complete or not at all.

    Args:
        records: dicts with "task_id" and "texts" (other keys are left out).
        path: the file to write, replaced if it exists.

    Raises:
        DatasetError: the file cannot be written.
    """
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "x", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps({key: record[key] for key in RECORD_KEYS}) + "\n")
        os.replace(partial, path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise DatasetError(f"{path}: cannot write: {error.strerror or error}") from error
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
