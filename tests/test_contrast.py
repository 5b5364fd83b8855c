"""Contrast pairs: equal length, one difference on the last line, both answers right (checked by the checker)."""

import pytest

from dcinterp import HookedDCFormer
from dcinterp.synth import contrast_pairs, load_catalog, tokenize_pairs
from dcinterp.synth.check import LineParser, line_problems


@pytest.fixture(scope="module")
def tokenizer():
    return HookedDCFormer.from_pretrained("dcpythia-synth").tokenizer


def checked_line(task, text):
    """Parse a plain line with the task's templates; the checker recomputes its answer from the facts."""
    catalog = load_catalog()
    parsed = LineParser(catalog, task).parse(text)
    assert parsed is not None, text
    line, _ = parsed
    assert line_problems(catalog, task, line) == [], text
    return line


@pytest.mark.parametrize("task_id", [f"task{i}" for i in range(74)])
def test_pairs_of_every_task_have_equal_length_and_the_stated_answers(task_id, tokenizer):
    task = load_catalog().tasks[task_id]
    pairs = contrast_pairs(task_id, n=3, seed=1, tokenizer=tokenizer)
    for pair in pairs:
        clean_lines, corrupt_lines = pair.clean.split("\n"), pair.corrupt.split("\n")
        assert clean_lines[:-1] == corrupt_lines[:-1] and clean_lines[-1] != corrupt_lines[-1]
        assert len(tokenizer(pair.clean)["input_ids"]) == len(tokenizer(pair.corrupt)["input_ids"])
        assert pair.clean_answer != pair.corrupt_answer
        for shot in clean_lines[1:-1]:
            checked_line(task, shot)
        clean = checked_line(task, f"{clean_lines[-1]} {pair.clean_answer}")
        corrupt = checked_line(task, f"{corrupt_lines[-1]} {pair.corrupt_answer}")
        if pair.kind == "person" and task.qk_pattern == "same-person":
            assert clean.facts == corrupt.facts and clean.query_person != corrupt.query_person
        elif pair.kind == "person":
            assert clean.query_value == corrupt.query_value
            assert sorted(f.item for f in clean.facts) == sorted(f.item for f in corrupt.facts)
        else:
            assert clean.query_person == corrupt.query_person and clean.query_value == corrupt.query_value
            assert sum(a != b for a, b in zip(clean.facts, corrupt.facts, strict=True)) == 1


def test_pairs_are_seeded_and_reproducible(tokenizer):
    first = contrast_pairs(2, n=5, seed=3, tokenizer=tokenizer)
    assert first == contrast_pairs("task2", n=5, seed=3, tokenizer=tokenizer)
    assert first != contrast_pairs(2, n=5, seed=4, tokenizer=tokenizer)
    assert contrast_pairs(2, n=8, seed=3, tokenizer=tokenizer)[:5] == first  # a pair does not depend on n


def test_the_case_study_pair_swaps_the_queried_person(tokenizer):
    (pair,) = contrast_pairs(2, n=1, seed=0, tokenizer=tokenizer)
    # Sample 0 is skipped: its other persons hold a sheep and a horse, so neither animal would be a unique answer.
    assert pair.sample == 1
    assert pair.clean.endswith(
        "< Laura has a steak. Patricia has a banana. David has underwear. >. Laura possesses a kind of"
    )
    assert pair.corrupt.endswith(
        "< Laura has a steak. Patricia has a banana. David has underwear. >. Patricia possesses a kind of"
    )
    assert (pair.clean_answer, pair.corrupt_answer) == ("food", "fruit")


def test_tokenize_pairs_gives_answers_and_positions(tokenizer):
    pairs = contrast_pairs(58, n=4, seed=0, tokenizer=tokenizer)
    tokens = tokenize_pairs(pairs, tokenizer)
    assert tokens.clean.shape == tokens.corrupt.shape
    for i, pair in enumerate(pairs):
        length = len(tokenizer(pair.clean)["input_ids"])
        assert int(tokens.position[i]) == length - 1
        assert tokens.clean[i, :length].tolist() == tokenizer(pair.clean)["input_ids"]
        assert tokenizer.decode([int(tokens.clean_answer[i])]).strip() == pair.clean_answer.split()[0]
        assert tokenizer.decode([int(tokens.corrupt_answer[i])]).strip() == pair.corrupt_answer.split()[0]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown task 'task99'"):
        contrast_pairs(99)
    with pytest.raises(ValueError, match="kind 'person' does not apply to task0"):
        contrast_pairs(0, kind="person")
    with pytest.raises(ValueError, match="kind must be one of"):
        contrast_pairs(2, kind="place")
    with pytest.raises(ValueError, match="n must be positive"):
        contrast_pairs(2, n=0)
