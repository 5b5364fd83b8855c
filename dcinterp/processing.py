"""TransformerLens' weight processing for HookedDCFormer, done in place, and the cache that reads either model.

`process_weights_(model, fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)`
rewrites the weights so that the model computes the same log-probabilities with simpler parts, as TransformerLens'
`process_weights_`: each norm keeps only its centring and scaling (`hook_normalized` is then the normalised
stream before any weight), what writes to the residual stream has no component along the all-ones direction
(a LayerNorm removes it anyway), and the logits have mean 0 over the vocabulary. What DCMHA changes:

- `ln1`'s output feeds q, k, v *and* the dynamic-weight FFN of the compose (Eq. 5-6, `W_dyn_in`, `W_dyn_gate`):
  folding `ln1` folds into all five, and a LayerNorm bias becomes the FFN's biases `b_dyn_in`, `b_dyn_gate`.
- Centring is valid only where every reader of the residual stream is a centring LayerNorm: on an RMSNorm
  model (DCFormer++) `center_writing_weights` is skipped with one warning, as in TransformerLens.
- Value biases are folded into `b_O` only in layers whose attention rows sum to 1. After post-compose they do
  not (`hook_composed_pattern`'s rows: docs/weight-processing.md), so b_V's effect there depends on the input and
  stays in `b_V` (one warning says so).
- `refactor_factored_attn_matrices` is refused: with rotary embeddings the QK product depends on the relative
  position, and QK-norm makes q and k nonlinear in the stream (TransformerLens refuses rotary models too).

Every tensor is changed in place, one layer at a time: processing a streamed 6.9B model needs no second copy.
The arithmetic is TransformerLens' (`ProcessWeights.fold_layer_norm_*`, `center_*`), written out here on
parameters because its functions copy the whole state dict, and because TransformerLens 2-3 (which SAELens pins)
has no `weight_processing` module. docs/weight-processing.md has the story and the recipes.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from transformer_lens import ActivationCache
from transformer_lens.utilities import get_act_name

PROCESSING_OPTIONS = (
    "fold_ln",
    "center_writing_weights",
    "center_unembed",
    "fold_value_biases",
    "refactor_factored_attn_matrices",
)


@torch.no_grad()
def process_weights_(
    model,
    fold_ln: bool = True,
    center_writing_weights: bool = True,
    center_unembed: bool = True,
    fold_value_biases: bool = True,
    refactor_factored_attn_matrices: bool = False,
):
    """Process `model`'s weights in place, as TransformerLens' `HookedTransformer.process_weights_`.

    The log-probabilities do not change (up to float rounding); the logits change by a constant per position with
    `center_unembed`. Hooks on the residual stream (and `ln*.hook_normalized`) see the processed values; every
    attention hook (q, k, scores, compose branches, dynamic weights, patterns) is unchanged, and so is `hook_z` except
    where value biases were folded.

    Args:
        model: the model.
        fold_ln: fold each norm's weight (and bias) into the weights that read its output.
        center_writing_weights: centre the weights that write into the residual stream.
        center_unembed: centre W_U over the vocabulary.
        fold_value_biases: fold the value biases into the attention output's bias.
        refactor_factored_attn_matrices: rebalance W_Q W_K^T and W_V W_O between their factors, as TransformerLens.

    Returns:
        The model.
    """
    if refactor_factored_attn_matrices:
        raise ValueError(
            "refactor_factored_attn_matrices: not possible with rotary embeddings (the QK product depends "
            "on the relative position) or QK-norm; TransformerLens refuses rotary models too"
        )
    meta = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(
            f"process_weights_: {meta[0]!r} is offloaded (meta); process a model loaded without disk "
            "offload, or pass fold_ln=... to from_pretrained, which processes before dispatching"
        )
    cfg = model.cfg
    centring_norms = cfg.normalization_type == "LN"
    if fold_ln:
        for block in model.blocks:
            _fold_ln_into_attention(block.ln1, block.attn, centre=centring_norms)
            _fold_ln_into_mlp(block.ln2, block.mlp, centre=centring_norms)
        _fold_final_ln(model.ln_final, model.unembed, centre=centring_norms)
    if center_writing_weights:
        if centring_norms:
            _center_writing_weights(model)
        else:
            warnings.warn(
                "center_writing_weights: skipped, the model's norms are RMSNorm (they do not remove the "
                "mean, so the writing weights' mean matters)",
                stacklevel=2,
            )
    if center_unembed:
        _center_(model.unembed.W_U, dim=-1)
        if model.unembed._parameters["b_U"] is not None:
            _center_(model.unembed.b_U, dim=-1)
    if fold_value_biases:
        skipped = [layer for layer, block in enumerate(model.blocks) if not _fold_value_biases(block.attn)]
        if skipped:
            warnings.warn(
                f"fold_value_biases: left in b_V in layers {skipped}: after post-compose the attention rows "
                "do not sum to 1, so b_V's contribution depends on the input",
                stacklevel=2,
            )
    done = {
        "fold_ln": fold_ln,
        "center_writing_weights": center_writing_weights and centring_norms,
        "center_unembed": center_unembed,
        "fold_value_biases": fold_value_biases,
    }
    model.weight_processing = {k: bool(v) or model.weight_processing.get(k, False) for k, v in done.items()}
    return model


def logit_offset(model) -> Tensor:
    """The part of the logits no residual component carries: the final norm's bias through W_U, plus b_U.

    For every model, processed or not: `cache.apply_ln_to_stack(components).sum(0) @ model.W_U + logit_offset(model)`
    is the logits, and so `cache.logit_attrs(components, tokens).sum(0) + logit_offset(model)[tokens]`.

    Args:
        model: the model.

    Returns:
        [d_vocab].
    """
    offset = model.unembed.b_U
    if model.ln_final.b is not None:
        offset = offset + model.ln_final.b @ model.W_U
    return offset


def require_raw_weights(model, analysis: str) -> None:
    """Refuse processed weights to the analyses that read the released weights as the paper does.

    Eq. 12's norms and Fig. 5's W_Q W_K^T read them: folding and centring change them, and what was folded cannot be
    told apart again.

    Args:
        model: the model.
        analysis: the analysis, named in the error.

    Raises:
        ValueError: the model's weights were processed.
    """
    changed = [k for k in ("fold_ln", "center_writing_weights") if model.weight_processing.get(k)]
    if changed:
        raise ValueError(
            f"{analysis}: reads the released weights as the paper does, and this model's are processed "
            f"({', '.join(changed)}); load it with HookedDCFormer.from_pretrained_no_processing"
        )


class DCActivationCache(ActivationCache):
    """TransformerLens' `ActivationCache`, whose `apply_ln_to_stack` applies the norm's weight as well.

    TransformerLens centres and divides by the cached scale, which is the whole norm once `fold_ln` has folded
    its weight away; on a raw model the weight then went missing. Here each component gets the norm's centring,
    scale and weight, so its share of the norm's output is exact on a raw model and unchanged on a processed
    one (weight 1). The norm's bias belongs to no component: `logit_offset`. `accumulated_resid(apply_ln=True)`
    runs each whole stream through the real final norm (bias included), as TransformerLens.
    """

    def __getitem__(self, key) -> Tensor:
        """As TransformerLens, and by the names TransformerLens gives hooks that sit elsewhere here
        (`model.hook_aliases`: `cache["q_input", 0]` is `blocks.0.attn.hook_q_input`)."""
        try:
            return super().__getitem__(key)
        except KeyError:
            real = getattr(self.model, "hook_aliases", {}).get(self._name_of(key))
            if real not in self.cache_dict:
                raise
            return self.cache_dict[real]

    def _name_of(self, key) -> str:
        """The hook name TransformerLens' lookup reads for `key`: a name, a shorthand, or (name, layer[, type])."""
        if isinstance(key, str):
            return key if "." in key else get_act_name(key)
        name, layer, *rest = (*key, None) if len(key) == 1 else key
        if layer is not None and layer < 0:
            layer += self.model.cfg.n_layers
        return get_act_name(name, layer, *rest)

    def apply_ln_to_stack(self, residual_stack, layer=None, mlp_input=False, *args, **kwargs):
        """TransformerLens' `apply_ln_to_stack`, with the norm's weight applied to each component as well.

        Args:
            residual_stack: the components [component, ..., d_model].
            layer: the norm's layer (None or -1: the final norm).
            mlp_input: the norm before the MLP of `layer`.
            *args: TransformerLens' other arguments.
            **kwargs: TransformerLens' other arguments.

        Returns:
            Each component's share of the norm's output.
        """
        stack = super().apply_ln_to_stack(residual_stack, layer, mlp_input, *args, **kwargs)
        final = layer is None or layer == -1 or layer == self.model.cfg.n_layers
        if final and kwargs.get("recompute_ln", False):
            return stack  # the real ln_final, weight and bias applied (TransformerLens 4's logit-lens path)
        return stack * self._norm(layer, mlp_input).w.to(stack.device)

    def _stack_neuron_results_apply_ln_projected(self, layer, pos_slice, neuron_slice, project_2d, *args, **kwargs):
        """TransformerLens' shortcut for `stack_neuron_results(apply_ln=True, project_output_onto=p)`: the norm's
        weight goes into the projection (LN(x) * w @ p = LN(x) @ (w * p))."""
        mlp_input = kwargs.get("mlp_input", args[0] if args else False)
        weight = self._norm(layer, mlp_input).w.to(project_2d.device, project_2d.dtype)
        return super()._stack_neuron_results_apply_ln_projected(
            layer, pos_slice, neuron_slice, project_2d * weight[:, None], *args, **kwargs
        )

    def _norm(self, layer, mlp_input: bool):
        """The norm that reads the stream entering `layer` (its MLP with mlp_input; ln_final past the last block)."""
        if layer is None or layer == -1 or layer == self.model.cfg.n_layers:
            return self.model.ln_final
        block = self.model.blocks[layer]
        return block.ln2 if mlp_input else block.ln1

    def apply_slice_to_batch_dim(self, batch_slice):
        """TransformerLens' `apply_slice_to_batch_dim`, keeping this class.

        Args:
            batch_slice: the prompts to keep.

        Returns:
            A DCActivationCache of them.
        """
        sliced = super().apply_slice_to_batch_dim(batch_slice)
        return DCActivationCache(sliced.cache_dict, self.model, has_batch_dim=sliced.has_batch_dim)


# --------------------------------------------------------------------------------------------------
# The steps, on parameters in place
def _center_(p: Tensor, dim: int) -> None:
    """p -= its mean along `dim`, in place, a slice at a time: a half-precision mean works on a float32 copy of
    what it reduces, which for a whole embedding would add twice its size to the peak."""
    if p.ndim == 1:
        p.sub_(p.mean())
        return
    across = 1 if dim % p.ndim == 0 else 0
    for part in p.split(1024, dim=across):
        part.sub_(part.mean(dim, keepdim=True))


def _new_parameter(module: nn.Module, name: str, value: Tensor) -> None:
    module.__dict__.pop(name, None)  # a plain `None` attribute (a model without biases)
    module.register_parameter(name, nn.Parameter(value, requires_grad=False))


def _fold_ln_into_attention(norm, attn, centre: bool) -> None:
    """x = x̂ w + b feeds q, k, v and the dynamic-weight FFN: W <- w W, b_W <- b_W + b W, then w = 1, b = 0."""
    w, b = norm.w, norm.b
    readers = [("W_Q", "b_Q", "d,hde->he", 1), ("W_K", "b_K", "d,hde->he", 1), ("W_V", "b_V", "d,hde->he", 1)]
    if attn.cfg.use_dcmha:
        readers += [("W_dyn_in", "b_dyn_in", "d,dck->ck", 0), ("W_dyn_gate", "b_dyn_gate", "d,dch->ch", 0)]
    for weight_name, bias_name, reads_b, d_axis in readers:
        W = getattr(attn, weight_name)
        w, b = norm.w.to(W.device), norm.b.to(W.device) if norm.b is not None else None
        if b is not None:
            if getattr(attn, bias_name) is None:
                _new_parameter(attn, bias_name, W.new_zeros(torch.einsum(reads_b, b, W).shape))
            getattr(attn, bias_name).add_(torch.einsum(reads_b, b, W))
        W.mul_(w.reshape([-1 if axis == d_axis else 1 for axis in range(W.ndim)]))
        if centre:
            _center_(W, dim=d_axis)
    _reset_norm(norm)


def _fold_ln_into_mlp(norm, mlp, centre: bool) -> None:
    w, b = norm.w, norm.b
    readers = [name for name in ("W_in", "W_gate", "W_mgate") if hasattr(mlp, name)]
    if b is not None and len(readers) > 1:
        raise ValueError("fold_ln: a LayerNorm bias before a SwiGLU or mgate MLP has no bias to fold into")
    for name in readers:
        W = getattr(mlp, name)
        w, b = norm.w.to(W.device), norm.b.to(W.device) if norm.b is not None else None
        if b is not None:
            if mlp.b_in is None:
                _new_parameter(mlp, "b_in", torch.zeros_like(W[0]))
            mlp.b_in.add_(b @ W)
        W.mul_(w[:, None])
        if centre:
            _center_(W, dim=0)
    _reset_norm(norm)


def _fold_final_ln(norm, unembed, centre: bool) -> None:
    W_U = unembed.W_U
    if norm.b is not None:
        if unembed._parameters["b_U"] is None:
            _new_parameter(unembed, "b_U", torch.zeros_like(W_U[0]))
        unembed.b_U.add_(norm.b.to(W_U.device) @ W_U)
    W_U.mul_(norm.w.to(W_U.device)[:, None])
    if centre:
        _center_(W_U, dim=0)
    _reset_norm(norm)


def _reset_norm(norm) -> None:
    norm.w.fill_(1.0)
    if norm.b is not None:
        norm.b.zero_()


def _center_writing_weights(model) -> None:
    """Remove the all-ones component of everything written to the residual stream (every reader centres)."""
    _center_(model.embed.W_E, dim=-1)
    for block in model.blocks:
        _center_(block.attn.W_O, dim=-1)
        _center_(block.mlp.W_out, dim=-1)
        for bias in (block.attn.b_O, block.mlp.b_out):
            if bias is not None:
                _center_(bias, dim=-1)


def _fold_value_biases(attn) -> bool:
    """b_O <- b_O + sum_h b_V[h] W_O[h], b_V <- 0, where each attention row sums to 1; False where it does not."""
    if attn.b_V is None:
        return True
    if attn.cfg.use_dcmha and attn.post_compose is not None:
        return False
    if attn.b_O is None:
        _new_parameter(attn, "b_O", attn.W_O.new_zeros(attn.W_O.shape[-1]))
    attn.b_O.add_(torch.einsum("he,hed->d", attn.b_V, attn.W_O))
    attn.b_V.zero_()
    return True
