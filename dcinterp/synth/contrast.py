"""Clean / corrupted prompt pairs from the synthetic tasks, for activation patching.

A pair is two prompts that differ in one thing on their last line and nowhere else: the earlier lines (the
shots, answers written plain) are the same, the last line ends right before its answer, and both answers are
known. Two kinds of corruption:

- "person": the query's person is swapped for another person of the same line (same-person tasks: the answer
  becomes that person's item, transformed), or, in the tasks that answer with a person (matching-person,
  not-matching-person), the answer's person trades names with another person of the line (the answer becomes
  that person);
- "object": the item the answer comes from is replaced by another item of the task's pool whose answer differs
  and is not what any other item of the line gives (same-person, other-person and odd-one-out tasks).

`kind=None` picks "person" where the task names persons in its query or answer and "object" for other-person
and odd-one-out tasks. Each pair is drawn by the generator's own sampler (seed, task, sample index), so the same
arguments give the same pairs. With a tokenizer, only corruptions that keep the token count are used; without
one, the word count; `tokenize_pairs` then gives the token ids, the answers' first tokens and the positions
where they are predicted.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .catalog import Catalog, Task, load_catalog
from .generator import Line, TaskSampler, answer_for, choose_phrasing, known_task_ids, render_line

if TYPE_CHECKING:  # torch is imported where it is used, so that `python -m dcinterp.synth --help` stays fast
    from torch import Tensor

KINDS = ("person", "object")
KIND_PATTERNS = {
    "person": ("same-person", "matching-person", "not-matching-person"),
    "object": ("same-person", "other-person", "odd-one-out"),
}
DEFAULT_KIND = {
    "same-person": "person",
    "matching-person": "person",
    "not-matching-person": "person",
    "other-person": "object",
    "odd-one-out": "object",
}
SHOTS = 2
MAX_DRAWS_PER_PAIR = 50


@dataclass(frozen=True)
class ContrastPair:
    """Two prompts of one task that differ in one thing on their last line, and their answers.

    Attributes:
        task_id: the task, "taskN".
        kind: "person" or "object", the corruption.
        clean: the prompt, ending right before the answer.
        corrupt: the corrupted prompt, ending right before its answer.
        clean_answer: the clean prompt's answer.
        corrupt_answer: the corrupted prompt's answer.
        sample: the generator's sample index the pair was drawn from.
        clean_source: the clean line's source item, for the tasks that answer from an item (None elsewhere).
        corrupt_source: the corrupted line's source item (for a person corruption, another person's item of the same
            line); None where the task does not answer from an item.
        query_person: the person the clean line asks about; None where the task does not answer from an item.
    """

    task_id: str
    kind: str
    clean: str
    corrupt: str
    clean_answer: str
    corrupt_answer: str
    sample: int
    clean_source: str | None = None
    corrupt_source: str | None = None
    query_person: str | None = None


def contrast_pairs(
    task: str | int,
    n: int = 16,
    seed: int = 0,
    kind: str | None = None,
    shots: int = SHOTS,
    tokenizer=None,
    catalog: Catalog | None = None,
) -> list[ContrastPair]:
    """`n` clean/corrupted pairs of one task; each prompt has `shots` answered lines, then the query line.

    The pairs are those of the first samples that allow one, so the first pairs do not depend on `n`.

    Args:
        task: the task, "taskN" or N.
        n: how many pairs.
        seed: the generator's seed.
        kind: "person", "object" or None (the task's default, see the module docstring).
        shots: the answered lines before the query line.
        tokenizer: a Hugging Face tokenizer (or `model.tokenizer`); the two prompts of a pair then have the same
            number of tokens and their answers different first tokens. None: the same number of words.
        catalog: the task catalog; None: the packaged one.

    Returns:
        The pairs, in sample order.

    Raises:
        ValueError: an unknown task, a kind that does not apply to it, a bad `n`, `shots` or `seed`, or fewer than
            `n` pairs found in `n * MAX_DRAWS_PER_PAIR` samples.
    """
    catalog = catalog or load_catalog()
    (task_id,) = known_task_ids([task], catalog)
    task = catalog.tasks[task_id]
    kind = kind or DEFAULT_KIND[task.qk_pattern]
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if task.qk_pattern not in KIND_PATTERNS[kind]:
        raise ValueError(
            f"kind {kind!r} does not apply to {task_id} ({task.qk_pattern}); it applies to "
            + ", ".join(KIND_PATTERNS[kind])
        )
    for name, value, least, what in (
        ("n", n, 1, "positive"),
        ("shots", shots, 0, "not negative"),
        ("seed", seed, None, "an integer"),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or least is not None and value < least:
            raise ValueError(
                f"{name} must be {what}" + (" (an integer)" if least is not None else "") + f", not {value!r}"
            )
    if tokenizer is not None:

        def same_shape(clean: str, corrupt: str, clean_answer: str, corrupt_answer: str) -> bool:
            return len(tokenizer(clean)["input_ids"]) == len(tokenizer(corrupt)["input_ids"]) and answer_token(
                tokenizer, clean, clean_answer
            ) != answer_token(tokenizer, corrupt, corrupt_answer)
    else:

        def same_shape(clean: str, corrupt: str, clean_answer: str, corrupt_answer: str) -> bool:
            return len(clean.split()) == len(corrupt.split())

    sampler = TaskSampler(catalog, catalog.sample_source(task))
    pairs = []
    for index in range(n * MAX_DRAWS_PER_PAIR):
        pair = _pair_of_sample(catalog, task, sampler, seed, index, kind, shots, same_shape)
        if pair is not None:
            pairs.append(pair)
            if len(pairs) == n:
                return pairs
    raise ValueError(f"{task_id}: only {len(pairs)} of {n} {kind} pairs found in {n * MAX_DRAWS_PER_PAIR} samples")


def answer_token(tokenizer, prompt: str, answer: str) -> int:
    """The answer's first token where it follows the prompt (BPE with leading spaces and word-level alike).

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt: the prompt, ending right before the answer.
        answer: the answer's text.

    Returns:
        The token id.
    """
    return tokenizer(prompt + " " + answer)["input_ids"][len(tokenizer(prompt)["input_ids"])]


@dataclass
class PairTokens:
    """A batch of pairs as token ids, right-padded; the clean and corrupted prompts of a pair have one length.

    Attributes:
        clean: the clean prompts [batch, pos].
        corrupt: the corrupted prompts [batch, pos].
        clean_answer: the clean answer's first token [batch].
        corrupt_answer: the corrupted answer's first token [batch].
        position: each prompt's last token, where the answer is predicted [batch].
    """

    clean: Tensor
    corrupt: Tensor
    clean_answer: Tensor
    corrupt_answer: Tensor
    position: Tensor


def tokenize_pairs(pairs: list[ContrastPair], tokenizer) -> PairTokens:
    """Token ids of the pairs, their answers' first tokens and where they are predicted.

    Args:
        pairs: from `contrast_pairs`.
        tokenizer: a Hugging Face tokenizer, the one `contrast_pairs` was given.

    Returns:
        The batch, padded with the tokenizer's pad token (0 without one).

    Raises:
        ValueError: no pairs, or a pair's prompts differ in length or its answers start alike.
        TypeError: a pair is not a ContrastPair.
    """
    import torch

    if not pairs:
        raise ValueError("pairs is empty: pass at least one ContrastPair (from contrast_pairs)")
    if not all(isinstance(pair, ContrastPair) for pair in pairs):
        raise TypeError("pairs must be ContrastPair objects (from contrast_pairs)")
    clean = [tokenizer(pair.clean)["input_ids"] for pair in pairs]
    corrupt = [tokenizer(pair.corrupt)["input_ids"] for pair in pairs]
    answers = [
        (answer_token(tokenizer, p.clean, p.clean_answer), answer_token(tokenizer, p.corrupt, p.corrupt_answer))
        for p in pairs
    ]
    for i, (pair, a, b, (x, y)) in enumerate(zip(pairs, clean, corrupt, answers, strict=True)):
        if len(a) != len(b) or x == y:
            raise ValueError(
                f"pair {i} ({pair.task_id}, sample {pair.sample}): the prompts are {len(a)} and "
                f"{len(b)} tokens and the answers' first tokens are {x} and {y}; pass the tokenizer "
                "to contrast_pairs"
            )
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
    width = max(len(ids) for ids in clean)
    return PairTokens(
        clean=torch.tensor([ids + [pad] * (width - len(ids)) for ids in clean]),
        corrupt=torch.tensor([ids + [pad] * (width - len(ids)) for ids in corrupt]),
        clean_answer=torch.tensor([x for x, _ in answers]),
        corrupt_answer=torch.tensor([y for _, y in answers]),
        position=torch.tensor([len(ids) - 1 for ids in clean]),
    )


def _pair_of_sample(
    catalog: Catalog,
    task: Task,
    sampler: TaskSampler,
    seed: int,
    index: int,
    kind: str,
    shots: int,
    same_shape: Callable[[str, str, str, str], bool],
) -> ContrastPair | None:
    sample = sampler.sample(seed, index, lines=shots + 1)
    phrasing = choose_phrasing(task.phrasings, sample.phrasing_draw)
    *shot_lines, query = sample.lines
    context = "".join(
        "\n" + render_line(catalog, task, phrasing, line, answer_for(catalog, task, line), False) for line in shot_lines
    )

    def prompt(line: Line) -> str:
        return context + "\n" + render_line(catalog, task, phrasing, line, "", False).rstrip()

    clean_answer = _answer(catalog, task, query)
    if clean_answer is None:
        return None
    clean = prompt(query)
    rng = random.Random(f"dcinterp.synth.contrast:{seed}:{task.id}:{index}:{kind}")
    for corrupted, corrupt_answer in _corruptions(catalog, task, sampler, query, kind, rng):
        corrupt = prompt(corrupted)
        if corrupt_answer != clean_answer and same_shape(clean, corrupt, clean_answer, corrupt_answer):
            return ContrastPair(
                task.id,
                kind,
                clean,
                corrupt,
                clean_answer,
                corrupt_answer,
                index,
                query.source_item,
                corrupted.source_item,
                query.query_person,
            )
    return None


def _answer(catalog: Catalog, task: Task, line: Line) -> str | None:
    """The line's one answer in `task`: a person, or the single value of its source item (None if several)."""
    if line.source_item is None:
        return line.answer
    values = catalog.transform(task, line.source_item)
    return values[0] if len(values) == 1 else None


def _corruptions(catalog: Catalog, task: Task, sampler: TaskSampler, line: Line, kind: str, rng: random.Random):
    """(corrupted line, its answer) candidates, in a seeded random order."""
    facts = list(line.facts)
    if kind == "person" and task.qk_pattern == "same-person":
        others = [fact for fact in facts if fact.person != line.query_person]
        for fact in rng.sample(others, len(others)):
            candidate = replace(line, query_person=fact.person, source_item=fact.item)
            answer = _answer(catalog, task, candidate)
            given = {
                value for other in facts if other.item != fact.item for value in catalog.transform(task, other.item)
            }
            if answer is not None and answer not in given:  # the new answer is the only one the facts allow
                yield candidate, answer
    elif kind == "person":  # the answer is a person: swap that person's name with another's
        others = [fact.person for fact in facts if fact.person != line.answer]
        for other in rng.sample(others, len(others)):
            names = {line.answer: other, other: line.answer}
            swapped = tuple(replace(fact, person=names.get(fact.person, fact.person)) for fact in facts)
            yield replace(line, facts=swapped), other
    else:
        source = line.source_item
        given = {value for fact in facts if fact.item != source for value in catalog.transform(task, fact.item)}
        (items,) = [pool for pool in sampler.line_pools if source in pool]  # ordinals: the source's domain
        pool = [item for item in items if item not in {fact.item for fact in facts}]
        for item in rng.sample(pool, len(pool)):
            values = catalog.transform(task, item)
            if len(values) != 1 or values[0] in given:
                continue
            if task.qk_pattern == "odd-one-out" and not catalog.contrasting(task, line.query_value, item):
                continue
            swapped = tuple(replace(fact, item=item) if fact.item == source else fact for fact in facts)
            yield replace(line, facts=swapped, source_item=item), values[0]
