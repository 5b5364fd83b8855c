"""The training data: an endless stream of synthetic-task samples, and the batches made of them.

Training samples come from the synthetic-task generator (`dcinterp.synth.generator`) with generation seeds
`1000 + 100000 * seed + k` (k = 0, 1, ...), disjoint from the evaluation seeds (0..999) and from the released
file. Each sample is unbracketed (the answers of lines 3-8 are written plain, as the evaluator feeds them) and is
row-aligned: a training row starts with the sample at position 0, exactly as at evaluation, and the rest of the
row, up to the batch's padded length, is filled with knowledge sentences that state the relations the tasks need
("The banana is a kind of fruit.", "Paris is the city in France.", "The opposite of happy is sad.", "2014 is the
year just before 2015.", ...). With row filling there is no padding to mask. The loss (`dcinterp.train.loop`)
weights the answer tokens, which `Batcher` marks: with the plain loss the answers are a small share of the tokens
and the random persons and items of the facts dominate the gradient (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..synth import data_dir, generate, load_catalog, unbracket
from .recipe import TRAIN_SEED_BASE, TrainConfig, tasks_at

if TYPE_CHECKING:
    import torch


def knowledge_sentences() -> list[str]:
    """Plain sentences stating the relations the tasks use: superclass, capability, country, opposite, order.

    Returns:
        The sentences, from the lexicon, in its order ("The banana is a kind of fruit.", ...).
    """
    lex = json.loads((data_dir() / "lexicon.json").read_text())
    out = []
    for name, obj in lex["objects"].items():
        if obj.get("superclass"):
            out.append(f"The {name} is a kind of {obj['superclass']}.")
        if obj.get("capability"):
            out.append(f"The {name} is the thing that can {obj['capability']}.")
    for country, cities in lex["countries"].items():
        for city in cities:
            out.append(f"{city} is the city in {country}.")
    for a, b in lex["adjective_opposites"]:
        out.append(f"The opposite of {a} is {b}.")
        out.append(f"The opposite of {b} is {a}.")
    for domain in lex["ordinal_domains"]:
        seq, unit = domain["sequence"], domain["unit"]
        for x, y in zip(seq, seq[1:], strict=False):
            out.append(f"{x} is the {unit} just before {y}.")
            out.append(f"{y} is the {unit} just after {x}.")
    return out


def unbracket_spans(text: str) -> tuple[str, list[tuple[int, int]]]:
    """A sample as the model reads it, and where its answers are.

    Args:
        text: A generated sample's text, its answers written `[ answer ]`.

    Returns:
        (the text with each answer written plain, the answers' (start, end) character spans in it).
    """
    plain, spans = unbracket(text)
    return plain, [(a, b) for a, b, *_ in spans]


def unbracket_text(text: str) -> str:
    """A sample as the model reads it, its answers written plain.

    Args:
        text: A generated sample's text, its answers written `[ answer ]`.

    Returns:
        The text.
    """
    return unbracket_spans(text)[0]


def compact_catalog(catalog):
    """The catalog with every context fact written bare, in the order of the task's own syntax.

    "Ruth has a cat." -> "Ruth cat.", "The cat is Ruth's." -> "cat Ruth.": `{person} {item}.` or `{item} {person}.`;
    the lines, queries and answers are the same.

    Args:
        catalog: The task catalog.

    Returns:
        A copy with the compact facts.
    """

    def compact(syntax):
        if syntax.shape.name != "context":
            return syntax
        person_first = syntax.fact.index("{person}") < syntax.fact.index("{item")
        return dataclasses.replace(syntax, fact="{person} {item}." if person_first else "{item} {person}.")

    tasks = {task_id: dataclasses.replace(task, syntax=compact(task.syntax)) for task_id, task in catalog.tasks.items()}
    return dataclasses.replace(catalog, tasks=tasks)


def compact_share_at(step: int, cfg: TrainConfig) -> float:
    """The probability that a training sample is written with compact facts.

    1 until `compact_hold` of the steps, then falling linearly to 0 at `compact_until` of the steps.

    Args:
        step: The training step.
        cfg: The run's recipe; `compact_until` 0 turns the curriculum off.

    Returns:
        The probability.
    """
    hold, end = cfg.compact_hold * cfg.steps, cfg.compact_until * cfg.steps
    if end <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - (step - hold) / (end - hold))) if end > hold else float(step < end)


class SampleStream:
    """(unbracketed sample, answer spans) forever: generator seeds 1000 + 100000 * seed + k, chunks shuffled.

    Each sample is written with compact facts with probability `compact_share()` (the same lines, see
    `compact_catalog`), else in the released format. A chunk (one generation seed) is drawn when the previous one
    is used up, of the tasks `tasks_at(step(), cfg, task_ids)`. Where the stream stands is `state_dict()`: the next
    generation seed and the samples of the current chunk not yet drawn; `rng` is the caller's and saved by it.

    Args:
        cfg: The run's recipe (seed, samples_per_task, lines and the curricula).
        task_ids: The training tasks; None for all the catalog's.
        rng: The data's random generator: which samples are compact, and the order within a chunk.
        compact_share: The current probability of a compact sample.
        focus: Without `step`: whether the first focus phase is on (the focus tasks) or over (`task_ids`).
        step: The training step under way, for `tasks_at`.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        task_ids: list[str] | None,
        rng: random.Random,
        compact_share: Callable[[], float] = lambda: 0.0,
        focus: Callable[[], bool] = lambda: False,
        step: Callable[[], int] | None = None,
    ):
        self.cfg, self.task_ids, self.rng = cfg, task_ids, rng
        self.compact_share = compact_share
        self.step = step if step is not None else lambda: 0 if focus() else cfg.steps
        self.released, self.compact = load_catalog(), None
        self.next_chunk = 0  # k of the next generation seed
        self.pending: list[tuple[str, list[tuple[int, int]]]] = []  # the current chunk, last to draw first

    def __iter__(self) -> SampleStream:
        return self

    def __next__(self) -> tuple[str, list[tuple[int, int]]]:
        if not self.pending:
            self.pending = self._chunk()[::-1]
            self.next_chunk += 1
        return self.pending.pop()

    def _chunk(self) -> list[tuple[str, list[tuple[int, int]]]]:
        cfg = self.cfg
        seed = TRAIN_SEED_BASE + 100_000 * cfg.seed + self.next_chunk
        ids = tasks_at(self.step(), cfg, self.task_ids)
        records = generate(seed, cfg.samples_per_task, ids, lines=cfg.lines, catalog=self.released)
        if self.compact_share() > 0:
            self.compact = self.compact or compact_catalog(self.released)
            short = generate(seed, cfg.samples_per_task, ids, lines=cfg.lines, catalog=self.compact)
            records = [
                s if self.rng.random() < self.compact_share() else r for r, s in zip(records, short, strict=True)
            ]
        texts = [unbracket_spans(r["texts"]) for r in records]
        self.rng.shuffle(texts)
        return texts

    def state_dict(self) -> dict:
        """Where the stream stands, as a checkpoint stores it.

        Returns:
            Plain lists and numbers (no tensors), for `load_state_dict`.
        """
        return {"next_chunk": self.next_chunk, "pending": list(self.pending)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from where `state_dict` said the stream stood.

        Args:
            state: A `state_dict()`, as a checkpoint returns it.
        """
        self.next_chunk = state["next_chunk"]
        self.pending = [(text, [tuple(span) for span in spans]) for text, spans in state["pending"]]


class Batcher:
    """Batches of rows: one sample at position 0, then knowledge sentences filling up to the batch's padded length.

    Samples are grouped by length (`bucket_batches` batches at a time), so a batch is about as long as its
    samples: attention (and DCMHA's composition) costs grow with the square of the length. Each batch is
    (tokens [batch, pos], answer mask [batch, pos]: the token is an answer token). Where the batcher stands is
    `state_dict()`.

    Args:
        tokenizer: The word-level tokenizer.
        samples: Samples, each a text or (text, answer spans), e.g. a `SampleStream`.
        cfg: The run's recipe (batch_size, bucket_batches, pad_multiple, n_ctx).
        rng: The data's random generator: the order of the batches and of the knowledge sentences.
    """

    def __init__(self, tokenizer, samples: Iterable[str], cfg: TrainConfig, rng: random.Random):
        self.tok, self.samples, self.cfg, self.rng = tokenizer, iter(samples), cfg, rng
        self.knowledge = [self.tok(s + "\n")["input_ids"] for s in knowledge_sentences()]
        self.order: list[int] = []  # knowledge sentences still to use in this cycle, last first
        self.pending: list[list[tuple[list[int], list[bool]]]] = []  # encoded batches still to return, last first

    def _knowledge_ids(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if not self.order:
                self.order = list(range(len(self.knowledge)))
                self.rng.shuffle(self.order)
            out.extend(self.knowledge[self.order.pop()])
        return out[:n]

    def _refill(self) -> None:
        """Draw `bucket_batches` batches' worth of samples, group them by length, shuffle the batch order."""
        B = self.cfg.batch_size
        pool = [self._encode(next(self.samples)) for _ in range(B * max(1, self.cfg.bucket_batches))]
        pool.sort(key=lambda r: len(r[0]))
        batches = [pool[i : i + B] for i in range(0, len(pool), B)]
        self.rng.shuffle(batches)
        self.pending = batches

    def _encode(self, sample) -> tuple[list[int], list[bool]]:
        """Token ids and, per token, whether it belongs to an answer (lines 3-8)."""
        text, spans = (sample, []) if isinstance(sample, str) else sample
        enc = self.tok(text, return_offsets_mapping=True)
        answer = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
        return enc["input_ids"], answer

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [batch, pos], answer mask [batch, pos]: the token is an answer token)."""
        import torch

        if not self.pending:
            self._refill()
        rows = self.pending.pop()
        m = self.cfg.pad_multiple
        width = min(self.cfg.n_ctx, -(-max(len(r[0]) for r in rows) // m) * m)
        ids = [r[0][:width] + self._knowledge_ids(width - len(r[0][:width])) for r in rows]
        answer = [r[1][:width] + [False] * (width - len(r[1][:width])) for r in rows]
        return torch.tensor(ids, dtype=torch.long), torch.tensor(answer, dtype=torch.bool)

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        """Where the stream stands, as a checkpoint stores it.

        Returns:
            Plain lists and numbers (no tensors), for `load_state_dict`.
        """
        return {"order": list(self.order), "pending": [list(batch) for batch in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from where `state_dict` said the stream stood.

        Args:
            state: A `state_dict()`, as a checkpoint returns it.
        """
        self.order = list(state["order"])
        self.pending = [[(list(ids), list(answer)) for ids, answer in batch] for batch in state["pending"]]
