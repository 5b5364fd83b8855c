"""A griffe extension: dcinterp's docstrings are plain text; make their lists Markdown lists for the API reference.

The docstrings list arguments as `name: text` lines and options as `- item` lines right after a sentence, as one
writes in a terminal. Markdown needs a blank line before a list and reads `name: text` lines as one paragraph, so
the reference would run them together. This rewrites, for rendering only (the source is unchanged):
- a `- item` line that follows a non-list line gets a blank line before it;
- a run of unindented `name: text` lines (lowercase identifiers, e.g. `tokens:` or `n_steps, method:`) becomes a
  list with the names in code;
- an unindented sentence right after a list gets a blank line before it, so that it does not join the last item.
Indented lines (code blocks, continuations of an item) are left as they are.
"""

from __future__ import annotations

import re

import griffe

ARGUMENT = re.compile(r"^([a-z_][a-z0-9_]*(?:, [a-z_][a-z0-9_]*)*): (\S.*)$")
BULLET = re.compile(r"^[-*] \S")


def markdown_lists(text: str) -> str:
    lines, out, in_list = text.split("\n"), [], False
    for i, line in enumerate(lines):
        argument = ARGUMENT.match(line)
        starts_item = bool(BULLET.match(line)) or (argument is not None and (in_list or _next_is_argument(lines, i)))
        if starts_item:
            if not in_list and out and out[-1].strip():
                out.append("")
            in_list = True
            if argument is not None and not BULLET.match(line):
                names = ", ".join(f"`{name}`" for name in argument.group(1).split(", "))
                line = f"- {names}: {argument.group(2)}"
        elif not line.strip():
            in_list = False
        elif in_list and not line.startswith(" "):  # a sentence after the list: end the list first
            out.append("")
            in_list = False
        out.append(line)
    return "\n".join(out)


def _next_is_argument(lines: list[str], i: int) -> bool:
    """An argument line starts a list only if another argument line follows before the next blank line."""
    for line in lines[i + 1 :]:
        if not line.strip():
            return False
        if ARGUMENT.match(line):
            return True
    return False


class PlainTextLists(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_lists(obj.docstring.value)
