"""benchmarks/bench_graph.py runs at a tiny width: a row a model, in a fresh process each, whose counts are those of
the graph it timed, with the L0 it was asked for; bad parts are one line."""

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_graph.py"


def test_the_shape_part_runs_at_a_tiny_width(tmp_path):
    out = tmp_path / "rows.jsonl"
    args = ["--parts", "6.9b", "--d-model", "256", "--layers", "2", "--seq", "12", "--d-transcoder", "2048"]
    args += ["--l0", "16", "--batch-size", "16", "--twin", "--json", str(out)]
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["model"] for row in rows] == ["dcpythia", "pythia"]
    for row in rows:
        assert row["nodes"] == row["features"] + (2 + 1) * 12 + row["logits"]
        assert row["passes"] == math.ceil((row["features"] + row["logits"]) / 16)
        assert 8 < row["l0"] < 32  # the encoder bias sets about 16 active features a token a layer
        assert row["kept_nodes"] >= 12 + row["logits"]  # pruning keeps every token and logit
        split = row["run"] + row["forward"] + row["backward"] + row["inputs"]
        assert math.isclose(split, row["graph"]) and min(row["run"], row["forward"], row["backward"]) > 0
        assert 0 < row["peak_above_model_gib"] < row["process_peak_gib"]
    printed = result.stdout.splitlines()
    assert printed[1].startswith("DCPythia-6.9B's shape in float32: weights ")
    assert sum("estimate at 32 layers" in line for line in printed) == 2


def test_an_unknown_part_is_one_line():
    result = subprocess.run([sys.executable, str(SCRIPT), "--parts", "7b"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith("expected embedded and/or 6.9b")
