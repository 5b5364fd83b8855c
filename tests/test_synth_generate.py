"""Tests of the synthetic task catalog, generator, checker and CLI (dcinterp.synth)."""

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dcinterp.synth import DatasetError, check_records, data_dir, generate, load_catalog, read_jsonl, unbracket
from dcinterp.synth.__main__ import main
from dcinterp.synth.catalog import template_parts
from dcinterp.synth.check import LineParser
from dcinterp.synth.records import join_lines, sample_lines, write_jsonl

REPO = Path(__file__).resolve().parents[1]
RELEASED = REPO / "synthetic_tasks" / "synthetic_dataset.jsonl"
TEMPLATE_CHECKER = REPO / "tests" / "fixtures" / "check_templates.py"
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


@pytest.fixture(scope="module")
def released():
    return read_jsonl(RELEASED)


@pytest.fixture(scope="module")
def generated():
    return {seed: generate(seed=seed) for seed in SEEDS}


def plain(texts):
    return texts.replace("[ ", "").replace(" ]", "")


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- catalog and lexicon


def test_data_dir_holds_catalog_lexicon_and_released_file():
    assert data_dir() == REPO / "synthetic_tasks"
    for name in ("catalog.json", "lexicon.json", "synthetic_dataset.jsonl"):
        assert (data_dir() / name).is_file()


def test_catalog_describes_the_74_released_tasks(catalog):
    assert list(catalog.tasks) == [f"task{number}" for number in range(74)]
    patterns = Counter(task.qk_pattern for task in catalog.tasks.values())
    assert patterns == {
        "other-person": 14,
        "same-person": 14,
        "not-matching-person": 14,
        "matching-person": 14,
        "odd-one-out": 18,
    }
    for number in range(0, 56, 2):
        even, odd = catalog.tasks[f"task{number}"], catalog.tasks[f"task{number + 1}"]
        assert odd.samples_of == even.id and even.samples_of is None
        assert (odd.qk_pattern, odd.ov_transformation, odd.phrasings) == (
            even.qk_pattern,
            even.ov_transformation,
            even.phrasings,
        )
    assert catalog.tasks["task72"].samples_of == "task70"
    assert catalog.tasks["task73"].samples_of == "task71"
    assert all(sum(p.weight for p in task.phrasings) == 12 for task in catalog.tasks.values())


def test_catalog_examples_follow_their_templates(catalog):
    records = [
        {"task_id": task.id, "texts": join_lines([plain(task.example)] * 2 + [task.example] * 6)}
        for task in catalog.tasks.values()
    ]
    assert check_records(records, catalog=catalog) == []


def test_phrasing_weights_are_the_released_counts(catalog, released):
    parsers = {task.id: LineParser(catalog, task) for task in catalog.tasks.values()}
    counts = {task_id: Counter() for task_id in catalog.tasks}
    for record in released:
        _, phrasing = parsers[record["task_id"]].parse(sample_lines(record["texts"])[0])
        counts[record["task_id"]][phrasing.template] += 1
    for task in catalog.tasks.values():
        assert counts[task.id] == {p.template: p.weight for p in task.phrasings}, task.id


def test_lexicon_covers_every_word_of_the_released_file(catalog, released):
    lexicon = catalog.lexicon
    words = re.compile(r"\w+")
    template_texts = []
    for task in catalog.tasks.values():
        template_texts += [task.syntax.fact, task.syntax.shape.line, task.answer_prefix]
        template_texts += [phrasing.template for phrasing in task.phrasings]
    template_words = {
        word for text in template_texts for literal, _, _ in template_parts(text) for word in words.findall(literal)
    }
    lexicon_texts = list(lexicon.people) + list(lexicon.country_of) + list(lexicon.country_of.values())
    lexicon_texts += [
        text
        for entry in lexicon.objects.values()
        for text in (entry.name, entry.has_form, entry.possessive_form, entry.superclass or "", entry.capability or "")
    ]
    lexicon_texts += [form for adjective in lexicon.opposites for form in (adjective, adjective.capitalize())]
    for domain in lexicon.ordinal_domains.values():
        lexicon_texts += [*domain.sequence, domain.unit, domain.preposition, domain.preposition.capitalize()]
    lexicon_words = {word for text in lexicon_texts for word in words.findall(text)}
    released_words = {word for record in released for word in words.findall(record["texts"])}
    assert released_words - template_words - lexicon_words == set()


# --------------------------------------------------------------------------- generated data


def test_released_file_passes_the_check(released):
    assert check_records(released) == []


@pytest.mark.parametrize("seed", SEEDS)
def test_generated_samples_validate_against_the_catalog(generated, seed):
    records = generated[seed]
    assert Counter(record["task_id"] for record in records) == {f"task{n}": 12 for n in range(74)}
    assert check_records(records) == []


def test_generated_file_passes_the_released_template_checker(tmp_path, generated):
    path = tmp_path / "generated.jsonl"
    write_jsonl(generated[0], path)
    result = subprocess.run(
        [sys.executable, str(TEMPLATE_CHECKER), str(path), "--strict", "--released", str(RELEASED)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "tasks_matched=74/74 line_match=1.000 structure_ok=True"


def test_same_seed_gives_identical_bytes_and_other_seeds_differ(tmp_path, generated):
    first, second, other = tmp_path / "first.jsonl", tmp_path / "second.jsonl", tmp_path / "other.jsonl"
    write_jsonl(generated[0], first)
    assert main(["generate", "--seed", "0", "--out", str(second)]) == 0
    write_jsonl(generated[1], other)
    assert first.read_bytes() == second.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    assert all(a["texts"] != b["texts"] for a, b in zip(generated[0], generated[1], strict=True))


def test_task_subsets_and_more_samples_reproduce_the_full_run(generated):
    full = generated[0]
    subset = generate(seed=0, tasks=["task5", 70, "task73"])
    assert subset == [r for r in full if r["task_id"] in ("task5", "task70", "task73")]
    longer = generate(seed=0, tasks=["task33"], samples_per_task=20)
    assert longer[:12] == [r for r in full if r["task_id"] == "task33"]
    selected = generate(seed=0, samples_per_task=1, qk_patterns=["odd-one-out"], ov_transformations=["copy"])
    assert [r["task_id"] for r in selected] == ["task56", "task57", "task60", "task61", "task64", "task65"]


def test_paired_tasks_render_the_same_samples(generated):
    texts = {}
    for record in generated[0]:
        texts.setdefault(record["task_id"], []).append(sample_lines(record["texts"]))
    for number in range(0, 56, 2):
        for even, odd in zip(texts[f"task{number}"], texts[f"task{number + 1}"], strict=True):
            assert [line.split(" >. ")[1] for line in even] == [line.split(" >. ")[1] for line in odd]
            assert even != odd
    list_pairs = [(56, 57), (58, 59), (60, 61), (62, 63), (64, 65), (66, 67), (68, 69), (70, 72), (71, 73)]
    for first, second in list_pairs:
        for a, b in zip(texts[f"task{first}"], texts[f"task{second}"], strict=True):
            assert [line.split(" Which is")[0] for line in a] == [line.split(" Which is")[0] for line in b]


def test_generated_lines_keep_the_released_quirks():
    records = generate(seed=5, samples_per_task=40, tasks=list(range(0, 48)) + list(range(56, 70)))
    text = "\n".join(record["texts"] for record in records)
    assert "has pencils." in text and "The pencil is" in text and "There are pencils" in text
    assert re.search(r"(?<!The )T-shirt is \w+'s\.", text) and "has T-shirt." in text
    assert "a T-shirt" not in text and "The T-shirt is" not in text and "a pencil" not in text
    assert "The sheep are" in text and "has sheep." in text and "has a deer." in text
    assert "likes Washington, D.C. " in text and "Which is not Washington, D.C?" in text and "Germany" not in text
    assert "the city in German" in text and "[ the United States ]" in text
    assert not re.search(r"\[ (?:a|an|the|The) (?!United)", text)
    context_adjectives = re.findall(
        r"is (un(?:happy|healthy|interesting))\.|Un(?:happy|healthy|interesting) [A-Z]", text
    )
    assert context_adjectives == []
    days = "\n".join(r["texts"] for r in generate(seed=5, samples_per_task=40, tasks=range(48, 56)))
    assert "Sunday" not in days and "On Monday arrived" in days and "At 3 o'clock arrived" in days


def test_special_positions_and_queried_classes_are_about_uniform(catalog):
    task = catalog.tasks["task6"]
    parser = LineParser(catalog, task)
    positions, classes = Counter(), Counter()
    for record in generate(seed=11, samples_per_task=60, tasks=["task6"]):
        for line_text in sample_lines(plain(record["texts"])):
            line, _ = parser.parse(line_text)
            positions[[fact.person for fact in line.facts].index(line.answer)] += 1
            classes[line.query_value] += 1
    assert len(classes) == 10 and min(classes.values()) > 480 / 10 * 0.6
    assert min(positions.values()) > 480 / 3 * 0.8


def test_more_lines_per_sample(catalog):
    records = generate(seed=0, tasks=["task0", "task72"], samples_per_task=2, lines=12)
    assert all(len(sample_lines(r["texts"])) == 12 for r in records)
    assert check_records(records, lines=12) == []
    assert "has 12 text lines, expected 8" in check_records(records)[0]
    with pytest.raises(ValueError):
        generate(lines=2)


# --------------------------------------------------------------------------- unbracket


def test_unbracket_returns_the_answer_spans(released, generated):
    for record in released + generated[0]:
        texts = record["texts"]
        plain_text, spans = unbracket(texts)
        assert plain_text == plain(texts)
        assert [k_shot for *_, k_shot in spans] == [2, 3, 4, 5, 6, 7]
        assert [answer for _, _, answer, _ in spans] == re.findall(r"\[ (.+?) \]", texts)
        lines = plain_text.split("\n")
        for start, end, answer, k_shot in spans:
            assert plain_text[start:end] == answer
            assert lines[k_shot + 1].endswith(" " + answer)


def test_unbracket_rejects_stray_brackets():
    with pytest.raises(ValueError, match="text line 2"):
        unbracket("\nA b\nC [ d\n")
    assert unbracket("\nno answers\n") == ("\nno answers\n", [])


# --------------------------------------------------------------------------- check of corrupted files


def corrupt(lines, number, old, new):
    lines = list(lines)
    record = json.loads(lines[number - 1])
    assert old in record["texts"]
    record["texts"] = record["texts"].replace(old, new, 1)
    lines[number - 1] = json.dumps(record)
    return lines


RELEASED_LINES = RELEASED.read_text(encoding="utf-8").splitlines()


@pytest.mark.parametrize(
    "lines, expected",
    [
        (
            corrupt(RELEASED_LINES, 1, "[ vehicle ]", "[ fruit ]"),
            "line 1: task0, text line 3: answer 'fruit' is wrong, expected 'vehicle'",
        ),
        (
            corrupt(RELEASED_LINES, 73, "[ Karen ]", "[ John ]"),
            "line 73: task6, text line 3: answer 'John' is wrong, expected 'Karen'",
        ),
        (corrupt(RELEASED_LINES, 40, " ]", ""), "line 40: task3, text line 3: must end with ' [ answer ]'"),
        (corrupt(RELEASED_LINES, 70, "\n<", "\n\n<"), "line 70: task5: has 9 text lines, expected 8"),
        (corrupt(RELEASED_LINES, 300, "\n", ""), "line 300: task24: texts must start and end with a newline"),
    ],
    ids=["wrong-answer", "wrong-person", "missing-bracket", "extra-line", "framing"],
)
def test_check_names_the_corrupted_line(tmp_path, capsys, lines, expected):
    path = write_lines(tmp_path / "corrupted.jsonl", lines)
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path}: {expected}" in out


def test_check_reports_a_wrong_line_count(tmp_path, capsys, released):
    record = dict(released[0], texts=join_lines(sample_lines(released[0]["texts"])[:7]))
    path = write_lines(tmp_path / "short.jsonl", [json.dumps(record)])
    assert main(["generate", "--check", str(path)]) == 1
    assert f"{path}: line 1: task0: has 7 text lines, expected 8" in capsys.readouterr().out


# --------------------------------------------------------------------------- bad input and CLI errors


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"task_id": "task0", "texts": ', "line 3: invalid JSON"),
        ("", "line 3: empty line"),
        ('["task0", "texts"]', "line 3: expected an object with string fields 'task_id' and 'texts'"),
        ('{"task_id": 0, "texts": "x"}', "line 3: expected an object"),
    ],
)
def test_malformed_input_exits_2_with_one_line(tmp_path, capsys, bad_line, message):
    path = write_lines(tmp_path / "bad.jsonl", RELEASED_LINES[:2] + [bad_line] + RELEASED_LINES[3:5])
    assert main(["check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and f"{path}: {message}" in captured.err
    with pytest.raises(DatasetError, match=re.escape(f"{path}: {message}")):
        read_jsonl(path)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["check", "{missing}"], "{missing}: cannot read"),
        (["generate", "--out", "{out}", "--tasks", "0,99"], "unknown task 'task99'"),
        (["generate", "--out", "{out}", "--tasks", "x-3"], "bad task selection 'x-3'"),
        (["generate", "--out", "{out}", "--qk-pattern", "same-obj"], "unknown QK pattern 'same-obj'"),
        (["generate", "--out", "{out}", "--ov-transformation", "reverse"], "unknown OV transformation 'reverse'"),
        (["generate", "--out", "{out}", "--lines", "2"], "--lines 2: check and eval read samples of 8 lines"),
        (["generate", "--out", "{out}", "--lines", "100"], "--lines 100: check and eval read samples of 8 lines"),
        (["generate", "--out", "{nodir}"], "{nodir}: cannot write"),
    ],
)
def test_cli_errors_exit_2_and_leave_no_output(tmp_path, capsys, arguments, message):
    places = {
        "missing": tmp_path / "missing.jsonl",
        "out": tmp_path / "out.jsonl",
        "nodir": tmp_path / "no" / "out.jsonl",
    }
    places["out"].write_text("previous\n")
    assert main([argument.format(**places) for argument in arguments]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(**places) in err
    assert places["out"].read_text() == "previous\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.jsonl"]


def test_module_entry_point(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", RELEASED_LINES[:1] + ["{oops"])
    result = subprocess.run(
        [sys.executable, "-m", "dcinterp.synth", "check", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip() == f"error: {path}: line 2: invalid JSON "
        "(Expecting property name enclosed in double quotes at column 2)"
    )
