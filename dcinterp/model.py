"""HookedDCFormer: DCFormer (Xiao et al., ICML 2024) as a TransformerLens `HookedRootModule`.

HookedDCFormer is assembled here from its components, one a file in `dcinterp.components` (embed, norms, rotary,
masks, compose, attention, mlp, block), which this module re-exports. Every intermediate that an interpretability
study needs sits behind a `HookPoint` named by where it is, as in TransformerLens (`blocks.3.attn.hook_pattern`).
Index names in einsums: b batch, p/t/s positions (query t, key s), h/n/m heads, e head dim, d model dim, r rank,
c dynamic-weight branch, k dynamic-weight hidden unit.

DCMHA in one layer (x = the normed residual input of the attention):
    scores A = q k^T / sqrt(d_head)                                  hook_attn_scores    [b, h, t, s]
    A' = A + o_qp + o_kp + o_qg + o_kg       (pre-compose)           hook_composed_scores
    P = softmax(A')                                                  hook_pattern
    P' = P + o_qp + o_kp + o_qg + o_kg       (post-compose)          hook_composed_pattern
    z = P' v,  out = z W_O                                           hook_z
with, for query t and key s,
    o_qp[m,t,s] = sum_r (sum_n A[n,t,s] qw1[t,r,n]) qw2[t,r,m]   and o_kp the same with key-side weights at s,
    o_qg[n,t,s] = A[n,t,s] qg[t,n],   o_kg[n,t,s] = A[n,t,s] kg[s,n].
The dynamic weights (qw1, qw2, kw1, kw2, qg, kg for each stage) are computed from x by a small FFN.
Both score hooks hold the dtype's minimum at the keys a query may not see (future keys, keys outside a local
window), as TransformerLens does. docs/hooks.md maps every hook to the paper's equations.
How a layer computes this (every tensor above materialised, or a block of queries at a time on the CPU, or the fused
Triton kernels on CUDA, ...) is chosen per call by `dcinterp.dcmha.choose_path`: `Attention.forward`
(dcinterp.components.attention) computes z by its hooked `materialised_z`, or by `dcinterp.dcmha.attend` on every
other path.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

# TransformerLens 4 exports HookedRootModule from the package only, 3.2 (the newest that circuit-tracer's transformers
# pin allows) from hook_points only
try:
    from transformer_lens import HookedRootModule
except ImportError:
    from transformer_lens.hook_points import HookedRootModule

from .components.attention import BRANCH_DYN_INDEX, Attention, project_heads  # noqa: F401 (re-exported)
from .components.block import TransformerBlock
from .components.compose import Compose  # noqa: F401 (re-exported)
from .components.embed import Embed
from .components.helpers import at_least_float32
from .components.masks import attention_mask, visible_keys  # noqa: F401 (re-exported)
from .components.mlp import MLP  # noqa: F401 (re-exported)
from .components.norms import HeadRMSNorm, Norm  # noqa: F401 (re-exported)
from .components.rotary import apply_rotary, model_rotary_tables, rotary_tables, rotate  # noqa: F401 (re-exported)
from .components.unembed import Unembed
from .config import DCFormerConfig
from .kv_cache import DCFormerKeyValueCache
from .loading import dispatch, load_tokenizer, open_checkpoint, stream_weights
from .loading import save_pretrained as save_checkpoint
from .processing import DCActivationCache
from .tl_api import TransformerLensAPI

# The hooks TransformerLens' get_act_name does not know: in blocks.{layer}.attn, and in its compose stages.
DCMHA_ACT_NAMES = ("composed_scores", "composed_pattern")
COMPOSE_ACT_NAMES = ("qw1", "qw2", "kw1", "kw2", "qg", "kg", "o_qp", "o_kp", "o_qg", "o_kg")

_attention_mask = attention_mask  # HookedDCFormer.forward's argument of that name shadows it


class HookedDCFormer(TransformerLensAPI, HookedRootModule):
    """DCFormer with every part of DCMHA exposed as a hook point. See the module docstring for the math.

    `model(tokens)` gives logits [batch, pos, d_vocab]; `run_with_cache`, `run_with_hooks`, `hooks()` work as
    in TransformerLens. Load checkpoints with `HookedDCFormer.from_pretrained(path_or_name)`.

    TransformerLens' accessors (`W_Q`, `OV`, `to_tokens`, `generate`, ...) come from `dcinterp.tl_api`.
    """

    def __init__(self, cfg: DCFormerConfig, tokenizer=None, init: bool = True):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.cache_memory_fraction: float | None = 0.5  # run_with_cache's guard (see dcinterp.memory)
        self.weight_processing: dict[str, bool] = {}  # what process_weights_ did (dcinterp.processing)
        self.use_activation_grads = False  # set_use_activation_grads: the forward starts an autograd graph
        self.allow_unknown_tokens = False  # to_tokens: unknown words raise (True: one warning line)
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.blocks = nn.ModuleList(TransformerBlock(cfg, layer) for layer in range(cfg.n_layers))
        self.ln_final = Norm(cfg.d_model, cfg.normalization_type, cfg.norm_eps)
        self.unembed = Unembed(cfg)
        if init:
            self.init_weights()
        self.setup()

    def setup(self) -> None:
        """TransformerLens' setup, plus the names TransformerLens gives hooks that sit elsewhere here, for hooks by
        name and cache lookups (caches hold the real names): TransformerBridge's `blocks.{l}.hook_in` (=
        hook_resid_pre) and `hook_out` (= hook_resid_post), HookedTransformer's `blocks.{l}.hook_q_input` (=
        `blocks.{l}.attn.hook_q_input`), `hook_k_input`, `hook_v_input` (what `get_act_name("q_input", l)` gives)."""
        super().setup()
        self.hook_aliases = {}
        for layer in range(len(self.blocks)):
            self.hook_aliases[f"blocks.{layer}.hook_in"] = f"blocks.{layer}.hook_resid_pre"
            self.hook_aliases[f"blocks.{layer}.hook_out"] = f"blocks.{layer}.hook_resid_post"
            for qkv in "qkv":
                self.hook_aliases[f"blocks.{layer}.hook_{qkv}_input"] = f"blocks.{layer}.attn.hook_{qkv}_input"
        for alias, name in self.hook_aliases.items():
            self.mod_dict[alias] = self.mod_dict[name]

    # ----------------------------------------------------------------------------------------------
    # Forward
    def forward(
        self,
        input: Int[Tensor, "b p"] | str | list[str] | Float[Tensor, "b p d"],
        return_type: Literal["logits", "loss", "both"] | None = "logits",
        loss_per_token: bool = False,
        prepend_bos: bool | None = None,
        start_at_layer: int | None = None,
        tokens: Int[Tensor, "b p"] | None = None,
        stop_at_layer: int | None = None,
        attention_mask: Int[Tensor, "b p"] | None = None,
        past_kv_cache: DCFormerKeyValueCache | None = None,
        padding_side: Literal["left", "right"] | None = None,
    ):
        """Logits (or loss) for tokens or text, as TransformerLens' forward.

        `stop_at_layer=l` returns the residual stream entering block l. `start_at_layer=l` takes that residual
        stream as `input` and runs blocks l onwards (pass `tokens` as well for a loss).
        `attention_mask` [batch, pos]: 1 for real tokens, 0 for padding; padded keys are hidden, each row's rotary
        positions count from its first real token, so a row gives what its prompt alone would, and a loss leaves
        the padding out. As in TransformerLens, where the padding side is "left" (`padding_side`, else the
        tokenizer's `padding_side`) and no mask is given, the mask is the leading pad tokens
        (`pad_attention_mask`); text is padded on that side. `past_kv_cache` (a `DCFormerKeyValueCache`): the
        input continues the cached positions, and is added to the cache (docs/generation.md).
        """
        if start_at_layer is None:
            tokens, attention_mask = self._tokens_and_mask(
                input, prepend_bos, padding_side, attention_mask, return_type
            )
            resid = self.hook_embed(self._graph_start(self.embed(tokens)))
        else:
            resid = self._graph_start(input.to(self.input_device))
        n = resid.shape[1]
        past, real, positions = 0, None, None
        own_mask = attention_mask  # [batch, pos] of this input, for the loss
        if past_kv_cache is not None:
            past = past_kv_cache.n_tokens
            if attention_mask is None:
                attention_mask = torch.ones(resid.shape[:2], dtype=torch.long)
            attention_mask = past_kv_cache.append_attention_mask(attention_mask)
            positions = torch.arange(past, past + n, device=resid.device)
        if attention_mask is not None:
            if attention_mask.shape != (resid.shape[0], past + n):
                raise ValueError(
                    f"attention_mask: shape {tuple(attention_mask.shape)}, expected [batch, pos] = "
                    f"{[resid.shape[0], n]}"
                )
            if not attention_mask.bool().all():
                real = attention_mask.to(resid.device).bool()
                positions = (real.cumsum(1) - 1).clamp_min(0)[:, past:]
        masks = {}
        rotary = model_rotary_tables(self.cfg, n, resid.device, positions)  # every layer's
        for layer in range(len(self.blocks))[start_at_layer:stop_at_layer]:  # a ModuleList's slice builds a new list
            block = self.blocks[layer]
            window = block.attn.window
            if window not in masks:
                masks[window] = _attention_mask(n, window, resid.device, resid.dtype, self.cfg.window, past, real)
            entry = None if past_kv_cache is None else past_kv_cache[layer]
            resid = block(resid, masks[window], positions, entry, real, rotary)
        if stop_at_layer is not None:
            return resid
        logits = self.unembed(self.ln_final(resid))
        if return_type == "logits":
            return logits
        if tokens is None:
            raise ValueError("forward: return_type 'loss' with start_at_layer needs the tokens (tokens=...)")
        loss = lm_cross_entropy(logits, tokens.to(logits.device), loss_per_token, own_mask)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        return None

    def _tokens_and_mask(self, input, prepend_bos, padding_side, attention_mask, return_type):
        """Token ids for `input` (text is tokenized, padded on `padding_side`, else the tokenizer's) and the
        attention mask: the one given, else, on a left padding side, the leading pad tokens masked out (as
        TransformerLens). Right padding stays unmasked, as in TransformerLens; a loss over right-padded text then
        counts the pads, and says so."""
        side = self._padding_side(padding_side)
        text = isinstance(input, (str, list))
        tokens = self.to_tokens(input, prepend_bos=prepend_bos, padding_side=side) if text else input
        tokens = tokens.to(self.input_device)
        if attention_mask is not None or getattr(self.tokenizer, "pad_token_id", None) is None:
            return tokens, attention_mask
        bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        if side == "left":
            return tokens, pad_attention_mask(self.tokenizer, tokens, bos, side)
        if return_type in ("loss", "both") and isinstance(input, list):
            pads = int((pad_attention_mask(self.tokenizer, tokens, bos, side) == 0).sum())
            if pads:
                warnings.warn(
                    f"forward: the loss counts the {pads} pad tokens of right-padded text, as TransformerLens "
                    "does; padding_side='left' (or an attention_mask) leaves them out",
                    stacklevel=5,  # the caller of model(...)
                )
        return tokens, None

    def _graph_start(self, resid: Tensor) -> Tensor:
        """With frozen weights nothing needs a graph, so the forward keeps none, unless a backward hook is attached
        or `set_use_activation_grads(True)`: then the stream starts one, and activation gradients flow."""
        if resid.requires_grad or not torch.is_grad_enabled():
            return resid
        if self.use_activation_grads or any(hook.bwd_hooks for hook in self.hook_dict.values()):
            return resid.detach().requires_grad_(True)
        return resid

    def set_use_activation_grads(self, use_activation_grads: bool) -> None:
        """Let `model(tokens)[...].backward()` reach the activations (and backward hooks) with frozen weights.

        Attaching a backward hook (`add_hook(name, fn, "bwd")`, `run_with_cache(incl_bwd=True)`) does it by
        itself; the weights stay frozen and get no gradient. The gradients equal an unfrozen model's."""
        self.use_activation_grads = use_activation_grads

    def run_with_cache(
        self,
        *args,
        return_cache_object: bool = True,
        remove_batch_dim: bool = False,
        allow_large_cache: bool = False,
        **kwargs,
    ):
        """As `HookedRootModule.run_with_cache`, returning a TransformerLens `ActivationCache`.

        Before running, the cache is estimated from the shapes (`dcinterp.estimate_cache`); one that would take
        more than `model.cache_memory_fraction` (default 0.5) of the free memory where it lands is refused with
        a `CacheTooLarge` line, unless `allow_large_cache=True` (or the fraction is None).
        """
        if not allow_large_cache and self.cache_memory_fraction is not None and args:
            from .memory import check_cache_fits, estimate_cache

            estimate = estimate_cache(
                self,
                args[0],
                kwargs.get("names_filter"),
                kwargs.get("incl_bwd", False),
                kwargs.get("device"),
                kwargs.get("past_kv_cache"),
            )
            check_cache_fits(self, estimate, self.cache_memory_fraction)
        out, cache = super().run_with_cache(*args, remove_batch_dim=remove_batch_dim, **kwargs)
        if return_cache_object:
            cache = DCActivationCache(cache, self, has_batch_dim=not remove_batch_dim)
        return out, cache

    def loss_fn(
        self,
        logits: Float[Tensor, "b p v"],
        tokens: Int[Tensor, "b p"],
        attention_mask: Int[Tensor, "b p"] | None = None,
        per_token: bool = False,
    ) -> Tensor:
        """Next-token cross-entropy, as TransformerLens' `loss_fn` (positions where a token or the next one is
        masked out are left out of the mean, and 0 per token)."""
        return lm_cross_entropy(logits, tokens.to(logits.device), per_token, attention_mask)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Compute `blocks.{l}.attn.hook_result` (per-head outputs in the residual basis) or not."""
        self.cfg.use_attn_result = use_attn_result

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Give each head its own copy of the stream for q, k and v (`attn.hook_q_input`, ...), or not.

        What TransformerLens' direct path patching switches on. In a DCMHA layer the dynamic compose weights
        keep reading the shared normed input: a patch on one head's copy reaches that head's q, k or v only."""
        self.cfg.use_split_qkv_input = use_split_qkv_input

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Fork the stream into each MLP through `blocks.{l}.hook_mlp_in` (a copy: a patch there reaches that MLP
        alone), as TransformerLens."""
        self.cfg.use_hook_mlp_in = use_hook_mlp_in

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Give each head its own copy of the stream for q, k and v together (`blocks.{l}.hook_attn_in`), or not,
        as TransformerLens. In a DCMHA layer the dynamic compose weights keep reading the shared normed input."""
        self.cfg.use_attn_in = use_attn_in

    # ----------------------------------------------------------------------------------------------
    # Weights
    @torch.no_grad()
    def init_weights(self, std: float = 0.02, identity_compose: bool = False) -> None:
        """Initialise for training: normal(std) projections, the official DCMHA initialisation.

        The parameters a plain-MHA model has too are drawn first, in its order, and DCMHA's dynamic-weight
        projections (`W_dyn_*`) last: a DCMHA model and its `use_dcmha=False` twin seeded alike start from the
        same shared weights. `identity_compose` starts the compose at the identity: the second factor of the
        low-rank projections (`qw2`, `kw2`) and the gates are zero, so every branch output is 0 and the model
        computes what its MHA twin does."""
        cfg = self.cfg
        # A stable sort into the order of the first releases (embedding and unembedding, then the blocks).
        embeddings = ("embed.W_E", "unembed.W_U")
        mha_first = sorted(self.named_parameters(), key=lambda named: ("W_dyn" in named[0], named[0] not in embeddings))
        for name, p in mha_first:
            if name.endswith((".w",)):
                p.fill_(1.0)
            elif name.split(".")[-1].startswith("b"):
                p.zero_()
            elif name.endswith("W_dyn_in"):
                p.normal_(0, math.sqrt(2 / (cfg.d_model + cfg.dyn_hidden_dim)))
            elif name.endswith("W_dyn_out"):
                H, R = cfg.n_heads, cfg.dcmha_rank
                p.normal_(0, 0.02 / (math.sqrt(2 * H * R) * (H + R)))
                if identity_compose:
                    p[:, :, R:].zero_()  # w2 = 0 (not w1 as well: at w1 = w2 = 0 neither has a gradient)
            elif name.endswith("W_dyn_gate"):
                p.normal_(0, 0.05 * math.sqrt(2 / (cfg.n_heads + cfg.d_model)))
                if identity_compose:
                    p.zero_()
            elif name.endswith(("W_O", "W_out")):
                p.normal_(0, std / math.sqrt(2 * cfg.n_layers))
            else:
                p.normal_(0, std)

    def _apply(self, fn, recurse=True):
        """What `to`, `half`, `bfloat16`, `cuda`, ... run: then `cfg.dtype` and `cfg.device` say what the weights
        are and where the forward starts, as TransformerLens' `to` keeps them (code that reads `model.cfg.dtype`
        after `model.to(torch.bfloat16)` sees bfloat16)."""
        out = super()._apply(fn, recurse)
        W_E = self.embed.W_E
        if W_E.is_floating_point():
            self.cfg.dtype = W_E.dtype
        if W_E.device.type != "meta":
            self.cfg.device = str(W_E.device)
        return out

    @property
    def input_device(self) -> torch.device:
        """Where the forward starts: the embedding's device (its execution device when accelerate offloads it)."""
        device = self.embed.W_E.device
        return torch.device(self.cfg.device) if device.type == "meta" and self.cfg.device else device

    # ----------------------------------------------------------------------------------------------
    # Loading and saving (see dcinterp.loading)
    @classmethod
    def from_pretrained(
        cls,
        path_or_name,
        dtype=None,
        device=None,
        device_map=None,
        max_memory=None,
        offload_folder=None,
        fold_ln: bool = False,
        center_writing_weights: bool = False,
        center_unembed: bool = False,
        fold_value_biases: bool = False,
        refactor_factored_attn_matrices: bool = False,
    ) -> "HookedDCFormer":
        """Load a local checkpoint directory (DCPythia, DCFormer, GPT-NeoX/Pythia, dcinterp) or an embedded model.

        The weights come as released (the paper's Eq. 12 reads the raw norms), as TransformerLens 4's
        `TransformerBridge`; TransformerLens' processing is one argument away: `fold_ln=True,
        center_writing_weights=True, center_unembed=True` (and `fold_value_biases=True`), done in place before
        dispatch (`dcinterp.processing`, docs/weight-processing.md).

        The weights stream from the (memory-mapped) files straight into `dtype` on `device`, or across devices
        with `device_map` ("auto", "balanced", "sequential" or {module name: device}, with `max_memory` as in
        Hugging Face and `offload_folder` for "disk"). The model comes back in eval mode with its parameters
        frozen; `model.train().requires_grad_(True)` unfreezes it for fine-tuning.
        """
        checkpoint = open_checkpoint(path_or_name, dtype)
        with torch.device("meta"):
            model = cls(checkpoint.cfg, init=False)
        device_map = stream_weights(model, checkpoint, device, device_map, max_memory, offload_folder)
        model.tokenizer = load_tokenizer(checkpoint.directory)
        model.weight_processing = checkpoint.weight_processing
        processing = dict(
            fold_ln=fold_ln,
            center_writing_weights=center_writing_weights,
            center_unembed=center_unembed,
            fold_value_biases=fold_value_biases,
            refactor_factored_attn_matrices=refactor_factored_attn_matrices,
        )
        if any(processing.values()):  # in place, before accelerate's hooks: no second copy of the weights
            model.process_weights_(**processing)
        dispatch(model, device_map, offload_folder)
        return model.eval().requires_grad_(False)  # inference: no autograd graph over the weights

    def save_pretrained(self, directory) -> None:
        """Write `config.json`, `model.safetensors` and the tokenizer (if any) to a directory."""
        save_checkpoint(self, directory)


def pad_attention_mask(
    tokenizer, tokens: Int[Tensor, "b p"], prepend_bos: bool, padding_side: Literal["left", "right"]
) -> Int[Tensor, "b p"]:
    """TransformerLens' `get_attention_mask`: 0 at the leading (left padding) or trailing (right) pad tokens, else
    1; a BOS that shares the pad token's id stays visible where BOS was prepended."""
    mask = torch.ones_like(tokens)
    real = tokens.ne(tokenizer.pad_token_id)
    if padding_side == "right":
        mask[real.flip(-1).cumsum(-1).flip(-1) == 0] = 0
        return mask
    leading = real.cumsum(-1) == 0
    mask[leading] = 0
    if prepend_bos and tokenizer.bos_token_id == tokenizer.pad_token_id:
        mask[torch.arange(len(mask)), (leading.sum(-1) - 1).clamp_min(0)] = 1
    return mask


def lm_cross_entropy(
    logits: Float[Tensor, "b p v"],
    tokens: Int[Tensor, "b p"],
    per_token: bool = False,
    attention_mask: Int[Tensor, "b p"] | None = None,
) -> Tensor:
    """Next-token cross-entropy; per token [batch, pos-1] or the mean (over unmasked pairs, as TransformerLens)."""
    logprobs = at_least_float32(logits[:, :-1]).log_softmax(-1)
    loss = -logprobs.gather(-1, tokens[:, 1:, None])[..., 0]
    kept = torch.ones_like(loss, dtype=torch.bool)
    if attention_mask is not None:
        mask = attention_mask.to(loss.device).bool()
        kept = mask[:, :-1] & mask[:, 1:]
        loss = loss.masked_fill(~kept, 0.0)
    if per_token:
        return loss
    if not kept.any():  # a mean over nothing would be NaN
        raise ValueError(
            "loss: no token has a next token to predict (every row has fewer than two real tokens); "
            "loss_per_token=True gives the empty per-token table"
        )
    return loss.sum() / kept.sum()


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """TransformerLens' `get_act_name`, knowing DCMHA's hooks as well.

    `get_act_name("composed_pattern", 2)` is `blocks.2.attn.hook_composed_pattern`; a compose stage's hooks take
    the stage as layer_type: `get_act_name("o_kp", 16, "post")` is `blocks.16.attn.post_compose.hook_o_kp`.
    Every other name goes to TransformerLens unchanged.
    """
    from transformer_lens.utilities import get_act_name as tl_get_act_name

    if layer is not None and name in DCMHA_ACT_NAMES:
        return f"blocks.{layer}.attn.hook_{name}"
    if layer is not None and name in COMPOSE_ACT_NAMES:
        stage = (layer_type or "").removesuffix("_compose")
        if stage not in ("pre", "post"):
            raise ValueError(f"get_act_name: {name!r} is a compose-stage hook; pass layer_type 'pre' or 'post'")
        return f"blocks.{layer}.attn.{stage}_compose.hook_{name}"
    return tl_get_act_name(name, layer, layer_type)
