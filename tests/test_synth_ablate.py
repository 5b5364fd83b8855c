"""`python -m dcinterp.synth ablate`: the post-hoc Table 9 of a checkpoint."""

import dataclasses
import json
import math

import pandas as pd
import pytest

from dcinterp import HookedDCFormer
from dcinterp.patching import ablation_hooks
from dcinterp.synth.__main__ import main
from dcinterp.synth.commands.ablate import ablation_table, ablations, label
from dcinterp.synth.evaluate import evaluate, load_samples, resolve_data_path

LIMIT = 6  # released samples of task0 (other-person, superclass)


@pytest.fixture(scope="module")
def model():
    return HookedDCFormer.from_pretrained("dcpythia-synth").eval()


@pytest.fixture(scope="module")
def samples():
    return load_samples(resolve_data_path("released"))[:LIMIT]


@pytest.fixture(scope="module")
def table(model, samples):
    return ablation_table(model, samples, progress=False)


def test_the_table_has_the_full_model_then_every_ablation(table):
    assert list(table["ablated"]) == [
        "none",
        "pre.qp",
        "pre.kp",
        "pre.qg",
        "pre.kg",
        "post.qp",
        "post.kp",
        "post.qg",
        "post.kg",
        "pre",
        "post",
        "all compose",
        "layer 0",
        "layer 1",
        "layer 2",
    ]
    assert {"accuracy", "ppl", "qk:other-person", "ov:superclass"} <= set(table.columns)


def test_a_branch_switched_off_scores_as_the_model_built_without_it(model, samples, table):
    without = HookedDCFormer(dataclasses.replace(model.cfg, compose_stages=("pre",)), model.tokenizer, init=False)
    without.load_state_dict(model.state_dict())
    expected = evaluate(without.eval(), samples, progress=False)
    row = table[table["ablated"] == "post"].iloc[0]
    assert row["accuracy"] == pytest.approx(expected["correct"].mean())
    assert row["ppl"] == pytest.approx(math.exp(expected["nll"].sum() / expected["n_tokens"].sum()), rel=1e-4)
    full = evaluate(model, samples, progress=False)
    assert table.iloc[0]["accuracy"] == pytest.approx(full["correct"].mean())
    assert row["ppl"] > table.iloc[0]["ppl"]  # switching post-compose off costs this model


def test_the_table_is_one_evaluation_per_ablation_with_the_branch_outputs_zeroed(model, samples, table):
    """What `synth ablate` computed before it shared work: the same rows, the full model bit for bit, the ablations
    within float32 rounding (zeroed branch outputs take the materialised compose, zeroed weights the no-hook one)."""
    for component, row in zip(ablations(model), table.to_dict("records"), strict=True):
        with model.hooks(fwd_hooks=[] if component is None else ablation_hooks(component)):
            results = evaluate(model, samples, name=label(component), progress=False)
        assert row["accuracy"] == results["correct"].mean(), row["ablated"]
        ppl = math.exp(results["nll"].sum() / results["n_tokens"].sum())
        if component is None:
            assert row["ppl"] == ppl
        else:
            assert row["ppl"] == pytest.approx(ppl, rel=1e-5), row["ablated"]


def test_cli_writes_csv_json_and_figure(tmp_path, capsys):
    assert main(["ablate", "--limit", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "post.kp" in out and "ablation.png" in out
    table = pd.read_csv(tmp_path / "ablation.csv")
    assert len(table) == 15
    summary = json.loads((tmp_path / "ablation.json").read_text())
    assert summary["checkpoint"] == "dcpythia-synth" and summary["world_size"] == 1
    assert [row["ablated"] for row in summary["ablations"]] == list(table["ablated"])
    assert summary["ablations"][0]["by_qk_pattern"] == {"other-person": table.iloc[0]["qk:other-person"]}
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ablation.csv", "ablation.json", "ablation.png"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--checkpoint", "pythia-synth"], "has no DCMHA"),
        (["--checkpoint", "/no/such/dir"], "/no/such/dir"),
        (["--data", "/no/such/file.jsonl"], "/no/such/file.jsonl: no such data file"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2_with_nothing_written(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["ablate", "--limit", "1", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists() or not any(out.iterdir())


def test_cli_rejects_a_bad_limit(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["ablate", "--limit", "0"])
    assert exit_info.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_a_bad_out_or_device_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import sys

    import torch

    monkeypatch.setattr(
        sys.modules["dcinterp.synth.commands.common"], "load_checkpoint", lambda *a: pytest.fail("loaded a checkpoint")
    )
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["ablate", "--out", str(blocker), "--limit", "2"]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["ablate", "--device", "cuda", "--limit", "2"]) == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_given_components_are_checked_before_any_forward(model, samples):
    from dcinterp.patching import Component

    assert list(ablation_table(model, samples[:1], components=[None], progress=False)["ablated"]) == ["none"]
    with pytest.raises(ValueError, match="components is empty"):
        ablation_table(model, samples[:1], components=[], progress=False)
    with pytest.raises(ValueError, match="has no sites"):
        ablation_table(model, samples[:1], components=[Component((), 0, "pre", "qp")], progress=False)
