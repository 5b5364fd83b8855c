"""Train small DCPythia-architecture models (DCMHA, and a plain-MHA twin) on the synthetic-task catalog.

    python -m dcinterp.train --arch both --out dcinterp/checkpoints --eval-every 1000
    python -m dcinterp.train --seeds 0-4 --out runs/study ...     # a study: OUT/seed<N>/<name>/, twins paired
    python -m dcinterp.train summarize RUNS_DIR                    # the study's table (dcinterp.study)

The command line of `dcinterp.train`: it parses the settings into a `TrainConfig` per run, plans the runs (seed by
seed, DCMHA then its MHA twin), checks before the first step what would otherwise fail at the end (a checkpoint
of another recipe, a folder it cannot write, a start that is not this run's), screens shared starts, and trains
or evaluates each run. Errors are one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from ..cli import Parser, check_writable_dir
from ..synth import load_catalog
from ..synth.generator import parse_task_ids
from .checkpointing import (
    CHECKPOINT_FILE,
    SCREEN_STEPS,
    CheckpointEvery,
    ResumeError,
    RunInterrupted,
    load_checkpoint,
    load_start,
    start_answer_loss,
)
from .evaluation import accuracy_report
from .loop import train, write_recipe
from .recipe import (
    ARCH_NAMES,
    DEFAULT_EXCLUDED_COMBOS,
    EVAL_SEED,
    PROBE_SAMPLES_PER_TASK,
    TrainConfig,
    config_mismatch,
    parse_combos,
    parse_focus_stages,
    split_tasks,
    training_tasks,
)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line's settings (`python -m dcinterp.train --help`), the recipe's defaults as its defaults.

    Args:
        argv: The arguments; default `sys.argv[1:]`.

    Returns:
        The parsed arguments.
    """
    d = TrainConfig()
    p = Parser(prog="python -m dcinterp.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=("dcmha", "mha", "both"), default="both")
    p.add_argument("--out", default="runs", help="directory; each model goes to OUT/<name>")
    p.add_argument("--name-suffix", default="", help="appended to the model names, e.g. '-heldout'")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seed", type=int, default=d.seed, help="one run per architecture, to OUT/<name>")
    p.add_argument(
        "--seeds",
        default=None,
        help="several seeds, '0-4' or '0,2,5': each to OUT/seed<N>/<name>, the twins of a seed paired "
        "(same data order, same initial shared weights)",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    p.add_argument("--n-layers", type=int, default=d.n_layers)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--n-heads", type=int, default=d.n_heads)
    p.add_argument("--d-head", type=int, default=d.d_head)
    p.add_argument(
        "--d-mlp",
        type=int,
        default=d.d_mlp,
        help="the MLP's hidden units; with --start-from, more than the start's widen it (new units weigh 0 at first):"
        " a parameter-matched MHA twin",
    )
    p.add_argument("--window-size", type=int, default=d.window_size)
    p.add_argument(
        "--window-type",
        default=d.window_type,
        help="local (L) / global (G) layer pattern, repeated over the depth: LG, LGG, G (all global); "
        "default %(default)s",
    )
    p.add_argument("--rotary-pct", type=float, default=d.rotary_pct)
    p.add_argument("--samples-per-task", type=int, default=d.samples_per_task)
    p.add_argument("--answer-weight", type=float, default=d.answer_weight)
    p.add_argument(
        "--tied-init",
        action=argparse.BooleanOptionalAction,
        default=d.tied_init,
        help="initialise the unembedding as the embedding's transpose (the two are still trained apart)",
    )
    p.add_argument(
        "--compact-until",
        type=float,
        default=d.compact_until,
        help="compact-facts curriculum: the share of samples written 'Ruth cat.' for 'Ruth has a cat.' "
        "falls from 1 to 0 by this fraction of the steps (0: off)",
    )
    p.add_argument(
        "--focus-tasks",
        default=None,
        help="task curriculum: train on these tasks only for --focus-until of the steps; '' for none "
        f"(default: {','.join(t.removeprefix('task') for t in d.focus_tasks)}, none with --tasks)",
    )
    p.add_argument(
        "--compact-hold",
        type=float,
        default=d.compact_hold,
        help="the compact share stays 1 until this fraction of the steps, then falls to 0 by --compact-until",
    )
    p.add_argument("--focus-until", type=float, default=d.focus_until)
    p.add_argument(
        "--focus-stages",
        default="",
        metavar="STAGES",
        help="further focus stages after --focus-until, in order: '14,15@0.3;12,13@0.35' trains on tasks 14 and 15 "
        "only until 0.3 of the steps, then on 12 and 13 only until 0.35, then on all the training tasks",
    )
    p.add_argument(
        "--compose-from",
        type=float,
        default=d.compose_from,
        help="DCMHA: the compose is the identity, and the model trains as its MHA twin, until this "
        "fraction of the steps (0: the official random initialisation, trained from the start)",
    )
    p.add_argument(
        "--exclude-combos",
        default="",
        help="comma-separated qk_pattern:ov_transformation combinations left out of training "
        f"(e.g. {','.join(DEFAULT_EXCLUDED_COMBOS)})",
    )
    p.add_argument(
        "--tasks", default="", help="train on these tasks only: 'task10,task14', '10,14' or '8-15' (default: all)"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help=f"log the accuracy on a generated probe set (seed {EVAL_SEED}, "
        f"{PROBE_SAMPLES_PER_TASK} samples per training task) every N steps",
    )
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model: minutes of compilation, then faster steps; pays for runs of thousands of "
        "steps (docs/training.md; the float results differ slightly from eager)",
    )
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--no-eval", action="store_true", help="skip the accuracy evaluation after training")
    p.add_argument(
        "--eval-only",
        action="store_true",
        help="do not train: evaluate OUT/<name> and write the accuracies into its recipe.json",
    )
    p.add_argument("--log-dir", default=None, help="write a JSON-lines loss log per model here")
    p.add_argument(
        "--checkpoint-every",
        default="5m",
        help="write OUT/.../checkpoint.pt every N steps ('500') or so much wall time ('300s', '5m', '1h'); "
        "default %(default)s",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue each run from its checkpoint (bit for bit the run that never stopped); runs already "
        "finished are skipped, runs not yet started start",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="STEPS",
        help="stop each run after this many steps in all, with a checkpoint (--resume continues it)",
    )
    p.add_argument(
        "--start-from",
        default=None,
        metavar="DIR",
        help="begin each run from the checkpoint of a run of the same recipe in DIR (DIR/seed<N>/<name>/ with "
        "--seeds): e.g. the MHA twins stopped with --stop-after at the end of the focus phase, where a seed's "
        "twins and held-out variants are still one model",
    )
    p.add_argument(
        "--lookup-threshold",
        type=float,
        default=None,
        metavar="LOSS",
        help="with --start-from: skip a seed whose start's answer loss (mean of its last "
        f"{SCREEN_STEPS} steps) is above LOSS, its focus phase having formed no lookup; written to "
        "OUT/seed<N>/screened_out.json",
    )
    p.add_argument("--quiet", "--no-progress", action="store_true", help="no progress bar (none without a terminal)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace, arch: str, task_ids: list[str], focus_ids: list[str]) -> TrainConfig:
    """The recipe of one run of the command.

    Args:
        args: The parsed arguments.
        arch: "dcmha" or "mha".
        task_ids: --tasks, as task ids; empty for all.
        focus_ids: The focus tasks, as task ids.

    Returns:
        The recipe.

    Raises:
        ValueError: A malformed --focus-stages or --exclude-combos.
    """
    return TrainConfig(
        arch=arch,
        steps=args.steps,
        seed=args.seed,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_frac=args.warmup_frac,
        n_layers=args.n_layers,
        d_model=args.d_model,
        n_heads=args.n_heads,
        d_head=args.d_head,
        d_mlp=args.d_mlp,
        window_size=args.window_size,
        window_type=args.window_type,
        rotary_pct=args.rotary_pct,
        samples_per_task=args.samples_per_task,
        answer_weight=args.answer_weight,
        compact_until=args.compact_until,
        compact_hold=args.compact_hold,
        tied_init=args.tied_init,
        focus_tasks=tuple(focus_ids),
        focus_until=args.focus_until,
        focus_stages=parse_focus_stages(args.focus_stages, load_catalog()) if args.focus_stages else (),
        compose_from=args.compose_from,
        exclude_combos=tuple(f"{a}:{b}" for a, b in parse_combos(args.exclude_combos)),
        tasks=tuple(task_ids),
        eval_every=args.eval_every,
        threads=args.threads,
        compile=args.compile,
        max_minutes=args.max_minutes,
    )


def usage_error(message: str) -> NoReturn:
    """Say what is wrong with the command in one line on stderr, and exit 2.

    Args:
        message: The line, after "python -m dcinterp.train: error: ".
    """
    print(f"python -m dcinterp.train: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_seeds(spec: str) -> list[int]:
    """The seeds of --seeds.

    Args:
        spec: "0-4", "0,2,5" or "0-2,7".

    Returns:
        The seeds, e.g. [0, 1, 2, 3, 4], [0, 2, 5], [0, 1, 2, 7].

    Raises:
        ValueError: One line, if `spec` is malformed or names a seed twice.
    """
    seeds: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        last = last if dash else first
        if not first.isdigit() or not last.isdigit() or int(last) < int(first):
            raise ValueError(f"--seeds {spec!r}: expected seeds like '0-4' or '0,2,5' (got {part.strip()!r})")
        seeds.extend(range(int(first), int(last) + 1))
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {spec!r}: a seed is named twice")
    return seeds


@dataclass
class Run:
    """One model of a sweep: its settings, its folder, and what `--resume` finds there.

    Attributes:
        cfg: The run's recipe.
        out_dir: The run's folder.
        name: The model's name.
        state: "new", "stopped" (a checkpoint to continue), "finished" (a recipe.json, no checkpoint), or "other" (the
            recipe.json of a run with other settings, which --resume does not overwrite).
        mismatch: What differs, for "other".
        start: --start-from: the checkpoint a new run begins from.
    """

    cfg: TrainConfig
    out_dir: Path
    name: str
    state: str = "new"
    mismatch: str | None = None
    start: Path | None = None


def plan_runs(args: argparse.Namespace, arches, task_ids, focus_ids) -> list[Run]:
    """The runs of the command, seed by seed (DCMHA, then its MHA twin), each with its state on disk.

    Args:
        args: The parsed arguments.
        arches: The architectures, in order.
        task_ids: --tasks, as task ids.
        focus_ids: The focus tasks, as task ids.

    Returns:
        The runs.

    Raises:
        ValueError: One line: bad --seeds, or no single start for a seed in --start-from.
    """
    seeds = parse_seeds(args.seeds) if args.seeds is not None else [args.seed]
    runs = []
    for seed in seeds:
        for arch in arches:
            name = ARCH_NAMES[arch] + args.name_suffix
            out_dir = Path(args.out) / (f"seed{seed}" if args.seeds is not None else "") / name
            cfg = dataclasses.replace(config_from_args(args, arch, task_ids, focus_ids), seed=seed)
            run = Run(cfg, out_dir, name, *run_state(cfg, out_dir))
            if args.start_from is not None and run.state == "new":
                run.start = find_start(Path(args.start_from), seed if args.seeds is not None else None)
            runs.append(run)
    return runs


def find_start(start_dir: Path, seed: int | None) -> Path:
    """The one checkpoint in `START_DIR/seed<N>/<name>/` (`START_DIR/<name>/` without --seeds).

    Args:
        start_dir: --start-from.
        seed: The seed, or None without --seeds.

    Returns:
        The checkpoint's path.

    Raises:
        ValueError: One line, if there is no checkpoint or more than one.
    """
    folder = start_dir / f"seed{seed}" if seed is not None else start_dir
    found = sorted(folder.glob(f"*/{CHECKPOINT_FILE}"))
    if len(found) != 1:
        what = "no checkpoint" if not found else f"{len(found)} checkpoints ({', '.join(map(str, found))})"
        raise ValueError(f"--start-from {start_dir}: {what} in {folder}/<run>/, expected one")
    return found[0]


def screen(runs: list[Run], out: Path, threshold: float | None, sweep: bool) -> list[Run]:
    """The runs to train: those whose start (checked by `load_start`) formed the lookup, when a threshold is given.

    A seed screened out is written to `OUT/seed<N>/screened_out.json` and said in one line on stderr.

    Args:
        runs: The planned runs.
        out: --out.
        threshold: --lookup-threshold: the highest start answer loss kept; None keeps every run.
        sweep: Whether the runs are a --seeds sweep (one folder per seed).

    Returns:
        The runs kept.

    Raises:
        ResumeError: A start that is not this run's beginning.
    """
    kept = []
    for run in runs:
        if run.start is None:
            kept.append(run)
            continue
        checkpoint = load_start(run.start, run.cfg)
        loss = start_answer_loss(checkpoint)
        if threshold is None or (loss is not None and loss <= threshold):
            kept.append(run)
            continue
        folder = out / f"seed{run.cfg.seed}" if sweep else out
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "seed": run.cfg.seed,
            "start": str(run.start),
            "step": checkpoint["progress"]["step"],
            "answer_loss": loss,
            "threshold": threshold,
            "reason": "the shared start did not form the lookup",
        }
        (folder / "screened_out.json").write_text(json.dumps(record, indent=2) + "\n")
        print(
            f"{run.out_dir}: screened out, its start {run.start} has answer loss {loss} > {threshold} "
            f"at step {record['step']}",
            file=sys.stderr,
        )
    return kept


def run_state(cfg: TrainConfig, out_dir: Path) -> tuple[str, str | None]:
    """What a run's folder holds.

    Args:
        cfg: The run's recipe.
        out_dir: The run's folder.

    Returns:
        (Run.state, Run.mismatch).
    """
    if (out_dir / CHECKPOINT_FILE).exists():
        return "stopped", None
    recipe_path = out_dir / "recipe.json"
    if recipe_path.exists():
        try:
            recipe = json.loads(recipe_path.read_text())
        except json.JSONDecodeError as e:
            return "other", f"{recipe_path} is not readable JSON ({e})"
        mismatch = config_mismatch(recipe.get("train_config", {}), cfg)
        if mismatch:
            return "other", f"{recipe_path} is another run's: {mismatch}"
        if not recipe.get("stopped_early"):
            return "finished", None
    return "new", None


def check_resumable(runs: list[Run], resume: bool) -> None:
    """Check the runs' folders before any step.

    With --resume: every checkpoint is of its run, and there is at least one checkpoint or finished run. Without: no
    run would start over a stopped run's checkpoint.

    Args:
        runs: The planned runs.
        resume: Whether --resume is given.

    Raises:
        ValueError: One line (a `ResumeError` with --resume).
    """
    if not resume:
        for run in runs:
            if run.state == "stopped":
                raise ValueError(
                    f"{run.out_dir / CHECKPOINT_FILE}: a stopped run's checkpoint is there; "
                    "--resume continues it (or remove the file to start over)"
                )
        return
    for run in runs:
        if run.state == "stopped":
            load_checkpoint(run.out_dir / CHECKPOINT_FILE, run.cfg)
        elif run.state == "other":
            raise ResumeError(f"--resume: {run.mismatch}")
    if all(run.state == "new" for run in runs):
        where = runs[0].out_dir / CHECKPOINT_FILE
        raise ResumeError(
            f"--resume: no checkpoint at {where}"
            if len(runs) == 1
            else f"--resume: none of the {len(runs)} runs has a checkpoint (the first: {where})"
        )


def main(argv=None) -> None:
    """`python -m dcinterp.train [summarize] ...`: train (or evaluate) every run of the command, or summarize a study.

    Errors in the command are one line on stderr and exit 2; a run stopped by Ctrl-C or SIGTERM exits 130 after its
    checkpoint.

    Args:
        argv: The arguments; default `sys.argv[1:]`. "summarize" first hands the rest to `dcinterp.study.main`.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["summarize"]:
        from ..study import main as summarize_main

        summarize_main(argv[1:])
        return
    args = parse_args(argv)
    command = "python -m dcinterp.train " + " ".join(shlex.quote(a) for a in argv)
    arches = ("dcmha", "mha") if args.arch == "both" else (args.arch,)
    catalog = load_catalog()
    try:
        task_ids = parse_task_ids(args.tasks, catalog) if args.tasks else []
    except ValueError as e:
        usage_error(f"--tasks: {e}")
    try:
        split_tasks(args.exclude_combos)
    except ValueError as e:
        usage_error(f"--exclude-combos: {e}")
    focus_spec = args.focus_tasks
    if focus_spec is None:  # the recipe's curriculum is for the whole catalog, not for a --tasks subset
        focus_spec = "" if args.tasks else ",".join(TrainConfig().focus_tasks)
    try:
        focus_ids = parse_task_ids(focus_spec, catalog) if focus_spec else []
    except ValueError as e:
        usage_error(f"--focus-tasks: {e}")
    try:
        every = CheckpointEvery.parse(args.checkpoint_every)
        runs = plan_runs(args, arches, task_ids, focus_ids)
        for run in runs:
            run.cfg.model_config(d_vocab=1)  # DCFormerConfig checks the size and the window pattern
            training_tasks(run.cfg)
        if args.lookup_threshold is not None and args.start_from is None:
            raise ValueError("--lookup-threshold screens the starts of --start-from, which is not given")
        if not args.eval_only:
            check_resumable(runs, args.resume)
            for run in runs:
                check_writable_dir(run.out_dir, "--out")  # before any step: no run lost at its save
            if args.log_dir:
                check_writable_dir(Path(args.log_dir), "--log-dir")
            runs = screen(runs, Path(args.out), args.lookup_threshold, args.seeds is not None)
    except ValueError as e:
        usage_error(str(e))
    from ..loading import CheckpointError

    for run in runs:
        if args.eval_only:
            try:
                evaluate_saved(run, args)
            except (CheckpointError, OSError) as e:
                usage_error(f"--eval-only: {e}")
            continue
        if args.resume and run.state == "finished":
            print(f"{run.out_dir}: finished already, skipped", file=sys.stderr)
            continue
        log_file = None
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            prefix = f"seed{run.cfg.seed}-" if args.seeds is not None else ""
            log_file = Path(args.log_dir) / f"{prefix}{run.name}.jsonl"
        try:
            _, recipe = train(
                run.cfg,
                out_dir=run.out_dir,
                progress=not args.quiet,
                log_file=log_file,
                command=command,
                evaluate_after=not args.no_eval,
                checkpoint_every=every,
                resume=run.state == "stopped",
                stop_after=args.stop_after,
                start_from=run.start,
            )
        except RunInterrupted as e:
            print(f"python -m dcinterp.train: {run.out_dir}: {e}", file=sys.stderr)
            sys.exit(130)
        recipe["name"] = run.name
        write_recipe(recipe, run.out_dir)
        print(json.dumps({str(run.out_dir): summarize(recipe)}, indent=2))


def evaluate_saved(run: Run, args: argparse.Namespace) -> None:
    """--eval-only: evaluate the model in the run's folder and write the accuracies into its recipe.json.

    Args:
        run: The run.
        args: The parsed arguments (threads, exclude_combos).

    Raises:
        CheckpointError: No model in the folder.
        OSError: No recipe.json in the folder.
    """
    import torch

    from ..model import HookedDCFormer

    torch.set_num_threads(args.threads)
    model = HookedDCFormer.from_pretrained(run.out_dir)
    recipe = json.loads((run.out_dir / "recipe.json").read_text())
    _, held = split_tasks(args.exclude_combos or recipe["data"].get("excluded_combos") or ())
    recipe["accuracy"] = accuracy_report(model, held)
    write_recipe(recipe, run.out_dir)
    print(json.dumps({run.name: summarize(recipe)}, indent=2))


def summarize(recipe: dict) -> dict:
    """A recipe's headline numbers, as the command prints them.

    Args:
        recipe: A recipe.json.

    Returns:
        steps, tokens seen, final loss, wall time, the last probe accuracy and each set's accuracy.
    """
    out = {k: recipe.get(k) for k in ("steps", "tokens_seen", "final_loss", "wall_time_s")}
    probes = [h["eval_accuracy"] for h in recipe.get("history", []) if "eval_accuracy" in h]
    if probes:
        out["probe_accuracy"] = probes[-1]
    acc = recipe.get("accuracy") or {}
    for name, entry in acc.items():
        if isinstance(entry, dict) and "accuracy" in entry:
            out[f"acc_{name}"] = entry["accuracy"]
            if "held_out_combos" in entry:
                out[f"acc_{name}_held_out_combos"] = entry["held_out_combos"]["accuracy"]
    return out


if __name__ == "__main__":
    main()
