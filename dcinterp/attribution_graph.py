"""Attribution graphs (Ameisen et al., 2025, "Circuit Tracing") of a HookedDCFormer, with every edge that passes
through attention split exactly by layer, head, source head and compose branch.

The local replacement model of a prompt: each MLP replaced by its transcoder (`dcinterp.transcoders`) plus an
error node, error = the MLP's true output - the transcoder's; every norm's scale (ln1, ln2, ln_final) and every
layer's attention pattern frozen at their values on the prompt (DCMHA: the composed pattern P' that multiplies V,
`hook_composed_pattern`; MHA: `hook_pattern`). On the prompt it gives the model's logits; and it is affine in its
sources: token embeddings, feature activations and error vectors, each written into the residual stream
(features and errors at their layer's `hook_mlp_out`).

Nodes, in circuit-tracer's order: active features (layer, position, feature; sorted), error nodes (layer-major:
layer * n_pos + pos), token embeddings (one a position), logits (at the last position). The adjacency matrix
A[target, source] is the direct effect: the change of the target's input when the source is removed, every other
node held (A[i, j] = source activation x d input_i / d source_j). A feature's input is its pre-activation
x W_enc + b_enc; a logit's is the logit minus the mean logit (circuit-tracer's demeaned unembedding). So every
target's input is sum_j A[i, j] + constant_i, the constant being the input with every source at zero (biases).
One backward pass per target row, batched: a forward of `batch_size` copies of the prompt, each copy's row
injected at its target's read point.

Edges through attention. With P' frozen, attention at layer L adds, at query t, sum_{m, s} P'_L[m, t, s]
(N1_L,s(x_s) W_V^m + b_V^m) W_O^m, where N1 is ln1 with its scale frozen (linear). A path from a source at
position s either stays in the residual stream (only when s is the target's position) or meets a first attention
layer L, which moves it from s to some query t' through head m. So an edge is exactly

    A[i, j] = residual + sum_{L, m, t'} P'_L[m, t', s] (g_L[t', m] . N1_L,s(u_j) W_V^m)

with u_j the source's written vector and g_L the gradient of the target at `hook_z` of layer L (everything after
layer L included). DCMHA's post-compose makes P'[m, t, s] a sum over source heads n and branches of terms in
P[n, t, s]: skip (P[m]), qp (sum_n P[n] (qw1[t]^T qw2[t])[n, m]), kp (the same with key-side weights at s), qg
(P[m] qg[t, m]), kg (P[m] kg[s, m]). `edge_parts` gives the edge in these (layer, head m, source head n, branch)
parts; plain MHA gives skip parts with n = m only. Each part's P[n, t', s] is what `dcinterp.qk` attributes.

Pruning (`prune_graph`) and the replacement and completeness scores (`graph_scores`) are circuit-tracer 0.5's
definitions on the same node order; they live in `dcinterp.graph_pruning`, and this module re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import Tensor

from .graph_pruning import (  # noqa: F401 (re-exported: the names users import from dcinterp.attribution_graph)
    compute_influence,
    find_threshold,
    graph_scores,
    logit_weights,
    normalize_matrix,
    prune_graph,
)
from .transcoders import FEATURE_INPUT_HOOK, FEATURE_OUTPUT_HOOK, Transcoder

BRANCHES = ("skip", "qp", "kp", "qg", "kg")
BRANCH_WEIGHT = {"qp": "qw1", "kp": "kw1", "qg": "qg", "kg": "kg"}  # the dynamic weight a post-compose branch reads


# ----------------------------------------------------------------------------------------------
# The prompt's frozen values


@dataclass
class ReplacementRun:
    """What the local replacement model freezes or reads on one prompt (batch of one, leading 1 dropped).

    Attributes:
        tokens: [pos].
        logits: the model's logits [pos, d_vocab].
        scales: every norm's `hook_scale` [pos, 1] by hook name.
        patterns: per layer, the pattern that multiplies V [head, query, key] (P' for DCMHA, P for MHA).
        softmax_patterns: per layer, P (`hook_pattern`) [head, query, key].
        post_weights: per DCMHA layer with a post-compose, its dynamic weights by name (qw1, qw2, kw1, kw2
            [pos, rank, head]; qg, kg [pos, head]), the branches that are on.
        mlp_inputs: per layer [pos, d_model].
        mlp_outputs: per layer [pos, d_model].
        acts: per layer, feature activations [pos, d_transcoder] (zero at `zero_positions`).
        errors: per layer, mlp output - transcoder output [pos, d_model].
    """

    tokens: Tensor
    logits: Tensor
    scales: dict[str, Tensor]
    patterns: list[Tensor]
    softmax_patterns: list[Tensor]
    post_weights: list[dict[str, Tensor]]
    mlp_inputs: list[Tensor]
    mlp_outputs: list[Tensor]
    acts: list[Tensor]
    errors: list[Tensor]


def pattern_hook(model) -> str:
    """The attention hook whose value multiplies V: `hook_composed_pattern` (DCMHA) or `hook_pattern` (MHA)."""
    return "hook_composed_pattern" if model.cfg.use_dcmha else "hook_pattern"


def replacement_run(
    model, transcoders: list[Transcoder], tokens: Tensor, zero_positions: slice = slice(0)
) -> ReplacementRun:
    """Run the model on a prompt and keep what the replacement freezes.

    Args:
        model: a HookedDCFormer.
        transcoders: one per layer.
        tokens: [pos] or [1, pos].
        zero_positions: positions whose feature activations are set to zero (their MLP output goes to the error
            node), as circuit-tracer's `zero_positions` (which zeroes the BOS position by default).

    Returns:
        The prompt's `ReplacementRun`.

    Raises:
        ValueError: not one transcoder per layer, or a batch of more than one prompt.
    """
    cfg = model.cfg
    if len(transcoders) != cfg.n_layers or [tc.layer for tc in transcoders] != list(range(cfg.n_layers)):
        raise ValueError(f"attribution graph: need one transcoder per layer, 0 to {cfg.n_layers - 1}")
    tokens = tokens.reshape(-1) if tokens.ndim == 1 or tokens.shape[0] == 1 else None
    if tokens is None:
        raise ValueError("attribution graph: one prompt at a time (tokens [pos] or [1, pos])")
    wanted = ("hook_scale", "hook_pattern", "hook_composed_pattern", FEATURE_INPUT_HOOK, FEATURE_OUTPUT_HOOK)
    post_names = ("qw1", "qw2", "kw1", "kw2", "qg", "kg")

    def names_filter(name: str) -> bool:
        return name.endswith(wanted) or (".post_compose." in name and name.rsplit("hook_", 1)[-1] in post_names)

    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens[None].to(model.input_device), names_filter=names_filter)
    cache = {name: value[0] for name, value in cache.items()}
    patterns, softmax_patterns, post_weights, inputs, outputs, acts, errors = [], [], [], [], [], [], []
    for layer, tc in enumerate(transcoders):
        block = f"blocks.{layer}"
        patterns.append(cache[f"{block}.attn.{pattern_hook(model)}"])
        softmax_patterns.append(cache[f"{block}.attn.hook_pattern"])
        prefix = f"{block}.attn.post_compose.hook_"
        post_weights.append({n: cache[prefix + n] for n in post_names if prefix + n in cache})
        x, out = cache[f"{block}.{FEATURE_INPUT_HOOK}"], cache[f"{block}.{FEATURE_OUTPUT_HOOK}"]
        with torch.no_grad():
            a = tc.encode(x.to(tc.W_enc.dtype)).to(x.dtype)
            a[zero_positions] = 0
            error = out - tc.decode(a.to(tc.W_dec.dtype)).to(out.dtype)
        inputs.append(x)
        outputs.append(out)
        acts.append(a)
        errors.append(error)
    scales = {name: value for name, value in cache.items() if name.endswith("hook_scale")}
    return ReplacementRun(
        tokens.cpu(), logits[0], scales, patterns, softmax_patterns, post_weights, inputs, outputs, acts, errors
    )


# ----------------------------------------------------------------------------------------------
# The local replacement model


@dataclass
class ReplacementOutputs:
    """A run of the local replacement model on a batch of copies of the prompt.

    Attributes:
        logits: [batch, pos, d_vocab] (None when the run skipped the unembedding).
        mlp_inputs: per layer, what the transcoder reads [batch, pos, d_model] (in the autograd graph).
        final: ln_final's output [batch, pos, d_model] (in the graph).
        z: per layer, `hook_z` [batch, pos, head, d_head] (in the graph).
        embed: the embedding written into the stream [batch, pos, d_model] (a leaf).
        mlp_outputs: per layer, what replaces the MLP's output [batch, pos, d_model] (leaves).
    """

    logits: Tensor | None
    mlp_inputs: list[Tensor]
    final: Tensor
    z: list[Tensor]
    embed: Tensor
    mlp_outputs: list[Tensor]


def replacement_forward(
    model,
    transcoders: list[Transcoder],
    run: ReplacementRun,
    batch: int = 1,
    embed: Tensor | None = None,
    acts: list[Tensor] | None = None,
    errors: list[Tensor] | None = None,
    requires_grad: bool = False,
    unembed: bool = True,
) -> ReplacementOutputs:
    """Run the local replacement model: norms' scales and attention patterns frozen at `run`'s, each MLP's output
    replaced by acts W_dec + b_dec + error. Affine in (embed, acts, errors).

    Args:
        model: the HookedDCFormer of `run`.
        transcoders: one per layer.
        run: the prompt's frozen values.
        batch: copies of the prompt.
        embed: the embeddings written at each position [batch or 1, pos, d_model] (default: the prompt's).
        acts: per layer, feature activations [batch or 1, pos, d_transcoder] (default: `run.acts`).
        errors: per layer, error vectors [batch or 1, pos, d_model] (default: `run.errors`).
        requires_grad: make the embeddings and MLP outputs leaves that require gradients.
        unembed: compute the logits; without, the run stops at ln_final's output (`final`), which is all the
            logit nodes read, and spares every copy's full-vocabulary product.

    Returns:
        The run's `ReplacementOutputs`.
    """
    n, dtype = len(run.tokens), model.unembed.W_U.dtype
    device = model.input_device
    if embed is None:
        embed = model.embed.W_E[run.tokens.to(device)][None]
    embed = embed.expand(batch, n, -1).detach().clone().requires_grad_(requires_grad)
    mlp_outputs = []
    for layer, tc in enumerate(transcoders):
        a = (run.acts[layer] if acts is None else acts[layer]).to(tc.W_dec.dtype)
        e = run.errors[layer] if errors is None else errors[layer]
        out = (tc.decode(a).to(dtype) + e).expand(batch, n, -1)
        mlp_outputs.append(out.detach().clone().requires_grad_(requires_grad))
    captured: dict[str, Tensor] = {}

    def replace(value: Tensor):
        return lambda x, hook: value.expand(x.shape).to(x.dtype)

    def capture(x, hook):
        captured[hook.name] = x

    hooks = [("hook_embed", lambda x, hook: embed)]
    hooks += [(name, replace(scale[None])) for name, scale in run.scales.items()]
    for layer in range(model.cfg.n_layers):
        block = f"blocks.{layer}"
        hooks.append((f"{block}.attn.{pattern_hook(model)}", replace(run.patterns[layer][None])))
        hooks.append((f"{block}.{FEATURE_OUTPUT_HOOK}", lambda x, hook, out=mlp_outputs[layer]: out))
        hooks += [(f"{block}.{FEATURE_INPUT_HOOK}", capture), (f"{block}.attn.hook_z", capture)]
    hooks.append(("ln_final.hook_normalized", capture))
    with torch.set_grad_enabled(requires_grad), model.hooks(fwd_hooks=hooks):
        resid = model(run.tokens[None].expand(batch, n).to(device), stop_at_layer=model.cfg.n_layers)
        final = model.ln_final(resid)  # the model's own last two steps, its hooks firing
        logits = model.unembed(final) if unembed else None
    layers = range(model.cfg.n_layers)
    return ReplacementOutputs(
        logits,
        [captured[f"blocks.{layer}.{FEATURE_INPUT_HOOK}"] for layer in layers],
        captured["ln_final.hook_normalized"],
        [captured[f"blocks.{layer}.attn.hook_z"] for layer in layers],
        embed,
        mlp_outputs,
    )


# ----------------------------------------------------------------------------------------------
# The graph


@dataclass
class AttributionGraph:
    """Nodes and direct edges of one prompt's local replacement model (node order in the module docstring).

    Attributes:
        run: the prompt's frozen values.
        active_features: [n_features, 3] (layer, position, feature).
        activation_values: [n_features].
        logit_tokens: [n_logits] token ids explained at the last position.
        logit_probabilities: [n_logits] their probabilities under the model.
        adjacency_matrix: [n_nodes, n_nodes], rows targets, columns sources.
        node_inputs: [n_nodes] each feature's pre-activation and each logit's demeaned value on the prompt (0 for
            errors and tokens).
        constant_inputs: [n_nodes] the same with every source at zero: the biases' share.
    """

    run: ReplacementRun
    active_features: Tensor
    activation_values: Tensor
    logit_tokens: Tensor
    logit_probabilities: Tensor
    adjacency_matrix: Tensor
    node_inputs: Tensor
    constant_inputs: Tensor
    n_layers: int
    n_pos: int
    extra: dict = field(default_factory=dict)

    @property
    def n_features(self) -> int:
        return len(self.active_features)

    @property
    def n_logits(self) -> int:
        return len(self.logit_tokens)

    def error_index(self, layer: int, pos: int) -> int:
        """The node index of the error node at (layer, pos)."""
        return self.n_features + layer * self.n_pos + pos

    def token_index(self, pos: int) -> int:
        """The node index of the token embedding at pos."""
        return self.n_features + self.n_layers * self.n_pos + pos

    def logit_index(self, i: int) -> int:
        """The node index of the i-th logit."""
        return self.n_features + (self.n_layers + 1) * self.n_pos + i

    def node(self, index: int) -> dict:
        """What node `index` is: {kind: feature/error/token/logit, layer, pos, feature or token id}."""
        if index < self.n_features:
            layer, pos, feature = self.active_features[index].tolist()
            return dict(kind="feature", layer=layer, pos=pos, feature=feature)
        index -= self.n_features
        if index < self.n_layers * self.n_pos:
            return dict(kind="error", layer=index // self.n_pos, pos=index % self.n_pos)
        index -= self.n_layers * self.n_pos
        if index < self.n_pos:
            return dict(kind="token", layer=-1, pos=index, token=int(self.run.tokens[index]))
        index -= self.n_pos
        return dict(kind="logit", layer=self.n_layers, pos=self.n_pos - 1, token=int(self.logit_tokens[index]))

    def nodes_frame(self) -> pd.DataFrame:
        """One row a node: index, kind, layer, pos, feature, token, activation, input."""
        rows = [dict(index=i, **self.node(i)) for i in range(self.adjacency_matrix.shape[0])]
        frame = pd.DataFrame(rows)
        activation = torch.zeros(len(frame), dtype=torch.float64)
        activation[: self.n_features] = self.activation_values.double().cpu()
        frame["activation"] = activation.numpy()
        frame["input"] = self.node_inputs.double().cpu().numpy()
        return frame

    def edges_frame(self, mask: Tensor | None = None) -> pd.DataFrame:
        """One row a non-zero edge (within `mask`, if given): target, source, weight."""
        A = self.adjacency_matrix if mask is None else self.adjacency_matrix * mask
        target, source = A.nonzero(as_tuple=True)
        return pd.DataFrame(
            dict(target=target.numpy(), source=source.numpy(), weight=A[target, source].double().numpy())
        )


def salient_logits(logits: Tensor, max_n_logits: int = 10, desired_logit_prob: float = 0.95) -> tuple[Tensor, Tensor]:
    """circuit-tracer's choice of logits to explain: the most probable, until their probabilities add up to
    `desired_logit_prob`, at most `max_n_logits`.

    Args:
        logits: [d_vocab] at the last position.
        max_n_logits: the most logits.
        desired_logit_prob: the probability to reach.

    Returns:
        (token ids, probabilities).
    """
    probs = logits.double().softmax(-1)
    top_p, top_idx = probs.topk(min(max_n_logits, len(probs)))
    cutoff = int(torch.searchsorted(top_p.cumsum(0), torch.tensor(desired_logit_prob, dtype=top_p.dtype))) + 1
    return top_idx[:cutoff], top_p[:cutoff]


def demeaned_unembed(model, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """For token ids k (n of them): the demeaned unembedding vectors `W_U[:, k] - mean_j W_U[:, j]`, shape
    [n, d_model], and biases `b_U[k] - mean b_U`, shape [n]. A logit minus the mean logit is the final normed stream
    times the first, plus the second."""
    W_U, b_U = model.unembed.W_U, model.unembed.b_U
    return (W_U[:, tokens] - W_U.mean(1, keepdim=True)).T, b_U[tokens] - b_U.mean()


def target_inputs(model, transcoders, graph: AttributionGraph, outputs: ReplacementOutputs) -> Tensor:
    """Every node's input in a replacement run [batch, n_nodes]: features' pre-activations, logits' demeaned
    values, 0 for errors and tokens (sources only)."""
    batch = outputs.final.shape[0]
    inputs = torch.zeros(batch, graph.adjacency_matrix.shape[0], dtype=outputs.final.dtype)
    for layer, rows, pos, feature in features_by_layer(graph.active_features, graph.n_layers):
        tc = transcoders[layer]
        pre = tc.pre_activation(outputs.mlp_inputs[layer].to(tc.W_enc.dtype))  # [batch, pos, d_transcoder]
        inputs[:, rows] = pre[:, pos.to(pre.device), feature.to(pre.device)].detach().to(inputs.dtype).cpu()
    vectors, biases = demeaned_unembed(model, graph.logit_tokens.to(model.unembed.W_U.device))
    logit_values = outputs.final[:, -1] @ vectors.T + biases
    inputs[:, graph.logit_index(0) :] = logit_values.detach().to(inputs.dtype).cpu()
    return inputs.detach()


def features_by_layer(features: Tensor, n_layers: int) -> list[tuple[int, Tensor, Tensor, Tensor]]:
    """(layer, node rows, positions, feature ids) of the active features [n, 3], a layer at a time (those with any)."""
    groups = []
    for layer in range(n_layers):
        rows = (features[:, 0] == layer).nonzero().flatten()
        if len(rows):
            groups.append((layer, rows, features[rows, 1], features[rows, 2]))
    return groups


def scaled_decoders(transcoders, run: ReplacementRun, features: Tensor) -> list[tuple[int, Tensor, Tensor, Tensor]]:
    """Per layer with active features: (layer, their node rows, positions, activation x decoder vectors [k, d_model]):
    what each feature writes into the stream."""
    groups = []
    for layer, rows, pos, feature in features_by_layer(features, len(transcoders)):
        dec = transcoders[layer].W_dec[feature.to(run.acts[layer].device)]
        act = run.acts[layer][pos.to(dec.device), feature.to(dec.device)]
        groups.append((layer, rows, pos, act[:, None].to(dec.dtype) * dec))
    return groups


def source_columns(model, run: ReplacementRun, n_features: int, decoders: list, grads: list[Tensor]) -> Tensor:
    """Edge rows from gradients at the sources' write points: [batch, n_features + (n_layers + 1) n_pos].

    Args:
        model: the HookedDCFormer.
        run: the prompt's frozen values.
        n_features: the number of active features.
        decoders: `scaled_decoders` of the active features.
        grads: the gradients at the embeddings, then at the MLP outputs of the first layers (all of them, or those
            below the targets' reads) [batch, pos, d_model]. The columns of the layers left out are zero.
    """
    g_embed, g_mlp = grads[0], grads[1:]
    batch, n, L = g_embed.shape[0], len(run.tokens), len(run.errors)
    columns = g_embed.new_zeros(batch, n_features + (L + 1) * n)
    for layer, rows, pos, written in decoders:
        if layer < len(g_mlp):
            along = (g_mlp[layer][:, pos.to(g_embed.device)] * written.to(g_embed.dtype)).sum(-1)  # [batch, k]
            columns[:, rows[0] : rows[-1] + 1] = along  # a layer's features are consecutive nodes
    for layer, (g, e) in enumerate(zip(g_mlp, run.errors, strict=False)):
        start = n_features + layer * n
        columns[:, start : start + n] = (g * e.to(g.dtype)).sum(-1)
    embed = model.embed.W_E[run.tokens.to(g_embed.device)].to(g_embed.dtype)
    columns[:, n_features + L * n :] = (g_embed * embed).sum(-1)
    return columns


def attribution_graph(
    model,
    transcoders: list[Transcoder],
    tokens: Tensor,
    logit_tokens: Tensor | list[int] | None = None,
    max_n_logits: int = 10,
    desired_logit_prob: float = 0.95,
    batch_size: int = 32,
    zero_positions: slice = slice(0),
) -> AttributionGraph:
    """The attribution graph of a prompt: every active feature's and every explained logit's incoming direct edges
    from every feature, error node and token embedding, in batched backward passes.

    Args:
        model: a HookedDCFormer.
        transcoders: one per layer (`dcinterp.transcoders`), in the model's dtype.
        tokens: the prompt [pos] or [1, pos].
        logit_tokens: the token ids to explain at the last position (default: `salient_logits`).
        max_n_logits: as `salient_logits`.
        desired_logit_prob: as `salient_logits`.
        batch_size: target rows a backward pass.
        zero_positions: as `replacement_run`.

    Returns:
        The `AttributionGraph`.

    Raises:
        ValueError: as `replacement_run`; an empty prompt.
    """
    run = replacement_run(model, transcoders, tokens, zero_positions)
    n, L = len(run.tokens), model.cfg.n_layers
    if n == 0:
        raise ValueError("attribution graph: an empty prompt")
    probs_all = run.logits[-1].double().softmax(-1)
    if logit_tokens is None:
        logit_tokens, probs = salient_logits(run.logits[-1], max_n_logits, desired_logit_prob)
    else:
        logit_tokens = torch.as_tensor(logit_tokens).reshape(-1)
        probs = probs_all[logit_tokens.to(probs_all.device)]
    logit_tokens = logit_tokens.cpu()
    features = torch.stack(run.acts).nonzero().cpu()  # [k, 3], sorted (layer, pos, feature)
    values = torch.stack(run.acts)[tuple(features.T)].cpu()
    n_sources = len(features) + (L + 1) * n
    n_nodes = n_sources + len(logit_tokens)
    # Targets: the layer whose read point they inject at (n_layers: ln_final's output), position, vector.
    vectors, _ = demeaned_unembed(model, logit_tokens.to(model.unembed.W_U.device))
    target_layer = torch.cat([features[:, 0], torch.full((len(logit_tokens),), L)])
    target_pos = torch.cat([features[:, 1], torch.full((len(logit_tokens),), n - 1)])
    target_vectors = torch.cat(
        [*(transcoders[layer].W_enc[:, feat].T for layer, _, _, feat in features_by_layer(features, L)), vectors]
    ).to(vectors.dtype)
    n_targets = len(target_layer)
    rows = torch.zeros(n_targets, n_sources, dtype=run.logits.dtype)
    if n_targets:
        outputs = replacement_forward(
            model, transcoders, run, batch=min(batch_size, n_targets), requires_grad=True, unembed=False
        )
        reads = [*outputs.mlp_inputs, outputs.final]
        sources = [outputs.embed, *outputs.mlp_outputs]
        decoders = scaled_decoders(transcoders, run, features)
        batch = outputs.final.shape[0]
        for start in range(0, n_targets, batch):
            chunk = torch.arange(start, min(start + batch, n_targets))
            # Only the reads the chunk's targets sit at (targets are sorted by layer: mostly one), and only the
            # sources written below the highest of them, so the backward runs through no layer above it.
            layers = target_layer[chunk].unique().tolist()
            injections = []
            for layer in layers:
                here = chunk[target_layer[chunk] == layer]
                injection = torch.zeros_like(reads[layer])
                injection[here - start, target_pos[here].to(injection.device)] = target_vectors[here].to(
                    injection.dtype
                )
                injections.append(injection)
            grads = torch.autograd.grad(
                [reads[layer] for layer in layers],
                sources[: max(layers) + 1],
                injections,
                retain_graph=start + batch < n_targets,
                allow_unused=True,
                materialize_grads=True,
            )
            rows[chunk] = source_columns(model, run, len(features), decoders, grads)[: len(chunk)].cpu()
    adjacency = torch.zeros(n_nodes, n_nodes, dtype=rows.dtype)
    adjacency[: len(features), :n_sources] = rows[: len(features)]
    adjacency[n_sources:, :n_sources] = rows[len(features) :]
    graph = AttributionGraph(
        run, features, values, logit_tokens, probs.cpu(), adjacency, torch.zeros(n_nodes), torch.zeros(n_nodes), L, n
    )
    with torch.no_grad():
        graph.node_inputs = target_inputs(model, transcoders, graph, replacement_forward(model, transcoders, run))[0]
        zero = replacement_forward(
            model,
            transcoders,
            run,
            embed=torch.zeros_like(run.mlp_inputs[0])[None],
            acts=[torch.zeros_like(a) for a in run.acts],
            errors=[torch.zeros_like(e) for e in run.errors],
        )
        graph.constant_inputs = target_inputs(model, transcoders, graph, zero)[0]
    return graph


# ----------------------------------------------------------------------------------------------
# Edges through attention, split by layer, head, source head and compose branch


def pattern_terms(model, run: ReplacementRun, layer: int) -> Tensor:
    """The terms of layer's frozen pattern: [branch (BRANCHES), source head n, head m, query, key], whose sum over
    branch and n is the pattern that multiplies V (P' for DCMHA; P, all on the skip branch with n = m, for MHA).

    Args:
        model: the HookedDCFormer of `run`.
        run: the prompt's frozen values.
        layer: the layer.

    Returns:
        The terms tensor, in the run's dtype.
    """
    P = run.softmax_patterns[layer]  # [n, t, s]
    H = P.shape[0]
    terms = P.new_zeros(len(BRANCHES), H, H, *P.shape[1:])
    heads = torch.arange(H)
    terms[0, heads, heads] = P
    w = run.post_weights[layer]
    if "qw1" in w:
        coef = torch.einsum("trn,trm->tnm", w["qw1"], w["qw2"])
        terms[1] = torch.einsum("nts,tnm->nmts", P, coef)
    if "kw1" in w:
        coef = torch.einsum("srn,srm->snm", w["kw1"], w["kw2"])
        terms[2] = torch.einsum("nts,snm->nmts", P, coef)
    if "qg" in w:
        terms[3, heads, heads] = P * w["qg"].T[:, :, None]
    if "kg" in w:
        terms[4, heads, heads] = P * w["kg"].T[:, None, :]
    return terms


def frozen_norm(model, name: str, run: ReplacementRun, pos: int, u: Tensor) -> Tensor:
    """The linear part of a norm with its scale frozen at `run`'s, at one position: w (u - mean u) / scale (LN) or
    w u / scale (RMS). `name`: the norm's module path (`blocks.3.ln1`, `ln_final`)."""
    norm = model.get_submodule(name)
    if norm.kind == "LN":
        u = u - u.mean(-1, keepdim=True)
    return u / run.scales[f"{name}.hook_scale"][pos] * norm.w


def source_vector(model, transcoders, graph: AttributionGraph, source: int) -> tuple[int, int, Tensor]:
    """(first attention layer it reaches, position, the vector it writes into the stream) of a source node."""
    node = graph.node(source)
    run = graph.run
    if node["kind"] == "feature":
        tc = transcoders[node["layer"]]
        u = run.acts[node["layer"]][node["pos"], node["feature"]] * tc.W_dec[node["feature"]]
        return node["layer"] + 1, node["pos"], u
    if node["kind"] == "error":
        return node["layer"] + 1, node["pos"], run.errors[node["layer"]][node["pos"]]
    if node["kind"] == "token":
        return 0, node["pos"], model.embed.W_E[node["token"]]
    raise ValueError(f"edge_parts: node {source} is a logit, not a source")


def branch_mask(cfg, run: ReplacementRun, layer: int) -> Tensor:
    """[branch, source head n, head m]: True where a part can be non-zero: skip, qg, kg at n = m, and qp, kp at every
    (n, m), for the post-compose branches that are on (MHA: skip alone)."""
    H = cfg.n_heads
    mask = torch.zeros(len(BRANCHES), H, H, dtype=torch.bool)
    mask[0] = torch.eye(H, dtype=torch.bool)
    for b, branch in enumerate(BRANCHES[1:], 1):
        if BRANCH_WEIGHT[branch] in run.post_weights[layer]:
            mask[b] = True if branch in ("qp", "kp") else torch.eye(H, dtype=torch.bool)
    return mask


def edge_parts(
    model, transcoders, graph: AttributionGraph, target: int, sources: int | list[int], by_query: bool = False
) -> pd.DataFrame:
    """Edges into one target split into their residual part and their parts through attention by (layer, head m,
    source head n, branch); each edge's parts sum to `graph.adjacency_matrix[target, source]` (module docstring).

    One backward pass for the target, whatever the number of sources.

    Args:
        model: the HookedDCFormer of the graph.
        transcoders: the graph's transcoders.
        graph: the attribution graph.
        target: a feature or logit node's index.
        sources: a feature, error or token node's index, or a list of them.
        by_query: also split each part by the query t' its head moves the source to (a `query` column, -1 on the
            residual row): the (layer, n, t', s) whose softmax pattern `qk.qk_attribution` explains.

    Returns:
        A frame with columns source, layer, head, source_head, branch, value: per source, one row with branch
        "residual" (layer and heads -1) for the path that stays at its position, then one row per (layer, m, n,
        branch) that can be non-zero (`branch_mask`), for the attention layers between source and target; with
        `by_query`, one such row per query t' from the source's position on, and the `query` column.

    Raises:
        ValueError: a target that is not a feature or logit, or a source that is a logit.
    """
    t_node = graph.node(target)
    if t_node["kind"] not in ("feature", "logit"):
        raise ValueError(f"edge_parts: node {target} is a {t_node['kind']}, which has no incoming edges")
    run, cfg = graph.run, model.cfg
    read_layer, t = t_node["layer"], t_node["pos"]
    if t_node["kind"] == "feature":
        vector, norm_name = transcoders[read_layer].W_enc[:, t_node["feature"]], f"blocks.{read_layer}.ln2"
        last = read_layer - 1 if cfg.parallel_residual else read_layer  # the last attention layer before the read
    else:
        vectors, _ = demeaned_unembed(model, torch.tensor([t_node["token"]], device=model.unembed.W_U.device))
        vector, norm_name, last = vectors[0], "ln_final", cfg.n_layers - 1
    outputs = replacement_forward(model, transcoders, run, requires_grad=True)
    read = outputs.final if t_node["kind"] == "logit" else outputs.mlp_inputs[read_layer]
    injection = torch.zeros_like(read)
    injection[0, t] = vector.to(read.dtype)
    g_z = torch.autograd.grad([read], outputs.z, [injection], allow_unused=True, materialize_grads=True)
    terms, masks = {}, {}
    names = ("source", "layer", "head", "source_head", "branch", "value") + (("query",) if by_query else ())
    columns: dict[str, list] = {name: [] for name in names}

    def add(source, layer, head, source_head, branch, value, query=None):
        values = (source, layer, head, source_head, branch, value, query or [-1] * len(source))
        for name, column in zip(names, values, strict=False):  # the query only where `by_query` named it
            columns[name].extend(column)

    for source in [sources] if isinstance(sources, int) else sources:
        first_layer, s, u = source_vector(model, transcoders, graph, source)
        residual = 0.0  # a source written after the target reads (same layer, parallel residual included) has none
        if s == t and (t_node["kind"] == "logit" or first_layer <= read_layer):
            residual = (vector.to(u.dtype) * frozen_norm(model, norm_name, run, t, u)).sum().item()
        add([source], [-1], [-1], [-1], ["residual"], [residual])
        for layer in range(first_layer, last + 1):
            if layer not in terms:
                terms[layer], masks[layer] = pattern_terms(model, run, layer), branch_mask(cfg, run, layer)
            W_V = model.blocks[layer].attn.W_V
            v = torch.einsum("d,hde->he", frozen_norm(model, f"blocks.{layer}.ln1", run, s, u).to(W_V.dtype), W_V)
            dots = torch.einsum("the,he->th", g_z[layer][0], v)  # [query t', head m]
            b, n, m = masks[layer].nonzero(as_tuple=True)
            if by_query:  # each (b, n, m) once per query t' >= s (a query before s does not see the source)
                per_query = torch.einsum("bnmt,tm->bnmt", terms[layer][..., s], dots.to(terms[layer].dtype))
                per_query, queries = per_query[b, n, m][:, s:], torch.arange(s, graph.n_pos)
                b, n, m = (x.repeat_interleave(len(queries)) for x in (b, n, m))
                k = len(b)
                add(
                    [source] * k,
                    [layer] * k,
                    m.tolist(),
                    n.tolist(),
                    [BRANCHES[i] for i in b],
                    per_query.flatten().tolist(),
                    queries.repeat(len(per_query)).tolist(),
                )
                continue
            parts = torch.einsum("bnmt,tm->bnm", terms[layer][..., s], dots.to(terms[layer].dtype))
            k = len(b)
            add([source] * k, [layer] * k, m.tolist(), n.tolist(), [BRANCHES[i] for i in b], parts[b, n, m].tolist())
    return pd.DataFrame(columns)


def live_removal(model, transcoders, graph: AttributionGraph, source: int) -> Tensor:
    """How much the model's own prediction moves when a source is removed with nothing frozen: its written vector
    (a feature's activation x decoder row, an error vector, a token's embedding) subtracted where it is written, and
    the patterns, the compose, the norms and the MLPs all recomputed. The estimate beside it is the source's
    direct edge into each logit (`graph.adjacency_matrix[logit, source]`, with P' and the norms frozen and every
    other node held).

    Args:
        model: the HookedDCFormer of the graph.
        transcoders: the graph's transcoders.
        graph: the graph.
        source: a feature, error or token node's index.

    Returns:
        [n_logits]: the change of each explained logit's demeaned value (removed minus original).
    """
    _, pos, u = source_vector(model, transcoders, graph, source)
    node = graph.node(source)
    name = "hook_embed" if node["kind"] == "token" else f"blocks.{node['layer']}.{FEATURE_OUTPUT_HOOK}"

    def remove(x, hook):
        x = x.clone()
        x[:, pos] -= u.to(x.dtype)
        return x

    with torch.no_grad():
        before = model(graph.run.tokens[None].to(model.input_device))[0, -1]
        after = model.run_with_hooks(graph.run.tokens[None].to(model.input_device), fwd_hooks=[(name, remove)])[0, -1]
    tokens = graph.logit_tokens.to(before.device)
    return ((after[tokens] - after.mean()) - (before[tokens] - before.mean())).double().cpu()


def edge_labels(model, transcoders, graph: AttributionGraph, edge_mask: Tensor) -> dict[tuple[int, int], str]:
    """For each kept edge that moves between positions: its largest part through attention, as
    `L1 H2<-H0 qp (62%)` (layer, head m, source head n, branch, its share of the edge).

    Args:
        model: the HookedDCFormer of the graph.
        transcoders: the graph's transcoders.
        graph: the graph.
        edge_mask: [n_nodes, n_nodes] the edges to label (`prune_graph`'s).

    Returns:
        {(target, source): label}.
    """
    labels = {}
    targets, sources = edge_mask.nonzero(as_tuple=True)
    by_target: dict[int, list[int]] = {}
    for target, source in zip(targets.tolist(), sources.tolist(), strict=True):
        if graph.node(target)["pos"] != graph.node(source)["pos"]:
            by_target.setdefault(target, []).append(source)
    for target, kept in by_target.items():
        frame = edge_parts(model, transcoders, graph, target, kept)
        frame = frame[frame.branch != "residual"]
        for source, rows in frame.groupby("source"):
            top = rows.loc[rows.value.abs().idxmax()]
            share = top.value / graph.adjacency_matrix[target, source].item()
            labels[(target, int(source))] = (
                f"L{top.layer} H{top['head']}<-H{top.source_head} {top.branch} ({share:.0%})"
            )
    return labels
