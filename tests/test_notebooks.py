"""Every notebook runs top to bottom on the embedded models and writes its figures."""

import re

import nbformat
import pytest

from dcinterp import embedded_models
from dcinterp.notebooks import available, main, run_notebook

NOTEBOOKS = {
    # notebook: (parameters that keep the run short, figures it must write)
    "case_study": (
        {"n_steps": 16},
        [
            "case_study_attribution.png",
            "case_study_breakdown.png",
            "case_study_attention.png",
            "case_study_attention_heads.html",
            "case_study_qk.png",
            "case_study_qk_twin.png",
            "case_study_qk_keys.html",
        ],
    ),
    "synthetic_eval": ({"limit": 74}, ["synthetic_eval.png"]),
    "composition_maps": (
        {},
        [
            "composition_maps_pre.png",
            "composition_maps_post.png",
            "composition_maps_keys.png",
            "composition_map_interactive.html",
            "composition_along_sequence.png",
        ],
    ),
    "head_diversity": ({}, ["head_diversity.png"]),
    "branch_analysis": (
        {"tasks": "2,10", "pairs_per_task": 2, "ablation_samples": 12},
        [
            "branch_ablation.png",
            "patching_layers.png",
            "patching_heads.png",
            "patching_attribution.png",
            "patching_agreement.png",
        ],
    ),
    "circuit_discovery": (
        {"tasks": "2", "pairs_per_task": 2, "n_steps": 2, "exact_top": 6},
        [
            "circuit_dcpythia-synth.png",
            "circuit_faithfulness_dcpythia-synth.png",
            "circuit_pythia-synth.png",
            "circuit_faithfulness_pythia-synth.png",
            "circuit_edge_terms_dcpythia-synth.png",
        ],
    ),
}


def test_the_embedded_models_are_shipped():
    assert {"dcpythia-synth", "pythia-synth"} <= set(embedded_models())


def test_every_notebook_is_tested_and_has_a_parameters_cell():
    assert {path.stem for path in available()} == set(NOTEBOOKS)
    for path in available():
        notebook = nbformat.read(path, as_version=4)
        tagged = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
        assert len(tagged) == 1, path
        assert "figures_dir" in tagged[0].source and "device" in tagged[0].source, path
        assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
            f"{path} has outputs"
        )


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_runs_on_the_embedded_models(name, tmp_path):
    parameters, figures = NOTEBOOKS[name]
    out = run_notebook(name, {**parameters, "figures_dir": str(tmp_path)}, out=tmp_path / f"{name}.ipynb")
    executed = nbformat.read(out, as_version=4)
    errors = [o for cell in executed.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    for figure in figures:
        assert (tmp_path / figure).stat().st_size > 1000, figure
        if figure.endswith(".html"):  # plotly.js inlined: the page works offline; a browser tab shows its title
            page = (tmp_path / figure).read_text()
            assert "<script src=" not in page, figure
            assert re.search(r"<title>[^<]+</title>", page.split("<body>")[0]), f"{figure}: no <title>"


def test_cli_reports_an_unknown_notebook(capsys):
    assert main(["run", "no_such_notebook"]) == 2
    assert "no_such_notebook: no such notebook" in capsys.readouterr().err


def test_cli_lists_the_notebooks(capsys):
    assert main(["list"]) == 0
    assert set(capsys.readouterr().out.split()) == set(NOTEBOOKS)
