"""Transcoders (dcinterp.transcoders): saved in circuit-tracer's transcoder_set layout and read back unchanged, read
from a corpus of text or JSON lines with one-line errors, trained on a model's own MLP activations (the loss falls,
TopK keeps k features a token), and measured (a transcoder that is the MLP's mean explains nothing, FVU 1)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors import safe_open

import dcinterp
from dcinterp import HookedDCFormer
from dcinterp.synth import generate, unbracket
from dcinterp.transcoders import (
    FEATURE_INPUT_HOOK,
    FEATURE_OUTPUT_HOOK,
    TrainConfig,
    Transcoder,
    init_transcoder,
    load_transcoders,
    main,
    mlp_activations,
    random_transcoders,
    read_corpus,
    save_transcoders,
    token_batches,
    train_transcoders,
    transcoder_loss,
    transcoder_metrics,
)

CORPUS = [
    "< Michelle has cake. Brian has a shotgun. George has a peach. >. George possesses a kind of fruit",
    "< Lisa has pizza. Patricia has a basketball. Sharon has a lion. >. Patricia possesses a kind of sport",
    "< Laura has a steak. Patricia has a banana. David has underwear. >. Laura possesses a kind of food",
] * 6


@pytest.fixture(scope="module")
def model() -> HookedDCFormer:
    return HookedDCFormer.from_pretrained("dcpythia-synth").eval().requires_grad_(False)


@pytest.mark.parametrize("activation", ["relu", "jumprelu", "topk"])
def test_save_and_load_in_circuit_tracers_layout(model, tmp_path, activation):
    transcoders = random_transcoders(model, 32, activation, k=4 if activation == "topk" else None)
    metrics = [dict(layer=tc.layer, fvu=0.5, l0=3.0, dead=0.0) for tc in transcoders]
    config_path = save_transcoders(transcoders, tmp_path, metrics)
    config = yaml.safe_load(config_path.read_text())  # circuit-tracer reads config.yaml with yaml.safe_load
    assert config["model_kind"] == "transcoder_set" and config["metrics"] == metrics
    assert (config["feature_input_hook"], config["feature_output_hook"]) == (FEATURE_INPUT_HOOK, FEATURE_OUTPUT_HOOK)
    assert config["transcoders"] == [f"layer_{layer}.safetensors" for layer in range(model.cfg.n_layers)]
    x = torch.randn(5, model.cfg.d_model)
    for tc, name in zip(transcoders, config["transcoders"], strict=True):
        with safe_open(tmp_path / name, framework="pt") as f:  # as circuit-tracer's load_relu_transcoder reads it
            keys = set(f.keys())
            W_enc, b_enc, W_dec = f.get_tensor("W_enc"), f.get_tensor("b_enc"), f.get_tensor("W_dec")
        threshold = {"activation_function.threshold"} if activation == "jumprelu" else set()
        assert keys == {"W_enc", "W_dec", "b_enc", "b_dec"} | threshold
        assert W_enc.shape == W_dec.shape == (32, model.cfg.d_model)
        assert torch.equal(F.linear(x, W_enc, b_enc), tc.pre_activation(x))
    loaded = load_transcoders(tmp_path)
    for tc, back in zip(transcoders, loaded, strict=True):
        assert (back.layer, back.activation, back.k) == (tc.layer, tc.activation, tc.k)
        assert all(torch.equal(a, b) for a, b in zip(tc.state_dict().values(), back.state_dict().values(), strict=True))
        assert torch.equal(back(x), tc(x))


def test_load_errors_name_the_file(tmp_path, model):
    with pytest.raises(ValueError, match="config.yaml: not a transcoder config"):
        load_transcoders(tmp_path)
    save_transcoders(random_transcoders(model, 8), tmp_path)
    (tmp_path / "layer_1.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="layer_1.safetensors"):
        load_transcoders(tmp_path)
    with pytest.raises(ValueError, match="one transcoder per layer"):
        save_transcoders(random_transcoders(model, 8)[1:], tmp_path)


def test_topk_and_jumprelu_activations():
    tc = Transcoder(4, 6, 0, "topk", k=2)
    pre = torch.tensor([[3.0, -1.0, 2.0, 0.5, 2.5, -4.0]])
    assert tc.activate(pre).tolist() == [[3.0, 0, 0, 0, 2.5, 0]]
    assert tc.activate(-pre.abs()).abs().sum() == 0  # the k largest, where positive
    jump = Transcoder(4, 6, 0, "jumprelu")
    jump.threshold.data.fill_(2.2)
    assert jump.activate(pre).tolist() == [[3.0, 0, 0, 0, 2.5, 0]]
    with pytest.raises(ValueError, match="needs k"):
        Transcoder(4, 6, 0, "topk")


def test_read_corpus(tmp_path):
    lines = tmp_path / "corpus.jsonl"
    lines.write_text(json.dumps({"text": "a b"}) + "\n\n" + json.dumps("c d") + "\n")
    assert read_corpus(lines) == ["a b", "c d"]
    text = tmp_path / "corpus.txt"
    text.write_text("one line\n\nanother\n")
    assert read_corpus(text) == ["one line", "another"]
    lines.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"body": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"corpus.jsonl, line 2: not a JSON string or object with 'text'"):
        read_corpus(lines)
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="no text"):
        read_corpus(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="missing.txt"):
        read_corpus(tmp_path / "missing.txt")


def test_activations_are_the_mlps(model):
    tokens = next(token_batches(model, CORPUS, batch_size=2, seq_len=16))
    assert tokens.shape == (2, 16)
    acts = mlp_activations(model, tokens, [1])
    _, cache = model.run_with_cache(tokens, names_filter=["blocks.1.hook_mlp_out", "blocks.1.ln2.hook_normalized"])
    assert torch.equal(acts[1][1], cache["blocks.1.hook_mlp_out"].reshape(-1, model.cfg.d_model))
    torch.testing.assert_close(model.blocks[1].mlp(acts[1][0]), acts[1][1])  # the input is what the MLP reads


@pytest.mark.parametrize("activation", ["relu", "topk"])
def test_training_lowers_the_loss(model, activation):
    config = TrainConfig(d_transcoder=64, activation=activation, k=6, steps=30, batch_size=2, seq_len=32, lr=3e-3)
    batches = list(token_batches(model, CORPUS, 2, 32))[:2]
    trained = train_transcoders(model, CORPUS, config, layers=[0, 2])
    assert [tc.layer for tc in trained] == [0, 2]
    for tc in trained:
        inputs, outputs = mlp_activations(model, batches[0], [tc.layer])[tc.layer]
        start = init_transcoder(tc.layer, inputs, outputs, config)
        loss, acts = transcoder_loss(tc, inputs, outputs, 0.0)
        assert loss < 0.7 * transcoder_loss(start, inputs, outputs, 0.0)[0]
        if activation == "topk":
            assert ((acts != 0).sum(-1) <= 6).all()
    metrics = transcoder_metrics(model, trained, batches)
    assert [m["layer"] for m in metrics] == [0, 2]
    assert all(0 < m["fvu"] < 1 and 0 < m["l0"] and 0 <= m["dead"] < 1 for m in metrics)
    with pytest.raises(ValueError, match="fewer than batch_size"):
        train_transcoders(model, CORPUS[:1], TrainConfig(batch_size=64, seq_len=512, steps=1))


def test_metrics_of_the_mean_are_one(model):
    """A transcoder with no feature on, whose output is the MLP output's mean: FVU 1, L0 0, every feature dead."""
    batches = list(token_batches(model, CORPUS, 4, 32))[:2]
    outputs = torch.cat([mlp_activations(model, b, [1])[1][1] for b in batches])
    tc = Transcoder(model.cfg.d_model, 16, 1)
    tc.b_enc.data.fill_(-1.0)
    tc.b_dec.data.copy_(outputs.mean(0))
    (metrics,) = transcoder_metrics(model, [tc], batches)
    assert metrics["fvu"] == pytest.approx(1.0, rel=1e-5) and metrics["l0"] == 0 and metrics["dead"] == 1


def test_command_line(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    out = tmp_path / "transcoders"
    common = ["--checkpoint", "dcpythia-synth", "--out", str(out), "--batch-size", "2", "--seq-len", "32"]
    assert main([*common, "--corpus", str(tmp_path / "missing.txt")]) == 1
    assert capsys.readouterr().err.strip().endswith("missing.txt: No such file or directory") and not out.exists()
    assert main([*common, "--corpus", str(corpus), "--activation", "topk"]) == 1
    assert "needs k > 0" in capsys.readouterr().err and not out.exists()
    assert main([*common, "--corpus", str(corpus), "--steps", "3", "--d-transcoder", "16", "--eval-batches", "1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == ["layer 0", "layer 1", "layer 2"]
    assert [tc.d_transcoder for tc in load_transcoders(out)] == [16, 16, 16]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the staging folder is gone


@pytest.mark.parametrize("name", ["dcpythia-synth", "pythia-synth"])
def test_shipped_transcoders_meet_their_goals(name):
    """The transcoders shipped beside each embedded model: the metrics stored with them (measured on held-out
    samples of the tasks) and those measured here on fresh samples under issue 61's goals: FVU < 0.1, L0 < 16 per
    token, fewer than 10% dead features (dead counted on the stored measurement's 20,480 tokens)."""
    model = HookedDCFormer.from_pretrained(name).eval().requires_grad_(False)
    transcoders = load_transcoders(name)
    assert [tc.layer for tc in transcoders] == list(range(model.cfg.n_layers))
    assert all(tc.activation == "relu" for tc in transcoders)  # what circuit-tracer's loader reads
    stored = yaml.safe_load(
        (Path(dcinterp.__file__).parent / "checkpoints" / name / "transcoders" / "config.yaml").read_text()
    )
    for metrics in stored["metrics"]:
        assert metrics["fvu"] < 0.1 and metrics["l0"] < 16 and metrics["dead"] < 0.1, metrics
    fresh = [unbracket(record["texts"])[0] for record in generate(seed=7, samples_per_task=1)]  # 74 new samples
    for metrics in transcoder_metrics(model, transcoders, list(token_batches(model, fresh, 8, 64))[:8]):
        assert metrics["fvu"] < 0.1 and metrics["l0"] < 16, metrics
