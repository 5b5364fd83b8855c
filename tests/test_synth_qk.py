"""`python -m dcinterp.synth qk`: QK attribution over samples of the synthetic tasks."""

import json

import pandas as pd
import pytest

from dcinterp.synth.__main__ import main
from dcinterp.synth.commands.qk_attribution import OUTPUTS, TERM_CSV_COLUMNS

FAST = ["--tasks", "2", "--samples", "2", "--checks", "1", "--top", "30"]


@pytest.mark.parametrize("checkpoint", ["dcpythia-synth", "pythia-synth"])
def test_cli_writes_terms_summary_and_figure(tmp_path, capsys, checkpoint):
    arguments = ["qk", "--checkpoint", checkpoint, "--layer", "1", "--head", "2", "--query", "after-person"]
    arguments += ["--key", "top", "--contrast", "other-source", *FAST, "--out", str(tmp_path)]
    assert main(arguments) == 0
    out = capsys.readouterr().out
    assert "largest relative gap" in out and "frozen" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(OUTPUTS)
    terms = pd.read_csv(tmp_path / "terms.csv")
    assert list(terms.columns) == TERM_CSV_COLUMNS and set(terms["sample"]) == {0, 1}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["samples"] == 2 and summary["dcmha"] == (checkpoint == "dcpythia-synth")
    for sample in summary["per_sample"]:
        rows = terms[terms["sample"] == sample["sample"]]
        assert len(rows) <= 31 and (rows["branch"] == "rest").sum() == 1  # the top 30 and the rest
        assert rows["value"].sum() == pytest.approx(sample["score"], abs=1e-4 * max(1.0, abs(sample["score"])))
        assert abs(sample["gap"]) <= 1e-4 * max(1.0, abs(sample["score"]))
        assert sample["query_token"] in ("possesses", "has", "owns")
        contrast = sample["contrast"]
        assert contrast["sum_of_terms"] == pytest.approx(contrast["difference"], abs=1e-4)
        for check in sample["checks"]:  # the frozen check equals the terms; the free ones are measured
            assert check["frozen"] == pytest.approx(check["estimate"], abs=1e-4 * max(1.0, abs(check["estimate"])))
    if checkpoint == "dcpythia-synth":
        change = summary["mean_change_from_corrupted"]
        assert change["scores_part"] + change["weights_part"] == pytest.approx(change["change"], abs=1e-4)
        assert set(summary["mean_head_branch"]) == {"skip", "qp", "kp", "qg", "kg"}
    else:
        assert set(summary["mean_head_branch"]) == {"skip"} and "mean_change_from_corrupted" not in summary


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--layer", "3", "--head", "0"], "--layer 3: dcpythia-synth has layers 0..2"),
        (["--layer", "1", "--head", "4"], "--head 4: dcpythia-synth has heads 0..3"),
        (["--layer", "1", "--head", "0", "--key", "zebra"], "key='zebra' does not occur in the prompt"),
        (["--layer", "1", "--head", "0", "--query", "top"], "--query top: 'top' is a key"),
        (["--layer", "1", "--head", "0", "--key", "last", "--query", "person"], "is not visible from query_pos"),
        (["--layer", "1", "--head", "0", "--contrast", "top"], "--contrast top: it is the key itself"),
        (["--layer", "1", "--head", "0", "--tasks", "20", "--key", "source"], "--key source: task20"),
        (["--layer", "1", "--head", "0", "--checkpoint", "/nonexistent/checkpoint"], "/nonexistent/checkpoint"),
        (["--layer", "1", "--head", "0", "--device", "cuda:7"], "--device"),
        (["--layer", "1", "--head", "0", "--key", " "], "--key: empty"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys, arguments, message):
    out = tmp_path / "out"
    assert main(["qk", *FAST, *arguments, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error
    assert not out.exists()


@pytest.mark.parametrize(
    "arguments", [["--layer", "-1", "--head", "0"], ["--layer", "1"], ["--layer", "1", "--head", "0", "--tasks", "99"]]
)
def test_argument_errors_are_one_line(tmp_path, capsys, arguments):
    with pytest.raises(SystemExit) as exit_:
        main(["qk", *arguments, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "out").exists()
