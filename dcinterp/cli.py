"""What the command lines share: a parser whose errors are one line, the check that an output can be written, and
the one line that says a GPU ran out of memory.

Light on purpose (no torch, no transformer_lens), so that parsing arguments and `--help` stay fast.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr ("PROG: error: ...", exit 2), without the usage block.

    `--help` still shows the usage. Subcommands made with `add_subparsers().add_parser` share the behaviour.
    """

    def error(self, message: str):
        """Exit 2 with one line, "PROG: error: MESSAGE".

        Args:
            message: the error.
        """
        self.exit(2, f"{self.prog}: error: {message}\n")


def nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else its closest ancestor that does.

    Args:
        path: a path.

    Returns:
        The existing path.
    """
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(directory: Path, option: str) -> None:
    """Check that `directory` is, or can be created as, a writable directory.

    Creates nothing: the check writes and removes a temporary file in the closest existing ancestor.

    Args:
        directory: the folder.
        option: the option named in the error.

    Raises:
        ValueError: one line naming `option`.
    """
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{option} {directory}: exists and is not a directory")
    _check_can_create_in(directory, option, directory)


def check_writable_file(path: Path, option: str) -> None:
    """Check that a file can be written at `path` (its folder may be created).

    Args:
        path: the file.
        option: the option named in the error.

    Raises:
        ValueError: one line naming `option`.
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
    """torch's account of a GPU that ran out of memory in one line, with the remedies.

    Its first three sentences (what was asked, the card's capacity, what was free), not the allocator's advice that
    follows.

    Args:
        message: torch's error message.
        remedies: what to try, each a phrase.

    Returns:
        The line.
    """
    account = ". ".join(" ".join(message.split()).split(". ")[:3]).rstrip(".")
    return f"{account}; try {', or '.join(remedies)}" if remedies else account
