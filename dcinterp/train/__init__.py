"""Train small DCPythia-architecture models (DCMHA, and a plain-MHA twin) on the synthetic-task catalog.

    python -m dcinterp.train --arch both --out dcinterp/checkpoints --eval-every 1000

rebuilds the shipped models (the defaults are their recipe: 3 layers, local-global-global, 10,000 steps of
batch 16, both curricula of `recipe`). It writes `<out>/dcpythia-synth/` (DCMHA) and `<out>/pythia-synth/` (MHA
twin): config.json, model.safetensors, the word-level tokenizer (dcinterp.tokenizer) and recipe.json (command,
seed, steps, tokens seen, final loss, wall time, torch version and the accuracies). From Python:

    from dcinterp.train import TrainConfig, train
    model, recipe = train(TrainConfig(arch="dcmha"), out_dir="runs/dcpythia-synth")

Runs for a study. `--seeds 0-4` (or `0,2,5`) trains each seed's DCMHA model and its MHA twin into
`<out>/seed<N>/<name>/`, the twins paired (same data order, same initial shared weights). Each run writes
`checkpoint.pt` every `--checkpoint-every` (`5m`, `300s`, or steps: `500`; written to a temporary file and renamed)
and on Ctrl-C, SIGTERM, `--max-minutes` or `--stop-after`; `--resume` continues from it bit for bit (weights,
AdamW state, schedule position, data stream, every random state). `python -m dcinterp.train summarize RUNS_DIR`
writes the folder's table with the paired differences (`dcinterp.study`).

The package, in the order it imports:

    recipe          TrainConfig (the recipe's settings and defaults), the tasks a step draws from, the optimiser
    data            the stream of training samples and the batches made of them
    checkpointing   checkpoints, resumption, shared starts (--start-from), random states
    evaluation      the probe accuracy and the accuracy report (scored by dcinterp.synth.evaluate)
    loop            train(): the training loop, its signals, and recipe.json
    __main__        the command line (python -m dcinterp.train); not imported by this package
"""

from .checkpointing import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    MLP_AXES,
    SCREEN_STEPS,
    START_MAY_DIFFER,
    CheckpointEvery,
    Progress,
    ResumeError,
    RunInterrupted,
    load_checkpoint,
    load_start,
    random_states,
    read_checkpoint,
    save_checkpoint,
    set_random_states,
    start_answer_loss,
    take_start,
    widen_mlp,
)
from .data import (
    Batcher,
    SampleStream,
    compact_catalog,
    compact_share_at,
    knowledge_sentences,
    unbracket_spans,
    unbracket_text,
)
from .evaluation import accuracy_report, probe_accuracy
from .loop import log_entry, make_recipe, save, stop_requests, train, write_recipe
from .recipe import (
    ARCH_NAMES,
    DEFAULT_EXCLUDED_COMBOS,
    DEFAULT_RECORD,
    EVAL_SEED,
    PROBE_SAMPLES_PER_TASK,
    RUN_SETTINGS,
    TEST_SET,
    TRAIN_SEED_BASE,
    TrainConfig,
    config_mismatch,
    config_record,
    focus_stage,
    lr_at,
    make_optimizer,
    optimizer_groups,
    parse_combos,
    parse_focus_stages,
    split_tasks,
    tasks_at,
    training_tasks,
)

__all__ = [
    "ARCH_NAMES",
    "CHECKPOINT_FILE",
    "CHECKPOINT_FORMAT",
    "DEFAULT_EXCLUDED_COMBOS",
    "DEFAULT_RECORD",
    "EVAL_SEED",
    "MLP_AXES",
    "PROBE_SAMPLES_PER_TASK",
    "RUN_SETTINGS",
    "SCREEN_STEPS",
    "START_MAY_DIFFER",
    "TEST_SET",
    "TRAIN_SEED_BASE",
    "Batcher",
    "CheckpointEvery",
    "Progress",
    "ResumeError",
    "RunInterrupted",
    "SampleStream",
    "TrainConfig",
    "accuracy_report",
    "compact_catalog",
    "compact_share_at",
    "config_mismatch",
    "config_record",
    "focus_stage",
    "knowledge_sentences",
    "load_checkpoint",
    "load_start",
    "log_entry",
    "lr_at",
    "make_optimizer",
    "make_recipe",
    "optimizer_groups",
    "parse_combos",
    "parse_focus_stages",
    "probe_accuracy",
    "random_states",
    "read_checkpoint",
    "save",
    "save_checkpoint",
    "set_random_states",
    "split_tasks",
    "start_answer_loss",
    "stop_requests",
    "take_start",
    "tasks_at",
    "train",
    "training_tasks",
    "unbracket_spans",
    "unbracket_text",
    "widen_mlp",
    "write_recipe",
]
