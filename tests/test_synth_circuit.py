"""`python -m dcinterp.synth circuit`: edge-level circuit discovery on the contrast pairs."""

import json

import pandas as pd
import pytest

from dcinterp.discovery import EDGE_COLUMNS
from dcinterp.synth.__main__ import main
from dcinterp.synth.commands.circuit import OUTPUTS

FAST = ["--tasks", "2", "--pairs", "2", "--n-steps", "2", "--exact-top", "6"]


@pytest.mark.parametrize("checkpoint", ["dcpythia-synth", "pythia-synth"])
def test_cli_writes_the_edges_curves_summary_and_figures(tmp_path, capsys, checkpoint):
    assert main(["circuit", "--checkpoint", checkpoint, *FAST, "--out", str(tmp_path)]) == 0
    assert "80% faithfulness" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(OUTPUTS)
    edges = pd.read_csv(tmp_path / "edges.csv")
    assert list(edges.columns[: len(EDGE_COLUMNS) + 2]) == [*EDGE_COLUMNS, "score", "exact"]
    assert edges["exact"].notna().sum() >= 6
    top = edges["score"].abs().nlargest(6).index
    assert edges.loc[top, "exact"].notna().all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["faithfulness_full_graph"] == pytest.approx(1.0, abs=1e-5)
    assert summary["faithfulness_empty_graph"] == pytest.approx(0.0, abs=1e-5)
    assert set(summary["spearman_score_vs_exact"]) == {"eap", "eap-ig"}
    assert summary["world_size"] == 1
    kinds = set(edges["kind"])
    assert kinds == ({"residual", "compose"} if checkpoint == "dcpythia-synth" else {"residual"})
    curve = pd.read_csv(tmp_path / "faithfulness.csv")
    assert list(curve.columns) == ["method", "selection", "edges", "faithfulness"]
    assert {"eap", "eap-ig", "random"} <= set(curve["method"])
    assert curve[curve.edges == len(edges)]["faithfulness"].to_numpy() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--kind", "person", "--tasks", "0"], "does not apply to task0"),
        (["--checkpoint", "/nonexistent/checkpoint"], "/nonexistent/checkpoint"),
        (["--device", "cuda:7"], "--device"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys, arguments, message):
    out = tmp_path / "out"
    assert main(["circuit", *FAST, *arguments, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
    assert not out.exists()


def test_out_must_be_a_directory(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["circuit", *FAST, "--out", str(target)]) == 2
    assert "--out" in capsys.readouterr().err


def test_unknown_task_is_an_argument_error(tmp_path):
    with pytest.raises(SystemExit) as exit:
        main(["circuit", "--tasks", "999", "--out", str(tmp_path)])
    assert exit.value.code == 2
