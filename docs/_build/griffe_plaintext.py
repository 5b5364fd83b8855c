"""A griffe extension: dcinterp's docstrings are plain text; make their lists Markdown lists for the API reference.

The docstrings list arguments as `name: text` lines and options as `- item` lines right after a sentence, as one
writes in a terminal. Markdown needs a blank line before a list and reads `name: text` lines as one paragraph, so
the reference would run them together. This rewrites, for rendering only (the source is unchanged):
- a `- item` line that follows a non-list line gets a blank line before it;
- a run of unindented `name: text` lines (lowercase identifiers, e.g. `tokens:` or `n_steps, method:`) becomes a
  list with the names in code;
- lines indented by four spaces right after a sentence (equations, commands) become a code block;
- an unindented sentence right after a list or a code block gets a blank line before it, so that it does not join
  the last item.
Indented lines (code blocks, continuations of an item) are left as they are, and so are Google-style sections
(`Args:`, `Returns:`, `Raises:`, ... and their indented entries), which mkdocstrings renders as tables.
"""

from __future__ import annotations

import re

import griffe

ARGUMENT = re.compile(r"^([a-z_][a-z0-9_]*(?:, [a-z_][a-z0-9_]*)*): (\S.*)$")
BULLET = re.compile(r"^[-*] \S")
SECTION = re.compile(r"^(Args|Arguments|Parameters|Attributes|Returns|Yields|Raises|Warns|Examples?):\s*$")


def markdown_lists(text: str) -> str:
    lines, out, in_list, in_code, in_section = text.split("\n"), [], False, False, False
    for i, line in enumerate(lines):
        if SECTION.match(line):
            in_section, in_list, in_code = True, False, False
        elif in_section and (not line.strip() or line.startswith(" ")):
            pass
        else:
            in_section = False
        if in_section:
            out.append(line)
            continue
        argument = ARGUMENT.match(line)
        starts_item = bool(BULLET.match(line)) or (argument is not None and (in_list or _next_is_argument(lines, i)))
        blank_before = False
        if starts_item:
            blank_before = not in_list
            in_list, in_code = True, False
            if argument is not None and not BULLET.match(line):
                names = ", ".join(f"`{name}`" for name in argument.group(1).split(", "))
                line = f"- {names}: {argument.group(2)}"
        elif not line.strip():
            in_list = False
        elif line.startswith("    ") and not in_list:  # lines set off by indentation: a code block
            blank_before, in_code = not in_code, True
        elif not line.startswith(" ") and (in_list or in_code):  # a sentence after a list or a code block
            blank_before, in_list, in_code = True, False, False
        if blank_before and out and out[-1].strip():
            out.append("")
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


class QuietAttributes(griffe.Extension):
    """Leave out of the reference the class attributes that have no docstring: a dataclass's fields are in its
    signature already, and a module's hook points and weights are in docs/hooks.md. (List this extension after
    griffe's `dataclasses`, which builds the signatures from those attributes.)"""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for cls in _classes(pkg):
            for name, member in list(cls.members.items()):
                if not member.is_alias and member.is_attribute and member.docstring is None:
                    cls.del_member(name)


def _classes(obj: griffe.Object):
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_class:
            yield member
        if member.is_module or member.is_class:
            yield from _classes(member)
