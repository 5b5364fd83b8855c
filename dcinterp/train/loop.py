"""The training loop: one model trained by its recipe, checkpointed, stopped on request, its recipe.json written.

The loss is the next-token loss on every token, with the answer tokens of lines 3-8 weighted 1 + `answer_weight`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..synth import generate
from ..tokenizer import build_tokenizer
from .checkpointing import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    CheckpointEvery,
    Progress,
    ResumeError,
    RunInterrupted,
    load_checkpoint,
    load_start,
    random_states,
    save_checkpoint,
    set_random_states,
    start_answer_loss,
    take_start,
)
from .data import Batcher, SampleStream, compact_share_at
from .evaluation import accuracy_report, probe_accuracy
from .recipe import (
    EVAL_SEED,
    PROBE_SAMPLES_PER_TASK,
    TRAIN_SEED_BASE,
    TrainConfig,
    config_record,
    lr_at,
    make_optimizer,
    parse_combos,
    training_tasks,
)

if TYPE_CHECKING:
    from ..model import HookedDCFormer


@contextmanager
def stop_requests() -> Iterator[list[str]]:
    """Catch Ctrl-C and SIGTERM while training, so that the loop stops after the step under way.

    The list gets the signal's name; a second Ctrl-C stops at once. Outside the main thread signals cannot be
    caught: the list stays empty. The previous handlers are put back on exit.

    Yields:
        The list of the signals received.
    """
    requested: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def handler(signum, frame):
        if requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requested.append(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# --------------------------------------------------------------------------------------------------
# Training
def train(
    cfg: TrainConfig,
    out_dir=None,
    progress: bool = True,
    log_file=None,
    command: str | None = None,
    evaluate_after: bool = True,
    checkpoint_every: CheckpointEvery | str = "5m",
    resume: bool = False,
    stop_after: int | None = None,
    start_from=None,
) -> tuple[HookedDCFormer, dict]:
    """Train one model by its recipe.

    With `out_dir`, the run writes `out_dir/checkpoint.pt` (model, optimizer, step, every random state, where the
    data stream stands, the loss log) every `checkpoint_every`, and when it stops early: after `stop_after` steps in
    all, when `max_minutes` run out, or on Ctrl-C / SIGTERM (after the step under way). `resume=True` continues from
    that checkpoint, and the run ends bit for bit as the run that never stopped. A run that stops early writes its
    model and a recipe with `stopped_early`, not evaluated; a finished run writes its model and recipe, evaluated, and
    then removes its checkpoint. `start_from` begins this run where another run of the recipe stopped (the MHA twin
    stopped at the end of the focus phase, say): bit for bit the run that began at step 0.

    Args:
        cfg: The recipe.
        out_dir: The folder to write the model, recipe.json and the checkpoint to; None to write nothing.
        progress: Whether to show a progress bar (only on a terminal).
        log_file: A JSON-lines file for the log entries; appended to, or rewritten up to the checkpoint on resume.
        command: The command line, for the recipe.
        evaluate_after: Whether a finished run computes its `accuracy_report`.
        checkpoint_every: A `CheckpointEvery`, or its spec: "500" (steps), "300s", "5m" (wall time).
        resume: Continue from `out_dir`'s checkpoint.
        stop_after: Stop (with a checkpoint) once this many steps are done in all.
        start_from: The checkpoint of another run of the recipe to begin from (`load_start`).

    Returns:
        (the model, in eval mode; the recipe, as recipe.json holds it).

    Raises:
        ResumeError: `resume` without `out_dir`, or a checkpoint (or start) that is not this run's.
        RunInterrupted: Ctrl-C or SIGTERM stopped the run; its message says where the checkpoint is.
    """
    import torch

    from ..model import HookedDCFormer

    every = (
        checkpoint_every if isinstance(checkpoint_every, CheckpointEvery) else CheckpointEvery.parse(checkpoint_every)
    )
    checkpoint_path = Path(out_dir) / CHECKPOINT_FILE if out_dir is not None else None
    if resume and checkpoint_path is None:
        raise ResumeError("--resume: no output directory to find the checkpoint in")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = build_tokenizer()
    model = HookedDCFormer(cfg.model_config(len(tokenizer)), tokenizer=tokenizer, init=False)
    model.init_weights(identity_compose=cfg.compose_from > 0)
    if cfg.tied_init:
        with torch.no_grad():
            model.W_U.copy_(model.W_E.T)
    if not model.cfg.use_dcmha:
        # The MHA twin computes its attention as tensors (the einsum path) rather than by SDPA: the arithmetic that
        # the DCMHA twin, its compose held at the identity, reproduces bit for bit, so the twins learn the same.
        model.add_hook(lambda name: name.endswith("hook_pattern"), lambda pattern, hook: pattern, is_permanent=True)
    compose_params = [p for name, p in model.named_parameters() if "W_dyn" in name]  # none for MHA
    opt = make_optimizer(model, cfg)
    forward = torch.compile(model, dynamic=True) if cfg.compile else model  # compiled at the first step
    train_ids, held_ids = training_tasks(cfg)
    step_now = 0
    stream = SampleStream(
        cfg,
        train_ids if cfg.exclude_combos or cfg.tasks else None,
        rng,
        lambda: compact_share_at(step_now, cfg),
        step=lambda: step_now,
    )
    batches = Batcher(tokenizer, stream, cfg, rng)
    probe = generate(EVAL_SEED, PROBE_SAMPLES_PER_TASK, train_ids) if cfg.eval_every else None
    done = Progress()
    if resume or start_from is not None:
        if resume:
            checkpoint = load_checkpoint(checkpoint_path, cfg)
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
        else:
            checkpoint = load_start(Path(start_from), cfg)
            take_start(checkpoint, model, opt)
        stream.load_state_dict(checkpoint["data"]["stream"])
        batches.load_state_dict(checkpoint["data"]["batcher"])
        set_random_states(rng, checkpoint["random"])
        done = Progress(**checkpoint["progress"])
        if resume:
            done.resumed_at.append(done.step)
        else:
            done.started_from = {
                "path": str(start_from),
                "step": done.step,
                "answer_loss": start_answer_loss(checkpoint),
            }

    from tqdm.auto import tqdm

    show_bar = progress and sys.stderr.isatty()
    bar = tqdm(total=cfg.steps, initial=done.step, desc=f"train {cfg.arch}", disable=not show_bar, dynamic_ncols=True)
    log = open(log_file, "w" if resume else "a") if log_file else None
    if log and resume:  # the log of the run so far, without the steps since the checkpoint that will be run again
        log.writelines(json.dumps(entry) + "\n" for entry in done.history)
    session_start = last_checkpoint = time.time()

    def wall_time() -> float:
        return done.elapsed_s + time.time() - session_start

    def write_checkpoint() -> None:
        save_checkpoint(
            checkpoint_path,
            {
                "format": CHECKPOINT_FORMAT,
                "train_config": config_record(cfg),
                "progress": dataclasses.asdict(dataclasses.replace(done, elapsed_s=wall_time())),
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "data": {"stream": stream.state_dict(), "batcher": batches.state_dict()},
                "random": random_states(rng),
            },
        )

    stopped_by = None  # why the run stopped before cfg.steps
    model.train()
    with stop_requests() as signals:
        for step in range(done.step, cfg.steps):
            step_now = step
            compose_trains = step >= cfg.compose_from * cfg.steps
            for p in compose_params:  # a parameter without a gradient is left alone by AdamW (no decay)
                p.requires_grad_(compose_trains)
            x, answer = next(batches)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            per_token = forward(x, return_type="loss", loss_per_token=True)  # [batch, pos - 1], predicts x[:, 1:]
            is_answer = answer[:, 1:].to(per_token.dtype)
            weights = 1.0 + cfg.answer_weight * is_answer
            loss = (per_token * weights).sum() / weights.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            done.tokens_seen += x.numel()
            with torch.no_grad():
                done.losses.append(per_token.mean().item())
                if is_answer.sum() > 0:
                    done.answer_losses.append(((per_token * is_answer).sum() / is_answer.sum()).item())
            done.step = step + 1
            bar.update(1)
            bar.set_postfix(loss=f"{done.losses[-1]:.3f}", lr=f"{lr_at(step, cfg):.2e}")
            if done.step % cfg.log_every == 0 or done.step == cfg.steps:
                entry = log_entry(done, cfg, lr_at(step, cfg), wall_time())
                if probe is not None and done.step % cfg.eval_every == 0:
                    entry["eval_accuracy"] = probe_accuracy(model, probe)
                done.history.append(entry)
                if log:
                    log.write(json.dumps(entry) + "\n")
                    log.flush()
            if done.step < cfg.steps:
                if signals:
                    stopped_by = f"stopped by {signals[0]}"
                elif stop_after is not None and done.step >= stop_after:
                    stopped_by = f"stopped after {done.step} steps (stop_after)"
                elif cfg.max_minutes is not None and time.time() - session_start > 60 * cfg.max_minutes:
                    stopped_by = f"stopped after {cfg.max_minutes} minutes (max_minutes)"
            if checkpoint_path is not None and (stopped_by or every.due(done.step, time.time() - last_checkpoint)):
                if done.step < cfg.steps:
                    write_checkpoint()
                    last_checkpoint = time.time()
            if stopped_by:
                break
    bar.close()
    if log:
        log.close()
    if signals and stopped_by:
        raise RunInterrupted(
            f"{stopped_by} at step {done.step} of {cfg.steps}"
            + (f"; checkpoint {checkpoint_path}: continue with --resume" if checkpoint_path else "")
        )
    model.eval()
    recipe = make_recipe(model, cfg, done, wall_time(), command, stopped_by, train_ids, held_ids)
    if evaluate_after and not stopped_by:
        recipe["accuracy"] = accuracy_report(model, held_ids)
    if out_dir is not None:
        save(model, recipe, out_dir)
        if not stopped_by and checkpoint_path.exists():
            checkpoint_path.unlink()
    return model, recipe


def log_entry(done: Progress, cfg: TrainConfig, lr: float, wall_time: float) -> dict:
    """The log line of the last `log_every` steps.

    Args:
        done: The run's progress.
        cfg: The run's recipe.
        lr: The learning rate of the last step.
        wall_time: The run's wall time so far, in seconds.

    Returns:
        step, mean loss (and answer loss), learning rate, tokens seen and elapsed seconds.
    """
    recent = done.losses[-cfg.log_every :]
    entry = {
        "step": done.step,
        "loss": round(sum(recent) / len(recent), 4),
        "lr": lr,
        "tokens": done.tokens_seen,
        "elapsed_s": round(wall_time, 1),
    }
    if done.answer_losses:
        tail = done.answer_losses[-cfg.log_every :]
        entry["answer_loss"] = round(sum(tail) / len(tail), 4)
    return entry


def make_recipe(model, cfg, done: Progress, wall_time, command, stopped_by, train_ids, held_ids) -> dict:
    """The recipe.json of a run: its command, settings, data, losses, log and what it cost.

    Args:
        model: The trained model.
        cfg: The run's recipe.
        done: The run's progress.
        wall_time: The run's wall time, in seconds.
        command: The command line, or None.
        stopped_by: Why the run stopped early, or None for a finished run.
        train_ids: The training task ids.
        held_ids: The held-out task ids.

    Returns:
        The recipe, without the accuracies (`accuracy_report` adds them).
    """
    import torch

    tail = done.losses[-min(len(done.losses), cfg.log_every) :]
    answer_tail = done.answer_losses[-len(tail) :]
    last_k = (done.step * cfg.batch_size) // max(1, len(train_ids) * cfg.samples_per_task)  # seeds drawn
    return {
        "name": cfg.model_config(len(model.tokenizer)).model_name,
        "command": command,
        "seed": cfg.seed,
        "steps": done.step,
        "steps_planned": cfg.steps,
        "stopped_early": stopped_by is not None,
        **({"stopped_by": stopped_by} if stopped_by else {}),
        "resumed_at": done.resumed_at,
        **({"started_from": done.started_from} if done.started_from else {}),
        "tokens_seen": done.tokens_seen,
        "final_loss": round(sum(tail) / len(tail), 4) if tail else None,
        "final_loss_note": f"mean next-token loss (all tokens, unweighted) over the last {len(tail)} steps",
        "final_answer_loss": round(sum(answer_tail) / len(answer_tail), 4) if answer_tail else None,
        "first_loss": round(done.losses[0], 4) if done.losses else None,
        "wall_time_s": round(wall_time, 1),
        "torch_version": torch.__version__,
        "threads": cfg.threads,
        "n_params": sum(p.numel() for p in model.parameters()),
        "train_config": config_record(cfg),
        "data": {
            "generation_seeds": f"{TRAIN_SEED_BASE + 100_000 * cfg.seed} + k, k = 0..{last_k}",
            "train_tasks": len(train_ids),
            "tasks": list(cfg.tasks) or "all",
            "excluded_combos": [f"{a}:{b}" for a, b in parse_combos(cfg.exclude_combos)],
            "held_out_tasks": held_ids,
        },
        "history": done.history,
    }


def save(model: HookedDCFormer, recipe: dict, out_dir) -> None:
    """Write a trained model (config, weights, tokenizer) and its recipe.json to a folder.

    Args:
        model: The model.
        recipe: Its recipe.
        out_dir: The folder.
    """
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    write_recipe(recipe, out_dir)


def write_recipe(recipe: dict, out_dir: Path) -> None:
    """Write recipe.json to a temporary file and rename it, so that it is never half written.

    Args:
        recipe: The recipe.
        out_dir: The run's folder.
    """
    partial = Path(out_dir) / "recipe.json.partial"
    partial.write_text(json.dumps(recipe, indent=2) + "\n")
    os.replace(partial, Path(out_dir) / "recipe.json")
