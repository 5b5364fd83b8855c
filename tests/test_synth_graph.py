"""`python -m dcinterp.synth graph`: attribution graphs from the command line, and its one-line errors."""

import json
import shutil

import pandas as pd
import pytest

from dcinterp import HookedDCFormer
from dcinterp.attribution_graph import attribution_graph, prune_graph
from dcinterp.loading import resolve_checkpoint
from dcinterp.synth.__main__ import main
from dcinterp.synth.commands.graph import PARTS_CSV_COLUMNS
from dcinterp.transcoders import Transcoder, load_transcoders, save_transcoders

PROMPT = "< Helen has a papaya. Michelle has a burger. >. Michelle owns a kind of"
SLUG = "dcpythia-synth-prompt"
FILES = [f"{SLUG}.json", f"{SLUG}.png", f"{SLUG}.html", f"{SLUG}-parts.csv", "graph-metadata.json"]


def test_a_prompts_graph_is_written_whole(tmp_path, capsys):
    out = tmp_path / "graphs"
    assert main(["graph", "--prompt", PROMPT, "--out", str(out)]) == 0
    assert 'Output "food"' in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    data = json.loads((out / f"{SLUG}.json").read_text())
    assert data["metadata"]["slug"] == SLUG and data["metadata"]["schema_version"] == 1
    assert [g["slug"] for g in json.loads((out / "graph-metadata.json").read_text())["graphs"]] == [SLUG]
    # the counts of the pruned graph, built again here with the same model and transcoders
    model = HookedDCFormer.from_pretrained("dcpythia-synth").eval().requires_grad_(False)
    graph = attribution_graph(model, load_transcoders("dcpythia-synth"), model.to_tokens(PROMPT)[0])
    node_mask, edge_mask, _ = prune_graph(graph, 0.8, 0.98)
    assert len(data["nodes"]) == int(node_mask.sum()) and len(data["links"]) == int(edge_mask.sum())
    # the parts: the links that pass through attention, each adding up to its weight
    parts = pd.read_csv(out / f"{SLUG}-parts.csv")
    assert list(parts.columns) == PARTS_CSV_COLUMNS
    with_parts = {(link["target"], link["source"]): link["weight"] for link in data["links"] if "parts" in link}
    sums = parts.groupby(["target", "source"])["value"].sum()
    assert set(sums.index) == set(with_parts) and with_parts
    for edge, weight in with_parts.items():
        assert sums[edge] == pytest.approx(weight, abs=1e-4 * max(1.0, abs(weight)))
    assert set(parts.branch) - {"residual"} <= {"skip", "qp", "kp", "qg", "kg"}
    assert "<html" in (out / f"{SLUG}.html").read_text()[:500].lower()
    # a second graph in the same folder: both listed in graph-metadata.json
    assert main(["graph", "--tasks", "2", "--out", str(out)]) == 0
    listed = json.loads((out / "graph-metadata.json").read_text())["graphs"]
    assert sorted(g["slug"] for g in listed) == sorted([SLUG, "dcpythia-synth-task2-1"])


@pytest.fixture(scope="module")
def bad_transcoders(tmp_path_factory):
    """Transcoders that do not fit dcpythia-synth: two layers of three, and d_model 32 of 64; and a checkpoint
    folder without transcoders."""
    root = tmp_path_factory.mktemp("transcoders")
    save_transcoders(load_transcoders("dcpythia-synth")[:2], root / "two-layers")
    save_transcoders([Transcoder(32, 16, layer) for layer in range(3)], root / "d-model-32")
    bare = root / "bare-checkpoint"
    shutil.copytree(resolve_checkpoint("dcpythia-synth"), bare, ignore=shutil.ignore_patterns("transcoders"))
    return root


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--checkpoint", "/nonexistent/checkpoint"], "/nonexistent/checkpoint"),
        (["--transcoders", "{root}/two-layers"], "2 layers of transcoders; dcpythia-synth has 3"),
        (["--transcoders", "{root}/d-model-32"], "transcoders of d_model 32; dcpythia-synth has d_model 64"),
        (["--transcoders", "{root}/missing"], "missing/config.yaml: not a transcoder config"),
        (["--checkpoint", "{root}/bare-checkpoint"], "train them with `python -m dcinterp.transcoders"),
        (["--prompt", " "], "--prompt: empty"),
        (["--prompt", "Michelle owns a zeppelinx"], "--prompt: not in the tokenizer's vocabulary"),
        (["--prompt", PROMPT, "--limit", "2"], "--limit: applies to --tasks"),
        (["--device", "cuda:7"], "--device"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys, bad_transcoders, arguments, message):
    out = tmp_path / "out"
    arguments = [a.format(root=bad_transcoders) for a in arguments]
    assert main(["graph", *arguments, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error
    assert not out.exists()


def test_bad_out_is_one_line(tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert main(["graph", "--prompt", PROMPT, "--out", str(not_a_folder)]) == 2
    error = capsys.readouterr().err
    assert "exists and is not a directory" in error and error.count("\n") == 1
    index = tmp_path / "graphs" / "graph-metadata.json"  # a folder whose graph list is not one: left as it was
    index.parent.mkdir()
    index.write_text("[]")
    assert main(["graph", "--prompt", PROMPT, "--out", str(index.parent)]) == 2
    error = capsys.readouterr().err
    assert f"{index}: not a graph-metadata.json" in error and error.count("\n") == 1, error
    assert [p.name for p in index.parent.iterdir()] == ["graph-metadata.json"] and index.read_text() == "[]"


@pytest.mark.parametrize(
    "arguments", [["--node-threshold", "1.5"], ["--edge-threshold", "x"], ["--prompt", PROMPT, "--tasks", "2"]]
)
def test_argument_errors_are_one_line(tmp_path, capsys, arguments):
    with pytest.raises(SystemExit) as exit_:
        main(["graph", *arguments, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "out").exists()
