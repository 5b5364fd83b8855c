"""Head attribution on the synthetic tasks: integrated gradients of each prompt's answer over every head.

    python -m dcinterp.synth attribute [--checkpoint C] [--tasks IDS] [--prompts N] --out DIR
                                       [--target-type logit|logprob|prob] [--baseline zero|mean]
                                       [--path joint|per-layer] [--n-steps K] [--kind person|object] [--seed S]
                                       [--device D] [--dtype T] [--batch-size N] [--internal-batch-size N]

The prompts are the clean prompts of the tasks' contrast pairs (`contrast.contrast_pairs`, the prompts `synth
circuit` uses): two shots, then the query line up to its answer; the target is the answer's first token at the
last position. `attribution.head_attribution_sweep` scores them `--batch-size` prompts at a time, and under
`torchrun` shares the batches between the processes.
Writes `heads.csv` (one row per head: layer, head, score = the mean over prompts, then one score column per task),
`prompts.csv` (one row per prompt: task, sample, answer, f_input, f_baseline, delta = the completeness gap),
`summary.json` (the settings, the top heads, the completeness gaps, `world_size`) and `heads.png`.
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
OUTPUTS = ("heads.csv", "prompts.csv", "summary.json", "heads.png")
TOP_HEADS = 10


def add_attribute_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `attribute` command's options.

    Args:
        parser: The parser to add them to.

    Returns:
        The same parser.
    """
    common.add_checkpoint_argument(parser, DEFAULT_CHECKPOINT)
    common.add_contrast_tasks_argument(parser)
    parser.add_argument("--prompts", type=positive_int, default=8, metavar="N", help="prompts per task (default 8)")
    parser.add_argument("--target-type", choices=["logit", "logprob", "prob"], default="logit")
    parser.add_argument(
        "--baseline",
        choices=["zero", "mean"],
        default="zero",
        help="head outputs at alpha = 0 (mean: over the prompts)",
    )
    parser.add_argument("--path", choices=["joint", "per-layer"], default="joint")
    parser.add_argument("--n-steps", type=positive_int, default=50, metavar="K", help="IG steps (default 50)")
    parser.add_argument("--kind", choices=["person", "object"], help="which contrast pairs give the prompts")
    parser.add_argument("--seed", type=int, default=0)
    common.add_out_argument(parser, OUTPUTS)
    common.add_device_arguments(parser)
    parser.add_argument("--batch-size", type=positive_int, default=8, metavar="N", help="prompts per call (default 8)")
    parser.add_argument(
        "--internal-batch-size",
        type=positive_int,
        metavar="N",
        help="rows per forward and backward pass (captum's internal_batch_size; default: all steps at once)",
    )
    return parser


def attribute(model, pairs, tokens, args: argparse.Namespace, progress: bool = True):
    """`head_attribution_sweep` of the pairs' clean prompts and answers, with the command's settings.

    Args:
        model: The model.
        pairs: The contrast pairs (their clean prompts are attributed).
        tokens: The pairs' tokens (`tokenize_pairs`).
        args: The parsed options (steps, baseline, path, batch sizes).
        progress: Say on stderr what runs.

    Returns:
        The sweep's result.
    """
    from ...attribution import head_attribution_sweep

    if progress:
        print(f"{model.cfg.model_name}: {len(pairs)} prompts, {args.n_steps} steps", file=sys.stderr, flush=True)
    return head_attribution_sweep(
        model,
        tokens.clean,
        tokens.clean_answer,
        position=tokens.position,
        target_type=args.target_type,
        baseline=args.baseline,
        reference_tokens=tokens.clean if args.baseline == "mean" else None,
        tasks=[pair.task_id for pair in pairs],
        n_steps=args.n_steps,
        internal_batch_size=args.internal_batch_size,
        path=args.path,
        batch_size=args.batch_size,
    )


def prompts_frame(result, pairs):
    """One row per prompt: task, sample, answer, the target at the input and at the baseline, and their gap.

    Args:
        result: `attribute`'s result.
        pairs: The contrast pairs, in the result's order.

    Returns:
        The frame.
    """
    import pandas as pd

    return pd.DataFrame(
        {
            "task": [pair.task_id for pair in pairs],
            "sample": [pair.sample for pair in pairs],
            "answer": [pair.clean_answer for pair in pairs],
            "f_input": result.f_input.tolist(),
            "f_baseline": result.f_baseline.tolist(),
            "delta": result.delta.tolist(),
        }
    )


def summary_of(result, args: argparse.Namespace, world_size: int) -> dict:
    """What summary.json holds: the settings, the top heads and the completeness gaps.

    Args:
        result: `attribute`'s result.
        args: The parsed options.
        world_size: How many processes shared the work.

    Returns:
        The JSON-ready dict.
    """
    gap = result.delta.abs()
    effect = (result.f_input - result.f_baseline).abs()
    return {
        "checkpoint": str(args.checkpoint),
        "tasks": list(args.tasks),
        "prompts": int(result.per_prompt.shape[0]),
        "target_type": args.target_type,
        "baseline": args.baseline,
        "path": args.path,
        "n_steps": args.n_steps,
        "top_heads": [
            {"layer": layer, "head": head, "score": float(result.scores[layer, head])}
            for layer, head in result.top_heads(TOP_HEADS)
        ],
        "completeness_gap_max": float(gap.max()),
        "completeness_gap_mean": float(gap.mean()),
        "total_effect_mean": float(effect.mean()),
        "world_size": world_size,
    }


def write_outputs(result, pairs, summary: dict, figure, out_dir: Path) -> None:
    """Write heads.csv, prompts.csv, summary.json and heads.png, all or none (`common.write_files`).

    Args:
        result: `attribute`'s result.
        pairs: The contrast pairs.
        summary: `summary_of`'s result.
        figure: The heads' figure.
        out_dir: The output directory.
    """
    common.write_files(
        out_dir,
        {
            "heads.csv": common.csv_writer(result.to_frame()),
            "prompts.csv": common.csv_writer(prompts_frame(result, pairs)),
            "summary.json": common.json_writer(summary),
            "heads.png": common.png_writer(figure),
        },
    )


def run_attribute(args: argparse.Namespace) -> int:
    """The `attribute` command: 0 on success, 2 (and one line on stderr) for bad input.

    Under `torchrun --nproc-per-node N` the N processes share the batches of prompts; rank 0 writes what one process
    writes, and summary.json records `world_size`.

    Args:
        args: The parsed options (`add_attribute_arguments`).

    Returns:
        The exit status.
    """
    from ...distributed import finish, start

    rank, world_size, rank_device = start()
    try:
        model, pairs, tokens = common.agreed(lambda: attribute_inputs(args, rank_device))
        result = attribute(model, pairs, tokens, args, progress=rank == 0)
        summary = summary_of(result, args, world_size)
        if rank == 0:
            from ...plotting import plot_head_attribution

            figure = plot_head_attribution(
                result,
                title=f"{Path(str(args.checkpoint)).name}: head attribution, {len(pairs)} prompts "
                f"of {', '.join(args.tasks)}",
            )
            write_outputs(result, pairs, summary, figure, args.out)
    except EvalError as error:
        return common.refuse(error, rank)
    finally:
        finish(world_size)
    if rank == 0:
        tasks = ", ".join(args.tasks)
        print(f"{args.checkpoint}: {summary['prompts']} prompts of {tasks}{common.processes_note(world_size)}")
        for entry in summary["top_heads"][:5]:
            print(f"  L{entry['layer']}H{entry['head']}: {entry['score']:+.4f}")
        print(
            f"completeness gap: mean {summary['completeness_gap_mean']:.3g}, max {summary['completeness_gap_max']:.3g} "
            f"(mean total effect {summary['total_effect_mean']:.3g})"
        )
        print(common.wrote_line(args.out, OUTPUTS))
    return 0


def attribute_inputs(args: argparse.Namespace, rank_device: str | None):
    """The checked checkpoint (loaded, frozen, on this process's device), the contrast pairs and their tokens.

    Args:
        args: The parsed options.
        rank_device: This process's device under torchrun, else None.

    Returns:
        (model, pairs, tokens).

    Raises:
        EvalError: An input that cannot be attributed (one line).
    """
    from .circuit import checked_model, pairs_of

    model = checked_model(args, rank_device)
    pairs, tokens = pairs_of(model, args.tasks, args.prompts, args.seed, args.kind)
    return model, pairs, tokens
