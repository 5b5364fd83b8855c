"""One configuration for every model dcinterp runs: DCPythia, DCFormer++, and their plain-MHA twins.

Field names follow TransformerLens (`n_layers`, `d_model`, `d_head`, `d_mlp`, `d_vocab`, `normalization_type`, ...)
so that TransformerLens tools (ActivationCache, FactoredMatrix, ...) can read them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

COMPOSE_STAGES = ("pre", "post")
COMPOSE_BRANCHES = ("qp", "kp", "qg", "kg")
WINDOW_SEMANTICS = ("training", "official-inference")

# Which layers are local (sliding window) in each of the released layouts; the pattern repeats. A window_type
# may also be any other pattern of L (local) and G (global) layers, e.g. "LGG".
WINDOW_PATTERNS = {
    "LG": "LG",
    "LGLL": "LGLL",
    "LGL6": "LG" + "L" * 6,
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """A torch.dtype from itself or its name ("bfloat16", "torch.bfloat16").

    Args:
        value: a torch.dtype or its name.

    Returns:
        The dtype.

    Raises:
        ValueError: not a floating-point torch dtype.
    """
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: {value!r} is not a floating-point torch dtype (float32, float16, bfloat16, ...)")
    return dtype


@dataclass
class DCFormerConfig:
    """The shape and conventions of a DCFormer, DCPythia or plain-MHA model.

    Attributes:
        n_layers: blocks.
        d_model: the residual stream's width.
        n_heads: heads per layer.
        d_head: each head's width.
        d_mlp: the MLP's hidden width.
        d_vocab: the vocabulary's size.
        n_ctx: the longest context.
        model_name: a name, shown in reprs.
        normalization_type: "LN" (LayerNorm with bias) or "RMS".
        norm_eps: the norms' epsilon.
        parallel_residual: attention and MLP read the same stream (DCPythia); False: sequential (DCFormer++).
        act_fn: "gelu" (exact erf) or "swiglu".
        use_bias: biases on the attention and MLP projections.
        mgate_dim: DCFormer++ "mgate": SwiGLU activations in groups of this size scaled by softmax(mg x) (None: off).
        rotary_pct: share of each head's dims that rotary rotates ("half" pairing: j with j + r/2).
        rotary_base: rotary's base.
        use_qk_norm: RMSNorm with scale over the head dim on q and k, before rotary.
        window_size: the sliding window of local layers.
        window_type: "LG", "LGLL", "LGL6", another L/G pattern ("LGG"), or None: all layers global.
        window: "training": a local layer admits window_size keys (t - window_size < s <= t), as the authors' JAX
            training; "official-inference": window_size + 1 keys and rotary tables rounded to float16, as their
            PyTorch inference code for DCPythia (modeling_dcpythia.py), to match its outputs exactly. DCFormer++'s
            inference code admits window_size keys, so keep "training" for those (docs/conventions.md).
        use_dcmha: DCMHA; False gives plain MHA (Pythia / Transformer++ baselines).
        query_wise: only the two query-side branches (qp, qg).
        compose_stages: the compose stages run; switch "pre" or "post" off (paper Table 9).
        compose_branches: the branches run; switch any of qp, kp, qg, kg off (paper Table 9).
        dcmha_rank: R, the rank of the dynamic projections.
        dyn_hidden_dim: K, the hidden size of the dynamic-weight FFN (None: 4 * n_heads, the official value).
        use_attn_result: compute blocks.{l}.attn.hook_result (per-head output in the residual basis).
        default_prepend_bos: to_tokens prepends BOS; False: it adds only what the tokenizer adds itself.
        dtype: a torch.dtype, as TransformerLens reads it; "float32" etc. accepted.
        attn_only: read by TransformerLens; set by loading, never saved.
        device: where the forward starts (the embedding); set by loading, never saved.
        n_key_value_heads: read by TransformerLens; None: no grouped-query attention.
        use_split_qkv_input: per-head q/k/v input forks.
        use_attn_in: blocks.{l}.hook_attn_in fires.
        use_hook_mlp_in: blocks.{l}.hook_mlp_in fires.
        positional_embedding_type: read by TransformerLens.

    Raises:
        ValueError: a field out of its choices, or inconsistent fields.
    """

    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int = 2048
    model_name: str = "dcformer"

    # Block layout. DCPythia: LN, parallel residual, GELU MLP with biases. DCFormer++: RMS, sequential, SwiGLU.
    normalization_type: str = "LN"
    norm_eps: float = 1e-5
    parallel_residual: bool = True
    act_fn: str = "gelu"
    use_bias: bool = True
    mgate_dim: int | None = None

    # Attention.
    rotary_pct: float = 1.0
    rotary_base: float = 10000.0
    use_qk_norm: bool = True
    window_size: int | None = None
    window_type: str | None = None
    window: str = "training"

    # DCMHA. use_dcmha=False gives plain MHA (Pythia / Transformer++ baselines).
    use_dcmha: bool = True
    query_wise: bool = False
    compose_stages: tuple[str, ...] = COMPOSE_STAGES
    compose_branches: tuple[str, ...] = COMPOSE_BRANCHES
    dcmha_rank: int = 2
    dyn_hidden_dim: int | None = None

    # TransformerLens behaviour switches.
    use_attn_result: bool = False
    default_prepend_bos: bool = False
    dtype: torch.dtype = torch.float32

    # Read by TransformerLens' ActivationCache and utilities; set by loading, never saved.
    attn_only: bool = field(default=False, init=False, repr=False)
    device: str | None = field(default=None, init=False, repr=False)
    n_key_value_heads: int | None = field(default=None, init=False, repr=False)
    use_split_qkv_input: bool = field(default=False, init=False, repr=False)
    use_attn_in: bool = field(default=False, init=False, repr=False)
    use_hook_mlp_in: bool = field(default=False, init=False, repr=False)
    positional_embedding_type: str = field(default="rotary", init=False, repr=False)

    def __setattr__(self, name, value) -> None:
        if name == "dtype":  # config.json and older callers give a name ("bfloat16"); TransformerLens a torch.dtype
            value = parse_dtype(value)
        super().__setattr__(name, value)

    def __post_init__(self) -> None:
        self.compose_stages = tuple(self.compose_stages)
        self.compose_branches = tuple(self.compose_branches)
        if self.dyn_hidden_dim is None:
            self.dyn_hidden_dim = 4 * self.n_heads
        if self.normalization_type not in ("LN", "RMS"):
            raise ValueError(f"normalization_type must be 'LN' or 'RMS', not {self.normalization_type!r}")
        if self.act_fn not in ("gelu", "swiglu"):
            raise ValueError(f"act_fn must be 'gelu' or 'swiglu', not {self.act_fn!r}")
        if self.window_type is not None and not set(self.window_pattern) <= {"L", "G"}:
            raise ValueError(
                f"window_type must be one of {sorted(WINDOW_PATTERNS)}, a pattern of L (local) and G "
                f"(global) layers, or None, not {self.window_type!r}"
            )
        if self.window not in WINDOW_SEMANTICS:
            raise ValueError(f"window must be one of {WINDOW_SEMANTICS}, not {self.window!r}")
        if self.window_type is not None and not self.window_size:
            raise ValueError(f"window_type {self.window_type!r} needs a window_size")
        for stage in self.compose_stages:
            if stage not in COMPOSE_STAGES:
                raise ValueError(f"compose_stages: unknown stage {stage!r} (known: {COMPOSE_STAGES})")
        for branch in self.compose_branches:
            if branch not in COMPOSE_BRANCHES:
                raise ValueError(f"compose_branches: unknown branch {branch!r} (known: {COMPOSE_BRANCHES})")
        if self.mgate_dim is not None and self.d_mlp % self.mgate_dim:
            raise ValueError(f"d_mlp {self.d_mlp} is not a multiple of mgate_dim {self.mgate_dim}")

    @property
    def active_branches(self) -> tuple[str, ...]:
        """The compose branches this model runs: `compose_branches` less the key side when `query_wise`."""
        if self.query_wise:
            return tuple(b for b in self.compose_branches if b in ("qp", "qg"))
        return self.compose_branches

    @property
    def rotary_dim(self) -> int:
        """Dims that rotary rotates: d_head * rotary_pct, rounded down to an even number (dims rotate in pairs)."""
        dim = int(self.d_head * self.rotary_pct)
        return dim - dim % 2

    @property
    def final_rms(self) -> bool:
        return self.normalization_type == "RMS"

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype

    # TransformerLens names for what the fields above already say.
    @property
    def d_vocab_out(self) -> int:
        return self.d_vocab

    @property
    def parallel_attn_mlp(self) -> bool:
        return self.parallel_residual

    @property
    def gated_mlp(self) -> bool:
        return self.act_fn == "swiglu"

    @property
    def attn_types(self) -> list[str] | None:
        """ "local" or "global" per layer, as TransformerLens writes it; None when every layer is global."""
        if self.window_type is None:
            return None
        return ["local" if self.layer_window(layer) else "global" for layer in range(self.n_layers)]

    @property
    def original_architecture(self) -> str:
        return "DCFormer" if self.use_dcmha else "GPTNeoX-like"

    @property
    def window_pattern(self) -> str:
        """Local (L) and global (G) layers, repeated over the depth; "G" when there are no local layers."""
        return WINDOW_PATTERNS.get(self.window_type, self.window_type or "G")

    def layer_window(self, layer: int) -> int | None:
        """The sliding-window size of a layer, or None for a global layer.

        Args:
            layer: the layer.

        Returns:
            The window, or None.
        """
        pattern = self.window_pattern
        return self.window_size if pattern[layer % len(pattern)] == "L" else None

    def to_dict(self) -> dict:
        """The config's constructor fields as JSON-ready values (the dtype by name)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        values["dtype"] = str(self.dtype).removeprefix("torch.")
        return values

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "DCFormerConfig":
        """A config from a dict of its constructor fields.

        Args:
            values: the fields.
            source: the file, named in the error.

        Returns:
            The config.

        Raises:
            ValueError: unknown keys, named, or as the constructor.
        """
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown config keys {unknown}")
        return cls(**values)

    def save(self, path: str | Path) -> None:
        """Write the config as JSON, with `"model_type": "dcinterp"`.

        Args:
            path: the file.
        """
        Path(path).write_text(json.dumps({"model_type": "dcinterp", **self.to_dict()}, indent=2) + "\n")
