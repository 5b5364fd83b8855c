"""What the command lines share: a parser whose errors are one line, the argument types (`positive_int`,
`non_negative_int`, `fraction`), the check that an output can be written, and the one line that says a GPU ran out
of memory.

Light on purpose (no torch, no transformer_lens), so that parsing arguments and `--help` stay fast.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr ("PROG: error: ...", exit 2), without the usage block;
    `--help` still shows the usage. Subcommands made with `add_subparsers().add_parser` share the behaviour."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def nearest_existing(path: Path) -> Path:
    """The closest existing path at or above a path.

    Args:
        path: Any path.

    Returns:
        `path` itself if it exists, else its closest ancestor that does.
    """
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(directory: Path, option: str) -> None:
    """Check that a directory is, or can be created as, a writable directory.

    Creates nothing: the check writes and removes a temporary file in the closest existing ancestor.

    Args:
        directory: The directory an option names.
        option: The option's name (e.g. "--out"), in the error.

    Raises:
        ValueError: One line naming the option, the directory and why not.
    """
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{option} {directory}: exists and is not a directory")
    _check_can_create_in(directory, option, directory)


def check_writable_file(path: Path, option: str) -> None:
    """Check that a file can be written at a path (its folder may be created).

    Args:
        path: The file an option names.
        option: The option's name (e.g. "--out"), in the error.

    Raises:
        ValueError: One line naming the option, the path and why not.
    """
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a directory, not a file")
    _check_can_create_in(path.parent, option, path)


def _check_can_create_in(directory: Path, option: str, named: Path) -> None:
    existing = nearest_existing(directory)
    if not existing.is_dir():
        raise ValueError(f"{option} {named}: {existing} is a file, not a directory")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        raise ValueError(f"{option} {named}: cannot write in {existing} ({error.strerror or error})") from None


def out_of_memory_line(message: str, remedies: list[str]) -> str:
    """torch's account of a GPU that ran out of memory, in one line.

    Args:
        message: The OutOfMemoryError's message.
        remedies: The options that would hold less, as the command spells them.

    Returns:
        The message's first three sentences (what was asked, the card's capacity, what was free; not the
        allocator's advice that follows), then the remedies, if any.
    """
    account = ". ".join(" ".join(message.split()).split(". ")[:3]).rstrip(".")
    return f"{account}; try {', or '.join(remedies)}" if remedies else account


# --------------------------------------------------------------------------------------------------
# Argument types shared by every command (argparse's `type=`)
def positive_int(text: str) -> int:
    """An integer of at least 1, as argparse reads an option's value.

    Args:
        text: The value as typed.

    Returns:
        The integer.

    Raises:
        argparse.ArgumentTypeError: Not an integer, or below 1 (argparse prints the one line and exits 2).
    """
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An integer of at least 0, as argparse reads an option's value.

    Args:
        text: The value as typed.

    Returns:
        The integer.

    Raises:
        argparse.ArgumentTypeError: Not an integer, or below 0 (argparse prints the one line and exits 2).
    """
    return _int_at_least(text, 0, "an integer >= 0")


def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, not {text!r}")
    return value


def fraction(text: str) -> float:
    """A number from 0 to 1, as argparse reads an option's value (a threshold, a probability).

    Args:
        text: The value as typed.

    Returns:
        The number.

    Raises:
        argparse.ArgumentTypeError: Not a number, or outside [0, 1] (argparse prints the one line and exits 2).
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, not {text!r}")
    return value
