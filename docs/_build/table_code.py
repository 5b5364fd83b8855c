"""A MkDocs hook: inline code in a table cell breaks between its words, never inside one.

A browser may end a line after any hyphen, and Material lets code break anywhere when a column is narrow, so a
cell showed `model_ty` / `pe` or `--d-` / `model 64`. Each space-free run of a cell's inline code is wrapped in
`<span class="nowrap">` (styled in stylesheets/extra.css); the text, and what a reader copies, is unchanged.
"""

import re

CELL = re.compile(r"(<t[dh]\b[^>]*>)(.*?)(</t[dh]>)", re.DOTALL)
INLINE_CODE = re.compile(r"<code>([^<]*)</code>")  # inline code holds text only; block code sits in <pre>
WORD = re.compile(r"\S+")


def keep_words_whole(code: re.Match) -> str:
    return "<code>" + WORD.sub(lambda word: f'<span class="nowrap">{word.group(0)}</span>', code.group(1)) + "</code>"


def on_page_content(html: str, **kwargs) -> str:
    return CELL.sub(lambda cell: cell.group(1) + INLINE_CODE.sub(keep_words_whole, cell.group(2)) + cell.group(3), html)
