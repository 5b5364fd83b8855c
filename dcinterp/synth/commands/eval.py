"""The `eval` command: score checkpoints on the synthetic ICL tasks as the paper does (Sec 4.3, Table 5, Fig. 6).

    python -m dcinterp.synth eval --checkpoint PATH [--checkpoint PATH ...] [--data released|FILE] [--out DIR]

The scoring itself is `dcinterp.synth.evaluate`; this module reads the arguments, loads each checkpoint, prints the
table and writes results.csv and summary.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from ...cli import positive_int
from ..catalog import CatalogError
from ..evaluate import (
    PPL_POOLINGS,
    EvalError,
    Sample,
    evaluate,
    load_samples,
    parse_sample,
    resolve_data_path,
    summarize,
)
from . import common

DEFAULT_CHECKPOINTS = ("dcpythia-synth", "pythia-synth")
OUTPUTS = ("results.csv", "summary.json")
DESCRIPTION = "Score language models on the synthetic ICL tasks as the paper does (Sec 4.3, Table 5, Fig. 6)."


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `eval` command's options.

    Args:
        parser: The parser to add them to.

    Returns:
        The same parser.
    """
    parser.add_argument(
        "--checkpoint",
        action="append",
        metavar="PATH",
        help="checkpoint directory or embedded model name; repeat to compare "
        f"(default: the embedded {' and '.join(DEFAULT_CHECKPOINTS)})",
    )
    common.add_data_argument(parser)
    common.add_out_argument(parser, OUTPUTS, required=False)
    common.add_device_arguments(parser)
    parser.add_argument("--batch-size", type=positive_int, default=8, metavar="N")
    common.add_sample_selection_arguments(parser)
    parser.add_argument(
        "--ppl-pooling",
        default="token",
        choices=PPL_POOLINGS,
        help="perplexity over all answer tokens (token, default), mean of per-answer perplexities "
        "(answer), or exp of the mean per-answer NLL (answer-nll); docs/conventions.md",
    )
    return parser


def run_eval(args: argparse.Namespace) -> int:
    """The `eval` command.

    Launched with `torchrun --nproc-per-node N` (or `accelerate launch`), the N processes share the samples of
    each checkpoint; rank 0 prints and writes the same files as one process would, and each checkpoint's entry of
    summary.json records `world_size`. Bad input stops every process with status 2.

    Args:
        args: The parsed options (`add_eval_arguments`).

    Returns:
        The exit status: 0 on success, 2 (and one line on stderr) for bad input.
    """
    from ...distributed import finish, process_device, start

    rank, world_size, rank_device = start()
    try:
        device, checkpoints, data_path, samples = common.agreed(lambda: eval_inputs(args))
        device = process_device(device, rank_device)
        results = []
        for checkpoint, name in zip(checkpoints, checkpoint_names(checkpoints), strict=True):
            model = common.load_checkpoint(checkpoint, args.dtype, device)
            results.append(evaluate(model, samples, batch_size=args.batch_size, name=name, progress=rank == 0))
            del model
        results = pd.concat(results, ignore_index=True)
        summary = summarize(results, getattr(args, "ppl_pooling", "token"))
        for entry in summary.values():
            entry["world_size"] = world_size
        if args.out is not None and rank == 0:
            write_outputs(results, summary, args.out)
    except (EvalError, CatalogError) as error:
        return common.refuse(error, rank)
    finally:
        finish(world_size)
    if rank == 0:
        print(
            f"{data_path}: {len(samples)} samples, {len(results) // len(checkpoints)} answers"
            + common.processes_note(world_size)
        )
        print_table(summary)
        if args.out is not None:
            print(f"wrote {args.out / 'results.csv'} and {args.out / 'summary.json'}")
    return 0


def eval_inputs(args: argparse.Namespace) -> tuple[str, list[str], Path, list[Sample]]:
    """The checked inputs of `eval`, before any checkpoint is loaded.

    Args:
        args: The parsed options.

    Returns:
        (device, checkpoints, data file, samples).

    Raises:
        EvalError: An input that cannot be evaluated (one line).
    """
    if args.out is not None:
        common.check_out_dir(args.out)
    device = common.eval_device(args.device)
    checkpoints = checkpoints_to_evaluate(args.checkpoint)
    data_path = resolve_data_path(args.data)
    samples = common.select_samples(load_samples(data_path), args.tasks, args.limit, data_path)
    for sample in samples:
        parse_sample(sample)  # structural errors before any checkpoint is loaded
    return device, checkpoints, data_path, samples


def main_eval(argv: list[str] | None = None) -> int:
    """`eval` as a program of its own.

    Args:
        argv: The arguments (None: the process's).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m dcinterp.synth eval", description=DESCRIPTION)
    return run_eval(add_eval_arguments(parser).parse_args(argv))


def checkpoints_to_evaluate(given: list[str] | None) -> list[str]:
    """The checkpoints `eval` scores.

    Args:
        given: The `--checkpoint` options, or None for the embedded models.

    Returns:
        The checkpoints.

    Raises:
        EvalError: None given and no embedded model shipped.
    """
    if given:
        return given
    from ...loading import embedded_models

    embedded = [name for name in DEFAULT_CHECKPOINTS if name in embedded_models()]
    if not embedded:
        raise EvalError("no embedded models are shipped yet; pass --checkpoint PATH (a checkpoint directory)")
    return embedded


def checkpoint_names(checkpoints: list[str]) -> list[str]:
    """The names results carry for checkpoints.

    Args:
        checkpoints: The checkpoints as given.

    Returns:
        Each one's directory name (or embedded name); the path as given where two names clash.
    """
    names = [Path(c).expanduser().resolve().name if Path(c).expanduser().is_dir() else str(c) for c in checkpoints]
    return [name if names.count(name) == 1 else str(c) for name, c in zip(names, checkpoints, strict=True)]


def write_outputs(results: pd.DataFrame, summary: dict, out_dir: Path) -> None:
    """Write results.csv and summary.json, both or neither (see `common.write_files`).

    Args:
        results: One row per answer (`evaluate`).
        summary: `summarize(results)`, with each checkpoint's `world_size`.
        out_dir: The output directory.
    """
    common.write_files(
        out_dir,
        {
            "results.csv": common.csv_writer(results),
            "summary.json": common.json_writer(summary),
        },
    )


def print_table(summary: dict) -> None:
    """Print accuracy and perplexity side by side per checkpoint, as in the paper's Table 5, then accuracy by K.

    Args:
        summary: `summarize(results)`.
    """
    from rich.console import Console
    from rich.table import Table

    table = Table()
    table.add_column("")
    for checkpoint in summary:
        table.add_column(checkpoint, justify="right")
    table.add_row("accuracy", *(f"{s['accuracy']:.1%}" for s in summary.values()))
    pooling = next(iter(summary.values()), {}).get("ppl_pooling", "token")
    table.add_row(f"perplexity ({pooling})", *(f"{s['ppl']:.2f}" for s in summary.values()), end_section=True)
    ks = dict.fromkeys(k for s in summary.values() for k in s["by_k"])
    for k in ks:
        table.add_row(f"accuracy, K={k}", *(fmt_accuracy(s["by_k"].get(k)) for s in summary.values()))
    Console().print(table)


def fmt_accuracy(value: float | None) -> str:
    """An accuracy as a percentage, or "-" for None.

    Args:
        value: The accuracy (0..1) or None.

    Returns:
        The text.
    """
    return "-" if value is None else f"{value:.1%}"
