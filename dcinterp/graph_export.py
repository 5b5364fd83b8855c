"""An attribution graph (`dcinterp.attribution_graph`) written as the JSON that circuit-tracer's frontend and
Neuronpedia read: `{slug}.json` with `metadata`, `qParams`, `nodes` and `links` (schema_version 1), and the folder's
`graph-metadata.json` listing its graphs, as circuit-tracer 0.5's `create_graph_files` writes them (node ids,
feature numbers and layers as its `Node` constructors make them).

What circuit-tracer's graphs lack rides along in fields its readers ignore: each link whose edge passes through
attention carries `parts`, the edge split by `edge_parts` into (layer, head, source head, branch) values (column-wise,
the residual part apart), and the metadata carries `dcinterp`: the model, the pruning thresholds and the graph's
replacement and completeness scores.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .attribution_graph import AttributionGraph, edge_parts
from .graph_pruning import graph_scores, prune_graph


def cantor_pairing(x: int, y: int) -> int:
    """circuit-tracer's feature number of (layer, feature): a unique integer of two non-negative integers."""
    return (x + y) * (x + y + 1) // 2 + y


def node_json(graph: AttributionGraph, index: int, influence: float, token_str) -> dict:
    """One node as circuit-tracer's `Node` (feature, error, embedding or logit)."""
    node = graph.node(index)
    kind, pos, layer = node["kind"], node["pos"], node["layer"]
    entry = dict(ctx_idx=pos, token_prob=0.0, is_target_logit=False, run_idx=0, reverse_ctx_idx=0, clerp="")
    entry.update(influence=influence, activation=None)
    if kind == "feature":
        feature = node["feature"]
        entry.update(node_id=f"{layer}_{feature}_{pos}", feature=cantor_pairing(layer, feature), layer=str(layer))
        entry.update(feature_type="cross layer transcoder", jsNodeId=f"{layer}_{feature}-0")
        entry.update(activation=graph.activation_values[index].item())
    elif kind == "error":
        entry.update(node_id=f"0_{layer}_{pos}", feature=-1, layer=str(layer), feature_type="mlp reconstruction error")
        entry.update(jsNodeId=f"{layer}_{pos}-0")
    elif kind == "token":
        token = node["token"]
        entry.update(node_id=f"E_{token}_{pos}", feature=pos, layer="E", feature_type="embedding")
        entry.update(jsNodeId=f"E_{token}-{pos}")
    else:
        i, token, top = index - graph.logit_index(0), node["token"], str(graph.n_layers + 1)
        prob = graph.logit_probabilities[i].item()
        entry.update(node_id=f"{top}_{token}_{pos}", feature=token, layer=top, feature_type="logit", influence=None)
        entry.update(token_prob=prob, is_target_logit=i == 0, jsNodeId=f"L_{token}-{pos}")
        entry.update(clerp=f'Output "{token_str(token)}" (p={prob:.3f})')
    return entry


def graph_json(
    model,
    transcoders,
    graph: AttributionGraph,
    slug: str,
    scan: str,
    node_threshold: float = 0.8,
    edge_threshold: float = 0.98,
    parts: bool = True,
) -> dict:
    """The pruned graph as circuit-tracer's graph JSON (a dict), with each attention edge's parts.

    Args:
        model: the HookedDCFormer of the graph (its tokenizer names the tokens, if it has one).
        transcoders: the graph's transcoders.
        graph: the attribution graph.
        slug: the graph's name (its file is `{slug}.json`).
        scan: the name of the transcoders, as circuit-tracer's `scan`.
        node_threshold: as `prune_graph`.
        edge_threshold: as `prune_graph`.
        parts: attach each attention edge's parts (one backward pass per target node kept).

    Returns:
        {"metadata", "qParams", "nodes", "links"}.
    """
    node_mask, edge_mask, cumulative = prune_graph(graph, node_threshold, edge_threshold)
    tokenizer = getattr(model, "tokenizer", None)

    def token_str(token: int) -> str:
        return tokenizer.decode([token]) if tokenizer is not None else str(token)

    nodes = {i: node_json(graph, i, cumulative[i].item(), token_str) for i in node_mask.nonzero().flatten().tolist()}
    targets, sources = edge_mask.nonzero(as_tuple=True)
    links = []
    by_target: dict[int, list[int]] = {}
    for target, source in zip(targets.tolist(), sources.tolist(), strict=True):
        if target in nodes and source in nodes:
            by_target.setdefault(target, []).append(source)
    for target, kept in by_target.items():
        frame = edge_parts(model, transcoders, graph, target, kept) if parts else None
        for source in kept:
            link = dict(
                source=nodes[source]["node_id"],
                target=nodes[target]["node_id"],
                weight=graph.adjacency_matrix[target, source].item(),
            )
            if frame is not None:
                rows = frame[frame.source == source]
                attention = rows[(rows.branch != "residual") & (rows.value != 0)]
                if len(attention):
                    link["parts"] = dict(
                        residual=float(rows.value[rows.branch == "residual"].sum()),
                        **{column: attention[column].tolist() for column in ("layer", "head", "source_head", "branch")},
                        value=attention.value.tolist(),
                    )
            links.append(link)
    connected = {link["source"] for link in links} | {link["target"] for link in links}
    used = [n for n in nodes.values() if n["node_id"] in connected or n["feature_type"] in ("embedding", "logit")]
    replacement, completeness = graph_scores(graph)
    metadata = dict(
        slug=slug,
        scan=scan,
        transcoder_list=[],
        prompt_tokens=[token_str(t) for t in graph.run.tokens.tolist()],
        prompt="".join(token_str(t) for t in graph.run.tokens.tolist()),
        node_threshold=node_threshold,
        schema_version=1,
        dcinterp=dict(
            model=model.cfg.model_name,
            dcmha=model.cfg.use_dcmha,
            edge_threshold=edge_threshold,
            replacement_score=replacement,
            completeness_score=completeness,
        ),
    )
    qparams = dict(pinnedIds=[], supernodes=[], linkType="both", clickedId="", sg_pos="")
    return dict(metadata=metadata, qParams=qparams, nodes=used, links=links)


def write_graph_files(data: dict, directory: str | Path) -> Path:
    """Write a `graph_json` result as `{slug}.json` in `directory` and list it in `graph-metadata.json` there (a
    graph of the same slug is replaced), as circuit-tracer's `create_graph_files`.

    Args:
        data: what `graph_json` returns.
        directory: the folder (created).

    Returns:
        The path of the graph's JSON file.

    Raises:
        ValueError: a `graph-metadata.json` there that is not a graph list (the file named).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index_path = directory / "graph-metadata.json"
    graphs = {"graphs": []}
    if index_path.exists():
        try:
            graphs = json.loads(index_path.read_text())
            graphs["graphs"] = [g for g in graphs["graphs"] if g["slug"] != data["metadata"]["slug"]]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"write_graph_files: {index_path}: not a graph-metadata.json") from None
    graphs["graphs"].append(data["metadata"])
    path = directory / f"{data['metadata']['slug']}.json"
    path.write_text(json.dumps(data, indent=1, default=_plain))
    index_path.write_text(json.dumps(graphs, indent=2, default=_plain))
    return path


def _plain(value):
    """JSON for the tensors' and numpy's scalars that slip into a graph's dict."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")
