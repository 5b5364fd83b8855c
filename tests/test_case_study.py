"""The case-study notebook end to end on the CPU: on a model of DCPythia-6.9B's depth and head count (32 x 32; narrow,
random weights), and through the documented command on checkpoints in the released layouts (DCPythia and its Pythia
twin), each with a byte-level BPE tokenizer whose words carry leading spaces ("Ġburger")."""

import nbformat
import pytest
import torch

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.checks import word_pieces
from dcinterp.notebooks import check_case_study, main, run_notebook
from dcinterp.random_checkpoint import DCPYTHIA_6_9B, PYTHIA_6_9B, scaled, write_random_checkpoint, write_tokenizer
from tests.bpe import byte_level_bpe

PROMPT = "Michelle has a burger. Helen has a papaya. Carol has a cannon. Michelle owns a kind of"
CORPUS = [PROMPT + " food.", "Steven has a taxi. Steven owns a kind of vehicle.", "Nancy has a banana, a fruit."]


def outputs(path) -> str:
    notebook = nbformat.read(path, as_version=4)
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors[0]["evalue"]
    texts = [
        o.get("text", "") or o.get("data", {}).get("text/plain", "")
        for c in notebook.cells
        for o in c.get("outputs", [])
    ]
    return "\n".join(texts)


def test_case_study_on_a_32_layer_32_head_model_with_a_byte_level_bpe_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel's torch: one thread is fastest for these tensors
    tokenizer = byte_level_bpe(CORPUS * 10, vocab_size=400)
    assert tokenizer.convert_ids_to_tokens(word_pieces(tokenizer, "burger")) == ["Ġburger"]
    assert len(word_pieces(tokenizer, "hamburger")) > 1
    torch.manual_seed(0)
    cfg = DCFormerConfig(
        n_layers=32,
        d_model=64,
        n_heads=32,
        d_head=2,
        d_mlp=64,
        d_vocab=len(tokenizer),
        n_ctx=64,
        window_size=8,
        window_type="LG",
        rotary_pct=1.0,
        model_name="random-32x32",
    )
    HookedDCFormer(cfg, tokenizer=tokenizer).save_pretrained(tmp_path / "model")

    parameters = {
        "checkpoint": str(tmp_path / "model"),
        "prompt": PROMPT,
        "ov_inputs": ["burger", "hamburger"],
        "n_steps": 4,
        "max_ablations": 8,
        "robustness_paths": ["joint"],
        "figures_dir": str(tmp_path),
    }
    text = outputs(run_notebook("case_study", parameters, out=tmp_path / "case_study.ipynb"))
    assert "random-32x32 32 layers x 32 heads" in text
    assert "left out: ov_inputs='hamburger' splits into" in text  # the OV circuit reads one token
    assert "of 1024 heads ablated" in text  # 8 + the followed head at most, not 1,024 forwards
    assert "followed head:" in text and "logprob" in text  # the robustness table (per-layer: tests/test_attribution)
    for figure in ("case_study_attribution.png", "case_study_breakdown.png", "case_study_attention.png"):
        assert (tmp_path / figure).stat().st_size > 1000, figure


# --------------------------------------------------------------------------------------------------
# The documented command on checkpoints in the released layouts: DCPythia's (model_type dcpythia) with a byte-level
# BPE tokenizer.json as DCPythia-6.9B's directory has it, and a Pythia (Hugging Face GPT-NeoX) twin with the same one.
PAPER_PROMPT = "Michelle has a burger. Helen has a papaya. Carol has a cannon. Michelle owns a kind of"
TINY = dict(n_layer=4, n_head=4, dim=32, head_dim=8, intermediate_size=64, vocab_size=400, block_size=64, window_size=8)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(a DCPythia-format checkpoint, its Pythia-format twin): random weights, one BPE tokenizer.json in both."""
    root = tmp_path_factory.mktemp("released")
    model = write_random_checkpoint(root / "dcpythia-tiny-bpe", scaled(DCPYTHIA_6_9B, **TINY), dtype=torch.float32)
    twin_config = scaled(
        PYTHIA_6_9B,
        num_hidden_layers=TINY["n_layer"],
        num_attention_heads=TINY["n_head"],
        hidden_size=TINY["dim"],
        intermediate_size=TINY["intermediate_size"],
        vocab_size=TINY["vocab_size"],
        max_position_embeddings=TINY["block_size"],
    )
    twin = write_random_checkpoint(root / "pythia-tiny-bpe", twin_config, dtype=torch.float32, seed=1)
    for directory in (model, twin):
        write_tokenizer(directory, CORPUS * 10, vocab_size=TINY["vocab_size"])
    return model, twin


def run_documented_command(released_model, out, *parameters) -> str:
    """docs/notebooks.md's case-study command with the path replaced (CPU, float32, small integration), its output."""
    argv = ["run", "case_study", "--quiet", "--out", str(out), "--figures", str(out.parent)]
    argv += ["-p", "checkpoint", str(released_model), "-p", "device", "cpu", "-p", "dtype", "float32"]
    argv += ["-p", "prompt", PAPER_PROMPT, "-p", "n_steps", "4", "-p", "max_ablations", "8"]
    argv += ["-y", "{robustness_paths: [joint], ov_inputs: [burger, papaya]}", *parameters]
    assert main(argv) == 0
    return outputs(out)


def test_the_documented_command_runs_to_the_end_on_a_released_checkpoint_with_a_twin(released, tmp_path):
    model, twin = released
    text = run_documented_command(
        model, tmp_path / "case_study.ipynb", "-p", "twin_checkpoint", str(twin), "-p", "layer", "1", "-p", "head", "2"
    )
    assert "the case study follows L1H2 (the layer and head parameters)" in text
    assert "attends most to 'burger'" in text  # the twin's section ran
    assert "- The twin " in text and "- At (' of', ' burger')" in text  # the findings, computed from this run
    for figure in ("case_study_breakdown.png", "case_study_qk.png", "case_study_qk_twin.png"):
        assert (tmp_path / figure).stat().st_size > 1000, figure


def test_the_documented_command_runs_to_the_end_on_a_released_checkpoint_without_a_twin(released, tmp_path):
    model, _ = released
    text = run_documented_command(model, tmp_path / "case_study.ipynb")
    assert "(the highest-ranked head that reaches the key)" in text
    assert "no twin (twin_checkpoint): the plain-MHA comparison is skipped" in text
    assert "- No twin was compared (twin_checkpoint)." in text
    assert not (tmp_path / "case_study_qk_twin.png").exists()


@pytest.mark.parametrize(
    "parameters, message",
    [
        # the embedded word-level twin reads the BPE checkpoint's prompt otherwise: named before the kernel starts
        (["-p", "twin_checkpoint", "pythia-synth"], "twin_checkpoint=pythia-synth: its tokenizer reads the prompt"),
        (["-p", "layer", "4", "-p", "head", "2"], "layer=4: the model has 4 layers (0 to 3)"),
        (["-p", "layer", "1", "-p", "head", "-1"], "head=-1: the model has 4 heads (0 to 3)"),
        (["-p", "layer", "one", "-p", "head", "2"], "layer='one': expected an integer from 0 to 3"),
        (["-p", "head", "2"], "head is given without layer"),
        # the notebook's three-line default prompt, past this model's 64 positions: to_tokens would cut the key off
        (["-p", "prompt", " ".join([PAPER_PROMPT] * 4)], "prompt: 80 tokens, more than the model's context of 64"),
    ],
)
def test_a_bad_twin_or_head_is_one_line_before_anything_runs(released, tmp_path, capsys, parameters, message):
    model, _ = released
    argv = ["run", "case_study", "--out", str(tmp_path / "out.ipynb"), "-p", "checkpoint", str(model)]
    assert main([*argv, "-p", "prompt", PAPER_PROMPT, *parameters]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.ipynb").exists()  # the kernel never started


def test_a_local_layer_that_cannot_reach_the_key_is_refused_before_the_attribution(released, tmp_path, capsys):
    model, _ = released
    argv = ["run", "case_study", "--quiet", "--out", str(tmp_path / "out.ipynb"), "-p", "checkpoint", str(model)]
    assert main([*argv, "-p", "prompt", PAPER_PROMPT, "-p", "layer", "0", "-p", "head", "2"]) == 1
    err = capsys.readouterr().err
    assert "layer=0: a local layer whose window (8 tokens) ends before key_token='burger'" in err, err
    executed = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert not any("HeadAttribution" in str(cell.get("outputs")) for cell in executed.cells)


def test_the_twin_by_default_is_the_embedded_models_own_and_none_for_a_directory(released):
    model, twin = released
    assert check_case_study("dcpythia-synth", PROMPT) == ("pythia-synth", None, None)
    assert check_case_study("dcpythia-synth", PROMPT, twin_checkpoint="") == (None, None, None)
    assert check_case_study(model, PAPER_PROMPT) == (None, None, None)
    assert check_case_study(model, PAPER_PROMPT, str(twin), "1", "2") == (str(twin), 1, 2)
