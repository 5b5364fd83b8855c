"""The checkpoint formats' tensors into HookedDCFormer's: the configs and converters of the authors' DCPythia and
DCFormer releases, of Hugging Face GPT-NeoX (Pythia), and of dcinterp's own format.

A converter takes keys from the checkpoint's files through a `Taker` and yields (HookedDCFormer key, tensor) one at a
time, in TransformerLens' layouts; `dcinterp.loading` streams them into the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

from .config import DCFormerConfig

if TYPE_CHECKING:
    from .loading import CheckpointFiles

LEGACY_KEYS = {"W_E": "embed.W_E", "W_U": "unembed.W_U"}  # dcinterp checkpoints saved before embed/unembed


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and key at fault."""


# --------------------------------------------------------------------------------------------------
# The authors' DCPythia / DCFormer releases
def config_from_official(raw: dict, source: Path) -> DCFormerConfig:
    """The config of an official DCFormer/DCPythia checkpoint, from its config.json.

    Args:
        raw: the config.json's content.
        source: the file, named in errors.

    Returns:
        The config.

    Raises:
        CheckpointError: a missing key or a setting dcinterp does not support.
    """
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


def convert_own(take: "Taker", cfg: DCFormerConfig) -> Iterator[tuple[str, Tensor]]:
    """dcinterp's own format: the model's keys as they are (and the legacy top-level W_E / W_U).

    Args:
        take: takes keys from the checkpoint's files.
        cfg: the model's config.

    Yields:
        (HookedDCFormer key, tensor), one at a time.
    """
    for key in take.keys():
        yield LEGACY_KEYS.get(key, key), take(key)


def convert_official(take: "Taker", cfg: DCFormerConfig) -> Iterator[tuple[str, Tensor]]:
    """Official DCPythia/DCFormer keys -> HookedDCFormer keys (weights in TransformerLens layouts), one at a time.

    Args:
        take: takes keys from the checkpoint's files.
        cfg: the model's config.

    Yields:
        (HookedDCFormer key, tensor).
    """
    H, E, D = cfg.n_heads, cfg.d_head, cfg.d_model
    take.ignore(lambda key: any(part in key for part in OFFICIAL_IGNORED))
    yield "embed.W_E", take("tok_embeddings.weight")
    yield "unembed.W_U", take("output.weight").T
    yield "ln_final.w", take("norm.weight")
    if cfg.normalization_type == "LN":
        yield "ln_final.b", take("norm.bias")
    for l in range(cfg.n_layers):
        src, dst = f"layers.{l}.", f"blocks.{l}."
        a = src + "attention."
        if take.has(a + "wqkv.weight"):
            wq, wk, wv = take(a + "wqkv.weight").split(H * E)
            biases = take(a + "wqkv.bias").split(H * E) if cfg.use_bias else None
        else:
            wq, wk, wv = (take(a + f"w{n}.weight") for n in "qkv")
            biases = [take(a + f"w{n}.bias") for n in "qkv"] if cfg.use_bias else None
        for name, w in zip("QKV", (wq, wk, wv), strict=True):
            yield dst + f"attn.W_{name}", w.reshape(H, E, D).transpose(1, 2)
        if biases is not None:
            for name, b in zip("QKV", biases, strict=True):
                yield dst + f"attn.b_{name}", b.reshape(H, E)
            yield dst + "attn.b_O", take(a + "wo.bias")
        yield dst + "attn.W_O", take(a + "wo.weight").T.reshape(H, E, D)
        if cfg.use_qk_norm:
            yield dst + "attn.q_norm.w", take(a + "q_norm.scale")
            yield dst + "attn.k_norm.w", take(a + "k_norm.scale")
        if cfg.use_dcmha:
            yield dst + "attn.W_dyn_in", take(a + "dyn_w_proj.dw1").squeeze(1)
            yield dst + "attn.W_dyn_out", take(a + "dyn_w_proj.qkw").squeeze(0)
            yield dst + "attn.W_dyn_gate", take(a + "dyn_w_proj.dd").reshape(D, 4, H)
        for ln, norm in (("ln1", "attention_norm"), ("ln2", "ffn_norm")):
            yield dst + f"{ln}.w", take(src + f"{norm}.weight")
            if cfg.normalization_type == "LN":
                yield dst + f"{ln}.b", take(src + f"{norm}.bias")
        f = src + "feed_forward."
        if cfg.act_fn == "gelu":
            yield dst + "mlp.W_in", take(f + "w1.weight").T
            yield dst + "mlp.W_out", take(f + "w2.weight").T
            if cfg.use_bias:
                yield dst + "mlp.b_in", take(f + "w1.bias")
                yield dst + "mlp.b_out", take(f + "w2.bias")
        else:
            yield dst + "mlp.W_gate", take(f + "w1.weight").T
            yield dst + "mlp.W_in", take(f + "w3.weight").T
            yield dst + "mlp.W_out", take(f + "w2.weight").T
            if cfg.mgate_dim:
                yield dst + "mlp.W_mgate", take(f + "mg.weight").T


# --------------------------------------------------------------------------------------------------
# Hugging Face GPT-NeoX (Pythia), the MHA baseline
def config_from_gpt_neox(raw: dict, source: Path) -> DCFormerConfig:
    """The config of a Hugging Face GPT-NeoX checkpoint, from its config.json.

    Args:
        raw: what config.json holds.
        source: the config file, named in errors.

    Returns:
        The config, as a DCFormerConfig with use_dcmha=False.

    Raises:
        CheckpointError: a missing key, or an activation or bias setting dcinterp does not support.
    """
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


def convert_gpt_neox(take: "Taker", cfg: DCFormerConfig) -> Iterator[tuple[str, Tensor]]:
    """Hugging Face GPT-NeoX keys -> HookedDCFormer keys, one at a time.

    Args:
        take: takes keys from the checkpoint's files.
        cfg: the model's config.

    Yields:
        (HookedDCFormer key, tensor).
    """
    H, E, D = cfg.n_heads, cfg.d_head, cfg.d_model
    take.ignore(lambda key: key.endswith(NEOX_IGNORED))
    yield "embed.W_E", take("gpt_neox.embed_in.weight")
    yield "unembed.W_U", take("embed_out.weight").T
    yield "ln_final.w", take("gpt_neox.final_layer_norm.weight")
    yield "ln_final.b", take("gpt_neox.final_layer_norm.bias")
    for l in range(cfg.n_layers):
        src, dst = f"gpt_neox.layers.{l}.", f"blocks.{l}."
        # query_key_value rows are interleaved per head: [head, (q|k|v), d_head].
        qkv = take(src + "attention.query_key_value.weight").reshape(H, 3, E, D)
        qkv_bias = take(src + "attention.query_key_value.bias").reshape(H, 3, E)
        for i, name in enumerate("QKV"):
            yield dst + f"attn.W_{name}", qkv[:, i].transpose(1, 2)
            yield dst + f"attn.b_{name}", qkv_bias[:, i]
        yield dst + "attn.W_O", take(src + "attention.dense.weight").T.reshape(H, E, D)
        yield dst + "attn.b_O", take(src + "attention.dense.bias")
        for ln, norm in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")):
            yield dst + f"{ln}.w", take(src + f"{norm}.weight")
            yield dst + f"{ln}.b", take(src + f"{norm}.bias")
        yield dst + "mlp.W_in", take(src + "mlp.dense_h_to_4h.weight").T
        yield dst + "mlp.b_in", take(src + "mlp.dense_h_to_4h.bias")
        yield dst + "mlp.W_out", take(src + "mlp.dense_4h_to_h.weight").T
        yield dst + "mlp.b_out", take(src + "mlp.dense_4h_to_h.bias")


def _required(raw: dict, source: Path):
    """need(key): raw[key], or a CheckpointError naming the config file and the key."""

    def need(key):
        if key not in raw:
            raise CheckpointError(f"{source}: missing key {key!r}")
        return raw[key]

    return need


class Taker:
    """Takes keys from the checkpoint's files one at a time, so that whatever is left over at the end is reported.

    Args:
        files: the checkpoint's weight files.
    """

    def __init__(self, files: CheckpointFiles):
        self.files = files
        self.left = dict.fromkeys(files.keys())
        self.last = ""

    def ignore(self, unused) -> None:
        """Leave out the keys a format's files hold and the model does not use.

        Args:
            unused: key -> whether to leave it out.
        """
        self.left = {k: None for k in self.left if not unused(k)}

    def keys(self) -> list[str]:
        return list(self.left)

    def has(self, key: str) -> bool:
        """Whether the files hold `key`, not yet taken.

        Args:
            key: the checkpoint's key.
        """
        return key in self.left

    def __call__(self, key: str) -> Tensor:
        if key not in self.left:
            raise CheckpointError(f"{self.files.directory}: missing weight {key!r}")
        self.last = key
        del self.left[key]
        return self.files.get(key)

    def finish(self) -> None:
        if self.left:
            extra = sorted(self.left)
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise CheckpointError(f"{self.files.origin(extra[0])}: unexpected weight {extra[0]!r}{more}")
