"""Random checkpoints in the official layouts, of any size: to size a machine before the real download arrives.

    from dcinterp.random_checkpoint import DCPYTHIA_6_9B, write_random_checkpoint
    write_random_checkpoint("/tmp/dcpythia-6.9b-random", DCPYTHIA_6_9B)          # 13 GiB of float16 shards
    HookedDCFormer.from_pretrained("/tmp/dcpythia-6.9b-random", dtype=torch.bfloat16, device="cuda")

The config dicts are the `config.json` of the release; the weights are float16 noise in the same keys, shapes and
shards (`model-00001-of-00003.safetensors` + index, or `pytorch_model-...bin`), so loading, memory and speed are
those of the real model. The benchmarks and the loading tests build theirs with this module.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# config.json of the authors' DCPythia-6.9B release (Caiyun-AI/DCFormer, pytorch/dcpythia/config.json).
DCPYTHIA_6_9B = {
    "model_type": "dcpythia",
    "dim": 4096,
    "n_layer": 32,
    "n_head": 32,
    "head_dim": 128,
    "intermediate_size": 16384,
    "vocab_size": 50257,
    "block_size": 2048,
    "rotary_pct": 0.25,
    "rope_base": 10000,
    "norm_eps": 1e-5,
    "use_qk_norm": True,
    "use_dcmha": True,
    "query_wise": False,
    "use_parallel_residual": True,
    "use_linear_bias": True,
    "window_size": 256,
    "window_type": None,
    "torch_dtype": "float16",
}
# Pythia-6.9B's shape in Hugging Face's GPT-NeoX layout (the MHA baseline).
PYTHIA_6_9B = {
    "model_type": "gpt_neox",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "intermediate_size": 16384,
    "vocab_size": 50432,
    "max_position_embeddings": 2048,
    "rotary_pct": 0.25,
    "rotary_emb_base": 10000,
    "layer_norm_eps": 1e-5,
    "use_parallel_residual": True,
    "hidden_act": "gelu",
    "torch_dtype": "float16",
}


def scaled(config: dict, **changes) -> dict:
    """A copy of a config with some sizes changed.

    Args:
        config: an official or GPT-NeoX config dict.
        **changes: the sizes to change, by their key names in `config`.

    Returns:
        The changed copy.
    """
    return {**config, **changes}


def official_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every key of the checkpoint and its shape, in the file layout of the config's `model_type`.

    Args:
        config: an official or GPT-NeoX config dict.

    Returns:
        {key: shape}.
    """
    if config["model_type"] == "gpt_neox":
        return _gpt_neox_shapes(config)
    D, H, F, V = config["dim"], config["n_head"], config["intermediate_size"], config["vocab_size"]
    E = config.get("head_dim") or D // H
    K, R = 4 * H, 2
    pythia = config["model_type"] == "dcpythia"
    bias = pythia and config.get("use_linear_bias", True)
    shapes = {"tok_embeddings.weight": (V, D)}
    for l in range(config["n_layer"]):
        a, f = f"layers.{l}.attention.", f"layers.{l}.feed_forward."
        shapes[a + "wqkv.weight"] = (3 * H * E, D)
        shapes[a + "wo.weight"] = (D, H * E)
        if bias:
            shapes[a + "wqkv.bias"], shapes[a + "wo.bias"] = (3 * H * E,), (D,)
        if config.get("use_qk_norm"):
            shapes[a + "q_norm.scale"] = shapes[a + "k_norm.scale"] = (E,)
        if config.get("use_dcmha", True):
            shapes[a + "dyn_w_proj.dw1"] = (D, 1, 4, K)
            shapes[a + "dyn_w_proj.qkw"] = (1, 4, K, 2 * R, H)
            shapes[a + "dyn_w_proj.dd"] = (D, 1, 4 * H)
        for norm in ("attention_norm", "ffn_norm"):
            shapes[f"layers.{l}.{norm}.weight"] = (D,)
            if pythia:
                shapes[f"layers.{l}.{norm}.bias"] = (D,)
        if pythia:
            shapes[f + "w1.weight"], shapes[f + "w2.weight"] = (F, D), (D, F)
            if bias:
                shapes[f + "w1.bias"], shapes[f + "w2.bias"] = (F,), (D,)
        else:
            shapes[f + "w1.weight"] = shapes[f + "w3.weight"] = (F, D)
            shapes[f + "w2.weight"] = (D, F)
    shapes["norm.weight"] = (D,)
    if pythia:
        shapes["norm.bias"] = (D,)
    shapes["output.weight"] = (V, D)
    return shapes


def _gpt_neox_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    D, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    shapes = {"gpt_neox.embed_in.weight": (V, D)}
    for l in range(config["num_hidden_layers"]):
        p = f"gpt_neox.layers.{l}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[p + f"{norm}.weight"] = shapes[p + f"{norm}.bias"] = (D,)
        shapes[p + "attention.query_key_value.weight"], shapes[p + "attention.query_key_value.bias"] = (
            (3 * D, D),
            (3 * D,),
        )
        shapes[p + "attention.dense.weight"], shapes[p + "attention.dense.bias"] = (D, D), (D,)
        shapes[p + "mlp.dense_h_to_4h.weight"], shapes[p + "mlp.dense_h_to_4h.bias"] = (F, D), (F,)
        shapes[p + "mlp.dense_4h_to_h.weight"], shapes[p + "mlp.dense_4h_to_h.bias"] = (D, F), (D,)
    shapes["gpt_neox.final_layer_norm.weight"] = shapes["gpt_neox.final_layer_norm.bias"] = (D,)
    shapes["embed_out.weight"] = (V, D)
    return shapes


def n_parameters(config: dict) -> int:
    """The number of parameters a checkpoint of this config holds.

    Args:
        config: an official or GPT-NeoX config dict.

    Returns:
        The count.
    """
    return sum(torch.Size(shape).numel() for shape in official_shapes(config).values())


def write_random_checkpoint(
    directory,
    config: dict,
    file_format: str = "safetensors",
    dtype=torch.float16,
    shard_bytes: int = 2 * 2**30,
    seed: int = 0,
    device="cpu",
) -> Path:
    """Write config.json and random weights (normal, std 0.02; norm scales near 1) in shards.

    A `*.index.json` is written when there is more than one shard.

    Args:
        directory: where to write (created if missing).
        config: an official or GPT-NeoX config dict.
        file_format: "safetensors" or "bin".
        dtype: the weights' dtype.
        shard_bytes: the largest shard.
        seed: seeds the weights.
        device: where the numbers are drawn; "cuda" is much faster for a 7B model, and draws other numbers.

    Returns:
        The directory.

    Raises:
        ValueError: an unknown `file_format`.
    """
    if file_format not in ("safetensors", "bin"):
        raise ValueError(f"file_format must be 'safetensors' or 'bin', not {file_format!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generator = torch.Generator(device).manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    shapes = official_shapes(config)
    for key, shape in shapes.items():
        nbytes = torch.Size(shape).numel() * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes

    stem, suffix = ("model", ".safetensors") if file_format == "safetensors" else ("pytorch_model", ".bin")
    names = (
        [f"{stem}{suffix}"]
        if len(shards) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{suffix}" for i in range(len(shards))]
    )
    weight_map = {}
    for name, keys in zip(names, shards, strict=True):
        tensors = {key: _random(shapes[key], key, dtype, generator) for key in keys}
        if file_format == "safetensors":
            save_file(tensors, str(directory / name), metadata={"format": "pt"})
        else:
            torch.save(tensors, directory / name)
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    if len(names) > 1:
        total = sum(torch.Size(s).numel() for s in shapes.values()) * itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / f"{stem}{suffix}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return directory


def write_tokenizer(directory, texts: list[str], vocab_size: int = 2048) -> Path:
    """A byte-level BPE tokenizer trained on `texts`, saved as `tokenizer.json` in a random checkpoint.

    GPT-NeoX style: words carry their leading space ("Ġburger"). Prompts can then be run through the checkpoint.

    Args:
        directory: where to save it.
        texts: the training texts.
        vocab_size: ids stay below it.

    Returns:
        The directory.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    directory = Path(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def _random(shape: tuple[int, ...], key: str, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    values = torch.randn(shape, generator=generator, device=generator.device, dtype=dtype) * 0.02
    if key.endswith(("norm.weight", "norm.scale", "layernorm.weight")):
        values += 1.0
    return values.cpu()
