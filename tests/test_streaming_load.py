"""Loading streams: random checkpoints in the official layouts load exactly, in any dtype, from shards of either
file format, with peak memory close to the weights themselves and nothing left mapped."""

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dcinterp import HookedDCFormer
from dcinterp.random_checkpoint import official_shapes, scaled, write_random_checkpoint

SMALL_DCPYTHIA = {
    "model_type": "dcpythia",
    "dim": 64,
    "n_layer": 2,
    "n_head": 4,
    "head_dim": 16,
    "intermediate_size": 256,
    "vocab_size": 300,
    "block_size": 128,
    "rotary_pct": 0.25,
    "use_qk_norm": True,
    "use_dcmha": True,
    "window_size": 8,
    "window_type": None,
}
SMALL_DCFORMER = {
    **{k: v for k, v in SMALL_DCPYTHIA.items() if k != "window_type"},
    "model_type": "dcformer",
    "window_type": "LG",
    "rope_base": 500000,
}
SMALL_NEOX = {
    "model_type": "gpt_neox",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "vocab_size": 300,
    "rotary_pct": 0.25,
}


def read_raw(directory: Path) -> dict[str, torch.Tensor]:
    raw = {}
    for path in sorted(directory.iterdir()):
        if path.suffix == ".safetensors":
            raw |= load_file(path)
        elif path.suffix == ".bin":
            raw |= torch.load(path, weights_only=True)
    return raw


@pytest.mark.parametrize("config", [SMALL_DCPYTHIA, SMALL_DCFORMER, SMALL_NEOX], ids=["dcpythia", "dcformer", "neox"])
@pytest.mark.parametrize("file_format", ["safetensors", "bin"])
def test_sharded_random_checkpoint_loads_exactly_in_every_dtype(tmp_path, config, file_format):
    directory = write_random_checkpoint(tmp_path / "ckpt", config, file_format, shard_bytes=60_000)
    assert len(list(directory.glob(f"*.{file_format}"))) > 2 and list(directory.glob("*.index.json"))
    raw = read_raw(directory)
    assert {k: tuple(v.shape) for k, v in raw.items()} == official_shapes(config)
    exact = HookedDCFormer.from_pretrained(directory, dtype=torch.float32)  # float16 -> float32 loses nothing
    # The layout conversion, checked by hand on a few weights:
    if config["model_type"] == "gpt_neox":
        torch.testing.assert_close(exact.W_E, raw["gpt_neox.embed_in.weight"].float(), rtol=0, atol=0)
        qkv = raw["gpt_neox.layers.1.attention.query_key_value.weight"].float().reshape(4, 3, 16, 64)
        torch.testing.assert_close(exact.blocks[1].attn.W_K, qkv[:, 1].transpose(1, 2), rtol=0, atol=0)
    else:
        torch.testing.assert_close(exact.W_E, raw["tok_embeddings.weight"].float(), rtol=0, atol=0)
        torch.testing.assert_close(exact.W_U, raw["output.weight"].float().T, rtol=0, atol=0)
        wk = raw["layers.1.attention.wqkv.weight"].float()[64:128]
        torch.testing.assert_close(exact.blocks[1].attn.W_K, wk.reshape(4, 16, 64).transpose(1, 2), rtol=0, atol=0)
    for dtype in (torch.float16, torch.bfloat16):
        with pytest.warns(UserWarning, match="on the CPU"):
            loaded = HookedDCFormer.from_pretrained(directory, dtype=dtype)
        for (name, p), (_, q) in zip(loaded.named_parameters(), exact.named_parameters(), strict=True):
            assert p.dtype == dtype and p.is_contiguous() and not p.requires_grad, name
            assert torch.equal(p, q.to(dtype)), name


def test_nothing_stays_mapped_after_loading(tmp_path):
    directory = write_random_checkpoint(tmp_path / "ckpt", SMALL_DCPYTHIA, "bin", shard_bytes=60_000)
    for dtype in (torch.float32, torch.float16):  # float16 is the file's own dtype: no conversion to copy it
        model = HookedDCFormer.from_pretrained(directory, dtype=dtype)
        gc.collect()
        assert str(directory) not in Path("/proc/self/maps").read_text()
        assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("file_format,dtype", [("bin", "bfloat16"), ("safetensors", "float32"), ("bin", "float16")])
def test_peak_memory_of_a_load_is_close_to_the_weights(tmp_path_factory, file_format, dtype):
    # ~85M parameters (170 MB of float16 shards): large next to the allocator's noise, small for a test.
    config = scaled(
        SMALL_DCPYTHIA, dim=1024, n_head=8, head_dim=128, intermediate_size=4096, vocab_size=16384, n_layer=4
    )
    directory = write_random_checkpoint(
        tmp_path_factory.mktemp(file_format), config, file_format, shard_bytes=60 * 2**20
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "dcinterp.memory", str(directory), dtype],
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(out.stdout)
    assert measured["peak_over_weights"] <= 1.3, measured
