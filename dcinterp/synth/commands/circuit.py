"""Circuit discovery on the synthetic tasks' contrast pairs (EAP / EAP-IG, `dcinterp.discovery`).

    python -m dcinterp.synth circuit [--checkpoint C] [--tasks IDS] [--pairs N] [--method eap|eap-ig] --out DIR
                                     [--n-steps K] [--metric logit-diff|logprob] [--kind person|object]
                                     [--exact-top N] [--seed S] [--device D] [--dtype T] [--batch-size N]

Scores every edge of the checkpoint's graph with both methods (`--method` is the one the circuit figure and the
`score` column use), patches the top-scored edges exactly, and evaluates circuits of growing size exactly.
Writes `edges.csv` (one row per edge: source, target, kind, layer, stage, branch, source_head, target_head, score,
exact, and both methods' scores), `faithfulness.csv` (method, selection, edges, faithfulness; a random-edges
baseline), `summary.json` and two figures, `faithfulness.png` and `circuit.png`.
Exit status 0, or 2 with one line on stderr for bad input, before anything is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...cli import positive_int
from ..evaluate import EvalError
from . import common

DEFAULT_CHECKPOINT = "dcpythia-synth"
OUTPUTS = ("edges.csv", "faithfulness.csv", "summary.json", "faithfulness.png", "circuit.png")
MAX_DRAWN_EDGES = 300


def add_circuit_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `circuit` command's options.

    Args:
        parser: The parser to add them to.

    Returns:
        The same parser.
    """
    common.add_checkpoint_argument(parser, DEFAULT_CHECKPOINT)
    common.add_contrast_tasks_argument(parser)
    parser.add_argument("--pairs", type=positive_int, default=8, metavar="N", help="contrast pairs per task")
    parser.add_argument(
        "--method",
        choices=["eap", "eap-ig"],
        default="eap-ig",
        help="the scores the circuit figure and the score column use (both are computed)",
    )
    parser.add_argument("--n-steps", type=positive_int, default=5, metavar="K", help="EAP-IG steps (default 5)")
    parser.add_argument("--metric", choices=["logit-diff", "logprob"], default="logit-diff")
    parser.add_argument("--kind", choices=["person", "object"], help="the corruption (default: the task's own)")
    parser.add_argument(
        "--exact-top",
        type=positive_int,
        default=50,
        metavar="N",
        help="patch exactly the N top edges of each method (default 50)",
    )
    parser.add_argument("--seed", type=int, default=0)
    common.add_out_argument(parser, OUTPUTS)
    common.add_device_arguments(parser)
    parser.add_argument("--batch-size", type=positive_int, default=8, metavar="N", help="pairs per forward pass")
    return parser


def check_kind(tasks: list[str], kind: str | None) -> None:
    """EvalError naming the first task the corruption does not apply to (before the checkpoint is loaded).

    Args:
        tasks: The task ids.
        kind: The corruption (`--kind`), or None for each task's own.

    Raises:
        EvalError: A task the corruption does not apply to.
    """
    from ..catalog import load_catalog
    from ..contrast import KIND_PATTERNS

    if kind is None:
        return
    catalog = load_catalog()
    for task in tasks:
        pattern = catalog.tasks[task].qk_pattern
        if pattern not in KIND_PATTERNS[kind]:
            raise EvalError(
                f"--kind {kind} does not apply to {task} ({pattern}); it applies to " + ", ".join(KIND_PATTERNS[kind])
            )


def discover(
    model,
    pairs,
    method: str = "eap-ig",
    n_steps: int = 5,
    metric: str = "logit_diff",
    exact_top: int = 50,
    batch_size: int | None = 8,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Scores (both methods), exact single-edge effects of the top edges, faithfulness curves and the summary.

    Args:
        model: The model.
        pairs: The contrast pairs' tokens (`tokenize_pairs`).
        method: The method the circuit is drawn from: "eap" or "eap-ig".
        n_steps: EAP-IG's steps.
        metric: "logit_diff" or "logprob".
        exact_top: How many top-scored edges are patched exactly.
        batch_size: Pairs a forward pass (None: all).
        seed: The seed of the random-edges baseline.
        progress: Say on stderr what runs.

    Returns:
        {graph, scores, edges, curve, summary}.
    """
    import torch

    from ...discovery import (
        CircuitEvaluator,
        build_graph,
        edge_scores,
        faithfulness_curve,
        smallest_faithful_circuit,
        spearman,
    )
    from ...distributed import rank_and_size

    def say(text: str) -> None:
        if progress:
            print(text, file=sys.stderr, flush=True)

    graph = build_graph(model)
    say(f"{graph}")
    evaluator = CircuitEvaluator(model, graph, pairs, metric, batch_size)
    scores = {"eap": edge_scores(model, pairs, "eap", metric=metric, batch_size=batch_size, graph=graph)}
    say("EAP scores done")
    scores["eap-ig"] = edge_scores(
        model, pairs, "eap-ig", n_steps=n_steps, metric=metric, batch_size=batch_size, graph=graph
    )
    say("EAP-IG scores done")
    top = sorted({int(i) for s in scores.values() for i in s.abs().argsort(descending=True)[:exact_top]})
    exact = dict(zip(top, evaluator.single_edge_effects(top), strict=True))
    say(f"{len(top)} edges patched exactly")
    edges = graph.frame()
    edges["score"] = scores[method].numpy()
    edges["exact"] = [exact.get(i) for i in range(len(graph))]
    edges["score_eap"] = scores["eap"].numpy()
    edges["score_eap_ig"] = scores["eap-ig"].numpy()
    curve = faithfulness_curve(evaluator, scores, seed=seed)
    say("faithfulness curves done")
    smallest = {}
    for name, method_scores in scores.items():
        for selection in ("top-n", "greedy"):
            n, value = smallest_faithful_circuit(evaluator, method_scores, selection, 0.8)
            smallest[f"{name}/{selection}"] = {"edges": n, "faithfulness": value}
    filled = edges[edges["exact"].notna()]
    full, empty = torch.ones(len(graph), dtype=torch.bool), torch.zeros(len(graph), dtype=torch.bool)
    summary = {
        "checkpoint": model.cfg.model_name,
        "method": method,
        "n_steps": n_steps,
        "metric": metric,
        "pairs": int(pairs.clean.shape[0]),
        "graph": graph.counts(),
        "metric_clean": evaluator.m_clean,
        "metric_corrupted": evaluator.m_corrupt,
        "faithfulness_full_graph": evaluator.faithfulness(full),
        "faithfulness_empty_graph": evaluator.faithfulness(empty),
        "smallest_circuit_80": smallest,
        "spearman_score_vs_exact": {
            name: spearman(filled[f"score_{name.replace('-', '_')}"], filled["exact"]) for name in scores
        },
        "exact_rows": len(filled),
        "world_size": rank_and_size()[1],  # how many processes shared the pairs
    }
    return {"graph": graph, "scores": scores, "edges": edges, "curve": curve, "summary": summary}


def figures(result: dict, method: str, label: str):
    """The faithfulness curves and the circuit `method` finds, drawn.

    Args:
        result: `discover`'s result.
        method: The method whose circuit is drawn.
        label: The checkpoint's name, in the titles.

    Returns:
        (curve figure, circuit figure).
    """
    from ...discovery import greedy_circuit
    from ...plotting import plot_circuit, plot_faithfulness

    summary = result["summary"]
    n = min(summary["smallest_circuit_80"][f"{method}/greedy"]["edges"], MAX_DRAWN_EDGES)
    circuit = greedy_circuit(result["graph"], result["scores"][method], n)
    reached = summary["smallest_circuit_80"][f"{method}/greedy"]["faithfulness"]
    circuit_figure = plot_circuit(
        result["graph"],
        result["scores"][method],
        circuit,
        title=f"{label}: {method} circuit, {n} edges (greedy, faithfulness {reached:.2f})",
    )
    curve_figure = plot_faithfulness(result["curve"], title=f"{label}: faithfulness, {summary['pairs']} pairs")
    return curve_figure, circuit_figure


def write_outputs(result: dict, curve_figure, circuit_figure, out_dir: Path) -> None:
    """Write edges.csv, faithfulness.csv, summary.json and the two figures, all or none (`common.write_files`).

    Args:
        result: `discover`'s result.
        curve_figure: The faithfulness curves.
        circuit_figure: The circuit.
        out_dir: The output directory.
    """
    common.write_files(
        out_dir,
        {
            "edges.csv": common.csv_writer(result["edges"]),
            "faithfulness.csv": common.csv_writer(result["curve"]),
            "summary.json": common.json_writer(result["summary"]),
            "faithfulness.png": common.png_writer(curve_figure),
            "circuit.png": common.png_writer(circuit_figure),
        },
    )


def run_circuit(args: argparse.Namespace) -> int:
    """The `circuit` command: 0 on success, 2 (and one line on stderr) for bad input.

    Under `torchrun --nproc-per-node N` the N processes share the contrast pairs (every N-th batch of
    `--batch-size` pairs each): scores and metrics are gathered batch by batch and combined as one process does,
    so rank 0 writes the files one process writes, and summary.json records `world_size`.

    Args:
        args: The parsed options (`add_circuit_arguments`).

    Returns:
        The exit status.
    """
    from ...distributed import finish, start

    rank, world_size, rank_device = start()
    try:
        model, tokens = common.agreed(lambda: circuit_inputs(args, rank_device))
        metric = args.metric.replace("-", "_")
        result = discover(
            model,
            tokens,
            args.method,
            args.n_steps,
            metric,
            args.exact_top,
            args.batch_size,
            args.seed,
            progress=rank == 0,
        )
        if rank == 0:
            curve_figure, circuit_figure = figures(result, args.method, Path(str(args.checkpoint)).name)
            write_outputs(result, curve_figure, circuit_figure, args.out)
    except EvalError as error:
        return common.refuse(error, rank)
    finally:
        finish(world_size)
    if rank == 0:
        print_summary(args, result["summary"])
    return 0


def circuit_inputs(args: argparse.Namespace, rank_device: str | None):
    """The checked checkpoint (loaded, frozen, on this process's device) and the tokenized contrast pairs.

    Args:
        args: The parsed options.
        rank_device: This process's device under torchrun, else None.

    Returns:
        (model, pairs' tokens).
    """
    model = checked_model(args, rank_device)
    return model, pairs_of(model, args.tasks, args.pairs, args.seed, args.kind)[1]


def checked_model(args: argparse.Namespace, rank_device: str | None):
    """`--out`, `--device` and `--kind` checked, then the checkpoint loaded on this process's device, in eval mode
    with frozen weights; EvalError where a check fails or the checkpoint has no tokenizer.

    Args:
        args: The parsed options.
        rank_device: This process's device under torchrun, else None.

    Returns:
        The model.

    Raises:
        EvalError: A check fails, or the checkpoint has no tokenizer.
    """
    from ...distributed import process_device

    common.check_out_dir(args.out)
    device = process_device(common.eval_device(args.device), rank_device)
    check_kind(args.tasks, args.kind)
    return common.load_frozen_model(args.checkpoint, args.dtype, device, "contrast pairs need one")


def pairs_of(model, tasks: list[str], n: int, seed: int, kind: str | None):
    """n contrast pairs of each task and their tokens (`contrast_pairs`, `tokenize_pairs`); EvalError naming
    --tasks where a task gives none.

    Args:
        model: The model (its tokenizer).
        tasks: The task ids.
        n: Pairs per task.
        seed: The pairs' seed.
        kind: The corruption, or None for each task's own.

    Returns:
        (pairs, their tokens).

    Raises:
        EvalError: A task gives no pair.
    """
    from ..contrast import tokenize_pairs

    pairs = common.tasks_contrast_pairs(tasks, n, seed, model.tokenizer, kind)
    try:
        return pairs, tokenize_pairs(pairs, model.tokenizer)
    except ValueError as error:
        raise EvalError(f"--tasks: {error}") from None


def print_summary(args: argparse.Namespace, summary: dict) -> None:
    """Print the summary's lines: the pairs, the metric, the smallest circuits and the rank agreements.

    Args:
        args: The parsed options.
        summary: `discover`'s summary.
    """
    print(
        f"{args.checkpoint}: {summary['pairs']} pairs of {', '.join(args.tasks)}; graph {summary['graph']}"
        + common.processes_note(summary["world_size"])
    )
    print(
        f"metric clean {summary['metric_clean']:.3f}, corrupted {summary['metric_corrupted']:.3f}; "
        f"faithfulness full graph {summary['faithfulness_full_graph']:.3f}, "
        f"empty {summary['faithfulness_empty_graph']:.3f}"
    )
    for key, value in summary["smallest_circuit_80"].items():
        print(f"  80% faithfulness, {key}: {value['edges']} edges ({value['faithfulness']:.3f})")
    for key, value in summary["spearman_score_vs_exact"].items():
        print(f"  Spearman {key} score vs exact ({summary['exact_rows']} edges): {value:.3f}")
    print(common.wrote_line(args.out, OUTPUTS))
