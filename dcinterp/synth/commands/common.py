"""What the commands that run models on the synthetic tasks share: the task selection they parse, loading a checkpoint
as one error line, the checks of `--out` and `--device`, the tasks' contrast pairs, the one line and exit status 2 of
bad input, outputs written whole or not at all, and inputs every process of a distributed run agrees on.

Light on purpose (torch and the model are imported where a checkpoint is loaded), so that `--help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ...cli import check_writable_dir, positive_int
from ...devices import check_device
from ..catalog import CatalogError, load_catalog
from ..evaluate import EvalError, Sample
from ..generator import parse_task_ids

if TYPE_CHECKING:
    from ...model import HookedDCFormer
    from ..contrast import ContrastPair

T = TypeVar("T")

CASE_STUDY_TASKS = "2,3"  # same-person : superclass, the case study's family


def parse_task_selection(text: str) -> set[str]:
    """A task selection as `generate --tasks` reads it (an argparse type).

    Args:
        text: Ids and ranges, e.g. "task0,task5" or "0-7,12".

    Returns:
        The task ids, e.g. {"task0", "task5"}.

    Raises:
        argparse.ArgumentTypeError: A selection the catalog does not have.
    """
    try:
        return set(parse_task_ids(text, load_catalog()))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def agreed(check: Callable[[], T]) -> T:
    """`check()` on every process of a distributed run, which all stop together where one refuses its input.

    Where any process refuses (EvalError, CatalogError), every process raises an EvalError with the first
    refusal's line, so that all of them stop with status 2 rather than leave the others waiting. One process:
    `check()` as it is.

    Args:
        check: What reads and checks the command's inputs.

    Returns:
        What `check()` returned.

    Raises:
        EvalError: The first refusal's line, on every process.
    """
    from ...distributed import first_error

    try:
        result, problem = check(), None
    except (EvalError, CatalogError) as error:
        result, problem = None, str(error)
    problem = first_error(problem)
    if problem is not None:
        raise EvalError(problem)
    return result


def load_checkpoint(checkpoint: str, dtype: str, device: str) -> HookedDCFormer:
    """The model of a checkpoint, for a command (every command loads through here).

    Args:
        checkpoint: A checkpoint directory or an embedded model's name.
        dtype: "float32", "float16" or "bfloat16".
        device: The torch device to load on.

    Returns:
        The model.

    Raises:
        EvalError: The checkpoint cannot be loaded (one line naming the file and key at fault).
    """
    from ...loading import CheckpointError
    from ...model import HookedDCFormer

    try:
        return HookedDCFormer.from_pretrained(checkpoint, dtype=dtype, device=device)
    except CheckpointError as error:
        raise EvalError(str(error)) from None


def load_frozen_model(checkpoint: str, dtype: str, device: str, needs: str) -> HookedDCFormer:
    """The model of a checkpoint that has a tokenizer, in eval mode with frozen weights (`load_checkpoint`).

    Args:
        checkpoint: A checkpoint directory or an embedded model's name.
        dtype: "float32", "float16" or "bfloat16".
        device: The torch device to load on.
        needs: What needs the tokenizer, ending the error, e.g. "the prompts need one".

    Returns:
        The model.

    Raises:
        EvalError: The checkpoint cannot be loaded, or has no tokenizer (one line).
    """
    model = load_checkpoint(checkpoint, dtype, device)
    if model.tokenizer is None:
        raise EvalError(f"{checkpoint}: the checkpoint has no tokenizer; {needs}")
    model.eval()
    model.requires_grad_(False)
    return model


def tasks_contrast_pairs(tasks: list[str], n: int, seed: int, tokenizer, kind: str | None = None) -> list[ContrastPair]:
    """n contrast pairs of each task (`contrast.contrast_pairs`), task after task.

    Args:
        tasks: The task ids.
        n: Pairs per task.
        seed: The pairs' seed.
        tokenizer: The model's tokenizer.
        kind: The corruption, or None for each task's own.

    Returns:
        The pairs.

    Raises:
        EvalError: A task gives no pair (one line naming --tasks).
    """
    from ..contrast import contrast_pairs

    try:
        return [pair for task in tasks for pair in contrast_pairs(task, n=n, seed=seed, kind=kind, tokenizer=tokenizer)]
    except ValueError as error:
        raise EvalError(f"--tasks: {error}") from None


def refuse(error: Exception, rank: int = 0) -> int:
    """What a command does with bad input: its one line on stderr ("error: ..."), from rank 0 only under torchrun.

    Args:
        error: The refusal (an EvalError or CatalogError: its message is one line).
        rank: This process's rank (0 for one process).

    Returns:
        2, the command's exit status.
    """
    if rank == 0:
        print(f"error: {error}", file=sys.stderr)
    return 2


def check_out_dir(out_dir: Path) -> None:
    """Check that `--out` is a directory that can be written, or can be created; creates nothing.

    Args:
        out_dir: The directory given.

    Raises:
        EvalError: One line naming the directory and why not.
    """
    try:
        check_writable_dir(out_dir, "--out")
    except ValueError as error:
        raise EvalError(str(error)) from None


def eval_device(name: str | None) -> str:
    """The `--device` a command runs on.

    Args:
        name: The device given, or None for cuda if available, else cpu.

    Returns:
        The device's name.

    Raises:
        EvalError: This machine lacks the device (one line naming it and what is available).
    """
    try:
        return check_device(name)
    except ValueError as error:
        raise EvalError(f"--device: {error}") from None


def write_files(out_dir: Path, writers: dict) -> None:
    """Write a command's outputs whole or not at all.

    Each `writers[name](path)` writes a partial file in `out_dir`; then all are renamed into place. On an OSError
    the partial files are removed: no half-written output.

    Args:
        out_dir: The output directory (created if missing).
        writers: {file name: a function that writes the file at the path it is given}.

    Raises:
        EvalError: A file could not be written (one line naming the directory and why).
    """
    staged: list[tuple[Path, Path]] = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, write in writers.items():
            partial = out_dir / f".{name}.{os.getpid()}.partial"
            staged.append((partial, out_dir / name))
            write(partial)
        for partial, final in staged:
            os.replace(partial, final)
    except OSError as error:
        for partial, _ in staged:
            partial.unlink(missing_ok=True)
        raise EvalError(f"{out_dir}: cannot write the results ({error.strerror or error})") from None


def csv_writer(frame) -> Callable[[Path], None]:
    """What writes a frame as a CSV file without its index, for `write_files`.

    Args:
        frame: A pandas DataFrame.

    Returns:
        A function of the path to write.
    """
    return lambda path: frame.to_csv(path, index=False)


def json_writer(data: dict) -> Callable[[Path], None]:
    """What writes `data` as indented JSON and a newline, for `write_files`.

    Args:
        data: The JSON-ready dict.

    Returns:
        A function of the path to write.
    """
    return lambda path: path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def png_writer(figure) -> Callable[[Path], None]:
    """What writes a matplotlib figure as a PNG at 130 dpi, for `write_files`.

    Args:
        figure: The figure.

    Returns:
        A function of the path to write.
    """
    return lambda path: figure.savefig(path, dpi=130, format="png")


def wrote_line(out_dir: Path, names: Sequence[str]) -> str:
    """The line a command prints last: "wrote" and the paths of the files it wrote.

    Args:
        out_dir: `--out`.
        names: The files' names, in the order written.

    Returns:
        The line.
    """
    return "wrote " + ", ".join(str(out_dir / name) for name in names)


def processes_note(world_size: int) -> str:
    """ " (N processes)" after a summary line where N > 1 processes shared the work; "" for one process.

    Args:
        world_size: How many processes shared the work.

    Returns:
        The note.
    """
    return f" ({world_size} processes)" if world_size > 1 else ""


def select_samples(samples: list[Sample], tasks: set[str] | None, limit: int | None, source: Path) -> list[Sample]:
    """The samples a command scores: those of `--tasks`, then the first `--limit`.

    Args:
        samples: The data file's samples.
        tasks: The task ids kept, or None for every task.
        limit: How many samples are kept at most, or None for all.
        source: The data file, named in the error.

    Returns:
        The samples kept, in file order.

    Raises:
        EvalError: No sample is left.
    """
    if tasks is not None:
        samples = [s for s in samples if s.task_id in tasks]
    if limit is not None:
        samples = samples[:limit]
    if not samples:
        raise EvalError(f"{source}: no samples to evaluate" + (" of the selected tasks" if tasks else ""))
    return samples


# --------------------------------------------------------------------------------------------------
# Arguments every command takes alike
def task_list(text: str) -> list[str]:
    """Tasks as `--tasks` gives them, in task order (an argparse type).

    Args:
        text: Ids and ranges, e.g. "2,3", "task0,task5" or "0-7".

    Returns:
        The task ids ("task2", ...) sorted by number.

    Raises:
        argparse.ArgumentTypeError: A selection the catalog does not have.
    """
    return sorted(parse_task_selection(text), key=lambda t: int(t.removeprefix("task")))


def add_checkpoint_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """`--checkpoint PATH`: the one checkpoint a command runs.

    Args:
        parser: The command's parser.
        default: The embedded model (or directory) taken without the option.
    """
    parser.add_argument(
        "--checkpoint",
        default=default,
        metavar="PATH",
        help="checkpoint directory or embedded model name (default: %(default)s)",
    )


def add_data_argument(parser: argparse.ArgumentParser) -> None:
    """`--data released|FILE`: the samples a command scores.

    Args:
        parser: The command's parser.
    """
    parser.add_argument(
        "--data",
        default="released",
        metavar="released|FILE",
        help="'released' (the shipped synthetic_dataset.jsonl) or a JSON-lines file",
    )


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """`--device` and `--dtype`: where and in which precision a command runs the model.

    Args:
        parser: The command's parser.
    """
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])


def add_out_argument(parser: argparse.ArgumentParser, outputs: Sequence[str], required: bool = True) -> None:
    """`--out DIR`: where a command writes its files.

    Args:
        parser: The command's parser.
        outputs: The files written there (their names, or words for them).
        required: Whether the option must be given; without it the command only prints.
    """
    parser.add_argument(
        "--out",
        type=Path,
        required=required,
        metavar="DIR",
        help="write " + ", ".join(outputs) + " here" + ("" if required else " (default: only print the table)"),
    )


def add_contrast_tasks_argument(parser: argparse.ArgumentParser) -> None:
    """`--tasks IDS`: the tasks whose contrast pairs give a command its prompts (default `CASE_STUDY_TASKS`).

    Args:
        parser: The command's parser.
    """
    parser.add_argument(
        "--tasks",
        type=task_list,
        default=CASE_STUDY_TASKS,
        metavar="IDS",
        help="tasks whose contrast pairs give the prompts, e.g. 2,3 or 0-7 (default: %(default)s, "
        "same-person : superclass)",
    )


def add_sample_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """`--tasks SEL` and `--limit N`: which samples of the data file a command scores (`select_samples`).

    Args:
        parser: The command's parser.
    """
    parser.add_argument(
        "--tasks",
        type=parse_task_selection,
        metavar="SEL",
        help="tasks to evaluate: ids and ranges, e.g. task0,task5 or 0-7",
    )
    parser.add_argument("--limit", type=positive_int, metavar="N", help="only the first N samples (after --tasks)")
