"""A trained model's accuracy: the probe logged during training and the report written into recipe.json.

The one module of `dcinterp.train` that scores with `dcinterp.synth.evaluate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..synth import data_dir, generate, read_jsonl
from ..synth.evaluate import RELEASED_DATA, accuracy_by, evaluate
from .recipe import DEFAULT_EXCLUDED_COMBOS, EVAL_SEED, TEST_SET, split_tasks

if TYPE_CHECKING:
    from ..model import HookedDCFormer


def probe_accuracy(model: HookedDCFormer, records: list[dict]) -> float:
    """The accuracy logged every `eval_every` steps; the model is left in train mode.

    Args:
        model: The model being trained.
        records: The probe: seed EVAL_SEED, PROBE_SAMPLES_PER_TASK samples per training task.

    Returns:
        The share of answers right, rounded to 4 decimals.
    """
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
    """A trained model's accuracies, as recipe.json holds them.

    On the released file, a fresh held-out set (seed EVAL_SEED, 12 samples per task) and the small test set
    (`TEST_SET`): overall, per task, by QK pattern and by OV transformation, and on the held-out tasks (or, for a
    model trained on every task, on the tasks the default exclusion leaves out, for comparison).

    Args:
        model: The model.
        held_task_ids: The tasks the run held out; empty for a model trained on every task.
        batch_size: Samples per forward.

    Returns:
        One entry per set, with the test set's definition.
    """
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
