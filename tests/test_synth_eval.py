"""Synthetic-task evaluation: the batched one-forward scoring equals the naive per-answer scoring; CLI and bad input."""

import argparse
import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dcinterp import DCFormerConfig, HookedDCFormer, loading
from dcinterp.synth.__main__ import main as synth_main
from dcinterp.synth.commands import common
from dcinterp.synth.commands.common import parse_task_selection
from dcinterp.synth.commands.eval import main_eval
from dcinterp.synth.evaluate import (
    RESULT_COLUMNS,
    encode_all,
    evaluate,
    evaluate_naive,
    load_samples,
    parse_sample,
    score_answer,
    summarize,
)

RELEASED = Path(__file__).resolve().parent.parent / "synthetic_tasks" / "synthetic_dataset.jsonl"


# --------------------------------------------------------------------------------------------------
# Fixtures: two tokenizers built offline, tiny random models
@pytest.fixture(scope="module")
def released_samples():
    return load_samples(RELEASED)


@pytest.fixture(scope="module")
def training_texts(released_samples):
    """Plain texts of 40 samples spread over all 74 tasks."""
    return [parse_sample(s).plain_text for s in released_samples[::22]]


@pytest.fixture(scope="module")
def eval_samples(released_samples):
    return released_samples[::44]  # 21 samples across the tasks, every other of the tokenizers' training samples


def word_level_tokenizer(texts, pre_tokenizer=None) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]")


def byte_level_bpe_tokenizer(texts) -> PreTrainedTokenizerFast:
    """A GPT-2-style BPE: words carry their leading space (" burger" is one token, "Ġburger")."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def tiny_model(tokenizer, seed=0, **overrides) -> HookedDCFormer:
    torch.manual_seed(seed)
    settings = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=len(tokenizer))
    model = HookedDCFormer(DCFormerConfig(**{**settings, **overrides}))
    model.init_weights(std=0.2)  # peakier than the training init, so that argmaxes are not near-ties
    model.tokenizer = tokenizer
    return model


@pytest.fixture(scope="module", params=["word-level", "bpe"])
def model(request, training_texts):
    if request.param == "word-level":
        return tiny_model(word_level_tokenizer(training_texts))
    return tiny_model(byte_level_bpe_tokenizer(training_texts))


# --------------------------------------------------------------------------------------------------
# Scoring
def test_answers_are_located_through_the_tokenizer_offsets(model, eval_samples):
    tokenizer = model.tokenizer
    leading_space_tokens = 0
    for encoded in encode_all(model, eval_samples, "tiny"):
        offsets = tokenizer(encoded.parsed.plain_text, return_offsets_mapping=True)["offset_mapping"]
        for answer, (start, end) in zip(encoded.parsed.answers, encoded.answer_tokens, strict=True):
            covered = encoded.parsed.plain_text[offsets[start][0] : offsets[end - 1][1]]
            assert covered.strip() == answer.text
            leading_space_tokens += tokenizer.convert_ids_to_tokens(encoded.token_ids[start]).startswith("Ġ")
    if isinstance(tokenizer.backend_tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel):
        assert leading_space_tokens > 0


def test_batched_evaluation_equals_naive_per_answer_evaluation(model, eval_samples):
    batched = evaluate(model, eval_samples, batch_size=3, name="tiny", progress=False)
    naive = evaluate_naive(model, eval_samples, name="tiny")
    assert list(batched.columns) == RESULT_COLUMNS
    assert len(batched) == 6 * len(eval_samples)
    same = ["checkpoint", "sample", "task", "k_shot", "answer", "predicted", "correct", "n_tokens"]
    pd.testing.assert_frame_equal(batched[same], naive[same])
    assert (batched["nll"] - naive["nll"]).abs().max() < 1e-4
    assert batched["k_shot"].tolist() == [2, 3, 4, 5, 6, 7] * len(eval_samples)


def test_batch_size_does_not_change_results(model, eval_samples):
    one = evaluate(model, eval_samples, batch_size=1, progress=False)
    three = evaluate(model, eval_samples, batch_size=3, progress=False)
    pd.testing.assert_frame_equal(one.drop(columns="nll"), three.drop(columns="nll"))
    assert (one["nll"] - three["nll"]).abs().max() < 1e-5


def test_bpe_splits_some_answers_into_several_tokens(training_texts, eval_samples):
    bpe_model = tiny_model(byte_level_bpe_tokenizer(training_texts))
    results = evaluate(bpe_model, eval_samples[:8], progress=False)
    assert results["n_tokens"].max() > 1


def test_score_answer_needs_every_token_to_be_the_argmax():
    tokenizer = word_level_tokenizer(["a b c d"])
    a, b, c, d = tokenizer.convert_tokens_to_ids(["a", "b", "c", "d"])
    token_ids = [a, b, c, d]
    logits = torch.zeros(4, len(tokenizer))
    logits[0, b] = logits[1, c] = 5.0  # predicts b after a and c after b; nothing special after c
    assert score_answer(logits, token_ids, (1, 3), tokenizer).correct
    assert score_answer(logits, token_ids, (1, 3), tokenizer).predicted == "b c"
    missed = score_answer(logits, token_ids, (2, 4), tokenizer)
    assert not missed.correct and missed.n_tokens == 2
    expected_nll = -(logits[1].log_softmax(-1)[c] + logits[2].log_softmax(-1)[d])
    assert missed.nll == pytest.approx(float(expected_nll), abs=1e-6)


def test_summary_has_accuracy_and_token_level_perplexity():
    rows = pd.DataFrame(
        {
            "checkpoint": ["m"] * 3,
            "sample": [0, 0, 1],
            "task": ["task0", "task0", "task1"],
            "qk_pattern": ["other-person"] * 3,
            "ov_transformation": ["superclass"] * 3,
            "k_shot": [2, 3, 2],
            "answer": ["x"] * 3,
            "predicted": ["x", "y", "x"],
            "correct": [True, False, True],
            "nll": [1.0, 2.0, 3.0],
            "n_tokens": [1, 1, 2],
        }
    )
    summary = summarize(rows)["m"]
    assert summary["accuracy"] == pytest.approx(2 / 3)
    assert summary["ppl"] == pytest.approx(float(torch.tensor(6.0 / 4).exp()))
    assert summary["by_k"] == {"2": 1.0, "3": 0.0}
    assert summary["by_task"] == {"task0": 0.5, "task1": 1.0}
    # the other poolings, by hand: per-answer mean nll 1, 2, 1.5
    e = torch.tensor([1.0, 2.0, 1.5]).exp()
    assert summary["ppl_by_pooling"]["answer"] == pytest.approx(float(e.mean()))
    assert summary["ppl_by_pooling"]["answer-nll"] == pytest.approx(float(torch.tensor(1.5).exp()))
    by_answer = summarize(rows, ppl_pooling="answer")["m"]
    assert by_answer["ppl"] == pytest.approx(float(e.mean())) and by_answer["ppl_pooling"] == "answer"
    with pytest.raises(ValueError, match="ppl pooling must be one of"):
        summarize(rows, ppl_pooling="mean")


def test_task_selection_reads_ids_and_ranges():
    assert parse_task_selection("task0,task5") == {"task0", "task5"}
    assert parse_task_selection("0-2,task7") == {"task0", "task1", "task2", "task7"}
    with pytest.raises(argparse.ArgumentTypeError, match="task99"):
        parse_task_selection("task99")


# --------------------------------------------------------------------------------------------------
# Command line
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, training_texts):
    """Saved tiny checkpoints: a DCFormer and a plain-MHA one with a word-level tokenizer, and broken ones."""
    root = tmp_path_factory.mktemp("checkpoints")
    tokenizer = word_level_tokenizer(training_texts)
    tiny_model(tokenizer).save_pretrained(root / "tiny-dc")
    tiny_model(tokenizer, seed=1, use_dcmha=False).save_pretrained(root / "tiny-mha")
    tiny_model(tokenizer, n_ctx=64).save_pretrained(root / "short-context")
    no_tokenizer = tiny_model(tokenizer)
    no_tokenizer.tokenizer = None
    no_tokenizer.save_pretrained(root / "no-tokenizer")
    # Splits on spaces only, so "vehicle\n<" is one token: the answer "vehicle" has no tokens of its own.
    space_split = word_level_tokenizer(training_texts, pre_tokenizers.Split(" ", behavior="removed"))
    tiny_model(space_split).save_pretrained(root / "space-split")
    return root


def test_cli_writes_results_and_summary_for_each_checkpoint(checkpoints, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main_eval(
        [
            "--checkpoint",
            str(checkpoints / "tiny-dc"),
            "--checkpoint",
            str(checkpoints / "tiny-mha"),
            "--data",
            "released",
            "--tasks",
            "5,task60",
            "--limit",
            "14",
            "--batch-size",
            "4",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "tiny-dc" in printed and "tiny-mha" in printed and "accuracy" in printed

    results = pd.read_csv(out / "results.csv")
    assert list(results.columns) == RESULT_COLUMNS
    assert len(results) == 2 * 14 * 6
    assert set(results["task"]) == {"task5", "task60"}
    assert results[results["task"] == "task60"]["sample"].min() == 60 * 12  # index in the data file
    assert set(results["qk_pattern"]) == {"not-matching-person", "odd-one-out"}

    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["tiny-dc", "tiny-mha"]
    for entry in summary.values():
        assert list(entry) == [
            "accuracy",
            "ppl",
            "ppl_pooling",
            "ppl_by_pooling",
            "by_k",
            "by_task",
            "by_qk_pattern",
            "by_ov_transformation",
            "world_size",
        ]
        assert entry["world_size"] == 1
        assert list(entry["by_k"]) == ["2", "3", "4", "5", "6", "7"]
        assert list(entry["by_task"]) == ["task5", "task60"]
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "summary.json"]


def released_lines(n=3) -> list[str]:
    return RELEASED.read_text().splitlines()[:n]


def with_texts(line: str, edit) -> str:
    record = json.loads(line)
    record["texts"] = edit(record["texts"])
    return json.dumps(record)


def drop_brackets(texts: str) -> str:
    return texts.replace("[ ", "").replace(" ]", "")


def drop_last_line(texts: str) -> str:
    return "\n".join(texts.split("\n")[:-2]) + "\n"


@pytest.mark.parametrize(
    "bad_line, expected",
    [
        ('{"task_id": "task0", "texts": ', "invalid JSON"),
        (lambda line: with_texts(line, drop_brackets), "no '[ answer ]'"),
        (lambda line: with_texts(line, drop_last_line), "7 lines"),
    ],
)
def test_bad_data_lines_exit_2_naming_file_and_line(bad_line, expected, checkpoints, tmp_path, capsys):
    lines = released_lines()
    lines[1] = bad_line(lines[1]) if callable(bad_line) else bad_line
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "eval"
    code = main_eval(["--checkpoint", str(checkpoints / "tiny-dc"), "--data", str(data), "--out", str(out)])
    error = capsys.readouterr().err.strip()
    assert code == 2
    assert "\n" not in error and f"{data}: line 2" in error and expected in error
    assert not out.exists()


@pytest.mark.parametrize(
    "checkpoint, expected",
    [
        ("space-split", "line 1: answer 'vehicle' (line 3) cannot be located"),
        ("short-context", "line 1: the sample is"),
        ("no-tokenizer", "no tokenizer"),
        ("missing", "not a checkpoint directory"),
    ],
)
def test_checkpoints_that_cannot_score_the_data_exit_2(checkpoint, expected, checkpoints, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main_eval(
        ["--checkpoint", str(checkpoints / checkpoint), "--data", "released", "--limit", "2", "--out", str(out)]
    )
    error = capsys.readouterr().err.strip()
    assert code == 2
    assert "\n" not in error and expected in error
    assert checkpoint in error
    assert not out.exists()


def test_a_checkpoint_past_the_gpus_memory_is_one_line_and_nothing_is_written(
    checkpoints, tmp_path, capsys, monkeypatch
):
    """A model that does not fit the card (float32 DCPythia-6.9B on a 24 GB card): exit status 3, one line naming
    the dtype and the batch size to change, no output."""

    def too_large(*args, **kwargs):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total capacity of 23.64 GiB of which 102.75 "
            "MiB is free. Including non-PyTorch memory, this process has 23.53 GiB memory in use."
        )

    monkeypatch.setattr(common, "load_checkpoint", too_large)
    out = tmp_path / "eval"
    code = synth_main(["eval", "--checkpoint", str(checkpoints / "tiny-dc"), "--limit", "2", "--out", str(out)])
    assert code == 3 and not out.exists()
    assert capsys.readouterr().err == (
        "error: CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total capacity of 23.64 GiB of which "
        "102.75 MiB is free; try --dtype bfloat16 (half the memory of float32), or a --batch-size below 8\n"
    )


def test_no_checkpoint_and_no_embedded_models_says_so(monkeypatch, capsys):
    monkeypatch.setattr(loading, "embedded_models", lambda: [])
    assert main_eval(["--limit", "1"]) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_ppl_pooling_flag(capsys):
    import argparse

    from dcinterp.synth.commands.eval import add_eval_arguments

    parser = add_eval_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).ppl_pooling == "token"
    assert parser.parse_args(["--ppl-pooling", "answer"]).ppl_pooling == "answer"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--ppl-pooling", "mean"])
    assert exit_info.value.code == 2 and "--ppl-pooling" in capsys.readouterr().err
