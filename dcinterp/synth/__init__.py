"""The synthetic in-context-learning tasks of DCFormer (Xiao et al. ICML 2024, Sec 4.3 / App. F).

``generate()`` draws fresh samples of the 74 tasks in the format of the released
``synthetic_dataset.jsonl``, ``check_records()`` validates records against the task
catalog, and ``unbracket()`` locates the scored answers.  Command line:
``python -m dcinterp.synth generate --seed 0 --out FILE.jsonl`` and
``python -m dcinterp.synth check FILE.jsonl``.
``contrast_pairs()`` makes clean/corrupted prompt pairs of a task for activation patching.

The dataset lives here: ``catalog`` (the tasks), ``generator`` (``generate()`` and the samplers), ``records`` (the
JSON-lines format), ``check`` and ``contrast``. Scoring a model on it: ``evaluate`` and ``accuracy``. The commands
that run models on it (``eval``, ``ablate``, ``circuit``, ``qk``, ``attribute``): ``dcinterp.synth.commands``.
"""

from .catalog import (
    Catalog,
    CatalogError,
    ItemPool,
    Lexicon,
    ObjectEntry,
    OrdinalDomain,
    Phrasing,
    Syntax,
    Task,
    data_dir,
    load_catalog,
    load_lexicon,
)
from .check import check_records
from .contrast import ContrastPair, PairTokens, contrast_pairs, tokenize_pairs
from .generator import generate
from .records import DatasetError, read_jsonl, sample_lines, unbracket, write_jsonl

__all__ = [
    "Catalog",
    "CatalogError",
    "ContrastPair",
    "DatasetError",
    "ItemPool",
    "Lexicon",
    "ObjectEntry",
    "OrdinalDomain",
    "PairTokens",
    "Phrasing",
    "Syntax",
    "Task",
    "check_records",
    "contrast_pairs",
    "data_dir",
    "generate",
    "load_catalog",
    "load_lexicon",
    "read_jsonl",
    "sample_lines",
    "tokenize_pairs",
    "unbracket",
    "write_jsonl",
]
