"""Validates dataset records against the catalog.

Every line is parsed with its task's templates (facts, phrasings, answer prefix), its QK
structure is checked, its answer is recomputed from the facts (it must be right and the
only one the facts allow), and the line must read exactly as the templates render it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from .catalog import (
    CLASS_TRANSFORMATIONS,
    PATTERNS_NAMING_A_VALUE,
    SHARED_FORMS,
    Catalog,
    Phrasing,
    Task,
    load_catalog,
    template_parts,
)
from .generator import Fact, Line, render_line
from .records import LINES_PER_SAMPLE, PLAIN_LINES, RECORD_KEYS, sample_lines

_BRACKETED_LINE = re.compile(r"(.*) \[ ([^\[\]]+) \]")
FACTS_PER_LINE = 3


def _alternatives(surfaces: Iterable[str]) -> str:
    """A regex matching any of the surfaces, longest first."""
    return "(?:" + "|".join(re.escape(surface) for surface in sorted(set(surfaces), key=len, reverse=True)) + ")"


class LineParser:
    """Reads a task's plain line (answer not bracketed) back into a Line and its phrasing.

    Args:
        catalog: the task catalog.
        task: the task whose templates the lines follow.
    """

    def __init__(self, catalog: Catalog, task: Task):
        self.catalog = catalog
        self.task = task
        lexicon = catalog.lexicon
        kind = task.pool.kind
        self.people = _alternatives(lexicon.people)
        self.units = _alternatives(lexicon.ordinal_domains)
        # A fact names its item once in a form that tells the item (besides e.g. its preposition).
        (self.item_form,) = [
            form for _, field, form in template_parts(task.syntax.fact) if field == "item" and form not in SHARED_FORMS
        ]
        self.item_by_surface = {lexicon.form(kind, item, self.item_form): item for item in lexicon.items(kind)}
        values = (
            lexicon.items(kind) if task.qk_pattern == "odd-one-out" else lexicon.values(task.ov_transformation, kind)
        )
        # Questions that name a value ask for a person.
        answers = (
            lexicon.people
            if task.qk_pattern in PATTERNS_NAMING_A_VALUE
            else lexicon.values(task.ov_transformation, kind)
        )
        self.values = _alternatives(values)
        shape = task.syntax.shape
        line_parts = {
            "facts": re.escape(shape.fact_separator).join(self._fact_pattern(index) for index in range(FACTS_PER_LINE)),
            "question": self._question_pattern(),
            "answer": f"(?P<answer>{_alternatives(answers)})",
        }
        self.pattern = re.compile(self._pattern(shape.line, lambda field, form: line_parts[field]))

    @staticmethod
    def _pattern(template: str, pattern_of) -> str:
        return "".join(
            re.escape(literal) + (pattern_of(field, form) if field is not None else "")
            for literal, field, form in template_parts(template)
        )

    def _fact_pattern(self, index: int) -> str:
        def pattern_of(field: str, form: str) -> str:
            if field == "person":
                return f"(?P<person{index}>{self.people})"
            if form == self.item_form:
                return f"(?P<item{index}>{_alternatives(self.item_by_surface)})"
            return _alternatives(
                self.catalog.lexicon.form(self.task.pool.kind, item, form)
                for item in self.catalog.lexicon.items(self.task.pool.kind)
            )

        return self._pattern(self.task.syntax.fact, pattern_of)

    def _question_pattern(self) -> str:
        def phrasing_pattern(number: int, template: str) -> str:
            slots = {
                "person": f"(?P<person_q{number}>{self.people})",
                "value": f"(?P<value_q{number}>{self.values})",
                "unit": self.units,
            }
            return f"(?P<phrasing{number}>{self._pattern(template, lambda field, form: slots[field])})"

        phrasings = "|".join(
            phrasing_pattern(number, phrasing.template) for number, phrasing in enumerate(self.task.phrasings)
        )
        prefix = self._pattern(self.task.answer_prefix, lambda field, form: self.units)
        return f"(?:{phrasings})" + (" " + prefix if prefix else "")

    def parse(self, plain_line: str) -> tuple[Line, Phrasing] | None:
        """A plain line read back by the task's templates.

        Args:
            plain_line: one text line, its answer written plain.

        Returns:
            The line and the phrasing of its question, or None where the line does not follow the templates.
        """
        match = self.pattern.fullmatch(plain_line)
        if match is None:
            return None
        groups = match.groupdict()
        number = next(number for number in range(len(self.task.phrasings)) if groups[f"phrasing{number}"])
        facts = tuple(
            Fact(groups.get(f"person{index}"), self.item_by_surface[groups[f"item{index}"]])
            for index in range(FACTS_PER_LINE)
        )
        line = Line(
            facts,
            groups["answer"],
            query_person=groups.get(f"person_q{number}"),
            query_value=groups.get(f"value_q{number}"),
        )
        return line, self.task.phrasings[number]


# --------------------------------------------------------------------------- line semantics


def _wrong_answer(answer: str, expected: Iterable[str]) -> str:
    return f"answer {answer!r} is wrong, expected {' or '.join(map(repr, expected))}"


def _contrast_problem(catalog: Catalog, task: Task, item: str, other: str) -> list[str]:
    if catalog.contrasting(task, item, other):
        return []
    respect = f"in {task.pool.class_name}" if task.pool.class_name else "and not be its opposite"
    return [f"item {item!r} must differ from {other!r} {respect}"]


def _distinct_persons(line: Line) -> list[str]:
    if len({fact.person for fact in line.facts}) != len(line.facts):
        return ["the facts must name three different persons"]
    return []


def _distinct_items(line: Line) -> list[str]:
    if len({fact.item for fact in line.facts}) != len(line.facts):
        return ["the three items must differ"]
    return []


def _check_other_person(catalog: Catalog, task: Task, line: Line) -> list[str]:
    person = line.query_person
    owners = [fact.person for fact in line.facts]
    if owners.count(person) != 2 or len(set(owners)) != 2:
        return [f"{person} must own two facts and one other person the third"]
    problems = _distinct_items(line)
    if problems:
        return problems
    other_item = next(fact.item for fact in line.facts if fact.person != person)
    expected = catalog.transform(task, other_item)
    if line.answer not in expected:
        return [_wrong_answer(line.answer, expected)]
    own_items_giving_it = [
        fact.item for fact in line.facts if fact.person == person and line.answer in catalog.transform(task, fact.item)
    ]
    if own_items_giving_it:
        return [f"answer {line.answer!r} also fits {person}'s own item {own_items_giving_it[0]!r}"]
    return []


def _check_same_person(catalog: Catalog, task: Task, line: Line) -> list[str]:
    problems = _distinct_persons(line) or _distinct_items(line)
    if problems:
        return problems
    own = [fact.item for fact in line.facts if fact.person == line.query_person]
    if not own:
        return [f"{line.query_person} is named in none of the facts"]
    expected = catalog.transform(task, own[0])
    if line.answer not in expected:
        return [_wrong_answer(line.answer, expected)]
    others_giving_it = [
        fact.item for fact in line.facts if fact.item != own[0] and line.answer in catalog.transform(task, fact.item)
    ]
    if others_giving_it:
        return [f"answer {line.answer!r} is not unique: {others_giving_it[0]!r} gives it too"]
    return []


def _check_not_matching_person(catalog: Catalog, task: Task, line: Line) -> list[str]:
    problems = _distinct_persons(line)
    if problems:
        return problems
    matching = [fact for fact in line.facts if line.query_value in catalog.transform(task, fact.item)]
    if len(matching) != 2:
        return [f"exactly two items must match {line.query_value!r}, found {len(matching)}"]
    same_item_twice = matching[0].item == matching[1].item
    if same_item_twice == (task.ov_transformation in CLASS_TRANSFORMATIONS):
        return [f"the two matching items must be {'different' if same_item_twice else 'the same'}"]
    odd = next(fact for fact in line.facts if fact not in matching)
    if task.ov_transformation == "copy":
        problems = _contrast_problem(catalog, task, odd.item, matching[0].item)
    if not problems and line.answer != odd.person:
        problems = [_wrong_answer(line.answer, [odd.person])]
    return problems


def _check_matching_person(catalog: Catalog, task: Task, line: Line) -> list[str]:
    problems = _distinct_persons(line) or _distinct_items(line)
    if problems:
        return problems
    matching = [fact for fact in line.facts if line.query_value in catalog.transform(task, fact.item)]
    if len(matching) != 1:
        return [f"exactly one item must match {line.query_value!r}, found {len(matching)}"]
    if line.answer != matching[0].person:
        return [_wrong_answer(line.answer, [matching[0].person])]
    return []


def _check_odd_one_out(catalog: Catalog, task: Task, line: Line) -> list[str]:
    counts = Counter(fact.item for fact in line.facts)
    if sorted(counts.values()) != [1, 2]:
        return ["the list must hold one item twice and one odd item"]
    repeated, odd = (item for item, _ in counts.most_common())
    if line.query_value is not None and line.query_value != repeated:
        return [f"the question names {line.query_value!r}, but the repeated item is {repeated!r}"]
    problems = _contrast_problem(catalog, task, odd, repeated)
    expected = catalog.transform(task, odd)
    if not problems and line.answer not in expected:
        problems = [_wrong_answer(line.answer, expected)]
    return problems


PATTERN_CHECKS = {
    "other-person": _check_other_person,
    "same-person": _check_same_person,
    "not-matching-person": _check_not_matching_person,
    "matching-person": _check_matching_person,
    "odd-one-out": _check_odd_one_out,
}


def line_problems(catalog: Catalog, task: Task, line: Line) -> list[str]:
    """What is wrong with a parsed line: items outside the task's pool, QK structure, answer.

    Args:
        catalog: the task catalog.
        task: the line's task.
        line: the line, from `LineParser.parse`.

    Returns:
        One message per problem; empty if all is well.
    """
    problems = [
        f"item {fact.item!r} is not in the item pool {task.pool.name!r}"
        for fact in line.facts
        if fact.item not in task.items
    ]
    if problems:
        return problems
    if task.pool.kind == "ordinal" and len({catalog.lexicon.domain_of(fact.item).unit for fact in line.facts}) > 1:
        return ["the items come from different ordinal domains"]
    return PATTERN_CHECKS[task.qk_pattern](catalog, task, line)


# --------------------------------------------------------------------------- records


def _check_text_line(
    catalog: Catalog, parser: LineParser, text: str, bracketed: bool
) -> tuple[Phrasing | None, list[str]]:
    if bracketed:
        match = _BRACKETED_LINE.fullmatch(text)
        if match is None or text.count("[") != 1 or text.count("]") != 1:
            return None, ["must end with ' [ answer ]' and hold no other bracket"]
        plain = f"{match[1]} {match[2]}"
    elif "[" in text or "]" in text:
        return None, [f"must not bracket its answer (lines 1-{PLAIN_LINES} are plain)"]
    else:
        plain = text
    parsed = parser.parse(plain)
    if parsed is None:
        return None, [f"does not follow the templates of {parser.task.id}: {text!r}"]
    line, phrasing = parsed
    problems = line_problems(catalog, parser.task, line)
    if not problems:
        expected = render_line(catalog, parser.task, phrasing, line, line.answer, bracketed)
        if text != expected:
            problems = [f"reads {text!r}, but its template gives {expected!r}"]
    return phrasing, problems


def _check_record(catalog: Catalog, parsers: dict[str, LineParser], record, lines: int) -> list[str]:
    if not isinstance(record, dict) or any(not isinstance(record.get(key), str) for key in RECORD_KEYS):
        return ["expected an object with string fields 'task_id' and 'texts'"]
    task = catalog.tasks.get(record["task_id"])
    if task is None:
        return [f"unknown task id {record['task_id']!r}"]
    if task.id not in parsers:
        parsers[task.id] = LineParser(catalog, task)
    texts = record["texts"]
    problems = []
    if not (texts.startswith("\n") and texts.endswith("\n")):
        problems.append(f"{task.id}: texts must start and end with a newline")
    text_lines = sample_lines(texts)
    if len(text_lines) != lines:
        problems.append(f"{task.id}: has {len(text_lines)} text lines, expected {lines}")
    phrasings_used = {}
    for number, text in enumerate(text_lines, 1):
        phrasing, line_problems_found = _check_text_line(catalog, parsers[task.id], text, number > PLAIN_LINES)
        problems += [f"{task.id}, text line {number}: {problem}" for problem in line_problems_found]
        if phrasing is not None:
            phrasings_used.setdefault(phrasing, number)
    if len(phrasings_used) > 1:
        (first, first_line), (other, other_line) = list(phrasings_used.items())[:2]
        problems.append(
            f"{task.id}, text line {other_line}: phrasing {other.template!r} differs from "
            f"{first.template!r} of text line {first_line} (one phrasing per sample)"
        )
    return problems


def check_records(records: Iterable[dict], lines: int = LINES_PER_SAMPLE, catalog: Catalog | None = None) -> list[str]:
    """Problems found in dataset records, checked against the catalog.

    Args:
        records: {"task_id", "texts"} records, as `read_jsonl` gives them.
        lines: the text lines each sample must have.
        catalog: the task catalog; None: the packaged one.

    Returns:
        One message per problem, each as 'line N: taskK, text line M: what is wrong', N counting records from 1 (the
        line of a JSONL file); empty if all is well.
    """
    catalog = catalog or load_catalog()
    parsers: dict[str, LineParser] = {}
    return [
        f"line {number}: {problem}"
        for number, record in enumerate(records, 1)
        for problem in _check_record(catalog, parsers, record, lines)
    ]
