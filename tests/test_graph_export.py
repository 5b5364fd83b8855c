"""The attribution graph as circuit-tracer's graph JSON (dcinterp.graph_export): node ids and links as its frontend
reads them, each link's weight the graph's edge, each attention edge's parts adding up to it, graph-metadata.json
listing the graph once; and, where circuit-tracer is installed (an environment of its own: it pins
TransformerLens < 4 through its dependencies), the files validate against its own pydantic models."""

import json

import pytest
import torch

from dcinterp import HookedDCFormer
from dcinterp.attribution_graph import attribution_graph, prune_graph
from dcinterp.graph_export import graph_json, write_graph_files
from dcinterp.transcoders import random_transcoders
from tests.test_graph import PROMPT


@pytest.fixture(scope="module", params=["dcpythia-synth", "pythia-synth"])
def exported(request, tmp_path_factory) -> tuple:
    model = HookedDCFormer.from_pretrained(request.param, dtype=torch.float64).eval().requires_grad_(False)
    transcoders = [tc.double() for tc in random_transcoders(model, 64, seed=3)]
    tokens = model.to_tokens(PROMPT, prepend_bos=False)[0]
    graph = attribution_graph(model, transcoders, tokens)
    data = graph_json(model, transcoders, graph, slug=f"lookup-{request.param}", scan="random-64")
    directory = tmp_path_factory.mktemp("graphs")
    path = write_graph_files(data, directory)
    return model, graph, json.loads(path.read_text()), directory


def test_nodes_and_links(exported):
    model, graph, data, _ = exported
    ids = [node["node_id"] for node in data["nodes"]]
    assert len(ids) == len(set(ids))
    assert {"metadata", "qParams", "nodes", "links"} == set(data)
    assert data["metadata"]["schema_version"] == 1 and len(data["metadata"]["prompt_tokens"]) == graph.n_pos
    kinds = {node["feature_type"] for node in data["nodes"]}
    assert kinds == {"cross layer transcoder", "mlp reconstruction error", "embedding", "logit"}
    assert sum(node["is_target_logit"] for node in data["nodes"]) == 1
    node_mask, edge_mask, _ = prune_graph(graph)
    assert len(data["links"]) == int(edge_mask.sum())  # every kept edge joins two kept nodes
    index = {graph_node_id(graph, i): i for i in range(graph.adjacency_matrix.shape[0])}
    with_parts = 0
    for link in data["links"]:
        target, source = index[link["target"]], index[link["source"]]
        assert link["weight"] == graph.adjacency_matrix[target, source].item()
        if "parts" in link:
            with_parts += 1
            parts = link["parts"]
            assert len({len(parts[c]) for c in ("layer", "head", "source_head", "branch", "value")}) == 1
            total = parts["residual"] + sum(parts["value"])
            assert abs(total - link["weight"]) <= 1e-12 * max(1.0, abs(link["weight"]))
            if not model.cfg.use_dcmha:
                assert set(parts["branch"]) == {"skip"} and parts["head"] == parts["source_head"]
        else:  # no path through attention: the edge is the residual stream's, at one position
            assert graph.node(target)["pos"] == graph.node(source)["pos"]
    assert with_parts > 0


# circuit-tracer's node ids (its frontend.graph_models.Node constructors), by node kind
NODE_IDS = {"feature": "{layer}_{feature}_{pos}", "error": "0_{layer}_{pos}", "token": "E_{token}_{pos}"}


def graph_node_id(graph, index: int) -> str:
    node = graph.node(index)
    return NODE_IDS.get(node["kind"], "{top}_{token}_{pos}").format(**node, top=graph.n_layers + 1)


def test_graph_metadata_lists_each_graph_once(exported):
    _, _, data, directory = exported
    write_graph_files(data, directory)  # the same slug again: replaced, not added
    other = dict(data, metadata=dict(data["metadata"], slug="other"))
    write_graph_files(other, directory)
    listed = json.loads((directory / "graph-metadata.json").read_text())["graphs"]
    assert sorted(g["slug"] for g in listed) == sorted([data["metadata"]["slug"], "other"])
    (directory / "graph-metadata.json").write_text("[]")
    with pytest.raises(ValueError, match="graph-metadata.json: not a graph-metadata.json"):
        write_graph_files(data, directory)


def test_circuit_tracers_models_read_it(exported, tmp_path):
    """The files as circuit-tracer's own pydantic models read them (runs where circuit-tracer is installed: .ci/run's
    environment of its own), and every node as its own constructors make it."""
    graph_models = pytest.importorskip("circuit_tracer.frontend.graph_models", reason="circuit-tracer not installed")
    model, graph, data, _ = exported
    path = write_graph_files(data, tmp_path)
    read = graph_models.Model.model_validate_json(path.read_text())
    links = [graph_models.Link.model_validate(link) for link in read.links]
    assert len(read.nodes) == len(data["nodes"]) and len(links) == len(data["links"])
    listed = json.loads((tmp_path / "graph-metadata.json").read_text())["graphs"]
    assert [graph_models.Metadata.model_validate(entry) for entry in listed] == [read.metadata]
    _, _, influence = prune_graph(graph)
    index = {graph_node_id(graph, i): i for i in range(graph.adjacency_matrix.shape[0])}
    for node in read.nodes:
        i = index[node.node_id]
        n = graph.node(i)
        if n["kind"] == "feature":
            made = graph_models.Node.feature_node(
                n["layer"], n["pos"], n["feature"], influence[i].item(), graph.activation_values[i].item()
            )
        elif n["kind"] == "error":
            made = graph_models.Node.error_node(n["layer"], n["pos"], influence[i].item())
        elif n["kind"] == "token":
            made = graph_models.Node.token_node(n["pos"], n["token"], influence[i].item())
        else:
            logit = i - graph.logit_index(0)
            token, prob = model.tokenizer.decode([n["token"]]), graph.logit_probabilities[logit].item()
            made = graph_models.Node.logit_node(n["pos"], n["token"], token, graph.n_layers, logit == 0, prob)
        assert node == made, node.node_id
