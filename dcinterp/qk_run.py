"""One run of layers 0..l and what QK attribution reads from it (`dcinterp.qk`, `dcinterp.qk_weights`).

`layer_run` keeps, through hooks, what the decomposition reads: the earlier layers' outputs at the positions asked
for, ln1's and the QK-norm's scales and the compose's dynamic weights. From it, `residual_components` splits the
stream entering a layer into its senders (`component_names`), `side_vectors` carries each one to every head's
rotated q or k with the scales frozen, and `branch_weights` gives the pre- or post-compose weights W_b[n, m] of
each branch (`compose_branches`). `single_prompt` and `key_positions` check the prompt and the keys asked for.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .checks import check_tokens, prompt_position
from .model import HookedDCFormer, apply_rotary, at_least_float32, project_heads, visible_keys

BRANCHES = ("skip", "qp", "kp", "qg", "kg")


# --------------------------------------------------------------------------------------------------
# The run: what the decomposition reads, through hooks
def component_names(model: HookedDCFormer, layer: int) -> list[str]:
    """The residual components entering a layer: embed, L{l}H{h} and MLP{l} of every earlier layer, bias.

    Args:
        model: The model.
        layer: The layer the components enter.

    Returns:
        The names, in the order of `residual_components`' component axis.
    """
    names = ["embed"]
    for earlier in range(layer):
        names += [f"L{earlier}H{h}" for h in range(model.cfg.n_heads)] + [f"MLP{earlier}"]
    return [*names, "bias"]


def compose_branches(model: HookedDCFormer, stage: str = "pre") -> list[str]:
    """The branches a compose stage runs: `skip`, then those of qp, kp, qg, kg the model has.

    Args:
        model: The model.
        stage: "pre" or "post".

    Returns:
        The branch names; only `skip` for plain MHA or a model without the stage.
    """
    cfg = model.cfg
    if not cfg.use_dcmha or stage not in cfg.compose_stages:
        return ["skip"]
    return ["skip", *(b for b in BRANCHES[1:] if b in cfg.active_branches)]


@torch.no_grad()
def layer_run(
    model: HookedDCFormer, prompt: Int[Tensor, "1 pos"], layer: int, query_pos: int, positions: list[int]
) -> dict[str, Tensor]:
    """One forward of layers 0..layer with hooks that keep what the decomposition reads (batch dimension dropped).

    At `positions` only (`run["positions"]`, sorted): embed, z{l} and mlp{l} of the earlier layers. At every
    position: ln_scale [pos, 1], q_scale / k_scale [pos, head, 1] (the QK-norm's, from ln1's output by the
    forward's own projection), the compose weights
    `{stage}.{weight}`. The query's row [head, key] of scores, composed (DCMHA), pattern, composed_pattern (DCMHA).

    Args:
        model: The model.
        prompt: One prompt's token ids [1, pos].
        layer: The last layer run.
        query_pos: The query whose row of scores and patterns is kept.
        positions: The positions whose earlier-layer outputs are kept.

    Returns:
        The run: {name: tensor}, as listed above.
    """
    attn = f"blocks.{layer}.attn"
    at = torch.tensor(sorted(set(positions)))
    names = {"embed": ("hook_embed", "at"), "ln_scale": (f"blocks.{layer}.ln1.hook_scale", "all")}
    for earlier in range(layer):
        names[f"z{earlier}"] = (f"blocks.{earlier}.attn.hook_z", "at")
        names[f"mlp{earlier}"] = (f"blocks.{earlier}.hook_mlp_out", "at")
    names |= {"scores": (f"{attn}.hook_attn_scores", "row"), "pattern": (f"{attn}.hook_pattern", "row")}
    if model.cfg.use_qk_norm:
        names["normed"] = (f"blocks.{layer}.ln1.hook_normalized", "all")
    if model.cfg.use_dcmha:
        names["composed"] = (f"{attn}.hook_composed_scores", "row")
        names["composed_pattern"] = (f"{attn}.hook_composed_pattern", "row")
        for stage in model.cfg.compose_stages:
            for weight in ("qw1", "qw2", "kw1", "kw2", "qg", "kg"):
                names[f"{stage}.{weight}"] = (f"{attn}.{stage}_compose.hook_{weight}", "all")
    run: dict[str, Tensor] = {"positions": at}

    def keep(key: str, part: str):
        def hook(x: Tensor, hook) -> Tensor:
            value = x[0].detach()
            run[key] = value[at.to(x.device)] if part == "at" else value[:, query_pos] if part == "row" else value
            return x

        return hook

    hooked = set(model.hook_dict)
    hooks = [(name, keep(key, part)) for key, (name, part) in names.items() if name in hooked]
    model.run_with_hooks(prompt, fwd_hooks=hooks, stop_at_layer=layer + 1)
    if model.cfg.use_qk_norm:  # the QK-norm's scales, by the forward's own ops (a hook on them changes the last bit)
        block = model.blocks[layer].attn
        normed = run.pop("normed")[None]
        for side, W, b, norm in (("q", block.W_Q, block.b_Q, block.q_norm), ("k", block.W_K, block.b_K, block.k_norm)):
            linear = project_heads(normed, W)
            linear = at_least_float32((linear + b if b is not None else linear)[0])
            run[f"{side}_scale"] = (linear.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()  # [pos, head, 1]
    return run


def residual_components(
    model: HookedDCFormer, run: dict[str, Tensor], layer: int, positions: Int[Tensor, " pos"]
) -> Float[Tensor, "pos component d_model"]:
    """The components of the stream entering a layer, which add up to `blocks.{layer}.hook_resid_pre` there.

    Args:
        model: The model.
        run: What `layer_run` kept.
        layer: The layer the stream enters.
        positions: Positions among those `layer_run` kept.

    Returns:
        The components in float32, in `component_names` order.
    """
    device = model.blocks[layer].attn.W_Q.device
    rows = torch.searchsorted(run["positions"], positions.cpu()).to(device)
    H, d = model.cfg.n_heads, model.cfg.d_model
    out = torch.empty(len(rows), 1 + layer * (H + 1) + 1, d, device=device)
    out[:, 0] = at_least_float32(run["embed"].to(device)[rows])
    bias = torch.zeros(d, device=device)
    for earlier in range(layer):
        attn = model.blocks[earlier].attn
        start = 1 + earlier * (H + 1)
        z = at_least_float32(run[f"z{earlier}"].to(device)[rows])
        out[:, start : start + H] = torch.einsum("phe,hed->phd", z, at_least_float32(attn.W_O.to(device)))
        out[:, start + H] = at_least_float32(run[f"mlp{earlier}"].to(device)[rows])
        if attn.b_O is not None:
            bias += at_least_float32(attn.b_O.to(device))
    out[:, -1] = bias
    return out


def normed_components(
    model: HookedDCFormer,
    run: dict[str, Tensor],
    layer: int,
    components: Float[Tensor, "pos component d_model"],
    positions: Int[Tensor, " pos"],
) -> Float[Tensor, "pos component d_model"]:
    """Each component through ln1 with the run's scale at its position; they add up to `ln1.hook_normalized`.

    A component is centred for a LayerNorm, divided by the scale and multiplied by the weight; the norm's bias goes
    to `bias`.

    Args:
        model: The model.
        run: What `layer_run` kept.
        layer: The layer whose ln1 the components go through.
        components: What `residual_components` returned at `positions`.
        positions: The positions of the components.

    Returns:
        The normed components, in the order given.
    """
    norm = model.blocks[layer].ln1
    device = components.device
    x = components
    if norm.kind == "LN":
        x = x - x.mean(-1, keepdim=True)
    scale = at_least_float32(run["ln_scale"].to(device)[positions.to(device)])  # [pos, 1]
    x = x / scale[:, None] * at_least_float32(norm.w.to(device))
    if norm.b is not None:
        x[:, -1] += at_least_float32(norm.b.to(device))
    return x


def side_vectors(
    model: HookedDCFormer,
    run: dict[str, Tensor],
    layer: int,
    components: Float[Tensor, "pos component d_model"],
    positions: Int[Tensor, " pos"],
    side: str,
) -> Float[Tensor, "pos component head d_head"]:
    """Each component's share of every head's rotated q or k at its position, with ln1's and the QK-norm's scales
    frozen at the run's: they add up to `hook_rot_q` (over sqrt(d_head)) or `hook_rot_k`.

    Args:
        model: The model.
        run: What `layer_run` kept.
        layer: The layer whose heads read the components.
        components: What `residual_components` returned at `positions`.
        positions: The positions of the components.
        side: "q" (divided by sqrt(d_head)) or "k".

    Returns:
        The vectors [pos, component, head, d_head].
    """
    cfg = model.cfg
    attn = model.blocks[layer].attn
    device = components.device
    positions = positions.to(device)
    x = normed_components(model, run, layer, components, positions)
    W = at_least_float32((attn.W_Q if side == "q" else attn.W_K).to(device))
    vectors = torch.einsum("pcd,hde->pche", x, W)
    b = attn.b_Q if side == "q" else attn.b_K
    if b is not None:
        vectors[:, -1] += at_least_float32(b.to(device))
    if cfg.use_qk_norm:
        qk_scale = at_least_float32(run[f"{side}_scale"].to(device)[positions])  # [pos, head, 1]
        weight = at_least_float32((attn.q_norm if side == "q" else attn.k_norm).w.to(device))
        vectors = vectors / qk_scale[:, None] * weight
    table = torch.float16 if cfg.window == "official-inference" else torch.float32
    P, C = vectors.shape[:2]
    vectors = apply_rotary(vectors, cfg.rotary_dim, cfg.rotary_base, table, positions[:, None].expand(P, C))
    return vectors / math.sqrt(cfg.d_head) if side == "q" else vectors


def branch_weights(
    model: HookedDCFormer, run: dict[str, Tensor], stage: str, query_pos: int, keys: Tensor, head: int
) -> Float[Tensor, "key branch source_head"]:
    """W_b[n, head] of every branch a compose stage runs, at (query_pos, s) for each key s.

    Args:
        model: The model.
        run: What `layer_run` kept (its compose weights).
        stage: "pre" or "post".
        query_pos: The query position.
        keys: The key positions.
        head: The head m whose composed score the weights feed.

    Returns:
        The weights [key, branch, source head], branches in `compose_branches` order.
    """
    branches = compose_branches(model, stage)
    H = model.cfg.n_heads
    W = torch.zeros(len(keys), len(branches), H)
    w = {
        name: at_least_float32(run[f"{stage}.{name}"]).cpu()
        for name in ("qw1", "qw2", "kw1", "kw2", "qg", "kg")
        if f"{stage}.{name}" in run
    }
    keys = keys.cpu()
    for b, branch in enumerate(branches):
        if branch == "skip":
            W[:, b, head] = 1.0
        elif branch == "qp":
            W[:, b] = w["qw1"][query_pos].T @ w["qw2"][query_pos][:, head]
        elif branch == "kp":
            W[:, b] = torch.einsum("srn,sr->sn", w["kw1"][keys], w["kw2"][keys][:, :, head])
        elif branch == "qg":
            W[:, b, head] = w["qg"][query_pos, head]
        else:
            W[:, b, head] = w["kg"][keys, head]
    return W


# --------------------------------------------------------------------------------------------------
# Prompt and positions
def single_prompt(
    model: HookedDCFormer, tokens, batch_index: int, name: str = "tokens", index_name: str = "batch_index"
) -> Int[Tensor, "1 pos"]:
    """One prompt of a batch, checked.

    Args:
        model: The model.
        tokens: Token ids [pos] or [batch, pos].
        batch_index: The prompt picked (negative counts from the end).
        name: The name of `tokens` in the one-line errors.
        index_name: The name of `batch_index` in the one-line errors.

    Returns:
        The prompt [1, pos] on the model's input device.
    """
    tokens = check_tokens(model, tokens, name)
    n = tokens.shape[0]
    if isinstance(batch_index, bool) or not isinstance(batch_index, int) or not -n <= batch_index < n:
        raise ValueError(f"{index_name}={batch_index!r} is out of range: the batch has prompts 0..{n - 1}")
    return tokens[batch_index % n :][:1]


def key_positions(model: HookedDCFormer, prompt: Tensor, layer: int, t: int, key_pos, name: str) -> list[int]:
    """The keys asked for, each checked to be visible from the query in this layer.

    Args:
        model: The model (its windows say which keys a layer's query sees).
        prompt: One prompt's token ids [1, pos].
        layer: The layer whose attention reads the keys.
        t: The query position.
        key_pos: A position or word, a list of them, or None for every key the query sees.
        name: The argument's name in the one-line ValueError.

    Returns:
        The key positions in the order asked, without repeats.

    Raises:
        ValueError: No key, or a key after the query or outside the layer's local window.
    """
    n = prompt.shape[1]
    visible = visible_keys(n, model.cfg.layer_window(layer), "cpu", model.cfg.window)[t]
    if key_pos is None:
        return visible.nonzero()[:, 0].tolist()
    if isinstance(key_pos, (list, tuple)) or isinstance(key_pos, Tensor) and key_pos.ndim:
        values = list(key_pos)
    else:  # one position or word (checked below)
        values = [key_pos]
    if not values:
        raise ValueError(f"{name} is empty: pass a position, a word, a list of them, or None for every visible key")
    keys = []
    for value in values:
        s = prompt_position(model, prompt, value, name)
        if not visible[s]:
            window = model.cfg.layer_window(layer)
            why = (
                "it comes after the query" if s > t else f"it is outside layer {layer}'s local window of {window} keys"
            )
            raise ValueError(f"{name}={value!r} (position {s}) is not visible from query_pos {t}: {why}")
        if s not in keys:
            keys.append(s)
    return keys


# --------------------------------------------------------------------------------------------------
# Forwards with a component taken out of a head's input (the causal checks of `dcinterp.qk`)
class Intervention:
    """Forwards of layers 0..layer with per-head q/k/v inputs, reading head m's composed score at (t, s).

    Calling it runs one forward: `remove=(fork, p, heads, vector)` takes `vector` out of the `fork` ("q" or "k")
    input of `heads` at position p (with `from_compose`, out of the stream the compose's weights read as well);
    `freeze` holds ln1's and the QK-norm's scales at the clean run's values. It returns the score.

    Args:
        model: The model.
        prompt: One prompt's token ids [1, pos] on the model's input device.
        layer: The layer of the head whose score is read.
        run: The clean run (`layer_run`), whose scales `freeze` holds.
        t: The query position.
        s: The key position.
        m: The head whose composed score (plain MHA: score) is read.
    """

    def __init__(self, model: HookedDCFormer, prompt: Tensor, layer: int, run: dict, t: int, s: int, m: int):
        self.model, self.prompt, self.layer, self.run = model, prompt, layer, run
        self.t, self.s, self.m = t, s, m

    def __call__(self, remove=None, freeze: bool = False, from_compose: bool = False) -> float:
        model, layer, run = self.model, self.layer, self.run
        block = f"blocks.{layer}"
        score = "hook_composed_scores" if model.cfg.use_dcmha else "hook_attn_scores"
        read: list[float] = []

        def read_score(x, hook):
            read.append(float(x[0, self.m, self.t, self.s]))
            return x

        hooks = [(f"{block}.attn.{score}", read_score)]
        if freeze:
            hooks.append((f"{block}.ln1.hook_scale", _frozen(run["ln_scale"])))
            if model.cfg.use_qk_norm:
                hooks += [
                    (f"{block}.attn.{side}_norm.hook_inv_scale", _frozen(1 / run[f"{side}_scale"])) for side in "qk"
                ]
        if remove is not None:
            fork, p, heads, vector = remove
            if from_compose:  # out of the stream at p, then back into every fork but the removed heads'
                hooks.append((f"{block}.hook_resid_pre", _shift(p, None, -vector)))
                for other in "qkv":
                    kept = [h for h in range(model.cfg.n_heads) if other != fork or h not in heads]
                    hooks.append((f"{block}.attn.hook_{other}_input", _shift(p, kept, vector)))
            else:
                hooks.append((f"{block}.attn.hook_{fork}_input", _shift(p, heads, -vector)))
        split = model.cfg.use_split_qkv_input
        model.set_use_split_qkv_input(True)
        try:
            with torch.no_grad():
                model.run_with_hooks(self.prompt, fwd_hooks=hooks, stop_at_layer=layer + 1)
        finally:
            model.set_use_split_qkv_input(split)
        return read[0]


def _frozen(clean: Tensor):
    """A hook that returns the clean run's scale ([pos, 1] or [pos, head, 1]) in the shape the hook sees."""

    def hook(x: Tensor, hook) -> Tensor:
        value = clean.to(x.device, x.dtype)[None]
        if x.ndim == value.ndim + 1:  # ln1 on a per-head copy: [batch, pos, head, 1]
            value = value[:, :, None]
        return value.expand_as(x)

    return hook


def _shift(p: int, heads: list[int] | None, vector: Tensor):
    """A hook adding `vector` at position p ([batch, pos, d]; or [batch, pos, head, d] at `heads`)."""

    def hook(x: Tensor, hook) -> Tensor:
        x = x.clone()
        delta = vector.to(x.device, x.dtype)
        if heads is None:
            x[:, p] += delta
        elif heads:
            x[:, p, heads] += delta
        return x

    return hook
