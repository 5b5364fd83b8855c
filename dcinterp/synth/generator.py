"""Draws fresh samples of the 74 synthetic ICL tasks and renders them in the released format.

Every sample has its own random generator, seeded from (seed, task, sample index), so a
sample does not depend on which other tasks or how many samples are generated.  Tasks
with ``samples_of`` re-render the samples drawn for that task (task 2k+1 shows the
samples of task 2k in its other context syntax; list tasks share their lists in pairs).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from .catalog import (
    CLASS_TRANSFORMATIONS,
    OV_TRANSFORMATIONS,
    QK_PATTERNS,
    Catalog,
    Phrasing,
    Task,
    fill_template,
    load_catalog,
)
from .records import LINES_PER_SAMPLE, PLAIN_LINES, bracket, join_lines

SAMPLES_PER_TASK = 12


@dataclass(frozen=True)
class Fact:
    """One fact of a line: a person's item, or an item of a list.

    Attributes:
        person: the person who has the item; None for the items of a list.
        item: the item.
    """

    person: str | None
    item: str


@dataclass(frozen=True)
class Line:
    """What one line says, independent of how its task writes it.

    Attributes:
        facts: the line's facts, in the order written.
        answer: the answer as the sampling task gives it.
        query_person: the person the question names, where it names one.
        query_value: the value the question names, where it names one.
        source_item: the item whose transformation is the answer, where the answer comes from an item.
    """

    facts: tuple[Fact, ...]
    answer: str
    query_person: str | None = None
    query_value: str | None = None
    source_item: str | None = None


@dataclass(frozen=True)
class Sample:
    """One sample drawn: its lines and the draw that picks the phrasing of its questions.

    Attributes:
        phrasing_draw: uniform in [0, 1); picks the phrasing by the rendering task's weights.
        lines: the sample's lines.
    """

    phrasing_draw: float
    lines: tuple[Line, ...]


# --------------------------------------------------------------------------- drawing


class TaskSampler:
    """Draws the samples of one task that does not re-render another task's samples.

    Args:
        catalog: the task catalog.
        task: the task that draws (`catalog.sample_source` of a task that re-renders another's samples).
    """

    def __init__(self, catalog: Catalog, task: Task):
        self.catalog = catalog
        self.task = task
        self.people = catalog.lexicon.people
        self.values_of = {item: catalog.transform(task, item) for item in task.items}
        self.line_pools = self._line_pools()
        self.items_by_class = self._items_by_class() if task.ov_transformation in CLASS_TRANSFORMATIONS else {}
        self.draw_line = {
            "other-person": self._other_person,
            "same-person": self._same_person,
            "not-matching-person": self._not_matching_person,
            "matching-person": self._matching_person,
            "odd-one-out": self._odd_one_out,
        }[task.qk_pattern]

    def sample(self, seed: int, index: int, lines: int = LINES_PER_SAMPLE) -> Sample:
        """One sample, from its own generator seeded by (seed, task, index).

        Args:
            seed: the generation's seed.
            index: the sample's index within the task.
            lines: how many lines.

        Returns:
            The sample.
        """
        rng = random.Random(f"dcinterp.synth:{seed}:{self.task.id}:{index}")
        phrasing_draw = rng.random()
        return Sample(phrasing_draw, tuple(self.draw_line(rng, rng.choice(self.line_pools)) for _ in range(lines)))

    def _line_pools(self) -> list[tuple[str, ...]]:
        """The item pools a line is drawn from: the task's items, or one per ordinal domain."""
        if self.task.pool.kind != "ordinal":
            return [self.task.items]
        pools = (
            tuple(item for item in self.task.items if item in domain.sequence)
            for domain in self.catalog.lexicon.ordinal_domains.values()
        )
        return [pool for pool in pools if pool]

    def _items_by_class(self) -> dict[str, list[str]]:
        by_class: dict[str, list[str]] = {}
        for item in self.task.items:
            by_class.setdefault(self.values_of[item][0], []).append(item)
        return by_class

    def _pick_source(self, rng: random.Random, pool: tuple[str, ...]) -> str:
        """An item to transform: uniform over classes for class transformations, else over items."""
        if self.items_by_class:
            return rng.choice(rng.choice(list(self.items_by_class.values())))
        return rng.choice(pool)

    def _items_not_giving(self, pool: tuple[str, ...], value: str, besides: str) -> list[str]:
        return [item for item in pool if item != besides and value not in self.values_of[item]]

    @staticmethod
    def _insert_at_random_position(rng: random.Random, others: list, special) -> tuple[list, int]:
        position = rng.randrange(len(others) + 1)
        return others[:position] + [special] + others[position:], position

    def _other_person(self, rng: random.Random, pool: tuple[str, ...]) -> Line:
        source = self._pick_source(rng, pool)
        answer = rng.choice(self.values_of[source])
        own_items = rng.sample(self._items_not_giving(pool, answer, besides=source), 2)
        person, other_person = rng.sample(self.people, 2)
        facts, _ = self._insert_at_random_position(
            rng, [Fact(person, item) for item in own_items], Fact(other_person, source)
        )
        return Line(tuple(facts), answer, query_person=person, source_item=source)

    def _source_among_persons(
        self, rng: random.Random, pool: tuple[str, ...]
    ) -> tuple[str, str, tuple[Fact, ...], str]:
        """A source item and one of its values, the source at a random place among two items that do not give the
        value, each item with a person of its own: (source, value, facts, the source's person)."""
        source = self._pick_source(rng, pool)
        value = rng.choice(self.values_of[source])
        others = rng.sample(self._items_not_giving(pool, value, besides=source), 2)
        items, position = self._insert_at_random_position(rng, others, source)
        persons = rng.sample(self.people, 3)
        return source, value, _facts(persons, items), persons[position]

    def _same_person(self, rng: random.Random, pool: tuple[str, ...]) -> Line:
        source, answer, facts, person = self._source_among_persons(rng, pool)
        return Line(facts, answer, query_person=person, source_item=source)

    def _not_matching_person(self, rng: random.Random, pool: tuple[str, ...]) -> Line:
        if self.items_by_class:
            value, members = rng.choice(
                [(value, members) for value, members in self.items_by_class.items() if len(members) >= 2]
            )
            matching = rng.sample(members, 2)
        else:
            item = rng.choice(pool)
            value = rng.choice(self.values_of[item])
            matching = [item, item]
        odd_candidates = [
            candidate
            for candidate in self._items_not_giving(pool, value, besides=matching[0])
            if self.task.ov_transformation != "copy" or self.catalog.contrasting(self.task, candidate, matching[0])
        ]
        items, position = self._insert_at_random_position(rng, matching, rng.choice(odd_candidates))
        persons = rng.sample(self.people, 3)
        return Line(_facts(persons, items), persons[position], query_value=value)

    def _matching_person(self, rng: random.Random, pool: tuple[str, ...]) -> Line:
        _, value, facts, person = self._source_among_persons(rng, pool)
        return Line(facts, person, query_value=value)

    def _odd_one_out(self, rng: random.Random, pool: tuple[str, ...]) -> Line:
        odd = self._pick_source(rng, pool)
        answer = rng.choice(self.values_of[odd])
        repeated = rng.choice([item for item in pool if self.catalog.contrasting(self.task, item, odd)])
        items, _ = self._insert_at_random_position(rng, [repeated, repeated], odd)
        return Line(_facts([None] * 3, items), answer, query_value=repeated, source_item=odd)


def _facts(persons: list, items: list[str]) -> tuple[Fact, ...]:
    return tuple(Fact(person, item) for person, item in zip(persons, items, strict=True))


# --------------------------------------------------------------------------- rendering


def choose_phrasing(phrasings: tuple[Phrasing, ...], draw: float) -> Phrasing:
    """The phrasing a uniform draw picks, by the phrasings' weights.

    Args:
        phrasings: The task's phrasings.
        draw: A number in [0, 1).

    Returns:
        The phrasing.
    """
    threshold = draw * sum(phrasing.weight for phrasing in phrasings)
    for phrasing in phrasings:
        threshold -= phrasing.weight
        if threshold < 0:
            return phrasing
    return phrasings[-1]


def answer_for(catalog: Catalog, task: Task, line: Line) -> str:
    """The line's answer in `task`, which may transform the source item differently than
    the task that drew the line (task 72 answers with the predecessor of task 70's item).

    Args:
        catalog: The task catalog.
        task: The task that renders the line.
        line: The line, as the sampling task drew it.

    Returns:
        The answer.
    """
    source = catalog.sample_source(task)
    if task.ov_transformation == source.ov_transformation or line.source_item is None:
        return line.answer
    (answer,) = catalog.transform(task, line.source_item)
    return answer


def render_fact(catalog: Catalog, task: Task, fact: Fact) -> str:
    """One fact as the task's syntax writes it.

    Args:
        catalog: The task catalog.
        task: The task.
        fact: The fact.

    Returns:
        The text.
    """

    def value_of(field: str, form: str) -> str:
        return fact.person if field == "person" else catalog.lexicon.form(task.pool.kind, fact.item, form)

    return fill_template(task.syntax.fact, value_of)


def render_line(catalog: Catalog, task: Task, phrasing: Phrasing, line: Line, answer: str, bracketed: bool) -> str:
    """One line as the task writes it: its facts, the question and the answer.

    Args:
        catalog: The task catalog.
        task: The task.
        phrasing: The question's phrasing.
        line: The line.
        answer: The answer written.
        bracketed: Write the answer as ` [ answer ]` (a scored line).

    Returns:
        The text.
    """
    unit = catalog.lexicon.domain_of(line.facts[0].item).unit if task.pool.kind == "ordinal" else None
    question_fields = {"person": line.query_person, "value": line.query_value, "unit": unit}
    question_parts = (
        fill_template(template, lambda field, form: question_fields[field])
        for template in (phrasing.template, task.answer_prefix)
    )
    line_fields = {
        "facts": task.syntax.shape.fact_separator.join(render_fact(catalog, task, fact) for fact in line.facts),
        "question": " ".join(part for part in question_parts if part),
        "answer": bracket(answer) if bracketed else answer,
    }
    return fill_template(task.syntax.shape.line, lambda field, form: line_fields[field])


def render_sample(catalog: Catalog, task: Task, sample: Sample) -> str:
    """A sample's lines as the task writes them, the scored ones bracketed.

    Args:
        catalog: The task catalog.
        task: The task.
        sample: The sample drawn.

    Returns:
        The sample's text.
    """
    phrasing = choose_phrasing(task.phrasings, sample.phrasing_draw)
    return join_lines(
        [
            render_line(catalog, task, phrasing, line, answer_for(catalog, task, line), bracketed=number >= PLAIN_LINES)
            for number, line in enumerate(sample.lines)
        ]
    )


# --------------------------------------------------------------------------- selection


def parse_task_ids(spec: str, catalog: Catalog) -> list[str]:
    """'task0,task5', '0-7' or '3,10-12' -> task ids; ValueError names a bad part.

    Args:
        spec: Ids and ranges.
        catalog: The task catalog.

    Returns:
        The task ids, in the order given.

    Raises:
        ValueError: A bad part of the selection, or a task the catalog does not have.
    """
    task_ids = []
    for part in filter(None, (part.strip() for part in spec.split(","))):
        first, _, last = part.removeprefix("task").partition("-")
        last = last.removeprefix("task")
        if not first.isdigit() or (last and not (last.isdigit() and int(last) >= int(first))):
            raise ValueError(f"bad task selection {part!r} (use task3, 3 or 0-7)")
        task_ids += [f"task{number}" for number in range(int(first), int(last or first) + 1)]
    return known_task_ids(task_ids, catalog)


def known_task_ids(task_ids: Iterable, catalog: Catalog) -> list[str]:
    """Task ids as the catalog names them, each checked to be one of its tasks.

    Args:
        task_ids: Ids such as "task3" or 3 (a bare number is the task of that number).
        catalog: The task catalog.

    Returns:
        The ids as "task{n}", in the order given.

    Raises:
        ValueError: An id the catalog does not have (one line naming it and the range of ids).
    """
    normalized = [f"task{task_id}" if str(task_id).isdigit() else str(task_id) for task_id in task_ids]
    unknown = [task_id for task_id in normalized if task_id not in catalog.tasks]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r} (tasks are task0..task{len(catalog.tasks) - 1})")
    return normalized


def select_tasks(
    catalog: Catalog,
    tasks: Iterable[str | int] | None = None,
    qk_patterns: Iterable[str] | None = None,
    ov_transformations: Iterable[str] | None = None,
) -> list[Task]:
    """The catalog's tasks, in task order, restricted by ids, QK patterns and OV transformations.

    Args:
        catalog: The task catalog.
        tasks: Task ids, or None for every task.
        qk_patterns: QK patterns kept, or None for all.
        ov_transformations: OV transformations kept, or None for all.

    Returns:
        The tasks.

    Raises:
        ValueError: An unknown task, QK pattern or OV transformation.
    """
    task_ids = set(known_task_ids(tasks, catalog)) if tasks is not None else None
    patterns = _known_names(qk_patterns, QK_PATTERNS, "QK pattern")
    transformations = _known_names(ov_transformations, OV_TRANSFORMATIONS, "OV transformation")
    return [
        task
        for task in catalog.tasks.values()
        if (task_ids is None or task.id in task_ids)
        and (patterns is None or task.qk_pattern in patterns)
        and (transformations is None or task.ov_transformation in transformations)
    ]


def _known_names(names: Iterable[str] | None, known: tuple[str, ...], what: str) -> set[str] | None:
    if names is None:
        return None
    names = {names} if isinstance(names, str) else set(names)
    unknown = sorted(names - set(known))
    if unknown:
        raise ValueError(f"unknown {what} {unknown[0]!r} (known: {', '.join(known)})")
    return names


def generate(
    seed: int = 0,
    samples_per_task: int = SAMPLES_PER_TASK,
    tasks: Iterable[str | int] | None = None,
    qk_patterns: Iterable[str] | None = None,
    ov_transformations: Iterable[str] | None = None,
    lines: int = LINES_PER_SAMPLE,
    catalog: Catalog | None = None,
) -> list[dict]:
    """Fresh samples in the released format: [{"task_id": "taskN", "texts": "..."}, ...],
    grouped by task in task order.  The same arguments give the same records.

    Args:
        seed: The seed of every sample's generator.
        samples_per_task: Samples of each task.
        tasks: Task ids, or None for every task.
        qk_patterns: QK patterns kept, or None for all.
        ov_transformations: OV transformations kept, or None for all.
        lines: Lines per sample (more than the plain lines).
        catalog: The task catalog (default: the shipped one).

    Returns:
        The records.

    Raises:
        ValueError: Too few lines, a negative count, or an unknown task, pattern or transformation.
    """
    if lines <= PLAIN_LINES:
        raise ValueError(f"lines must be more than {PLAIN_LINES}, got {lines}")
    if samples_per_task < 0:
        raise ValueError(f"samples_per_task must not be negative, got {samples_per_task}")
    catalog = catalog or load_catalog()
    records = []
    for task in select_tasks(catalog, tasks, qk_patterns, ov_transformations):
        sampler = TaskSampler(catalog, catalog.sample_source(task))
        for index in range(samples_per_task):
            sample = sampler.sample(seed, index, lines)
            records.append({"task_id": task.id, "texts": render_sample(catalog, task, sample)})
    return records
