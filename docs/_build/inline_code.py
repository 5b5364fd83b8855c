"""A MkDocs hook: inline code breaks between its words, never inside one.

A browser may end a line after any hyphen, and Material lets code break anywhere where a column is narrow, so a
table cell showed `model_ty` / `pe` and a paragraph `-` / `p twin_checkpoint`. Each space-free run of inline code is
wrapped in `<span class="nowrap">` (styled in stylesheets/extra.css); the text, and what a reader copies, is
unchanged. Code blocks are left alone: they keep their lines and scroll.
"""

import re

INLINE_CODE = re.compile(r"<code>([^<]*)</code>")  # inline code holds text only; a code block's is highlighted
WORD = re.compile(r"\S+")


def keep_words_whole(code: re.Match) -> str:
    return "<code>" + WORD.sub(lambda word: f'<span class="nowrap">{word.group(0)}</span>', code.group(1)) + "</code>"


def on_page_content(html: str, **kwargs) -> str:
    return INLINE_CODE.sub(keep_words_whole, html)
