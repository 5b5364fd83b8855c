"""A word-level tokenizer for the DCFormer synthetic tasks, built with the `tokenizers` library.

Pre-tokenisation: "\\n" is its own token, every run of letters/digits is a word, and every other
non-space character is its own token (`Washington, D.C` -> Washington , D . C; `o'clock` -> o ' clock;
`Ruth's` -> Ruth ' s). Spaces are dropped; offsets point into the original text, so answers can be found
by character offsets. The vocabulary is every word of the lexicon (`synthetic_tasks/lexicon.json`), of the
task templates (`synthetic_tasks/catalog.json`), of the knowledge sentences the training corpus adds, the
punctuation, the digits and years, plus `[UNK]`, `[PAD]`, `[BOS]`, `[EOS]` (never added automatically).

    from dcinterp.tokenizer import build_tokenizer
    tok = build_tokenizer()          # a transformers.PreTrainedTokenizerFast
    tok("\\n< Ruth has a cat. >.")["input_ids"]
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

from .synth import data_dir, read_jsonl

SPECIAL_TOKENS = ("[UNK]", "[PAD]", "[BOS]", "[EOS]")
# One token: a newline, a run of word characters, or one other non-space character.
TOKEN_PATTERN = r"\n|\w+|[^\w\s]"
_TOKEN_RE = re.compile(TOKEN_PATTERN)


def split_words(text: str) -> list[str]:
    """The pre-tokenisation in Python (the same regex the tokenizer uses).

    Args:
        text: the text.

    Returns:
        Its words and punctuation.
    """
    return _TOKEN_RE.findall(text)


# Words the training corpus's knowledge sentences use (see dcinterp.train.knowledge_sentences), and a few
# generic template words, so that every corpus sentence tokenizes without [UNK].
EXTRA_WORDS = (
    "A An a an is are the The of kind city in can opposite just before after year month day season time "
    "There Which not different Who does did has have owns own possesses possess likes attracts arrived "
    "thing that to go visit want wants long longs yearn yearns for showed show up appeared appear arrive "
    "on at In On At o clock"
)


def lexicon_words(directory: Path | None = None) -> set[str]:
    """Every word of the lexicon and the catalog's templates (split as the tokenizer splits).

    Args:
        directory: the synthetic dataset's folder (None: the package's).

    Returns:
        The words.
    """
    directory = Path(directory) if directory is not None else data_dir()
    texts: list[str] = []

    def walk(value) -> None:
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                texts.append(str(k))
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    lexicon = json.loads((directory / "lexicon.json").read_text())
    catalog = json.loads((directory / "catalog.json").read_text())
    walk({k: v for k, v in lexicon.items() if k != "about"})
    walk({k: v for k, v in catalog.items() if k != "about"})
    texts.append(EXTRA_WORDS)
    words: set[str] = set()
    for text in texts:
        # capitalised forms are used sentence-initially (ADJ-FIRST, PREP-FIRST, "The X is")
        for w in split_words(text):
            if w.startswith("{") or w.startswith("}"):
                continue
            words.add(w)
            words.add(w[:1].upper() + w[1:])
    # template slot names such as {person} are not words
    words -= {
        "person",
        "Person",
        "item",
        "Item",
        "value",
        "Value",
        "unit",
        "Unit",
        "facts",
        "Facts",
        "question",
        "Question",
        "answer",
        "Answer",
        "has_form",
        "possessive_form",
        "capitalized",
        "capitalized_preposition",
        "preposition",
    } - set(split_words(EXTRA_WORDS))
    return words


def build_vocab(directory: Path | None = None, extra_texts=()) -> list[str]:
    """The sorted vocabulary (special tokens first), deterministic for a given lexicon.

    Args:
        directory: the synthetic dataset's folder (None: the package's).
        extra_texts: more texts whose words join the vocabulary.

    Returns:
        The vocabulary.
    """
    words = lexicon_words(directory)
    words |= set(string.punctuation)
    words |= set(string.digits)
    words |= {str(n) for n in range(0, 101)}  # clock times, counts
    words |= {str(y) for y in range(1990, 2041)}  # years
    words.add("\n")
    for text in extra_texts:
        words.update(split_words(text))
    words -= set(SPECIAL_TOKENS)
    return [*SPECIAL_TOKENS, *sorted(words)]


def build_tokenizer(directory: Path | None = None, extra_texts=()):
    """The word-level tokenizer wrapped as a `transformers.PreTrainedTokenizerFast`.

    Args:
        directory: the synthetic dataset's folder (None: the package's).
        extra_texts: more texts whose words join the vocabulary.

    Returns:
        The tokenizer.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = build_vocab(directory, extra_texts)
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),  # drop spaces, keep "\n"
            pre_tokenizers.Split(Regex(TOKEN_PATTERN), behavior="isolated"),
        ]
    )
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=4096,
    )


def released_texts(directory: Path | None = None) -> list[str]:
    """The `texts` of the released synthetic_dataset.jsonl, bracketed as released.

    Args:
        directory: the synthetic dataset's folder (None: the package's).

    Returns:
        The texts.
    """
    directory = Path(directory) if directory is not None else data_dir()
    return [record["texts"] for record in read_jsonl(directory / "synthetic_dataset.jsonl")]


def unknown_words(tokenizer, texts) -> dict[str, int]:
    """Pieces of `texts` that map to [UNK], with counts (empty when the tokenizer covers them).

    Args:
        tokenizer: a Hugging Face tokenizer.
        texts: a string or several.

    Returns:
        {piece: count}.
    """
    unk = tokenizer.unk_token_id
    found: dict[str, int] = {}
    for text in texts:
        enc = tokenizer(text, return_offsets_mapping=True)
        for tid, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
            if tid == unk:
                found[text[a:b]] = found.get(text[a:b], 0) + 1
    return found


def check_vocabulary(tokenizer, texts, name: str = "text") -> None:
    """Refuse words that the tokenizer maps to its unknown token, instead of letting them silently become [UNK].

    Byte-level BPE tokenizers have none: always passes.

    Args:
        tokenizer: a Hugging Face tokenizer.
        texts: a string or several.
        name: the argument named in the error.

    Raises:
        ValueError: naming the unknown words.
    """
    if tokenizer.unk_token_id is None:
        return
    unknown = unknown_words(tokenizer, [texts] if isinstance(texts, str) else texts)
    if unknown:
        words = ", ".join(repr(word) for word in sorted(unknown))
        raise ValueError(f"{name}: not in the tokenizer's vocabulary (would become {tokenizer.unk_token}): {words}")
