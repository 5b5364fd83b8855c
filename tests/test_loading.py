"""Checkpoint layouts, save/load round trips, tokenizers, and the errors bad checkpoints give."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dcinterp import CheckpointError, DCFormerConfig, HookedDCFormer

FIXTURES = Path(__file__).parent / "fixtures"


def expected(name):
    return load_file(FIXTURES / name / "expected.safetensors")


def logits_of(directory, name, **kwargs):
    model = HookedDCFormer.from_pretrained(directory, **kwargs)
    with torch.no_grad():
        return model(expected(name)["input_ids"]).float()


def official_state(name) -> dict:
    directory = FIXTURES / name
    if (directory / "model.safetensors").exists():
        return load_file(directory / "model.safetensors")
    return torch.load(directory / "pytorch_model.bin", weights_only=True)


def copy_fixture(name, tmp_path, state=None, weights="model.safetensors") -> Path:
    directory = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
    directory.mkdir()
    shutil.copy(FIXTURES / name / "config.json", directory)
    state = official_state(name) if state is None else state
    if weights.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in state.items()}, directory / weights)
    else:
        torch.save(state, directory / weights)
    return directory


def assert_matches_reference(directory, name, tol=1e-4):
    assert (logits_of(directory, name) - expected(name)["logits"]).abs().max() < tol


def test_bin_as_safetensors_and_safetensors_as_bin(tmp_path):
    assert_matches_reference(copy_fixture("dcpythia-tiny", tmp_path), "dcpythia-tiny")
    assert_matches_reference(copy_fixture("dcformer-tiny", tmp_path, weights="pytorch_model.bin"), "dcformer-tiny")


def test_split_wq_wk_wv_layout(tmp_path):
    state = official_state("dcpythia-tiny")
    for key in [k for k in state if "wqkv" in k]:
        q, k, v = state.pop(key).split(32)
        for name, part in zip("qkv", (q, k, v), strict=True):
            state[key.replace("wqkv", f"w{name}")] = part
    assert_matches_reference(copy_fixture("dcpythia-tiny", tmp_path, state), "dcpythia-tiny")


def test_sharded_checkpoint_with_index(tmp_path):
    state = official_state("dcformer-tiny")
    directory = tmp_path / "sharded"
    directory.mkdir()
    shutil.copy(FIXTURES / "dcformer-tiny" / "config.json", directory)
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for file, names in shards.items():
        save_file({k: state[k].contiguous() for k in names}, directory / file)
    weight_map = {k: file for file, names in shards.items() for k in names}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert_matches_reference(directory, "dcformer-tiny")

    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        HookedDCFormer.from_pretrained(directory)


@pytest.mark.parametrize("disk_dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_disk_loads_in_float32(tmp_path, disk_dtype):
    state = {k: v.to(disk_dtype) for k, v in official_state("dcpythia-tiny").items()}
    model = HookedDCFormer.from_pretrained(copy_fixture("dcpythia-tiny", tmp_path, state))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        logits = model(expected("dcpythia-tiny")["input_ids"])
    assert (logits - expected("dcpythia-tiny")["logits"]).abs().max() < 0.05


def test_stale_merged_weights_are_ignored(tmp_path):
    state = official_state("dcpythia-tiny")
    stale = [k for k in state if k.endswith(("dw_m", "qkw_m"))]
    assert stale, "the fixture carries the merged copies"
    for key in stale:
        state[key] = torch.randn_like(state[key]) * 100
    assert_matches_reference(copy_fixture("dcpythia-tiny", tmp_path, state), "dcpythia-tiny")


@pytest.mark.parametrize("name", ["dcpythia-tiny", "dcformer-tiny"])
def test_save_pretrained_round_trips_exactly(tmp_path, name):
    model = HookedDCFormer.from_pretrained(FIXTURES / name)
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "dcinterp"
    again = HookedDCFormer.from_pretrained(tmp_path / "saved")
    assert again.cfg == model.cfg
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert k1 == k2 and torch.equal(v1, v2)
    tokens = expected(name)["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(tokens), again(tokens))


def word_tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def test_tokenizer_is_saved_loaded_and_used(tmp_path):
    cfg = DCFormerConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_mlp=32, d_vocab=8)
    model = HookedDCFormer(cfg, tokenizer=word_tokenizer(["Michelle", "has", "a", "burger", "."]))
    model.save_pretrained(tmp_path / "m")
    again = HookedDCFormer.from_pretrained(tmp_path / "m")
    assert again.to_tokens("Michelle has a burger").tolist() == [[2, 3, 4, 5]]
    assert again.to_tokens(["has a", "Michelle has a"]).tolist() == [[3, 4, 1], [2, 3, 4]]
    assert again.to_string(torch.tensor([2, 3])) == "Michelle has"
    assert again.to_str_tokens("a burger") == ["a", "burger"]
    assert again.to_single_token("burger") == 5
    torch.testing.assert_close(again("Michelle has a burger"), model("Michelle has a burger"))


def test_to_tokens_without_tokenizer_says_so():
    model = HookedDCFormer.from_pretrained(FIXTURES / "dcpythia-tiny")
    with pytest.raises(ValueError, match="no tokenizer"):
        model.to_tokens("hello")


# --------------------------------------------------------------------------------------------------
# Bad input: one clear error naming the file and the key.
def test_unknown_model_type(tmp_path):
    directory = copy_fixture("dcpythia-tiny", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"config.json: unknown model_type 'llama'"):
        HookedDCFormer.from_pretrained(directory)


def test_missing_directory_and_missing_weights(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        HookedDCFormer.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    shutil.copy(FIXTURES / "dcpythia-tiny" / "config.json", tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no weights"):
        HookedDCFormer.from_pretrained(tmp_path / "empty")


def test_missing_key(tmp_path):
    state = official_state("dcpythia-tiny")
    del state["layers.2.attention.dyn_w_proj.qkw"]
    with pytest.raises(CheckpointError, match=r"missing weight 'layers.2.attention.dyn_w_proj.qkw'"):
        HookedDCFormer.from_pretrained(copy_fixture("dcpythia-tiny", tmp_path, state))


def test_unexpected_key(tmp_path):
    state = {**official_state("dcformer-tiny"), "layers.0.attention.extra.weight": torch.zeros(3)}
    with pytest.raises(
        CheckpointError, match=r"model.safetensors: unexpected weight 'layers.0.attention.extra.weight'"
    ):
        HookedDCFormer.from_pretrained(copy_fixture("dcformer-tiny", tmp_path, state))


def test_wrong_shape(tmp_path):
    state = official_state("dcpythia-tiny")
    state["layers.1.attention.wo.weight"] = torch.zeros(32, 30)
    with pytest.raises(CheckpointError, match=r"'layers.1.attention.wo.weight'.*config.json"):
        HookedDCFormer.from_pretrained(copy_fixture("dcpythia-tiny", tmp_path, state))
    state = official_state("dcpythia-tiny")
    state["tok_embeddings.weight"] = torch.zeros(90, 32)
    with pytest.raises(CheckpointError, match=r"'embed.W_E' has shape \(90, 32\), expected \(97, 32\)"):
        HookedDCFormer.from_pretrained(copy_fixture("dcpythia-tiny", tmp_path, state))


def test_own_format_wrong_shape_names_key(tmp_path):
    model = HookedDCFormer.from_pretrained(FIXTURES / "dcpythia-tiny")
    model.save_pretrained(tmp_path / "saved")
    state = load_file(tmp_path / "saved" / "model.safetensors")
    state["blocks.0.attn.W_dyn_gate"] = torch.zeros(32, 4, 3)
    save_file(state, tmp_path / "saved" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: weight 'blocks.0.attn.W_dyn_gate' has shape"):
        HookedDCFormer.from_pretrained(tmp_path / "saved")


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_corrupt_file(tmp_path, weights):
    directory = copy_fixture("dcpythia-tiny", tmp_path, weights=weights)
    data = (directory / weights).read_bytes()
    (directory / weights).write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match=weights.replace(".", r"\.") + ": not a readable"):
        HookedDCFormer.from_pretrained(directory)


class NotATensor:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pickle_with_objects_is_refused(tmp_path, capsys):
    state = {**official_state("dcpythia-tiny"), "evil": NotATensor()}
    directory = copy_fixture("dcpythia-tiny", tmp_path, state, weights="pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: refused to unpickle"):
        HookedDCFormer.from_pretrained(directory)
    assert "this must never run" not in capsys.readouterr().out


def test_bad_config_json(tmp_path):
    directory = copy_fixture("dcpythia-tiny", tmp_path)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        HookedDCFormer.from_pretrained(directory)
    config = json.loads((FIXTURES / "dcpythia-tiny" / "config.json").read_text())
    del config["n_head"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json: missing key 'n_head'"):
        HookedDCFormer.from_pretrained(directory)


def test_remote_code_is_never_run(tmp_path):
    directory = copy_fixture("dcpythia-tiny", tmp_path)
    (directory / "modeling_dcpythia.py").write_text("raise SystemExit('remote code ran')\n")
    (directory / "configuration_dcpythia.py").write_text("raise SystemExit('remote code ran')\n")
    assert_matches_reference(directory, "dcpythia-tiny")
