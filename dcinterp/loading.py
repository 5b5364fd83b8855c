"""Load checkpoints into HookedDCFormer, from local directories only; save in dcinterp's own format.

Formats, told apart by `config.json`'s `model_type`:
- `dcpythia`, `dcformer`: the authors' releases (Caiyun-AI/DCFormer), `.bin` or `.safetensors`, single or sharded;
- `gpt_neox`: Hugging Face Pythia checkpoints, loaded as the plain-MHA baseline;
- `dcinterp`: what `HookedDCFormer.save_pretrained` writes.
Nothing is downloaded and no code from the directory is run: `.bin` files are read with `weights_only=True`.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors
from torch import Tensor

from .config import DCFormerConfig
from .model import HookedDCFormer

EMBEDDED_DIR = Path(__file__).parent / "checkpoints"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LEGACY_KEYS = {"W_E": "embed.W_E", "W_U": "unembed.W_U"}  # dcinterp checkpoints saved before embed/unembed


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and key at fault."""


# --------------------------------------------------------------------------------------------------
# Entry points
def load_pretrained(path_or_name, dtype=None, device=None) -> HookedDCFormer:
    directory = resolve_checkpoint(path_or_name)
    config_file = directory / "config.json"
    raw = read_json(config_file)
    model_type = raw.get("model_type")
    converters = {"dcpythia": convert_official, "dcformer": convert_official, "gpt_neox": convert_gpt_neox}
    dtype = resolve_dtype(dtype)
    if model_type == "dcinterp":
        try:
            cfg = DCFormerConfig.from_dict({k: v for k, v in raw.items() if k != "model_type"}, source=str(config_file))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{config_file}: {e}") from None
        state, origin = read_state_dict(directory)
        state = {LEGACY_KEYS.get(k, k): v for k, v in state.items()}
    elif model_type in converters:
        cfg = config_from_official(raw, config_file) if model_type != "gpt_neox" else config_from_gpt_neox(raw, config_file)
        state, origin = read_state_dict(directory)
        take = _Taker(state, origin, directory)
        try:
            state = converters[model_type](take, cfg)
        except RuntimeError as e:  # a reshape that does not fit: the weight's shape disagrees with config.json
            raise CheckpointError(f"{origin[take.last]}: weight {take.last!r} does not fit config.json ({e})") from None
    else:
        known = ["dcinterp", *converters]
        raise CheckpointError(f"{config_file}: unknown model_type {model_type!r} (known: {', '.join(known)})")
    cfg.dtype = str(dtype).removeprefix("torch.")

    with torch.device("meta"):
        model = HookedDCFormer(cfg, init=False)
    check_state_dict(state, origin, model, directory)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    model.tokenizer = load_tokenizer(directory)
    model = model.to(device) if device is not None else model
    model.cfg.device = str(model.W_E.device)
    return model.eval().requires_grad_(False)  # inference: no autograd graph over the weights


def save_pretrained(model: HookedDCFormer, directory) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.cfg.save(directory / "config.json")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_safetensors(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(directory))


def embedded_models() -> list[str]:
    """Names of the models shipped inside the package (load them with `from_pretrained(name)`)."""
    if not EMBEDDED_DIR.is_dir():
        return []
    return sorted(p.name for p in EMBEDDED_DIR.iterdir() if (p / "config.json").is_file())


def resolve_checkpoint(path_or_name) -> Path:
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return path
    if (EMBEDDED_DIR / str(path_or_name) / "config.json").is_file():
        return EMBEDDED_DIR / str(path_or_name)
    embedded = ", ".join(embedded_models()) or "none"
    raise CheckpointError(f"{path_or_name}: not a checkpoint directory nor an embedded model (embedded: {embedded})")


def resolve_dtype(dtype) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if str(dtype).removeprefix("torch.") not in names:
        raise ValueError(f"unknown dtype {dtype!r} (use float32, float16 or bfloat16)")
    return names[str(dtype).removeprefix("torch.")]


# --------------------------------------------------------------------------------------------------
# Reading files
def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint: a single file, or the shards an index json names."""
    for name in WEIGHT_FILES:
        index = directory / f"{name}.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map'")
            shards = [directory / shard for shard in dict.fromkeys(weight_map.values())]
            for shard in shards:
                if not shard.is_file():
                    raise CheckpointError(f"{shard}: shard named in {index.name} is missing")
            return shards
        if (directory / name).is_file():
            return [directory / name]
    raise CheckpointError(f"{directory}: no weights (looked for {', '.join(WEIGHT_FILES)} and their .index.json)")


def read_weight_file(path: Path) -> dict[str, Tensor]:
    if path.suffix == ".safetensors":
        try:
            return load_safetensors(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: refused to unpickle anything but plain tensors ({first_line})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a readable PyTorch file ({first_line})") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a flat dict of tensors")
    return state


def read_state_dict(directory: Path) -> tuple[dict[str, Tensor], dict[str, Path]]:
    """All weights of a checkpoint, and the file each key came from."""
    state: dict[str, Tensor] = {}
    origin: dict[str, Path] = {}
    for path in weight_files(directory):
        for key, value in read_weight_file(path).items():
            if key in state:
                raise CheckpointError(f"{path}: key {key!r} is also in {origin[key].name}")
            state[key], origin[key] = value, path
    return state, origin


def check_state_dict(state: dict[str, Tensor], origin: dict, model: HookedDCFormer, directory: Path) -> None:
    """Same keys and shapes as the model's; `origin` maps a key to the file (or source key) it came from."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{directory}: missing weight {missing[0]!r}{more}")
    for key, value in state.items():
        where = origin.get(key, directory)
        if key not in expected:
            raise CheckpointError(f"{where}: unexpected weight {key!r}")
        if tuple(value.shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"{where}: weight {key!r} has shape {tuple(value.shape)}, expected {tuple(expected[key].shape)}"
            )


def load_tokenizer(directory: Path):
    """The tokenizer in a checkpoint directory, loaded offline (None if there is none)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer_json = directory / "tokenizer.json"
    if tokenizer_json.is_file():
        special = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            config = read_json(config_file)
            for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
                token = config.get(name)
                token = token.get("content") if isinstance(token, dict) else token
                if isinstance(token, str):
                    special[name] = token
        try:
            return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), **special)
        except Exception as e:  # tokenizers raises its own exception types
            raise CheckpointError(f"{tokenizer_json}: not a readable tokenizer ({e})") from None
    if any((directory / f).is_file() for f in ("vocab.json", "tokenizer.model", "vocab.txt")):
        try:
            return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
        except Exception as e:
            raise CheckpointError(f"{directory}: tokenizer files present but not loadable offline ({e})") from None
    return None


# --------------------------------------------------------------------------------------------------
# The authors' DCPythia / DCFormer releases
def config_from_official(raw: dict, source: Path) -> DCFormerConfig:
    need = _required(raw, source)
    is_pythia = raw["model_type"] == "dcpythia"
    n_heads = need("n_head")
    if raw.get("n_local_heads", n_heads) != n_heads:
        raise CheckpointError(f"{source}: n_local_heads != n_head (grouped-query attention) is not supported")
    window_size = raw.get("window_size")
    window_type = raw.get("window_type")
    if window_type is None and window_size:
        window_type = "LG"  # the official code's meaning of window_type null
    mgate = raw.get("mgate", False)
    return DCFormerConfig(
        model_name=raw.get("name_or_path") or raw["model_type"],
        n_layers=need("n_layer"),
        d_model=need("dim"),
        n_heads=n_heads,
        d_head=raw.get("head_dim") or need("dim") // n_heads,
        d_mlp=need("intermediate_size"),
        d_vocab=need("vocab_size"),
        n_ctx=raw.get("block_size", 2048),
        normalization_type="LN" if is_pythia else "RMS",
        norm_eps=raw.get("norm_eps", 1e-5),
        parallel_residual=raw.get("use_parallel_residual", True) if is_pythia else False,
        act_fn="gelu" if is_pythia else "swiglu",
        use_bias=raw.get("use_linear_bias", True) if is_pythia else False,
        mgate_dim=raw.get("mgate_dim") if mgate else None,
        rotary_pct=raw.get("rotary_pct", 0.25 if is_pythia else 1.0),
        rotary_base=float(raw.get("rope_base", 10000)),
        use_qk_norm=raw.get("use_qk_norm", False),
        window_size=window_size if window_type else None,
        window_type=window_type,
        use_dcmha=raw.get("use_dcmha", True),
        query_wise=raw.get("query_wise", False),
    )


OFFICIAL_IGNORED = ("dyn_w_proj.dw_m", "dyn_w_proj.qkw_m", "dyn_w_proj.sw", "pre_proj.w", "post_proj.w", "kv_cache.")


def convert_official(take: "_Taker", cfg: DCFormerConfig) -> dict[str, Tensor]:
    """Official DCPythia/DCFormer keys -> HookedDCFormer keys (weights in TransformerLens layouts)."""
    H, E, D = cfg.n_heads, cfg.d_head, cfg.d_model
    take.ignore(lambda key: any(part in key for part in OFFICIAL_IGNORED))
    out = {
        "embed.W_E": take("tok_embeddings.weight"),
        "unembed.W_U": take("output.weight").T,
        "ln_final.w": take("norm.weight"),
    }
    if cfg.normalization_type == "LN":
        out["ln_final.b"] = take("norm.bias")
    for l in range(cfg.n_layers):
        src, dst = f"layers.{l}.", f"blocks.{l}."
        a = src + "attention."
        if take.has(a + "wqkv.weight"):
            wq, wk, wv = take(a + "wqkv.weight").split(H * E)
            biases = take(a + "wqkv.bias").split(H * E) if cfg.use_bias else None
        else:
            wq, wk, wv = (take(a + f"w{n}.weight") for n in "qkv")
            biases = [take(a + f"w{n}.bias") for n in "qkv"] if cfg.use_bias else None
        for name, w in zip("QKV", (wq, wk, wv)):
            out[dst + f"attn.W_{name}"] = w.reshape(H, E, D).transpose(1, 2)
        if biases is not None:
            for name, b in zip("QKV", biases):
                out[dst + f"attn.b_{name}"] = b.reshape(H, E)
            out[dst + "attn.b_O"] = take(a + "wo.bias")
        out[dst + "attn.W_O"] = take(a + "wo.weight").T.reshape(H, E, D)
        if cfg.use_qk_norm:
            out[dst + "attn.q_norm.w"] = take(a + "q_norm.scale")
            out[dst + "attn.k_norm.w"] = take(a + "k_norm.scale")
        if cfg.use_dcmha:
            out[dst + "attn.W_dyn_in"] = take(a + "dyn_w_proj.dw1").squeeze(1)
            out[dst + "attn.W_dyn_out"] = take(a + "dyn_w_proj.qkw").squeeze(0)
            out[dst + "attn.W_dyn_gate"] = take(a + "dyn_w_proj.dd").reshape(D, 4, H)
        for ln, norm in (("ln1", "attention_norm"), ("ln2", "ffn_norm")):
            out[dst + f"{ln}.w"] = take(src + f"{norm}.weight")
            if cfg.normalization_type == "LN":
                out[dst + f"{ln}.b"] = take(src + f"{norm}.bias")
        f = src + "feed_forward."
        if cfg.act_fn == "gelu":
            out[dst + "mlp.W_in"] = take(f + "w1.weight").T
            out[dst + "mlp.W_out"] = take(f + "w2.weight").T
            if cfg.use_bias:
                out[dst + "mlp.b_in"] = take(f + "w1.bias")
                out[dst + "mlp.b_out"] = take(f + "w2.bias")
        else:
            out[dst + "mlp.W_gate"] = take(f + "w1.weight").T
            out[dst + "mlp.W_in"] = take(f + "w3.weight").T
            out[dst + "mlp.W_out"] = take(f + "w2.weight").T
            if cfg.mgate_dim:
                out[dst + "mlp.W_mgate"] = take(f + "mg.weight").T
    take.finish()
    return {k: v.contiguous() for k, v in out.items()}


# --------------------------------------------------------------------------------------------------
# Hugging Face GPT-NeoX (Pythia), the MHA baseline
def config_from_gpt_neox(raw: dict, source: Path) -> DCFormerConfig:
    need = _required(raw, source)
    if raw.get("hidden_act", "gelu") != "gelu":
        raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only 'gelu')")
    if raw.get("attention_bias", True) is False:
        raise CheckpointError(f"{source}: attention_bias false is not supported")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    n_heads = need("num_attention_heads")
    return DCFormerConfig(
        model_name=raw.get("_name_or_path") or "gpt_neox",
        n_layers=need("num_hidden_layers"),
        d_model=need("hidden_size"),
        n_heads=n_heads,
        d_head=need("hidden_size") // n_heads,
        d_mlp=need("intermediate_size"),
        d_vocab=need("vocab_size"),
        n_ctx=raw.get("max_position_embeddings", 2048),
        normalization_type="LN",
        norm_eps=raw.get("layer_norm_eps", 1e-5),
        parallel_residual=raw.get("use_parallel_residual", True),
        act_fn="gelu",
        use_bias=True,
        rotary_pct=rope.get("partial_rotary_factor", raw.get("rotary_pct", 0.25)),
        rotary_base=float(rope.get("rope_theta", raw.get("rotary_emb_base", 10000))),
        use_qk_norm=False,
        use_dcmha=False,
    )


NEOX_IGNORED = (".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")


def convert_gpt_neox(take: "_Taker", cfg: DCFormerConfig) -> dict[str, Tensor]:
    """Hugging Face GPT-NeoX keys -> HookedDCFormer keys."""
    H, E, D = cfg.n_heads, cfg.d_head, cfg.d_model
    take.ignore(lambda key: key.endswith(NEOX_IGNORED))
    out = {
        "embed.W_E": take("gpt_neox.embed_in.weight"),
        "unembed.W_U": take("embed_out.weight").T,
        "ln_final.w": take("gpt_neox.final_layer_norm.weight"),
        "ln_final.b": take("gpt_neox.final_layer_norm.bias"),
    }
    for l in range(cfg.n_layers):
        src, dst = f"gpt_neox.layers.{l}.", f"blocks.{l}."
        # query_key_value rows are interleaved per head: [head, (q|k|v), d_head].
        qkv = take(src + "attention.query_key_value.weight").reshape(H, 3, E, D)
        qkv_bias = take(src + "attention.query_key_value.bias").reshape(H, 3, E)
        for i, name in enumerate("QKV"):
            out[dst + f"attn.W_{name}"] = qkv[:, i].transpose(1, 2)
            out[dst + f"attn.b_{name}"] = qkv_bias[:, i]
        out[dst + "attn.W_O"] = take(src + "attention.dense.weight").T.reshape(H, E, D)
        out[dst + "attn.b_O"] = take(src + "attention.dense.bias")
        for ln, norm in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")):
            out[dst + f"{ln}.w"] = take(src + f"{norm}.weight")
            out[dst + f"{ln}.b"] = take(src + f"{norm}.bias")
        out[dst + "mlp.W_in"] = take(src + "mlp.dense_h_to_4h.weight").T
        out[dst + "mlp.b_in"] = take(src + "mlp.dense_h_to_4h.bias")
        out[dst + "mlp.W_out"] = take(src + "mlp.dense_4h_to_h.weight").T
        out[dst + "mlp.b_out"] = take(src + "mlp.dense_4h_to_h.bias")
    take.finish()
    return {k: v.contiguous() for k, v in out.items()}


def _required(raw: dict, source: Path):
    """need(key): raw[key], or a CheckpointError naming the config file and the key."""
    def need(key):
        if key not in raw:
            raise CheckpointError(f"{source}: missing key {key!r}")
        return raw[key]

    return need


class _Taker:
    """Pops keys from a source state dict, so that whatever is left over at the end is reported."""

    def __init__(self, state: dict[str, Tensor], origin: dict[str, Path], directory: Path):
        self.state, self.origin, self.directory = dict(state), origin, directory
        self.last = ""

    def ignore(self, unused) -> None:
        self.state = {k: v for k, v in self.state.items() if not unused(k)}

    def has(self, key: str) -> bool:
        return key in self.state

    def __call__(self, key: str) -> Tensor:
        if key not in self.state:
            raise CheckpointError(f"{self.directory}: missing weight {key!r}")
        self.last = key
        return self.state.pop(key)

    def finish(self) -> None:
        if self.state:
            extra = sorted(self.state)
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise CheckpointError(f"{self.origin[extra[0]]}: unexpected weight {extra[0]!r}{more}")
