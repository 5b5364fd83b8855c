"""Command line of the synthetic tasks:

    python -m dcinterp.synth generate --seed S --out FILE.jsonl [--samples-per-task N] [--tasks 0-7]
                                      [--qk-pattern P] [--ov-transformation T]
    python -m dcinterp.synth check FILE.jsonl [--lines L]      (also: generate --check FILE.jsonl)
    python -m dcinterp.synth eval [--checkpoint PATH ...] [--data released|FILE] [--out DIR]
                                  [--device D] [--dtype T] [--batch-size N] [--tasks IDS] [--limit N]
    python -m dcinterp.synth ablate [--checkpoint PATH] [--data released|FILE] [--out DIR] [...as eval]
    python -m dcinterp.synth circuit [--checkpoint PATH] [--tasks IDS] [--pairs N] [--method eap|eap-ig] --out DIR
    python -m dcinterp.synth qk --layer L --head H [--checkpoint PATH] [--tasks IDS] [--query WORD --key WORD] --out DIR
    python -m dcinterp.synth attribute [--checkpoint PATH] [--tasks IDS] [--prompts N] [--n-steps K] --out DIR
    python -m dcinterp.synth graph [--checkpoint PATH] [--transcoders DIR] [--prompt TEXT | --tasks IDS] --out DIR

Under `torchrun --nproc-per-node N`, eval, ablate, circuit and attribute share their batches between the N
processes; rank 0 writes what one process writes, and records world_size (`dcinterp.distributed`).

Exit status: 0 success, 1 the check found problems, 2 bad arguments or unreadable input (one line on stderr,
checked before any work, nothing written), 3 the GPU ran out of memory (one line on stderr: torch's account of it
and the options that hold less at a time; nothing written).

Parsing the arguments imports neither torch nor transformer_lens (`--help` is fast): `eval` imports them when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..cli import Parser, check_writable_file, non_negative_int, out_of_memory_line, positive_int
from .catalog import OV_TRANSFORMATIONS, QK_PATTERNS, CatalogError, load_catalog
from .check import check_records
from .commands.eval import add_eval_arguments, run_eval
from .generator import SAMPLES_PER_TASK, generate, parse_task_ids
from .records import LINES_PER_SAMPLE, DatasetError, read_jsonl, write_jsonl


def _names(text: str | None) -> list[str] | None:
    return [name.strip() for name in text.split(",") if name.strip()] if text else None


def run_generate(args: argparse.Namespace) -> int:
    if args.check:
        return check_file(args.check, args.lines)
    check_generate_arguments(args)
    catalog = load_catalog()
    records = generate(
        seed=args.seed,
        samples_per_task=args.samples_per_task,
        tasks=parse_task_ids(args.tasks, catalog) if args.tasks else None,
        qk_patterns=_names(args.qk_pattern),
        ov_transformations=_names(args.ov_transformation),
        lines=args.lines,
        catalog=catalog,
    )
    if not records:
        raise ValueError(
            f"no task is both {args.qk_pattern} and {args.ov_transformation}"
            + (f" among --tasks {args.tasks}" if args.tasks else "")
            + "; nothing written"
        )
    write_jsonl(records, args.out)
    task_count = len({record["task_id"] for record in records})
    print(f"{args.out}: wrote {len(records)} records ({task_count} tasks x {args.samples_per_task} samples)")
    return 0


def check_generate_arguments(args: argparse.Namespace) -> None:
    """Refuse, before generating anything, what `check` or `eval` would reject or what cannot be written."""
    if args.lines != LINES_PER_SAMPLE:
        raise ValueError(
            f"--lines {args.lines}: check and eval read samples of {LINES_PER_SAMPLE} lines (K = 2..7 "
            "shots), so generate writes those; other lengths: dcinterp.synth.generate(lines=...)"
        )
    if not args.out.parent.is_dir():
        raise ValueError(f"--out {args.out}: cannot write: the directory {args.out.parent} does not exist")
    check_writable_file(args.out, "--out")


def run_check(args: argparse.Namespace) -> int:
    return check_file(args.file, args.lines)


def check_file(path: Path, lines: int) -> int:
    records = read_jsonl(path)
    problems = check_records(records, lines=lines)
    for problem in problems:
        print(f"{path}: {problem}")
    if problems:
        print(f"{path}: {len(problems)} problem(s) in {len(records)} records")
        return 1
    task_count = len({record["task_id"] for record in records})
    print(f"{path}: OK ({len(records)} records, {task_count} tasks)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m dcinterp.synth", description="Generate, check and evaluate the DCFormer synthetic ICL tasks."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate_parser = commands.add_parser("generate", help="write fresh samples of the tasks as JSONL")
    target = generate_parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", type=Path, metavar="FILE.jsonl", help="where to write the samples")
    target.add_argument("--check", type=Path, metavar="FILE.jsonl", help="check FILE instead (as the check command)")
    generate_parser.add_argument("--seed", type=non_negative_int, default=0)
    generate_parser.add_argument("--samples-per-task", type=positive_int, default=SAMPLES_PER_TASK, metavar="N")
    generate_parser.add_argument("--tasks", metavar="IDS", help="e.g. task0,task5 or 0-7 (default: all 74)")
    generate_parser.add_argument("--qk-pattern", metavar="P", help="comma separated: " + ", ".join(QK_PATTERNS))
    generate_parser.add_argument(
        "--ov-transformation", metavar="T", help="comma separated: " + ", ".join(OV_TRANSFORMATIONS)
    )
    generate_parser.add_argument(
        "--lines",
        type=int,
        default=LINES_PER_SAMPLE,
        metavar="L",
        help="with --check: expected lines per sample; samples are written with %(default)s (what eval scores)",
    )
    generate_parser.set_defaults(run=run_generate)

    check_parser = commands.add_parser("check", help="validate a dataset file against the task catalog")
    check_parser.add_argument("file", type=Path, metavar="FILE.jsonl")
    check_parser.add_argument(
        "--lines",
        type=int,
        default=LINES_PER_SAMPLE,
        metavar="L",
        help="expected lines per sample (default: %(default)s)",
    )
    check_parser.set_defaults(run=run_check)

    eval_parser = commands.add_parser("eval", help="score checkpoints on the tasks (accuracy, perplexity)")
    add_eval_arguments(eval_parser)
    eval_parser.set_defaults(run=run_eval)

    ablate_parser = commands.add_parser("ablate", help="score a checkpoint with parts of its compose switched off")
    _add_ablate_arguments(ablate_parser)
    ablate_parser.set_defaults(run=_run_ablate)

    circuit_parser = commands.add_parser("circuit", help="edge-level circuit discovery (EAP, EAP-IG) on contrast pairs")
    _add_circuit_arguments(circuit_parser)
    circuit_parser.set_defaults(run=_run_circuit)

    qk_parser = commands.add_parser("qk", help="why a head attends where it does: QK attribution through the compose")
    _add_qk_arguments(qk_parser)
    qk_parser.set_defaults(run=_run_qk)

    attribute_parser = commands.add_parser(
        "attribute", help="head attribution (integrated gradients) of the answers of many prompts"
    )
    _add_attribute_arguments(attribute_parser)
    attribute_parser.set_defaults(run=_run_attribute)

    graph_parser = commands.add_parser(
        "graph", help="attribution graphs: transcoder features, errors and tokens to logits, edges split by head"
    )
    _add_graph_arguments(graph_parser)
    graph_parser.set_defaults(run=_run_graph)
    return parser


def _add_ablate_arguments(parser: argparse.ArgumentParser) -> None:
    # each command's module is imported when its parser is built or it runs
    from .commands.ablate import add_ablate_arguments

    add_ablate_arguments(parser)


def _run_ablate(args: argparse.Namespace) -> int:
    from .commands.ablate import run_ablate

    return run_ablate(args)


def _add_circuit_arguments(parser: argparse.ArgumentParser) -> None:
    from .commands.circuit import add_circuit_arguments

    add_circuit_arguments(parser)


def _run_circuit(args: argparse.Namespace) -> int:
    from .commands.circuit import run_circuit

    return run_circuit(args)


def _add_qk_arguments(parser: argparse.ArgumentParser) -> None:
    from .commands.qk_attribution import add_qk_arguments

    add_qk_arguments(parser)


def _run_qk(args: argparse.Namespace) -> int:
    from .commands.qk_attribution import run_qk

    return run_qk(args)


def _add_attribute_arguments(parser: argparse.ArgumentParser) -> None:
    from .commands.attribute import add_attribute_arguments

    add_attribute_arguments(parser)


def _run_attribute(args: argparse.Namespace) -> int:
    from .commands.attribute import run_attribute

    return run_attribute(args)


def _add_graph_arguments(parser: argparse.ArgumentParser) -> None:
    from .commands.graph import add_graph_arguments

    add_graph_arguments(parser)


def _run_graph(args: argparse.Namespace) -> int:
    from .commands.graph import run_graph

    return run_graph(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (DatasetError, CatalogError, ValueError) as error:
        if os.environ.get("RANK", "0") == "0":  # under torchrun, one line from rank 0
            print(f"error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        torch = sys.modules.get("torch")  # a command that never imported torch ran no model
        if torch is None or not isinstance(error, torch.cuda.OutOfMemoryError):
            raise
        rank = f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"error: {rank}{out_of_memory_line(str(error), out_of_memory_remedies(args))}", file=sys.stderr)
        return 3


def out_of_memory_remedies(args: argparse.Namespace) -> list[str]:
    """The command's options that would hold less on the GPU, as they were given."""
    remedies = []
    if getattr(args, "dtype", None) == "float32":
        remedies.append("--dtype bfloat16 (half the memory of float32)")
    if getattr(args, "batch_size", 1) > 1:
        remedies.append(f"a --batch-size below {args.batch_size}")
    steps_a_pass = getattr(args, "internal_batch_size", 1)  # attribute's; None: every step of the integral at once
    if steps_a_pass is None or steps_a_pass > 1:
        remedies.append(f"a smaller --internal-batch-size (now {steps_a_pass or 'every step of the integral at once'})")
    return remedies


if __name__ == "__main__":
    sys.exit(main())
