"""Checkpoints, resumption and shared starts: a run stopped and continued is the run that never stopped.

A run writes `checkpoint.pt` (model, AdamW state, schedule position, where the data stream stands, every random
state, the loss log) to a temporary file and renames it, so that a checkpoint on disk is never half written;
`load_checkpoint` checks that a checkpoint is of the run being continued. A shared start (`--start-from`) is
another run's checkpoint that this run can begin from while the two are still the same run (`load_start`,
`take_start`), its MLP widened for a parameter-matched twin (`widen_mlp`).
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .recipe import RUN_SETTINGS, TrainConfig, config_mismatch, optimizer_groups, tasks_at

if TYPE_CHECKING:
    import torch

    from ..model import HookedDCFormer


# --------------------------------------------------------------------------------------------------
# Checkpoints: a run stopped and continued is the run that never stopped
CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_FORMAT = "dcinterp.train checkpoint 1"


class ResumeError(ValueError):
    """A checkpoint that cannot be continued: missing, unreadable, or written by another recipe (one line)."""


class RunInterrupted(Exception):
    """Ctrl-C or SIGTERM stopped the run after the step under way; the message says where its checkpoint is."""


@dataclass
class CheckpointEvery:
    """How often a run writes its checkpoint: every `steps` steps, or every `seconds` of wall time.

    Attributes:
        steps: Every this many steps; None to go by wall time.
        seconds: Every this many seconds of wall time, where `steps` is None.
    """

    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, spec: str) -> CheckpointEvery:
        """A checkpoint interval as the command line writes it.

        Args:
            spec: "500" (every 500 steps), or "300s", "5m", "1h" (every so much wall time).

        Returns:
            The interval.

        Raises:
            ValueError: One line naming --checkpoint-every, if `spec` is neither.
        """
        units = {"s": 1, "m": 60, "h": 3600}
        text = str(spec).strip().lower()
        try:
            if text[-1:] in units and float(text[:-1]) > 0:
                return cls(seconds=float(text[:-1]) * units[text[-1]])
            if text.isdigit() and int(text) > 0:
                return cls(steps=int(text))
        except ValueError:
            pass
        raise ValueError(f"--checkpoint-every {spec!r}: expected a number of steps (500) or a time (300s, 5m, 1h)")

    def due(self, steps_done: int, seconds_since_last: float) -> bool:
        """Whether a checkpoint is due now.

        Args:
            steps_done: Steps done in all.
            seconds_since_last: Wall time since the last checkpoint (or the session's start).

        Returns:
            True when `steps_done` is a multiple of `steps`, or `seconds` have passed.
        """
        if self.steps is not None:
            return steps_done % self.steps == 0
        return seconds_since_last >= self.seconds


@dataclass
class Progress:
    """What a run has done so far (saved in its checkpoint).

    Attributes:
        step: Steps done.
        tokens_seen: Tokens trained on.
        losses: Each step's mean next-token loss.
        answer_losses: Each step's answer-token loss.
        history: The log entries, every `log_every` steps.
        elapsed_s: Wall time of the sessions before this one.
        resumed_at: The steps it was continued from.
        started_from: --start-from: the start's checkpoint, its step and its answer loss.
    """

    step: int = 0
    tokens_seen: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)
    answer_losses: list[float] = dataclasses.field(default_factory=list)
    history: list[dict] = dataclasses.field(default_factory=list)
    elapsed_s: float = 0.0
    resumed_at: list[int] = dataclasses.field(default_factory=list)
    started_from: dict | None = None


def read_checkpoint(path: Path, option: str = "--resume") -> dict:
    """The checkpoint at `path`, checked to be a dcinterp.train checkpoint.

    Args:
        path: The checkpoint file.
        option: The command-line option the error names.

    Returns:
        The checkpoint.

    Raises:
        ResumeError: One line naming `option` and the file: it is missing, unreadable, or not a checkpoint of
            this format.
    """
    import torch

    if not path.is_file():
        raise ResumeError(f"{option}: no checkpoint at {path}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: torch's own message is many lines deep
        raise ResumeError(f"{option}: {path} is not a readable checkpoint ({type(e).__name__})") from e
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ResumeError(f"{option}: {path} is not a dcinterp.train checkpoint (no format {CHECKPOINT_FORMAT!r})")
    return checkpoint


def load_checkpoint(path: Path, cfg: TrainConfig) -> dict:
    """The checkpoint at `path`, checked to be of the run `cfg` describes (for --resume).

    Args:
        path: The checkpoint file.
        cfg: The run's recipe.

    Returns:
        The checkpoint.

    Raises:
        ResumeError: One line: it is not a checkpoint, or another run's.
    """
    checkpoint = read_checkpoint(path)
    mismatch = config_mismatch(checkpoint["train_config"], cfg)
    if mismatch:
        raise ResumeError(f"--resume: {path} is another run's checkpoint: {mismatch}")
    return checkpoint


def save_checkpoint(path: Path, checkpoint: dict) -> None:
    """Write a checkpoint to a temporary file beside `path`, then rename: a checkpoint on disk is never half written.

    Args:
        path: The checkpoint file; its folder is made if missing.
        checkpoint: What `torch.save` writes.
    """
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


# --------------------------------------------------------------------------------------------------
# Shared starts: a seed's twins are one model until the compose trains, and the held-out variants are that model
# until the focus phase ends, so all of them can begin from one run stopped there (`--start-from`); so are runs of
# other focus stages until the first stage in which they differ begins
START_MAY_DIFFER = ("arch", "exclude_combos", "focus_stages", "eval_every", "d_mlp", *RUN_SETTINGS)
SCREEN_STEPS = 100  # a start's answer loss, which says whether its focus phase formed the lookup: over its last steps


def start_answer_loss(checkpoint: dict) -> float | None:
    """A start's answer loss, which says whether its focus phase formed the lookup.

    Args:
        checkpoint: A checkpoint.

    Returns:
        The mean answer-token loss of its last `SCREEN_STEPS` steps, rounded to 4 decimals; None where none was
        logged.
    """
    losses = checkpoint["progress"]["answer_losses"][-SCREEN_STEPS:]
    return round(sum(losses) / len(losses), 4) if losses else None


def load_start(path: Path, cfg: TrainConfig) -> dict:
    """Another run's checkpoint (stopped with --stop-after), checked to be the beginning of the run `cfg` describes.

    The same recipe but for `START_MAY_DIFFER`, stopped while the two runs are still the same run: before the compose
    trains when the architectures differ, within the focus phase when the excluded combinations differ, before the
    first step that draws other tasks when the focus stages differ. This run's MLP may be wider (`widen_mlp`).

    Args:
        path: The start's checkpoint file.
        cfg: This run's recipe.

    Returns:
        The checkpoint.

    Raises:
        ResumeError: One line naming the file, if it is not such a start.
    """
    checkpoint = read_checkpoint(path, "--start-from")
    saved, step = checkpoint["train_config"], checkpoint["progress"]["step"]
    mismatch = config_mismatch(saved, cfg, START_MAY_DIFFER)
    if mismatch:
        raise ResumeError(f"--start-from: {path} is another recipe's checkpoint: {mismatch}")
    if cfg.d_mlp < saved["d_mlp"]:
        raise ResumeError(
            f"--start-from: {path} has an MLP of {saved['d_mlp']} units, this run {cfg.d_mlp}: a start can be widened "
            f"(a parameter-matched twin), not narrowed"
        )
    compose_from = round(cfg.compose_from * cfg.steps)
    if saved["arch"] != cfg.arch and step > compose_from:
        raise ResumeError(
            f"--start-from: {path} is at step {step}, after the compose began to train (step {compose_from}): "
            f"a {saved['arch']} run is the {cfg.arch} run only until then"
        )
    focus_until = round(cfg.focus_until * cfg.steps) if cfg.focus_tasks else 0
    if list(saved["exclude_combos"]) != list(cfg.exclude_combos) and step > focus_until:
        raise ResumeError(
            f"--start-from: {path} is at step {step}, after the focus phase (step {focus_until}): its data differ "
            f"from this run's from then on (exclude_combos {saved['exclude_combos']}, this run "
            f"{list(cfg.exclude_combos)})"
        )
    start_cfg = dataclasses.replace(cfg, focus_stages=tuple(saved.get("focus_stages", ())))
    if start_cfg.focus_stages != cfg.focus_stages:
        steps_apart = (s for s in range(cfg.steps) if tasks_at(s, start_cfg, None) != tasks_at(s, cfg, None))
        apart = next(steps_apart, cfg.steps)
        if step > apart:
            raise ResumeError(
                f"--start-from: {path} is at step {step}, after its focus stages {list(start_cfg.focus_stages)} "
                f"and this run's {list(cfg.focus_stages)} draw other tasks (from step {apart})"
            )
    return checkpoint


MLP_AXES = {"mlp.W_in": 1, "mlp.b_in": 0, "mlp.W_out": 0}  # each MLP tensor's d_mlp axis


def widen_mlp(name: str, start: torch.Tensor, own: torch.Tensor, moment: bool = False) -> torch.Tensor:
    """The start's MLP tensor `name` in this run's wider MLP.

    The start's hidden units come first, then the new ones, which keep this run's initialisation in W_in and b_in
    and are 0 in W_out (and in every AdamW moment), so that the widened model computes what its start did (a
    parameter-matched twin begins as its start).

    Args:
        name: The parameter's name, ending in mlp.W_in, mlp.b_in or mlp.W_out.
        start: The start's tensor.
        own: This run's tensor, as initialised.
        moment: Whether the tensors are AdamW moments (the new units' are 0).

    Returns:
        The widened tensor, of `own`'s shape.

    Raises:
        ResumeError: `name` is no MLP tensor, or the two differ in rank.
    """
    import torch

    suffix = next((key for key in MLP_AXES if name.endswith(key)), None)
    if suffix is None or start.ndim != own.ndim:
        raise ResumeError(f"--start-from: the start's {name} is {list(start.shape)}, this run's {list(own.shape)}")
    widened = torch.zeros_like(own) if moment or suffix == "mlp.W_out" else own.clone()
    widened.narrow(MLP_AXES[suffix], 0, start.shape[MLP_AXES[suffix]]).copy_(start)
    return widened


def take_start(checkpoint: dict, model: HookedDCFormer, opt: torch.optim.AdamW) -> None:
    """The start's weights and AdamW state, by parameter name, into this run's model and optimizer.

    The compose's parameters (`W_dyn_*`, DCMHA only) keep this run's initialisation when the start has none (an MHA
    start) and are dropped when this run has none: they have not trained in either run yet (`load_start`). A wider MLP
    than the start's takes the start's hidden units and keeps its own new ones (`widen_mlp`).

    Args:
        checkpoint: The start, from `load_start`.
        model: This run's model, initialised.
        opt: This run's optimizer, from `make_optimizer`.

    Raises:
        ResumeError: The models differ in more than the compose and the MLP's width, or the start has trained a
            parameter this run does not have.
    """
    from ..model import HookedDCFormer

    start_arch = checkpoint["train_config"]["arch"]
    start_model = HookedDCFormer(dataclasses.replace(model.cfg, use_dcmha=start_arch == "dcmha"), init=False)
    weights, own = checkpoint["model"], model.state_dict()
    unshared = sorted(set(weights) ^ set(own))
    if any("W_dyn" not in name for name in unshared):
        raise ResumeError(f"--start-from: the start's model differs from this run's in {unshared[0]}")
    widened = {name for name in weights if name in own and weights[name].shape != own[name].shape}
    weights = {name: widen_mlp(name, w, own[name]) if name in widened else w for name, w in weights.items()}
    model.load_state_dict({name: w for name, w in weights.items() if name in own}, strict=False)
    start_names = [name for group in optimizer_groups(start_model) for name in group]
    own_groups = optimizer_groups(model)
    index = {name: i for i, name in enumerate(name for group in own_groups for name in group)}
    saved = checkpoint["optimizer"]
    trained_compose = [start_names[i] for i in saved["state"] if start_names[i] not in index]
    if trained_compose:
        raise ResumeError(f"--start-from: the start has trained {trained_compose[0]}, which this run does not have")
    state = {
        index[start_names[i]]: {
            key: widen_mlp(start_names[i], value, own[start_names[i]], moment=True)
            if start_names[i] in widened and key.startswith("exp_avg")
            else value
            for key, value in s.items()
        }
        for i, s in saved["state"].items()
    }
    groups, first = [], 0
    for saved_group, names in zip(saved["param_groups"], own_groups, strict=True):
        groups.append({**saved_group, "params": list(range(first, first + len(names)))})
        first += len(names)
    opt.load_state_dict({"state": state, "param_groups": groups})


def random_states(data_rng: random.Random) -> dict:
    """Every random state a run may draw from: the data's own generator, python's, numpy's and torch's.

    Args:
        data_rng: The data's random generator.

    Returns:
        The states, as a checkpoint stores them.
    """
    import numpy as np
    import torch

    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "data": data_rng.getstate(),
        "python": random.getstate(),
        "numpy": (kind, key.tolist(), pos, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
    }


def set_random_states(data_rng: random.Random, states: dict) -> None:
    """Set every random state a run may draw from to what `random_states` saved.

    Args:
        data_rng: The data's random generator.
        states: A `random_states()`, as a checkpoint returns it.
    """
    import numpy as np
    import torch

    data_rng.setstate(states["data"])
    random.setstate(states["python"])
    kind, key, pos, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((kind, np.array(key, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch"])
