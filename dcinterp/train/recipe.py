"""The recipe of a training run: its settings (`TrainConfig`), which tasks it trains on and when, and the optimiser.

The defaults of `TrainConfig` are the recipe of the shipped models: 3 layers, local-global-global, 10,000 steps of
batch 16, both curricula below.

`compact_until` turns on a curriculum: at step 0 every sample is written with compact facts ("Ruth cat." for
"Ruth has a cat.", "cat Ruth." for "The cat is Ruth's.", same lines, queries and answers), and the share of such
samples falls linearly to 0 at that fraction of the steps. With the person next to its item, a previous-token
head suffices to bind them: on task10 alone, a small model that stays at chance on the released format without the
curriculum learns the binding with it (docs/training.md has the runs).

`focus_tasks` with `focus_until` is a curriculum over tasks: the first `focus_until` of the steps draw samples
of the focus tasks only, the rest of all the training tasks. `focus_stages` ("task14,task15@0.3",
"task12,task13@0.35") are further focus phases, in order after the first: each draws its tasks only, from where the
one before it ends until its own fraction of the steps; after the last, all the training tasks (`tasks_at`).

`compose_from` (DCMHA only) starts the compose at the identity (the second factor of the low-rank projections and
the gates at zero, `init_weights(identity_compose=True)`) and holds every `W_dyn_*` parameter still until that
fraction of the steps: until then the DCMHA model computes, and learns, exactly what its MHA twin of the same
seed does (the shared parameters are initialised alike), then the compose trains from the identity.
With 0 the compose starts at the official random initialisation and trains from step 0 (docs/training.md).

`exclude_combos` ("same-person:superclass,matching-person:country") leaves the tasks with those (QK pattern,
OV transformation) combinations out of the training corpus, for the held-out composition study (paper
Sec. 4.3); every pattern and transformation must still occur in another task (`split_tasks`).

Optimiser as in the paper's App. C: AdamW (beta 0.9, 0.95), weight decay 0.1 (on matrices, not on norms and
biases), gradient clipping 1.0, linear warmup over 1% of the steps and cosine decay to 10% of the peak rate.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..synth import load_catalog
from ..synth.catalog import OV_TRANSFORMATIONS, QK_PATTERNS
from ..synth.generator import parse_task_ids

if TYPE_CHECKING:  # torch and the model are imported where they are used, so that `--help` starts fast
    import torch

    from ..config import DCFormerConfig


ARCH_NAMES = {"dcmha": "dcpythia-synth", "mha": "pythia-synth"}
TRAIN_SEED_BASE = 1000  # generation seeds below this are reserved for evaluation sets
EVAL_SEED = 0  # the held-out generated evaluation set
TEST_SET = {"seed": EVAL_SEED, "samples_per_task": 2}  # the small fixed set tests/test_train.py checks
PROBE_SAMPLES_PER_TASK = 4  # the accuracy logged every `eval_every` steps
DEFAULT_EXCLUDED_COMBOS = (
    "same-person:superclass",
    "matching-person:country",
    "other-person:capability",
    "not-matching-person:opposite",
)


@dataclass
class TrainConfig:
    """The recipe of one training run; the defaults are the shipped models' (docs/training.md).

    Attributes:
        arch: "dcmha", or "mha" for the plain-MHA twin.
        steps: Optimiser steps.
        seed: The run's seed: initial weights, data order and the generation seeds of its samples.
        batch_size: Rows per batch.
        lr: Peak learning rate.
        warmup_frac: Linear warmup over this fraction of the steps (App. C: 1%).
        min_lr_frac: Cosine decay to this fraction of the peak (App. C: 10%).
        weight_decay: AdamW's weight decay, on matrices only.
        betas: AdamW's betas.
        grad_clip: Gradient clipping by global norm.
        n_layers: Layers (DCPythia layout: LN, parallel residual, GELU MLP, QK-norm, local/global layers).
        d_model: Residual width.
        n_heads: Attention heads per layer.
        d_head: Width of a head.
        d_mlp: The MLP's hidden units.
        n_ctx: Longest sequence; a batch is cut to it.
        window_size: A local layer's window, in tokens.
        window_type: Local (L) / global (G) layer pattern, repeated over the depth; None: every layer global.
        rotary_pct: Share of each head's dimensions that are rotated.
        samples_per_task: Samples per task per generator call (one call = one generation seed).
        lines: Lines per sample.
        exclude_combos: "qk_pattern:ov_transformation" combinations whose tasks are left out of training.
        tasks: Train on these task ids only; default all the catalog's, less `exclude_combos`.
        pad_multiple: A batch's length is rounded up to a multiple of this (and filled with knowledge sentences).
        answer_weight: Extra loss weight of the answer tokens (lines 3-8); 0 = plain LM loss.
        tied_init: Initialise the unembedding as the embedding's transpose (then trained apart).
        compact_until: Compact-facts curriculum: the share of compact samples falls from 1 to 0 by this fraction of
            the steps; 0 turns it off.
        compact_hold: ... after staying at 1 until this fraction.
        focus_tasks: Task curriculum: train on these tasks only ...
        focus_until: ... for this fraction of the steps, then on all the training tasks.
        focus_stages: Then, stage by stage, "task14,task15@0.3": these tasks only until 0.3 of the steps.
        compose_from: DCMHA: the compose is the identity (the model trains as its MHA twin) until this fraction.
        bucket_batches: Batches drawn at once and grouped by sample length (less padding, less T^2).
        threads: torch's threads; on a shared 2-core machine two OpenMP threads spin-wait and run slower.
        compile: torch.compile the model (minutes of compilation, then faster steps; docs/training.md).
        max_minutes: Stop early (and say so in the recipe) when this much wall time has run out.
        log_every: Log the mean loss every this many steps.
        eval_every: Every this many steps, log the accuracy on a small generated set of the training tasks; 0: never.
    """

    arch: str = "dcmha"
    steps: int = 10000
    seed: int = 0
    batch_size: int = 16
    lr: float = 3e-3
    warmup_frac: float = 0.01
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    # model size: the defaults are the shipped recipe, a 4-token local layer, then two global ones
    n_layers: int = 3
    d_model: int = 64
    n_heads: int = 4
    d_head: int = 16
    d_mlp: int = 256
    n_ctx: int = 512
    window_size: int = 4
    window_type: str | None = "LGG"
    rotary_pct: float = 1.0
    # data and curricula
    samples_per_task: int = 4
    lines: int = 8
    exclude_combos: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    pad_multiple: int = 16
    answer_weight: float = 20.0
    tied_init: bool = True
    compact_until: float = 0.5
    compact_hold: float = 0.0
    focus_tasks: tuple[str, ...] = ("task10", "task11")
    focus_until: float = 0.25
    focus_stages: tuple[str, ...] = ()
    compose_from: float = 0.25
    # how the run runs
    bucket_batches: int = 8
    threads: int = 1
    compile: bool = False
    max_minutes: float | None = None
    log_every: int = 25
    eval_every: int = 0

    def model_config(self, d_vocab: int) -> DCFormerConfig:
        """The model this recipe trains.

        Args:
            d_vocab: The tokenizer's vocabulary size.

        Returns:
            The `DCFormerConfig` (QK-norm on; DCMHA for arch "dcmha"), named by `ARCH_NAMES`.

        Raises:
            ValueError: The size or the window pattern is not a valid model (`DCFormerConfig` checks them).
        """
        from ..config import DCFormerConfig

        return DCFormerConfig(
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_head=self.d_head,
            d_mlp=self.d_mlp,
            d_vocab=d_vocab,
            n_ctx=self.n_ctx,
            model_name=ARCH_NAMES.get(self.arch, self.arch),
            rotary_pct=self.rotary_pct,
            window_size=self.window_size if self.window_type else None,
            window_type=self.window_type,
            use_qk_norm=True,
            use_dcmha=self.arch == "dcmha",
        )


# --------------------------------------------------------------------------------------------------
# Which tasks a run trains on, and when
def parse_combos(spec) -> tuple[tuple[str, str], ...]:
    """Excluded combinations as (QK pattern, OV transformation) pairs.

    Args:
        spec: "same-person:superclass,matching-person:country", a sequence of such items, or empty.

    Returns:
        The pairs, e.g. (("same-person", "superclass"), ("matching-person", "country")); () for an empty spec.

    Raises:
        ValueError: An item is not "qk_pattern:ov_transformation".
    """
    if not spec:
        return ()
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    combos = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        if item.count(":") != 1:
            raise ValueError(f"combo {item!r} is not 'qk_pattern:ov_transformation'")
        qk, ov = (s.strip() for s in item.split(":"))
        combos.append((qk, ov))
    return tuple(combos)


def split_tasks(exclude_combos) -> tuple[list[str], list[str]]:
    """The catalog's tasks split by a set of excluded (QK pattern, OV transformation) combinations.

    Args:
        exclude_combos: The combinations, as `parse_combos` takes them.

    Returns:
        (training task ids, held-out task ids).

    Raises:
        ValueError: No task has a combination, or excluding it leaves its pattern or transformation out of training.
    """
    combos = set(parse_combos(exclude_combos))
    tasks = list(load_catalog().tasks.values())
    known = {(t.qk_pattern, t.ov_transformation) for t in tasks}
    if combos - known:
        qk, ov = min(combos - known)
        raise ValueError(
            f"no task combines {qk}:{ov} (QK patterns: {', '.join(QK_PATTERNS)}; "
            f"OV transformations: {', '.join(OV_TRANSFORMATIONS)})"
        )
    kept = [t for t in tasks if (t.qk_pattern, t.ov_transformation) not in combos]
    for qk, ov in combos:
        if not any(t.qk_pattern == qk for t in kept) or not any(t.ov_transformation == ov for t in kept):
            raise ValueError(f"excluding {qk}:{ov} removes the pattern or the transformation from training")
    return [t.id for t in kept], [t.id for t in tasks if t not in kept]


def training_tasks(cfg: TrainConfig) -> tuple[list[str], list[str]]:
    """The tasks a run trains on and the ones it holds out, its curricula checked against them.

    All the catalog's tasks less `exclude_combos`, then only `tasks` if given; the focus tasks and the tasks of every
    focus stage must be among the training tasks, and the stages must end one after the other, after the first focus
    phase, by the end of the run.

    Args:
        cfg: The run's recipe.

    Returns:
        (training task ids, held-out task ids).

    Raises:
        ValueError: One line naming the setting at fault.
    """
    train_ids, held_ids = split_tasks(cfg.exclude_combos)
    if cfg.tasks:
        train_ids = [t for t in train_ids if t in set(cfg.tasks)]
        if not train_ids:
            raise ValueError(f"tasks {list(cfg.tasks)} are all excluded by {list(cfg.exclude_combos)}")
    outside = [t for t in cfg.focus_tasks if t not in train_ids]
    if outside:
        raise ValueError(f"focus tasks (--focus-tasks) {', '.join(outside)} not among the training tasks")
    begins = cfg.focus_until if cfg.focus_tasks else 0.0
    for number, stage in enumerate(cfg.focus_stages):
        stage_tasks, until = focus_stage(stage)
        outside = [t for t in stage_tasks if t not in train_ids]
        if outside:
            raise ValueError(
                f"focus stage (--focus-stages) {stage!r}: {', '.join(outside)} not among the training tasks"
            )
        if not begins < until <= 1:
            after = "the stage before it" if number else "--focus-until" if cfg.focus_tasks else "0"
            raise ValueError(
                f"focus stage (--focus-stages) {stage!r} ends at {until}: it must end after {after} ({begins}) "
                "and at 1 at the latest"
            )
        begins = until
    return train_ids, held_ids


def focus_stage(stage: str) -> tuple[list[str], float]:
    """One focus stage, as `TrainConfig.focus_stages` holds it, read.

    Args:
        stage: "task14,task15@0.3".

    Returns:
        (["task14", "task15"], 0.3): the stage's tasks and the fraction of the steps at which it ends.

    Raises:
        ValueError: One line naming the stage, if it is not "TASKS@UNTIL".
    """
    spec, at, until = stage.rpartition("@")
    stage_tasks = [t.strip() for t in spec.split(",") if t.strip()]
    try:
        fraction = float(until)
    except ValueError:
        fraction = math.nan
    if not at or not stage_tasks or not math.isfinite(fraction):
        raise ValueError(f"focus stage (--focus-stages) {stage!r} is not 'TASKS@UNTIL' (e.g. '14,15@0.3')")
    return stage_tasks, fraction


def parse_focus_stages(spec: str, catalog) -> tuple[str, ...]:
    """The focus stages of the command line (--focus-stages), with the catalog's task ids.

    Args:
        spec: "14,15@0.3;12,13@0.35", the task ids as --tasks takes them.
        catalog: The task catalog the ids are looked up in.

    Returns:
        ("task14,task15@0.3", "task12,task13@0.35").

    Raises:
        ValueError: One line naming the stage at fault.
    """
    stages = []
    for stage in filter(None, (part.strip() for part in spec.split(";"))):
        stage_tasks, until = focus_stage(stage)
        try:
            stage_ids = parse_task_ids(",".join(stage_tasks), catalog)
        except ValueError as e:
            raise ValueError(f"focus stage (--focus-stages) {stage!r}: {e}") from None
        stages.append(f"{','.join(stage_ids)}@{until}")
    return tuple(stages)


def tasks_at(step: int, cfg: TrainConfig, train_ids: list[str] | None) -> list[str] | None:
    """The tasks that step `step` draws its samples from.

    The focus tasks for the first `focus_until` of the steps, then each focus stage's tasks until its fraction of
    the steps, then `train_ids`.

    Args:
        step: The training step.
        cfg: The run's recipe.
        train_ids: The training tasks after the curricula; None for all the catalog's.

    Returns:
        The task ids, or None for all the catalog's.
    """
    if cfg.focus_tasks and step < cfg.focus_until * cfg.steps:
        return list(cfg.focus_tasks)
    for stage in cfg.focus_stages:
        stage_tasks, until = focus_stage(stage)
        if step < until * cfg.steps:
            return stage_tasks
    return train_ids


# --------------------------------------------------------------------------------------------------
# Optimiser and schedule
def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate at a step: linear warmup over `warmup_frac` of the steps, then cosine decay to `min_lr_frac`.

    Args:
        step: The training step, from 0.
        cfg: The run's recipe (lr, warmup_frac, min_lr_frac, steps).

    Returns:
        The learning rate.
    """
    warmup = max(1, round(cfg.warmup_frac * cfg.steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_groups(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """The parameter names of AdamW's two groups, in its order.

    Args:
        model: The model.

    Returns:
        (matrices, which are decayed; norms and biases, which are not).
    """
    named = list(model.named_parameters())
    return [n for n, p in named if p.ndim >= 2], [n for n, p in named if p.ndim < 2]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW as in the paper's App. C, weight decay on the matrices only.

    Args:
        model: The model to train.
        cfg: The run's recipe (lr, betas, weight_decay).

    Returns:
        The optimizer, its groups in `optimizer_groups`'s order.
    """
    import torch

    params = dict(model.named_parameters())
    decay, no_decay = optimizer_groups(model)
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": cfg.weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


# --------------------------------------------------------------------------------------------------
# The recipe as recipe.json and a checkpoint record it
RUN_SETTINGS = ("max_minutes",)  # may differ when a run is continued: they say when it stops, not what it learns


def config_record(cfg: TrainConfig) -> dict:
    """The recipe as recipe.json and the checkpoint store it.

    Args:
        cfg: The run's recipe.

    Returns:
        Its fields as JSON values (tuples as lists).
    """
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


DEFAULT_RECORD = json.loads(json.dumps(dataclasses.asdict(TrainConfig())))


def config_mismatch(saved: dict, cfg: TrainConfig, may_differ: tuple[str, ...] = RUN_SETTINGS) -> str | None:
    """The first setting in which a saved train_config differs from `cfg`, in words.

    A setting the saved record lacks counts as the same where `cfg` has it at its default (a setting added since).

    Args:
        saved: The train_config of a recipe.json or a checkpoint.
        cfg: This run's recipe.
        may_differ: Settings left out of the comparison.

    Returns:
        The difference, as the end of a one-line error; None where there is none.
    """
    now = config_record(cfg)
    for key in [*now, *(k for k in saved if k not in now)]:
        if key in may_differ:
            continue
        if key not in saved:
            if now[key] == DEFAULT_RECORD.get(key):  # a setting added since, which the run left at its default
                continue
            return f"it has no train_config key {key!r} (this run: {key}={now[key]!r})"
        if key not in now:
            return f"its train_config key {key!r} is unknown to this version of dcinterp.train"
        if saved[key] != now[key]:
            return f"it was written with {key}={saved[key]!r}, this run has {key}={now[key]!r}"
    return None
