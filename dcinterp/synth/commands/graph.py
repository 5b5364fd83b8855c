"""Attribution graphs (`dcinterp.attribution_graph`) of a prompt or of the synthetic tasks' prompts.

    python -m dcinterp.synth graph --out DIR [--checkpoint C] [--transcoders DIR] [--prompt TEXT | --tasks IDS]
                                   [--limit N] [--seed S] [--node-threshold F] [--edge-threshold F]
                                   [--max-n-logits N] [--desired-logit-prob F] [--batch-size N] [--device D]
                                   [--dtype T]

The prompt is `--prompt`, or, per task of `--tasks`, the clean prompts of its first `--limit` contrast pairs
(`contrast.contrast_pairs`, the prompts `synth qk`, `circuit` and `attribute` use: two shots, then the query line
up to its answer). The transcoders are `--transcoders`, or those shipped in the checkpoint's `transcoders/` folder.
The graph explains the most probable next tokens (circuit-tracer's `max_n_logits` and `desired_logit_prob`) and is
pruned with circuit-tracer's thresholds (0.8 of the nodes' influence, 0.98 of the edges').

Writes, per prompt (its slug: the checkpoint's name and the task and sample, or `prompt`): `{slug}.json`, the graph
as circuit-tracer's frontend and Neuronpedia read it, listed in the folder's `graph-metadata.json`
(`graph_export.write_graph_files`: a folder the frontend serves; graphs of other slugs already listed stay);
`{slug}.png`, the pruned graph drawn, attention edges labelled by their largest (head, source head, branch) part;
`{slug}.html`, the same as an interactive page that works offline; `{slug}-parts.csv`, each kept edge that passes
through attention split into its parts (target, source, weight, layer, head, source_head, branch, value: the
residual part first, with layer and heads -1; each edge's values add up to its weight).
Exit status 0, or 2 with one line on stderr for bad input, before anything is written.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ...cli import fraction, positive_int
from ..evaluate import EvalError
from . import common

DEFAULT_CHECKPOINT = "dcpythia-synth"
DEFAULT_TASKS = "2"  # same-person : superclass, the case study's person lookup
PARTS_CSV_COLUMNS = ["target", "source", "weight", "layer", "head", "source_head", "branch", "value"]
TRAIN_HINT = "python -m dcinterp.transcoders --checkpoint CKPT --corpus FILE --out DIR"


def add_graph_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `graph` command's options.

    Args:
        parser: The parser to add them to.

    Returns:
        The same parser.
    """
    common.add_out_argument(parser, ["the graphs' files"])
    common.add_checkpoint_argument(parser, DEFAULT_CHECKPOINT)
    parser.add_argument(
        "--transcoders", metavar="DIR", help="the transcoders' folder (default: the checkpoint's transcoders/)"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", metavar="TEXT", help="the prompt whose next token is explained")
    source.add_argument(
        "--tasks",
        type=common.task_list,
        metavar="IDS",
        help=f"tasks whose prompts are explained, e.g. 2,3 (default without --prompt: {DEFAULT_TASKS})",
    )
    parser.add_argument("--limit", type=positive_int, metavar="N", help="prompts per task (default 1: the first)")
    parser.add_argument("--seed", type=int, default=0, help="the tasks' samples' seed")
    parser.add_argument(
        "--node-threshold", type=fraction, default=0.8, metavar="F", help="node influence kept (default 0.8)"
    )
    parser.add_argument(
        "--edge-threshold", type=fraction, default=0.98, metavar="F", help="edge influence kept (default 0.98)"
    )
    parser.add_argument("--max-n-logits", type=positive_int, default=10, metavar="N", help="logits explained at most")
    parser.add_argument(
        "--desired-logit-prob",
        type=fraction,
        default=0.95,
        metavar="F",
        help="explain the most probable tokens until their probabilities reach F (default 0.95)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=32, metavar="N", help="target rows a backward")
    common.add_device_arguments(parser)
    return parser


# --------------------------------------------------------------------------------------------------
# Inputs
def checked_transcoders(args: argparse.Namespace, model) -> list:
    """The transcoders of `--transcoders` (or the checkpoint's own), checked against the model.

    Args:
        args: The parsed options.
        model: The checkpoint's model.

    Returns:
        One transcoder per layer, in the model's dtype and on its device.

    Raises:
        EvalError: No transcoders, unreadable ones, or ones of another number of layers or d_model.
    """
    from ...loading import resolve_checkpoint
    from ...transcoders import load_transcoders

    where = args.transcoders
    if where is None:
        where = resolve_checkpoint(args.checkpoint) / "transcoders"
        if not (where / "config.yaml").is_file():
            raise EvalError(
                f"{args.checkpoint}: no transcoders shipped ({where}/config.yaml); train them with "
                f"`{TRAIN_HINT}` and pass --transcoders DIR"
            )
    dtype = model.unembed.W_U.dtype
    try:
        transcoders = load_transcoders(where, device=model.input_device, dtype=dtype)
    except ValueError as error:
        raise EvalError(f"--transcoders {where}: {error}") from None
    cfg = model.cfg
    if len(transcoders) != cfg.n_layers:
        raise EvalError(
            f"--transcoders {where}: {len(transcoders)} layers of transcoders; {args.checkpoint} has {cfg.n_layers}"
        )
    if transcoders[0].d_model != cfg.d_model:
        raise EvalError(
            f"--transcoders {where}: transcoders of d_model {transcoders[0].d_model}; {args.checkpoint} has "
            f"d_model {cfg.d_model}"
        )
    return transcoders


def prompts_of(args: argparse.Namespace, model) -> list[tuple[str, str]]:
    """The prompts explained, each with its slug.

    Args:
        args: The parsed options.
        model: The checkpoint's model (its tokenizer).

    Returns:
        [(slug, prompt)].

    Raises:
        EvalError: An empty prompt, words the tokenizer does not know, a prompt longer than the context, or tasks
            without contrast pairs.
    """
    from ...tokenizer import check_vocabulary

    name = model.cfg.model_name or Path(str(args.checkpoint)).name
    if args.prompt is not None:
        if args.limit is not None:
            raise EvalError("--limit: applies to --tasks, not to --prompt")
        try:
            check_vocabulary(model.tokenizer, args.prompt, "--prompt")
        except ValueError as error:
            raise EvalError(str(error)) from None
        n = len(model.to_tokens(args.prompt)[0])
        if n > model.cfg.n_ctx:
            raise EvalError(f"--prompt: {n} tokens; {args.checkpoint} reads at most {model.cfg.n_ctx}")
        return [(f"{name}-prompt", args.prompt)]
    pairs = common.tasks_contrast_pairs(
        args.tasks or common.task_list(DEFAULT_TASKS), args.limit or 1, args.seed, model.tokenizer
    )
    return [(f"{name}-{pair.task_id}-{pair.sample}", pair.clean) for pair in pairs]


# --------------------------------------------------------------------------------------------------
# The work
def parts_frame(data: dict):
    """The kept attention edges' parts, read from the graph JSON's links (`graph_export.graph_json`).

    Args:
        data: The graph's JSON (a dict).

    Returns:
        A frame with `PARTS_CSV_COLUMNS`: per link with parts, its residual part, then each attention part.
    """
    import pandas as pd

    rows = []
    for link in data["links"]:
        parts = link.get("parts")
        if parts is None:
            continue
        ends = dict(target=link["target"], source=link["source"], weight=link["weight"])
        rows.append(dict(ends, layer=-1, head=-1, source_head=-1, branch="residual", value=parts["residual"]))
        for layer, head, source_head, branch, value in zip(
            parts["layer"], parts["head"], parts["source_head"], parts["branch"], parts["value"], strict=True
        ):
            rows.append(dict(ends, layer=layer, head=head, source_head=source_head, branch=branch, value=value))
    return pd.DataFrame(rows, columns=PARTS_CSV_COLUMNS)


def explain(args: argparse.Namespace, model, transcoders, slug: str, prompt: str) -> dict:
    """One prompt's graph, pruned, exported, drawn and split into parts.

    Args:
        args: The parsed options.
        model: The checkpoint's model.
        transcoders: Its transcoders.
        slug: The graph's name.
        prompt: The prompt.

    Returns:
        {data: the graph JSON, figure, graph, masks (node, edge), labels, tokens (strings), parts: the frame}.
    """
    from ...attribution_graph import attribution_graph, edge_labels
    from ...graph_export import graph_json
    from ...graph_pruning import prune_graph
    from ...plotting.graph import plot_attribution_graph

    tokens = model.to_tokens(prompt)[0]
    graph = attribution_graph(
        model,
        transcoders,
        tokens,
        max_n_logits=args.max_n_logits,
        desired_logit_prob=args.desired_logit_prob,
        batch_size=args.batch_size,
    )
    scan = Path(str(args.transcoders)).name if args.transcoders else f"{model.cfg.model_name}-transcoders"
    data = graph_json(model, transcoders, graph, slug, scan, args.node_threshold, args.edge_threshold)
    node_mask, edge_mask, _ = prune_graph(graph, args.node_threshold, args.edge_threshold)
    labels = edge_labels(model, transcoders, graph, edge_mask)
    str_tokens = model.to_str_tokens(tokens)
    scores = data["metadata"]["dcinterp"]
    figure = plot_attribution_graph(
        graph,
        node_mask,
        edge_mask,
        str_tokens,
        labels,
        title=f"{slug}: {len(data['nodes'])} nodes, {len(data['links'])} links (replacement score "
        f"{scores['replacement_score']:.2f}, completeness {scores['completeness_score']:.2f})",
    )
    return dict(
        data=data,
        figure=figure,
        graph=graph,
        masks=(node_mask, edge_mask),
        labels=labels,
        tokens=str_tokens,
        parts=parts_frame(data),
    )


def write_outputs(out_dir: Path, results: dict[str, dict]) -> None:
    """Write every prompt's files and the folder's graph-metadata.json, all or none (`common.write_files`).

    The graph files are first written by `write_graph_files` into a scratch folder seeded with the folder's
    graph-metadata.json (so that graphs listed there stay listed), then moved in with the others.

    Args:
        out_dir: `--out`.
        results: {slug: `explain`'s result}.

    Raises:
        EvalError: A graph-metadata.json in `out_dir` that is not one, or a file that cannot be written.
    """
    import shutil

    from ...graph_export import write_graph_files
    from ...plotting.graph import write_graph_html

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        index = out_dir / "graph-metadata.json"
        if index.is_file():
            shutil.copyfile(index, scratch / index.name)
        try:
            for result in results.values():
                write_graph_files(result["data"], scratch)
        except ValueError as error:
            raise EvalError(str(error).replace(str(scratch / index.name), str(index))) from None

        def copy(name: str):
            return lambda path: shutil.copyfile(scratch / name, path)

        writers = {}
        for slug, r in results.items():
            writers[f"{slug}.json"] = copy(f"{slug}.json")
            writers[f"{slug}.png"] = common.png_writer(r["figure"])
            writers[f"{slug}.html"] = lambda path, r=r, slug=slug: write_graph_html(
                r["graph"], *r["masks"], path, r["tokens"], r["labels"], title=f"attribution graph: {slug}"
            )
            writers[f"{slug}-parts.csv"] = common.csv_writer(r["parts"])
        writers["graph-metadata.json"] = copy("graph-metadata.json")
        common.write_files(out_dir, writers)


def run_graph(args: argparse.Namespace) -> int:
    """The `graph` command: 0 on success, 2 (and one line on stderr) for bad input.

    Args:
        args: The parsed options (`add_graph_arguments`).

    Returns:
        The exit status.
    """
    from ..catalog import CatalogError

    try:
        common.check_out_dir(args.out)
        device = common.eval_device(args.device)
        if args.prompt is not None and not args.prompt.strip():
            raise EvalError("--prompt: empty; pass the text whose next token the graph explains")
        model = common.load_frozen_model(args.checkpoint, args.dtype, device, "the prompts need one")
        transcoders = checked_transcoders(args, model)
        prompts = prompts_of(args, model)
        results = {}
        for slug, prompt in prompts:
            results[slug] = explain(args, model, transcoders, slug, prompt)
        write_outputs(args.out, results)
    except (EvalError, CatalogError) as error:
        return common.refuse(error)
    names = [f"{slug}{suffix}" for slug in results for suffix in (".json", ".png", ".html", "-parts.csv")]
    print(f"{args.checkpoint}: {len(results)} graph{'s' if len(results) > 1 else ''}")
    for slug, r in results.items():
        print("  " + summary_line(slug, r["data"]))
    print(common.wrote_line(args.out, [*names, "graph-metadata.json"]))
    return 0


def summary_line(slug: str, data: dict) -> str:
    """One graph in a line: its top logit, kept nodes and links, and its scores."""
    scores = data["metadata"]["dcinterp"]
    top = next(node["clerp"] for node in data["nodes"] if node["is_target_logit"])
    return (
        f"{slug}: {top}; {len(data['nodes'])} nodes, {len(data['links'])} links kept; replacement score "
        f"{scores['replacement_score']:.3f}, completeness {scores['completeness_score']:.3f}"
    )
