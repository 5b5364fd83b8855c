"""The catalog of the 74 synthetic ICL tasks and their lexicon, loaded into small dataclasses.

The data lives in two JSON files, ``catalog.json`` (tasks, templates, item pools) and
``lexicon.json`` (people, objects, cities, adjectives, ordinal domains); see their
``about`` entries for the meaning of every field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from string import Formatter

QK_PATTERNS = ("other-person", "same-person", "not-matching-person", "matching-person", "odd-one-out")
OV_TRANSFORMATIONS = ("copy", "superclass", "country", "capability", "opposite", "next", "prev")
# Transformations that map several items to one value (an item's "class").
CLASS_TRANSFORMATIONS = ("superclass", "country", "capability")
ITEM_KINDS = ("object", "city", "adjective", "ordinal")
ITEM_FORMS = ("", "has_form", "possessive_form", "capitalized", "preposition", "capitalized_preposition")
# Forms that are the same for many items, so that they do not tell which item is meant.
SHARED_FORMS = ("preposition", "capitalized_preposition")
QUESTION_FIELDS = {"person", "value", "unit"}
FACT_FIELDS = {"person", "item"}
PATTERNS_NAMING_A_PERSON = ("other-person", "same-person")
PATTERNS_NAMING_A_VALUE = ("not-matching-person", "matching-person")


class CatalogError(ValueError):
    """The catalog or lexicon file is inconsistent."""


def data_dir() -> Path:
    """The folder with catalog.json, lexicon.json and the released dataset."""
    package_dir = Path(__file__).resolve().parent.parent
    installed = package_dir / "_synthetic_tasks"
    return installed if installed.is_dir() else package_dir.parent / "synthetic_tasks"


def capitalize(word: str) -> str:
    """A word with its first letter upper-cased, the rest as it is.

    Args:
        word: the word.

    Returns:
        The capitalized word.
    """
    return word[:1].upper() + word[1:]


def template_parts(template: str) -> list[tuple[str, str | None, str]]:
    """Splits a template into (literal text, field name or None, form) parts.

    Args:
        template: a format string such as "{person} has {item:has_form}".

    Returns:
        The parts, in order; the form is "" where the field names none.
    """
    return [(literal, field, form or "") for literal, field, form, _ in Formatter().parse(template)]


def fill_template(template: str, value_of: Callable[[str, str], str]) -> str:
    """Fills a template.

    Args:
        template: a format string such as "{person} has {item:has_form}".
        value_of: value_of(field, form) gives the text of a field.

    Returns:
        The filled text.
    """
    return "".join(
        literal + (value_of(field, form) if field is not None else "")
        for literal, field, form in template_parts(template)
    )


def template_fields(template: str) -> set[str]:
    """The field names a template uses.

    Args:
        template: a format string.

    Returns:
        The names of its fields.
    """
    return {field for _, field, _ in template_parts(template) if field is not None}


# --------------------------------------------------------------------------- lexicon


@dataclass(frozen=True)
class ObjectEntry:
    """One object of the lexicon and how it is written.

    Attributes:
        name: the bare form, used in queries and answers.
        has_form: after "has" and in "There are" lists: "a cat", "an apple", "jeans", "pencils".
        possessive_form: "The cat is", "The jeans are", "T-shirt is".
        superclass: the object's superclass, if it has one.
        capability: what the object can do, if the lexicon says.
    """

    name: str
    has_form: str
    possessive_form: str
    superclass: str | None
    capability: str | None


@dataclass(frozen=True)
class OrdinalDomain:
    """An ordered sequence of items of one unit (years, months, days, seasons, times).

    Attributes:
        unit: year, month, day, season or time.
        preposition: the preposition an item of this domain takes.
        sequence: the items, in order.
    """

    unit: str
    preposition: str
    sequence: tuple[str, ...]

    def successor(self, item: str) -> str | None:
        """The item after `item` in the sequence.

        Args:
            item: an item of the sequence.

        Returns:
            The next item, or None after the last.
        """
        position = self.sequence.index(item) + 1
        return self.sequence[position] if position < len(self.sequence) else None

    def predecessor(self, item: str) -> str | None:
        """The item before `item` in the sequence.

        Args:
            item: an item of the sequence.

        Returns:
            The previous item, or None before the first.
        """
        position = self.sequence.index(item) - 1
        return self.sequence[position] if position >= 0 else None


@dataclass(frozen=True)
class Lexicon:
    """The people and the items the tasks draw from, with what the transformations map them to.

    Attributes:
        people: the persons' names.
        objects: the objects, by name.
        country_of: city -> country.
        opposites: adjective -> its opposites.
        ordinal_domains: the ordinal domains, by unit.
    """

    people: tuple[str, ...]
    objects: dict[str, ObjectEntry]
    country_of: dict[str, str]
    opposites: dict[str, tuple[str, ...]]
    ordinal_domains: dict[str, OrdinalDomain]

    def items(self, kind: str) -> tuple[str, ...]:
        """All items of a kind, in lexicon order.

        Args:
            kind: "object", "city", "adjective" or "ordinal".

        Returns:
            The items.
        """
        if kind == "object":
            return tuple(self.objects)
        if kind == "city":
            return tuple(self.country_of)
        if kind == "adjective":
            return tuple(self.opposites)
        return tuple(item for domain in self.ordinal_domains.values() for item in domain.sequence)

    def domain_of(self, ordinal: str) -> OrdinalDomain:
        """The ordinal domain an ordinal belongs to.

        Args:
            ordinal: an item of one of the ordinal domains.

        Returns:
            Its domain.
        """
        return next(domain for domain in self.ordinal_domains.values() if ordinal in domain.sequence)

    def form(self, kind: str, item: str, form: str) -> str:
        """How an item is written in a given form.

        Args:
            kind: the item's kind.
            item: the item.
            form: one of ITEM_FORMS ("" is the bare item).

        Returns:
            The written form.

        Raises:
            CatalogError: items of this kind have no such form.
        """
        if form == "":
            return item
        if form == "capitalized":
            return capitalize(item)
        if kind == "object" and form in ("has_form", "possessive_form"):
            return getattr(self.objects[item], form)
        if form == "has_form":  # cities, adjectives and ordinals are listed bare
            return item
        if kind == "ordinal" and form == "preposition":
            return self.domain_of(item).preposition
        if kind == "ordinal" and form == "capitalized_preposition":
            return capitalize(self.domain_of(item).preposition)
        raise CatalogError(f"{kind} items have no form {form!r}")

    def class_of(self, item: str, class_name: str) -> str | None:
        """The superclass, capability or country of an item.

        Args:
            item: an object or a city.
            class_name: "superclass", "capability" or "country".

        Returns:
            The class, or None if the item has none.
        """
        if class_name == "country":
            return self.country_of.get(item)
        entry = self.objects.get(item)
        return getattr(entry, class_name) if entry else None

    def transform(self, ov_transformation: str, kind: str, item: str) -> tuple[str, ...]:
        """The values an item maps to.

        Args:
            ov_transformation: one of OV_TRANSFORMATIONS.
            kind: the item's kind.
            item: the item.

        Returns:
            The values: empty where undefined, two for some opposites.

        Raises:
            CatalogError: the transformation does not apply to items of this kind.
        """
        if ov_transformation == "copy":
            return (item,)
        if ov_transformation in CLASS_TRANSFORMATIONS:
            value = self.class_of(item, ov_transformation)
            return (value,) if value else ()
        if ov_transformation == "opposite":
            return self.opposites.get(item, ())
        if kind == "ordinal" and ov_transformation in ("next", "prev"):
            domain = self.domain_of(item)
            value = domain.successor(item) if ov_transformation == "next" else domain.predecessor(item)
            return (value,) if value else ()
        raise CatalogError(f"transformation {ov_transformation!r} does not apply to {kind} items")

    def values(self, ov_transformation: str, kind: str) -> tuple[str, ...]:
        """Every value the transformation gives for some item of the kind.

        Args:
            ov_transformation: one of OV_TRANSFORMATIONS.
            kind: the items' kind.

        Returns:
            The values, each once, in lexicon order.
        """
        values = (value for item in self.items(kind) for value in self.transform(ov_transformation, kind, item))
        return tuple(dict.fromkeys(values))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CatalogError(f"{path}: cannot read: {error}") from error


def load_lexicon(path: Path | None = None) -> Lexicon:
    """Loads the lexicon.

    Args:
        path: a lexicon JSON file; None: lexicon.json in `data_dir()`.

    Returns:
        The lexicon.

    Raises:
        CatalogError: the file cannot be read or lacks an entry, naming the file.
    """
    path = path or data_dir() / "lexicon.json"
    raw = _read_json(path)
    try:
        objects = {
            name: ObjectEntry(
                name, entry["has_form"], entry["possessive_form"], entry.get("superclass"), entry.get("capability")
            )
            for name, entry in raw["objects"].items()
        }
        country_of = {city: country for country, cities in raw["countries"].items() for city in cities}
        opposites: dict[str, tuple[str, ...]] = {}
        for first, second in raw["adjective_opposites"]:
            opposites[first] = opposites.get(first, ()) + (second,)
            opposites[second] = opposites.get(second, ()) + (first,)
        domains = {
            domain["unit"]: OrdinalDomain(domain["unit"], domain["preposition"], tuple(domain["sequence"]))
            for domain in raw["ordinal_domains"]
        }
        return Lexicon(tuple(raw["people"]), objects, country_of, dict(sorted(opposites.items())), domains)
    except (KeyError, TypeError, ValueError) as error:
        raise CatalogError(f"{path}: {_describe(error)}") from error


# --------------------------------------------------------------------------- catalog


@dataclass(frozen=True)
class LineShape:
    """How a line is laid out: a context line of facts, or a list.

    Attributes:
        name: "context" or "list".
        line: the template with {facts}, {question} and {answer}.
        fact_separator: the text between two facts.
    """

    name: str
    line: str
    fact_separator: str


@dataclass(frozen=True)
class Syntax:
    """How a task writes its facts.

    Attributes:
        name: HAS, POSS, LIKES, ...
        shape: the line's layout.
        fact: the template with {person} and {item:form}.
    """

    name: str
    shape: LineShape
    fact: str


@dataclass(frozen=True)
class ItemPool:
    """The items a task draws from.

    Attributes:
        name: the pool's name in catalog.json.
        kind: "object", "city", "adjective" or "ordinal".
        class_name: superclass, capability or country, where the pool's items must have one.
        exclude: items left out of the pool.
    """

    name: str
    kind: str
    class_name: str | None
    exclude: tuple[str, ...]


@dataclass(frozen=True)
class Phrasing:
    """One way a task asks its question.

    Attributes:
        template: the question, with {person}, {value} and {unit}.
        weight: the number of released samples with this phrasing.
    """

    template: str
    weight: int


@dataclass(frozen=True)
class Task:
    """One synthetic task: its QK pattern, OV transformation, items and how it writes its lines.

    Attributes:
        id: "taskN".
        qk_pattern: one of QK_PATTERNS.
        ov_transformation: one of OV_TRANSFORMATIONS.
        pool: the item pool.
        items: the pool's items for which the transformations in use are defined.
        syntax: how the facts are written.
        samples_of: the task whose samples this one re-renders, or None.
        phrasings: the question's phrasings.
        answer_prefix: fixed text between the phrasing and the answer, may hold {unit}.
        example: line 3 of the first released sample.
    """

    id: str
    qk_pattern: str
    ov_transformation: str
    pool: ItemPool
    items: tuple[str, ...]
    syntax: Syntax
    samples_of: str | None
    phrasings: tuple[Phrasing, ...]
    answer_prefix: str
    example: str


@dataclass(frozen=True)
class Catalog:
    """The tasks and the lexicon they draw from.

    Attributes:
        tasks: the tasks by id, in task order.
        lexicon: the lexicon.
    """

    tasks: dict[str, Task]
    lexicon: Lexicon

    def sample_source(self, task: Task) -> Task:
        """The task whose samples `task` renders.

        Args:
            task: a task of the catalog.

        Returns:
            Its `samples_of` task, else the task itself.
        """
        return self.tasks[task.samples_of] if task.samples_of else task

    def transform(self, task: Task, item: str) -> tuple[str, ...]:
        """The values an item maps to under the task's OV transformation.

        Args:
            task: the task.
            item: an item of its pool.

        Returns:
            The values, as `Lexicon.transform` gives them.
        """
        return self.lexicon.transform(task.ov_transformation, task.pool.kind, item)

    def contrasting(self, task: Task, first: str, second: str) -> bool:
        """Whether two items set each other off.

        They do as a list's odd and repeated item, or as the odd and the repeated item of a copy
        not-matching-person line: another class, or for adjectives, not opposites.

        Args:
            task: the task.
            first: one item.
            second: the other.

        Returns:
            True where the items contrast.
        """
        if first == second:
            return False
        if task.pool.class_name:
            return self.lexicon.class_of(first, task.pool.class_name) != self.lexicon.class_of(
                second, task.pool.class_name
            )
        return second not in self.lexicon.opposites.get(first, ())


def _pool_items(lexicon: Lexicon, pool: ItemPool, ov_transformations: set[str]) -> tuple[str, ...]:
    return tuple(
        item
        for item in lexicon.items(pool.kind)
        if item not in pool.exclude
        and (pool.class_name is None or lexicon.class_of(item, pool.class_name))
        and all(lexicon.transform(ov, pool.kind, item) for ov in ov_transformations)
    )


def _check_task(task: Task, lexicon: Lexicon, tasks: dict[str, Task]) -> None:
    def fail(message: str):
        raise CatalogError(message)

    if task.qk_pattern not in QK_PATTERNS:
        fail(f"unknown qk_pattern {task.qk_pattern!r}")
    if task.ov_transformation not in OV_TRANSFORMATIONS:
        fail(f"unknown ov_transformation {task.ov_transformation!r}")
    if not task.phrasings or any(p.weight <= 0 for p in task.phrasings):
        fail("needs at least one phrasing, each with a positive weight")
    for phrasing in task.phrasings:
        fields = template_fields(phrasing.template)
        if not fields <= QUESTION_FIELDS:
            fail(f"phrasing {phrasing.template!r} uses fields other than {sorted(QUESTION_FIELDS)}")
        if ("person" in fields) != (task.qk_pattern in PATTERNS_NAMING_A_PERSON):
            fail(f"phrasing {phrasing.template!r}: {{person}} belongs exactly to the other- and same-person tasks")
        if task.qk_pattern in PATTERNS_NAMING_A_VALUE and "value" not in fields:
            fail(f"phrasing {phrasing.template!r} must name the {{value}}")
    if not template_fields(task.answer_prefix) <= {"unit"}:
        fail("answer_prefix may only use {unit}")
    if len(task.items) < 3:
        fail(f"pool {task.pool.name!r} leaves fewer than 3 items")
    for _, field, form in template_parts(task.syntax.fact):
        if field is not None and field not in FACT_FIELDS:
            fail(f"fact template {task.syntax.fact!r} has unknown field {field!r}")
        if field == "item":
            lexicon.form(task.pool.kind, task.items[0], form)
    if (task.syntax.shape.name == "list") != (task.qk_pattern == "odd-one-out"):
        fail("odd-one-out tasks and only they use the list shape")
    if task.samples_of:
        source = tasks.get(task.samples_of)
        if source is None or source.samples_of:
            fail(f"samples_of must name a task that draws its own samples, not {task.samples_of!r}")
        if (source.qk_pattern, source.pool) != (task.qk_pattern, task.pool):
            fail(f"samples_of {source.id} has another QK pattern or item pool")


def _transformations_of_shared_samples(raw_tasks: list[dict]) -> dict[str, set[str]]:
    """For each task id: the OV transformations applied to the samples it renders."""
    source_of = {raw["id"]: raw.get("samples_of") or raw["id"] for raw in raw_tasks}
    transformations_of_source: dict[str, set[str]] = {}
    for raw in raw_tasks:
        transformations_of_source.setdefault(source_of[raw["id"]], set()).add(raw["ov_transformation"])
    return {task_id: transformations_of_source[source] for task_id, source in source_of.items()}


def _build_catalog(raw: dict, lexicon: Lexicon) -> Catalog:
    shapes = {
        name: LineShape(name, shape["line"], shape["fact_separator"]) for name, shape in raw["line_shapes"].items()
    }
    syntaxes = {name: Syntax(name, shapes[syntax["shape"]], syntax["fact"]) for name, syntax in raw["syntaxes"].items()}
    pools = {
        name: ItemPool(name, pool["kind"], pool.get("class"), tuple(pool.get("exclude", ())))
        for name, pool in raw["item_pools"].items()
    }
    transformations_in_use = _transformations_of_shared_samples(raw["tasks"])
    tasks: dict[str, Task] = {}
    for number, entry in enumerate(raw["tasks"]):
        try:
            if entry["id"] != f"task{number}":
                raise CatalogError(f"has id {entry['id']!r}, expected 'task{number}'")
            pool = pools[entry["items"]]
            task = Task(
                id=entry["id"],
                qk_pattern=entry["qk_pattern"],
                ov_transformation=entry["ov_transformation"],
                pool=pool,
                items=_pool_items(lexicon, pool, transformations_in_use[entry["id"]]),
                syntax=syntaxes[entry["syntax"]],
                samples_of=entry.get("samples_of"),
                phrasings=tuple(Phrasing(template, weight) for template, weight in entry["phrasings"].items()),
                answer_prefix=entry["answer_prefix"],
                example=entry["example"],
            )
            _check_task(task, lexicon, tasks)
        except (KeyError, TypeError, ValueError) as error:
            raise CatalogError(f"task entry {number}: {_describe(error)}") from error
        tasks[task.id] = task
    return Catalog(tasks, lexicon)


def _describe(error: Exception) -> str:
    if isinstance(error, KeyError):
        return f"unknown or missing name {error}"
    return str(error) if isinstance(error, CatalogError) else f"{type(error).__name__}: {error}"


def load_catalog(path: Path | None = None, lexicon_path: Path | None = None) -> Catalog:
    """Loads the task catalog.

    Args:
        path: a catalog JSON file; None: catalog.json in `data_dir()`.
        lexicon_path: a lexicon JSON file; None: lexicon.json in `data_dir()`.

    Returns:
        The catalog, cached by the two paths.

    Raises:
        CatalogError: a file cannot be read or is inconsistent, naming the file and the task entry.
    """
    return _load_catalog_cached(
        Path(path or data_dir() / "catalog.json").resolve(), Path(lexicon_path or data_dir() / "lexicon.json").resolve()
    )


@lru_cache(maxsize=4)
def _load_catalog_cached(path: Path, lexicon_path: Path) -> Catalog:
    lexicon = load_lexicon(lexicon_path)
    raw = _read_json(path)
    try:
        return _build_catalog(raw, lexicon)
    except (KeyError, TypeError, ValueError) as error:
        raise CatalogError(f"{path}: {_describe(error)}") from error
