"""Train small DCPythia-architecture models (DCMHA, and a plain-MHA twin) on the synthetic-task catalog.

    python -m dcinterp.train --arch both --out dcinterp/checkpoints --eval-every 1000

rebuilds the shipped models (the defaults are their recipe: 3 layers, local-global-global, 10,000 steps of
batch 16, both curricula below). It writes `<out>/dcpythia-synth/` (DCMHA) and `<out>/pythia-synth/` (MHA
twin): config.json, model.safetensors, the word-level tokenizer (dcinterp.tokenizer) and recipe.json (command,
seed, steps, tokens seen, final loss, wall time, torch version and the accuracies). From Python:

    from dcinterp.train import TrainConfig, train
    model, recipe = train(TrainConfig(arch="dcmha"), out_dir="runs/dcpythia-synth")

Data. Training samples come from the synthetic-task generator (`dcinterp.synth.generate`) with generation
seeds `1000 + 100000 * seed + k` (k = 0, 1, ...), disjoint from the evaluation seeds (0..999) and from the
released file. Each sample is unbracketed (the answers of lines 3-8 are written plain, as the evaluator feeds
them) and is row-aligned: a training row starts with the sample at position 0, exactly as at evaluation, and
the rest of the row, up to the batch's padded length, is filled with knowledge sentences that state the
relations the tasks need ("The banana is a kind of fruit.", "Paris is the city in France.", "The opposite of
happy is sad.", "2014 is the year just before 2015.", ...). The loss is the next-token loss on every token,
with the answer tokens of lines 3-8 weighted 1 + `answer_weight` (default 20): with the plain loss the answers
are ~3% of the tokens and the random persons and items of the facts dominate the gradient (a plain-loss run
learned markedly slower, see docs/training.md). With row filling there is no padding to mask.

`compact_until` turns on a curriculum: at step 0 every sample is written with compact facts ("Ruth cat." for
"Ruth has a cat.", "cat Ruth." for "The cat is Ruth's.", same lines, queries and answers), and the share of such
samples falls linearly to 0 at that fraction of the steps. With the person next to its item, a previous-token
head suffices to bind them. On task10 alone, a 2-layer model with a 4-token local window and `tied_init` stays
at chance on the released format for 2,750 steps without it and is at 96% after 1,000 steps with it
(docs/training.md).

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
Sec. 4.3); every pattern and transformation must still occur in another task.

Runs for a study. `--seeds 0-4` (or `0,2,5`) trains each seed's DCMHA model and its MHA twin into
`<out>/seed<N>/<name>/`, the twins paired (same data order, same initial shared weights). Each run writes
`checkpoint.pt` every `--checkpoint-every` (`5m`, `300s`, or steps: `500`; written to a temporary file and renamed)
and on Ctrl-C, SIGTERM, `--max-minutes` or `--stop-after`; `--resume` continues from it bit for bit (weights,
AdamW state, schedule position, data stream, every random state). `python -m dcinterp.train summarize RUNS_DIR`
writes the folder's table with the paired differences (`dcinterp.study`).

Optimiser as in the paper's App. C: AdamW (beta 0.9, 0.95), weight decay 0.1 (on matrices, not on norms and
biases), gradient clipping 1.0, linear warmup over 1% of the steps and cosine decay to 10% of the peak rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from .cli import Parser, check_writable_dir
from .synth import data_dir, generate, load_catalog, read_jsonl, unbracket
from .synth.catalog import OV_TRANSFORMATIONS, QK_PATTERNS
from .synth.evaluate import RELEASED_DATA, accuracy_by, evaluate
from .synth.generate import parse_task_ids
from .tokenizer import build_tokenizer

if TYPE_CHECKING:  # torch and the model are imported where they are used, so that `--help` starts fast
    import torch

    from .config import DCFormerConfig
    from .model import HookedDCFormer

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
    arch: str = "dcmha"  # "dcmha" or "mha"
    steps: int = 10000
    seed: int = 0
    batch_size: int = 16
    lr: float = 3e-3
    warmup_frac: float = 0.01  # App. C: 1% warmup
    min_lr_frac: float = 0.1  # App. C: cosine decay to 10% of the peak
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    # model size (DCPythia layout: LN, parallel residual, GELU MLP, QK-norm, local/global layers); the
    # defaults are the shipped recipe: a 4-token local layer, then two global ones (docs/training.md)
    n_layers: int = 3
    d_model: int = 64
    n_heads: int = 4
    d_head: int = 16
    d_mlp: int = 256
    n_ctx: int = 512
    window_size: int = 4
    window_type: str | None = "LGG"
    rotary_pct: float = 1.0
    # data
    samples_per_task: int = 4  # per generator call (one call = one generation seed)
    lines: int = 8
    exclude_combos: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()  # train on these task ids only (default: all 74, less exclude_combos)
    pad_multiple: int = 16
    answer_weight: float = 20.0  # extra loss weight of the answer tokens (lines 3-8); 0 = plain LM loss
    tied_init: bool = True  # initialise the unembedding as the embedding's transpose (then trained apart)
    compact_until: float = 0.5  # compact-facts curriculum: share of compact samples falls 1 -> 0 by this fraction
    compact_hold: float = 0.0  # ... after staying at 1 until this fraction
    focus_tasks: tuple[str, ...] = ("task10", "task11")  # task curriculum: train on these tasks only ...
    focus_until: float = 0.25  # ... for this fraction of the steps, then on all the training tasks
    focus_stages: tuple[str, ...] = ()  # then, stage by stage, "task14,task15@0.3": these tasks only until 0.3
    compose_from: float = 0.25  # DCMHA: the compose is the identity (trains as its MHA twin) until this fraction
    bucket_batches: int = 8  # batches drawn at once and grouped by sample length (less padding, less T^2)
    threads: int = 1  # one thread: on a shared 2-core machine two OpenMP threads spin-wait and run slower
    compile: bool = False  # torch.compile the model: minutes of compilation, then faster steps (docs/training.md)
    max_minutes: float | None = None  # stop early (and say so in the recipe) when the wall time runs out
    log_every: int = 25
    eval_every: int = 0  # every N steps, log the accuracy on a small generated set of the training tasks

    def model_config(self, d_vocab: int) -> DCFormerConfig:
        from .config import DCFormerConfig

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
# Catalog, knowledge sentences, samples
def parse_combos(spec) -> tuple[tuple[str, str], ...]:
    """ "same-person:superclass,matching-person:country" -> (("same-person", "superclass"), ...)."""
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
    """(training task ids, held-out task ids) for a set of excluded (QK pattern, OV) combinations."""
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
    """(training task ids, held-out task ids): all 74 less `exclude_combos`, then only `tasks` if given; the
    focus tasks and the tasks of every focus stage must be among the training tasks, and the stages must end one
    after the other, after the first focus phase, by the end of the run."""
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
    """ "task14,task15@0.3" -> (["task14", "task15"], 0.3); ValueError (one line, naming the stage) if malformed."""
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
    """ "14,15@0.3;12,13@0.35" (task ids as --tasks takes them) -> ("task14,task15@0.3", "task12,task13@0.35")."""
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
    """The tasks that step `step` draws its samples from: the focus tasks for the first `focus_until` of the steps,
    then each focus stage's tasks until its fraction of the steps, then `train_ids` (None: all the catalog's)."""
    if cfg.focus_tasks and step < cfg.focus_until * cfg.steps:
        return list(cfg.focus_tasks)
    for stage in cfg.focus_stages:
        stage_tasks, until = focus_stage(stage)
        if step < until * cfg.steps:
            return stage_tasks
    return train_ids


def knowledge_sentences() -> list[str]:
    """Plain sentences stating the relations the tasks use (superclass, capability, country, opposite, order)."""
    lex = json.loads((data_dir() / "lexicon.json").read_text())
    out = []
    for name, obj in lex["objects"].items():
        if obj.get("superclass"):
            out.append(f"The {name} is a kind of {obj['superclass']}.")
        if obj.get("capability"):
            out.append(f"The {name} is the thing that can {obj['capability']}.")
    for country, cities in lex["countries"].items():
        for city in cities:
            out.append(f"{city} is the city in {country}.")
    for a, b in lex["adjective_opposites"]:
        out.append(f"The opposite of {a} is {b}.")
        out.append(f"The opposite of {b} is {a}.")
    for domain in lex["ordinal_domains"]:
        seq, unit = domain["sequence"], domain["unit"]
        for x, y in zip(seq, seq[1:], strict=False):
            out.append(f"{x} is the {unit} just before {y}.")
            out.append(f"{y} is the {unit} just after {x}.")
    return out


def unbracket_spans(text: str) -> tuple[str, list[tuple[int, int]]]:
    """The sample as the model reads it (`[ answer ]` written as `answer`) and the answers' character spans."""
    plain, spans = unbracket(text)
    return plain, [(a, b) for a, b, *_ in spans]


def unbracket_text(text: str) -> str:
    return unbracket_spans(text)[0]


def compact_catalog(catalog):
    """The catalog with every context fact written bare, `{person} {item}.` or `{item} {person}.`, in the order
    of the task's own syntax ("Ruth has a cat." -> "Ruth cat.", "The cat is Ruth's." -> "cat Ruth.")."""

    def compact(syntax):
        if syntax.shape.name != "context":
            return syntax
        person_first = syntax.fact.index("{person}") < syntax.fact.index("{item")
        return dataclasses.replace(syntax, fact="{person} {item}." if person_first else "{item} {person}.")

    tasks = {task_id: dataclasses.replace(task, syntax=compact(task.syntax)) for task_id, task in catalog.tasks.items()}
    return dataclasses.replace(catalog, tasks=tasks)


def compact_share_at(step: int, cfg: TrainConfig) -> float:
    """The probability that a training sample is written with compact facts: 1 until `compact_hold` of the steps,
    then falling linearly to 0 at `compact_until` of the steps (0 turns the curriculum off)."""
    hold, end = cfg.compact_hold * cfg.steps, cfg.compact_until * cfg.steps
    if end <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - (step - hold) / (end - hold))) if end > hold else float(step < end)


class SampleStream:
    """(unbracketed sample, answer spans) forever: generator seeds 1000 + 100000 * seed + k, chunks shuffled.

    Each sample is written with compact facts with probability `compact_share()` (the same lines, see
    `compact_catalog`), else in the released format. A chunk (one generation seed) is drawn when the previous one
    is used up, of the tasks `tasks_at(step(), cfg, task_ids)`: with `step`, the training step under way, the
    focus tasks, then each focus stage's, then `task_ids`. Without it, `focus()` says whether the first focus
    phase is on (the focus tasks) or over (`task_ids`). Where the stream stands is `state_dict()`: the next
    generation seed and the samples of the current chunk not yet drawn; `rng` is the caller's and saved by it."""

    def __init__(
        self,
        cfg: TrainConfig,
        task_ids: list[str] | None,
        rng: random.Random,
        compact_share: Callable[[], float] = lambda: 0.0,
        focus: Callable[[], bool] = lambda: False,
        step: Callable[[], int] | None = None,
    ):
        self.cfg, self.task_ids, self.rng = cfg, task_ids, rng
        self.compact_share = compact_share
        self.step = step if step is not None else lambda: 0 if focus() else cfg.steps
        self.released, self.compact = load_catalog(), None
        self.next_chunk = 0  # k of the next generation seed
        self.pending: list[tuple[str, list[tuple[int, int]]]] = []  # the current chunk, last to draw first

    def __iter__(self) -> SampleStream:
        return self

    def __next__(self) -> tuple[str, list[tuple[int, int]]]:
        if not self.pending:
            self.pending = self._chunk()[::-1]
            self.next_chunk += 1
        return self.pending.pop()

    def _chunk(self) -> list[tuple[str, list[tuple[int, int]]]]:
        cfg = self.cfg
        seed = TRAIN_SEED_BASE + 100_000 * cfg.seed + self.next_chunk
        ids = tasks_at(self.step(), cfg, self.task_ids)
        records = generate(seed, cfg.samples_per_task, ids, lines=cfg.lines, catalog=self.released)
        if self.compact_share() > 0:
            self.compact = self.compact or compact_catalog(self.released)
            short = generate(seed, cfg.samples_per_task, ids, lines=cfg.lines, catalog=self.compact)
            records = [
                s if self.rng.random() < self.compact_share() else r for r, s in zip(records, short, strict=True)
            ]
        texts = [unbracket_spans(r["texts"]) for r in records]
        self.rng.shuffle(texts)
        return texts

    def state_dict(self) -> dict:
        return {"next_chunk": self.next_chunk, "pending": list(self.pending)}

    def load_state_dict(self, state: dict) -> None:
        self.next_chunk = state["next_chunk"]
        self.pending = [(text, [tuple(span) for span in spans]) for text, spans in state["pending"]]


class Batcher:
    """Rows = one sample at position 0 + knowledge sentences filling up to the batch's padded length.

    Samples are grouped by length (`bucket_batches` batches at a time), so a batch is about as long as its
    samples: attention (and DCMHA's composition) costs grow with the square of the length."""

    def __init__(self, tokenizer, samples: Iterable[str], cfg: TrainConfig, rng: random.Random):
        self.tok, self.samples, self.cfg, self.rng = tokenizer, iter(samples), cfg, rng
        self.knowledge = [self.tok(s + "\n")["input_ids"] for s in knowledge_sentences()]
        self.order: list[int] = []  # knowledge sentences still to use in this cycle, last first
        self.pending: list[list[tuple[list[int], list[bool]]]] = []  # encoded batches still to return, last first

    def _knowledge_ids(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if not self.order:
                self.order = list(range(len(self.knowledge)))
                self.rng.shuffle(self.order)
            out.extend(self.knowledge[self.order.pop()])
        return out[:n]

    def _refill(self) -> None:
        """Draw `bucket_batches` batches' worth of samples, group them by length, shuffle the batch order."""
        B = self.cfg.batch_size
        pool = [self._encode(next(self.samples)) for _ in range(B * max(1, self.cfg.bucket_batches))]
        pool.sort(key=lambda r: len(r[0]))
        batches = [pool[i : i + B] for i in range(0, len(pool), B)]
        self.rng.shuffle(batches)
        self.pending = batches

    def _encode(self, sample) -> tuple[list[int], list[bool]]:
        """Token ids and, per token, whether it belongs to an answer (lines 3-8)."""
        text, spans = (sample, []) if isinstance(sample, str) else sample
        enc = self.tok(text, return_offsets_mapping=True)
        answer = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
        return enc["input_ids"], answer

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [batch, pos], answer mask [batch, pos]: the token is an answer token)."""
        import torch

        if not self.pending:
            self._refill()
        rows = self.pending.pop()
        m = self.cfg.pad_multiple
        width = min(self.cfg.n_ctx, -(-max(len(r[0]) for r in rows) // m) * m)
        ids = [r[0][:width] + self._knowledge_ids(width - len(r[0][:width])) for r in rows]
        answer = [r[1][:width] + [False] * (width - len(r[1][:width])) for r in rows]
        return torch.tensor(ids, dtype=torch.long), torch.tensor(answer, dtype=torch.bool)

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        return {"order": list(self.order), "pending": [list(batch) for batch in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        self.order = list(state["order"])
        self.pending = [[(list(ids), list(answer)) for ids, answer in batch] for batch in state["pending"]]


# --------------------------------------------------------------------------------------------------
# Optimiser and schedule
def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_frac of the steps, then cosine decay to min_lr_frac of the peak."""
    warmup = max(1, round(cfg.warmup_frac * cfg.steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_groups(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """The parameter names of AdamW's two groups, in its order: matrices (decayed), then norms and biases."""
    named = list(model.named_parameters())
    return [n for n, p in named if p.ndim >= 2], [n for n, p in named if p.ndim < 2]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    import torch

    params = dict(model.named_parameters())
    decay, no_decay = optimizer_groups(model)
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": cfg.weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


# --------------------------------------------------------------------------------------------------
# Checkpoints: a run stopped and continued is the run that never stopped
CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_FORMAT = "dcinterp.train checkpoint 1"
RUN_SETTINGS = ("max_minutes",)  # may differ when a run is continued: they say when it stops, not what it learns


class ResumeError(ValueError):
    """A checkpoint that cannot be continued: missing, unreadable, or written by another recipe (one line)."""


class RunInterrupted(Exception):
    """Ctrl-C or SIGTERM stopped the run after the step under way; the message says where its checkpoint is."""


@dataclass
class CheckpointEvery:
    """How often a run writes its checkpoint: every `steps` steps, or every `seconds` of wall time."""

    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, spec: str) -> CheckpointEvery:
        """'500' -> every 500 steps; '300s', '5m', '1h' -> every so much wall time."""
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
        if self.steps is not None:
            return steps_done % self.steps == 0
        return seconds_since_last >= self.seconds


@dataclass
class Progress:
    """What a run has done so far (saved in its checkpoint)."""

    step: int = 0  # steps done
    tokens_seen: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)  # each step's mean next-token loss
    answer_losses: list[float] = dataclasses.field(default_factory=list)  # each step's answer-token loss
    history: list[dict] = dataclasses.field(default_factory=list)  # the log entries, every `log_every` steps
    elapsed_s: float = 0.0  # wall time of the sessions before this one
    resumed_at: list[int] = dataclasses.field(default_factory=list)  # the steps it was continued from
    started_from: dict | None = None  # --start-from: the start's checkpoint, its step and its answer loss


def config_record(cfg: TrainConfig) -> dict:
    """The TrainConfig as recipe.json and the checkpoint store it (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


DEFAULT_RECORD = json.loads(json.dumps(dataclasses.asdict(TrainConfig())))


def config_mismatch(saved: dict, cfg: TrainConfig, may_differ: tuple[str, ...] = RUN_SETTINGS) -> str | None:
    """The first setting (other than `may_differ`) in which a saved train_config differs from `cfg`, in words."""
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


def read_checkpoint(path: Path, option: str = "--resume") -> dict:
    """The checkpoint at `path`; ResumeError (one line, naming `option` and the file) if it is not one."""
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
    """The checkpoint at `path`, checked to be of the run `cfg` describes; ResumeError (one line) if not."""
    checkpoint = read_checkpoint(path)
    mismatch = config_mismatch(checkpoint["train_config"], cfg)
    if mismatch:
        raise ResumeError(f"--resume: {path} is another run's checkpoint: {mismatch}")
    return checkpoint


def save_checkpoint(path: Path, checkpoint: dict) -> None:
    """Write to a temporary file beside `path`, then rename: a checkpoint on disk is never half written."""
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
    """The mean answer-token loss of the checkpoint's last SCREEN_STEPS steps."""
    losses = checkpoint["progress"]["answer_losses"][-SCREEN_STEPS:]
    return round(sum(losses) / len(losses), 4) if losses else None


def load_start(path: Path, cfg: TrainConfig) -> dict:
    """The checkpoint at `path`, another run's (stopped with --stop-after), checked to be the beginning of the run
    `cfg` describes: the same recipe but for START_MAY_DIFFER, stopped while the two runs are still the same run
    (before the compose trains when the architectures differ, within the focus phase when the excluded
    combinations differ, before the first step that draws other tasks when the focus stages differ); this run's MLP
    may be wider (`widen_mlp`). ResumeError (one line naming the file) if not."""
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
    """The start's MLP tensor `name` in this run's wider MLP: the start's hidden units first, then the new ones, which
    keep this run's initialisation in W_in and b_in and are 0 in W_out (and in every AdamW moment, `moment`), so
    that the widened model computes what its start did (a parameter-matched twin begins as its start)."""
    import torch

    suffix = next((key for key in MLP_AXES if name.endswith(key)), None)
    if suffix is None or start.ndim != own.ndim:
        raise ResumeError(f"--start-from: the start's {name} is {list(start.shape)}, this run's {list(own.shape)}")
    widened = torch.zeros_like(own) if moment or suffix == "mlp.W_out" else own.clone()
    widened.narrow(MLP_AXES[suffix], 0, start.shape[MLP_AXES[suffix]]).copy_(start)
    return widened


def take_start(checkpoint: dict, model: HookedDCFormer, opt: torch.optim.AdamW) -> None:
    """The start's weights and AdamW state, by parameter name, into this run's model and optimizer. The compose's
    parameters (`W_dyn_*`, DCMHA only) keep this run's initialisation when the start has none (an MHA start) and
    are dropped when this run has none: they have not trained in either run yet (`load_start`). A wider MLP than the
    start's takes the start's hidden units and keeps its own new ones (`widen_mlp`)."""
    from .model import HookedDCFormer

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
    """Every random state a run may draw from: the data's own generator, python's, numpy's and torch's."""
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
    import numpy as np
    import torch

    data_rng.setstate(states["data"])
    random.setstate(states["python"])
    kind, key, pos, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((kind, np.array(key, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch"])


@contextmanager
def stop_requests() -> Iterator[list[str]]:
    """Ctrl-C or SIGTERM while training: the list gets the signal's name, and the loop stops after the step under
    way (a second Ctrl-C stops at once). Outside the main thread signals cannot be caught: the list stays empty."""
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
    """Train one model; returns (model, recipe), and writes them to `out_dir` if given.

    With `out_dir`, the run writes `out_dir/checkpoint.pt` (model, optimizer, step, every random state, where the
    data stream stands, the loss log) every `checkpoint_every` ("500": steps; "300s", "5m": wall time), and when it
    stops early: after `stop_after` steps in all, when `max_minutes` run out, or on Ctrl-C / SIGTERM (after the step
    under way; then RunInterrupted is raised). `resume=True` continues from that checkpoint, and the run ends bit for
    bit as the run that never stopped. A run that stops early writes its model and a recipe with `stopped_early`, not
    evaluated; a finished run writes its model and recipe, evaluated, and then removes its checkpoint.

    `start_from`, the checkpoint of another run of the recipe (`load_start`: the MHA twin stopped at the end of the
    focus phase, say), begins this run where that one stopped: bit for bit the run that began at step 0."""
    import torch

    from .model import HookedDCFormer

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
    """The log line of the last `log_every` steps: mean loss (and answer loss), learning rate, tokens, time."""
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
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    write_recipe(recipe, out_dir)


def write_recipe(recipe: dict, out_dir: Path) -> None:
    """recipe.json, written to a temporary file and renamed (never half written)."""
    partial = Path(out_dir) / "recipe.json.partial"
    partial.write_text(json.dumps(recipe, indent=2) + "\n")
    os.replace(partial, Path(out_dir) / "recipe.json")


# --------------------------------------------------------------------------------------------------
# Evaluation (dcinterp.synth.evaluate)
def probe_accuracy(model: HookedDCFormer, records: list[dict]) -> float:
    """Accuracy on `records` (the `eval_every` probe: seed EVAL_SEED, PROBE_SAMPLES_PER_TASK per training task)."""
    import torch

    model.eval()
    with torch.no_grad():
        df = evaluate(model, records, batch_size=16, progress=False)
    model.train()
    return round(float(df["correct"].mean()), 4)


def _accuracy(df, task_ids=None) -> dict:
    if task_ids is not None:
        df = df[df["task"].isin(set(task_ids))]
    answers = len(df)
    samples = df.groupby(["task", "sample"]).ngroups if "sample" in df.columns else None
    out = {"accuracy": round(float(df["correct"].mean()), 4) if answers else None, "answers": int(answers)}
    if samples is not None:
        out["samples"] = int(samples)
    out["correct"] = int(df["correct"].sum())
    return out


def accuracy_report(model: HookedDCFormer, held_task_ids=(), batch_size: int = 16) -> dict:
    """Accuracy on the released file, a fresh held-out set (seed 0, 12 per task) and the small test set."""
    import torch

    sets = {
        "released": read_jsonl(data_dir() / RELEASED_DATA),
        f"generated_seed{EVAL_SEED}": generate(EVAL_SEED, 12),
        "test_set": generate(TEST_SET["seed"], TEST_SET["samples_per_task"]),
    }
    report = {}
    for name, records in sets.items():
        with torch.no_grad():
            df = evaluate(model, records, batch_size=batch_size, progress=False)
        entry = _accuracy(df)
        for key, column in (
            ("per_task", "task"),
            ("by_qk_pattern", "qk_pattern"),
            ("by_ov_transformation", "ov_transformation"),
        ):
            entry[key] = {k: round(v, 3) for k, v in accuracy_by(df, column).items()}
        if held_task_ids:
            entry["held_out_combos"] = _accuracy(df, held_task_ids)
        else:  # the same tasks, for comparison with a model trained without them
            entry["default_combo_tasks"] = _accuracy(df, split_tasks(",".join(DEFAULT_EXCLUDED_COMBOS))[1])
        report[name] = entry
    report["test_set"]["definition"] = (
        f"generate(seed={TEST_SET['seed']}, samples_per_task={TEST_SET['samples_per_task']}), "
        "accuracy per answer (6 per sample) from dcinterp.synth.evaluate"
    )
    return report


# --------------------------------------------------------------------------------------------------
# Command line
def parse_args(argv=None) -> argparse.Namespace:
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
        help="torch.compile the model: about 10 minutes of compilation on a busy 2-core CPU, then steps about a "
        "quarter faster; pays for runs of thousands of steps (the float results differ slightly from eager)",
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
    print(f"python -m dcinterp.train: error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_seeds(spec: str) -> list[int]:
    """'0-4' -> [0, 1, 2, 3, 4]; '0,2,5' -> [0, 2, 5]; '0-2,7' -> [0, 1, 2, 7]."""
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
    """One model of a sweep: its settings, its folder, and what `--resume` finds there."""

    cfg: TrainConfig
    out_dir: Path
    name: str
    # "new", "stopped" (a checkpoint to continue), "finished" (a recipe.json, no checkpoint), or "other" (the
    # recipe.json of a run with other settings, which --resume does not overwrite: the mismatch says which)
    state: str = "new"
    mismatch: str | None = None
    start: Path | None = None  # --start-from: the checkpoint a new run begins from


def plan_runs(args: argparse.Namespace, arches, task_ids, focus_ids) -> list[Run]:
    """The runs of the command, seed by seed (DCMHA, then its MHA twin), each with its state on disk."""
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
    """The one checkpoint in `START_DIR/seed<N>/<name>/` (`START_DIR/<name>/` without --seeds); ValueError if not."""
    folder = start_dir / f"seed{seed}" if seed is not None else start_dir
    found = sorted(folder.glob(f"*/{CHECKPOINT_FILE}"))
    if len(found) != 1:
        what = "no checkpoint" if not found else f"{len(found)} checkpoints ({', '.join(map(str, found))})"
        raise ValueError(f"--start-from {start_dir}: {what} in {folder}/<run>/, expected one")
    return found[0]


def screen(runs: list[Run], out: Path, threshold: float | None, sweep: bool) -> list[Run]:
    """The runs to train: those whose start (checked by `load_start`) formed the lookup when a threshold is given.
    A seed screened out is written to `OUT/seed<N>/screened_out.json` and said in one line."""
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
    """(Run.state, Run.mismatch) of the run `cfg` describes, from what its folder holds."""
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
    """With --resume: every checkpoint is of its run, and there is at least one checkpoint or finished run.
    Without: no run would start over a stopped run's checkpoint. ValueError (one line) otherwise."""
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
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["summarize"]:
        from .study import main as summarize_main

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
    from .loading import CheckpointError

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
    """--eval-only: evaluate the model in the run's folder and write the accuracies into its recipe.json."""
    import torch

    from .model import HookedDCFormer

    torch.set_num_threads(args.threads)
    model = HookedDCFormer.from_pretrained(run.out_dir)
    recipe = json.loads((run.out_dir / "recipe.json").read_text())
    _, held = split_tasks(args.exclude_combos or recipe["data"].get("excluded_combos") or ())
    recipe["accuracy"] = accuracy_report(model, held)
    write_recipe(recipe, run.out_dir)
    print(json.dumps({run.name: summarize(recipe)}, indent=2))


def summarize(recipe: dict) -> dict:
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
