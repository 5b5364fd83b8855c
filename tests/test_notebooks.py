"""Every notebook runs top to bottom on the embedded models, writes its figures, and shows what the docs site's
copy (docs/notebooks/, `python -m dcinterp.notebooks render`) shows."""

import re

import nbformat
import pytest

from dcinterp import embedded_models
from dcinterp.notebooks import (
    RENDERED_DIR,
    SITE_PARAMETERS,
    available,
    main,
    rendered_differences,
    run_notebook,
    site_copy,
)

FIGURES = {
    # notebook: the figures it must write (run with the site's parameters, which keep the run short)
    "case_study": [
        "case_study_attribution.png",
        "case_study_breakdown.png",
        "case_study_attention.png",
        "case_study_attention_heads.html",
        "case_study_qk.png",
        "case_study_qk_twin.png",
        "case_study_qk_keys.html",
    ],
    "synthetic_eval": ["synthetic_eval.png"],
    "composition_maps": [
        "composition_maps_pre.png",
        "composition_maps_post.png",
        "composition_maps_keys.png",
        "composition_map_interactive.html",
        "composition_along_sequence.png",
    ],
    "head_diversity": ["head_diversity.png"],
    "branch_analysis": [
        "branch_ablation.png",
        "patching_layers.png",
        "patching_heads.png",
        "patching_attribution.png",
        "patching_agreement.png",
    ],
    "circuit_discovery": [
        "circuit_dcpythia-synth.png",
        "circuit_faithfulness_dcpythia-synth.png",
        "circuit_pythia-synth.png",
        "circuit_faithfulness_pythia-synth.png",
        "circuit_edge_terms_dcpythia-synth.png",
    ],
    "attribution_graph": [
        "attribution_graph_dcpythia-synth.png",
        "attribution_graph_dcpythia-synth.html",
        "attribution_graph_pythia-synth.png",
        "attribution_graph_pythia-synth.html",
    ],
}


def test_the_embedded_models_are_shipped():
    assert {"dcpythia-synth", "pythia-synth"} <= set(embedded_models())


def test_every_notebook_is_tested_and_has_a_parameters_cell():
    assert {path.stem for path in available()} == set(FIGURES) == set(SITE_PARAMETERS)
    for path in available():
        notebook = nbformat.read(path, as_version=4)
        tagged = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
        assert len(tagged) == 1, path
        assert "figures_dir" in tagged[0].source and "device" in tagged[0].source, path
        assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
            f"{path} has outputs"
        )


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_on_the_embedded_models_as_the_site_shows_it(name, tmp_path):
    figures_dir = tmp_path / "figures"
    out = run_notebook(name, SITE_PARAMETERS[name], out=tmp_path / f"{name}.ipynb", figures=figures_dir)
    executed = nbformat.read(out, as_version=4)
    errors = [o for cell in executed.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    for figure in FIGURES[name]:
        assert (figures_dir / figure).stat().st_size > 1000, figure
        if figure.endswith(".html"):  # plotly.js inlined: the page works offline; a browser tab shows its title
            page = (figures_dir / figure).read_text()
            assert "<script src=" not in page, figure
            assert re.search(r"<title>[^<]+</title>", page.split("<body>")[0]), f"{figure}: no <title>"
    shown = [o for cell in executed.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(shown) == sum(figure.endswith(".png") for figure in FIGURES[name])  # each PNG is shown, once

    committed = RENDERED_DIR / f"{name}.ipynb"
    assert committed.is_file(), f"{committed} is missing: python -m dcinterp.notebooks render {name}"
    differences = rendered_differences(site_copy(executed, name, figures_dir), nbformat.read(committed, as_version=4))
    assert not differences, (
        f"docs/notebooks/{name}.ipynb is not what the code gives now (python -m dcinterp.notebooks render {name}):\n"
        + "\n".join(differences[:10])
    )


def site_copies(text: str, images: int = 1, source: str = "x = 1"):
    """Two one-cell site copies: one printing `text` with `images` PNGs, to compare."""
    cell = nbformat.v4.new_code_cell(source)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
    cell.outputs += [nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0K"}) for _ in range(images)]
    return nbformat.v4.new_notebook(cells=[cell])


def test_the_comparison_with_the_site_copy_forgives_rounding_only():
    committed = site_copies("L1H2: A = 0.224 -> A' = 0.337 (relative gap 1.5e-07); 12 heads, delta -0.0001")
    rounding = "L1H2:  A = 0.225 -> A' = 0.336 (relative gap 3.1e-08); 12 heads, delta +0.0000"  # another CPU
    assert rendered_differences(site_copies(rounding), committed) == []
    split = site_copies("L1H2: A = 0.224 -> A' = 0.3")  # the same print, flushed in two pieces
    split.cells[0].outputs.insert(1, nbformat.v4.new_output("stream", name="stdout", text="37 (relative gap 1.5e-07)"))
    split.cells[0].outputs[1].text += "; 12 heads, delta -0.0001"
    assert rendered_differences(split, committed) == []
    for changed in [
        "L1H2: A = 0.231 -> A' = 0.337 (relative gap 1.5e-07); 12 heads, delta -0.0001",  # a number moved
        "L1H0: A = 0.224 -> A' = 0.337 (relative gap 1.5e-07); 12 heads, delta -0.0001",  # another head
        "L1H2: A = 0.224 -> A' = 0.337 (relative gap 1.5e-03); 12 heads, delta -0.0001",  # an error grew
        "L1H2: A = 0.224 -> A' = 0.337 (relative gap 1.5e-07); 13 heads, delta -0.0001",  # a count
        "L1H2: A = 0.224 -> A' = 0.337 (relative gap 1.5e-07); 12 heads, delta -0.0001 more",  # a word
    ]:
        assert rendered_differences(site_copies(changed), committed), changed
    text = "L1H2: A = 0.224 -> A' = 0.337 (relative gap 1.5e-07); 12 heads, delta -0.0001"
    assert rendered_differences(site_copies(text, images=0), committed)  # a figure no longer shown
    assert rendered_differences(site_copies(text, source="x = 2"), committed)  # the code changed


def test_a_value_rounded_to_fewer_digits_than_printed_may_take_the_next_step_of_its_rounding():
    committed = site_copies("skip -2.574000, qp -0.573997")  # pandas' float32 after .round(3)
    assert rendered_differences(site_copies("skip -2.573000, qp -0.573997"), committed) == []  # -2.5735 on another CPU
    for changed in [
        "skip -2.571000, qp -0.573997",  # three steps of the rounding
        "skip -2.574000, qp -0.574997",  # a number printed in full moved by 1e-3
        "skip -2.576100, qp -0.573997",  # two steps off, and not rounded: its own, finer digit counts
    ]:
        assert rendered_differences(site_copies(changed), committed), changed


def test_cli_reports_an_unknown_notebook(capsys):
    assert main(["run", "no_such_notebook"]) == 2
    assert "no_such_notebook: no such notebook" in capsys.readouterr().err


def test_cli_lists_the_notebooks(capsys):
    assert main(["list"]) == 0
    assert set(capsys.readouterr().out.split()) == set(FIGURES)


def test_a_gpu_out_of_memory_in_a_cell_is_one_line_naming_the_parameters_that_hold_less(tmp_path, capsys, monkeypatch):
    """torch's account of the card's memory (not the allocator's advice after it), and the parameters as the run had
    them that would hold less: the dtype, the twin beside the model, the batch sizes."""
    import papermill

    import dcinterp.notebooks as notebooks

    message = (
        "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 23.64 GiB of which 0.98 GiB is "
        "free. Including non-PyTorch memory, this process has 22.6 GiB memory in use. If reserved but unallocated "
        "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )

    def out_of_memory(*args, **kwargs):
        raise papermill.PapermillExecutionError(7, 12, "...", "OutOfMemoryError", message, [])

    monkeypatch.setattr(notebooks, "run_notebook", out_of_memory)
    out = tmp_path / "case_study.ipynb"
    assert main(["run", "case_study", "--quiet", "-p", "ig_batch_size", "3", "--out", str(out)]) == 1
    assert capsys.readouterr().err == (
        "error: case_study: cell 12 raised OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has "
        "a total capacity of 23.64 GiB of which 0.98 GiB is free; try -p dtype bfloat16 (half the memory of float32), "
        f"or a -p ig_batch_size below 3 (the executed notebook, up to the error: {out})\n"
    )
    with_twin = {"dtype": "bfloat16", "twin_checkpoint": "/models/pythia-6.9b", "ig_batch_size": 1}
    assert notebooks.out_of_memory_remedies(with_twin) == [
        "no -p twin_checkpoint (the twin's weights beside the model's)"
    ]
