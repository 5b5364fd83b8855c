"""The case-study notebook end to end on a model of DCPythia-6.9B's depth and head count (32 x 32; narrow, random
weights) with a byte-level BPE tokenizer whose words carry leading spaces ("Ġburger"), on the CPU."""

import nbformat
import torch

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.checks import word_pieces
from dcinterp.notebooks import run_notebook
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
