"""What "the mean" of mean ablation is over ragged batches, and how much the choice moves the effects.

    python benchmarks/mean_ablation_rules.py [--pairs 2] [--markdown]

The clean prompts of `--pairs` contrast pairs of every same-person task (the family of the case study; prompts of
different templates and lengths, right-padded), `dcpythia-synth`, target the clean answer's log-probability at its
position; `branch_ablation(..., ablation="mean")` of every (layer, stage, branch) under four rules:
- "pads counted": the per-position mean over every prompt, pad tokens included (dcinterp before #24);
- "position": the per-position mean over the prompts that have a real token there (the default);
- "position, per task": the same, over the prompts of the same task only (`templates=task ids`);
- "token": the mean over all real tokens, the same at every position (`mean_over="token"`).
Prints one row per component and the largest differences between the rules.
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

from dcinterp import HookedDCFormer
from dcinterp.patching import branch_ablation
from dcinterp.synth import contrast_pairs, tokenize_pairs
from dcinterp.synth.catalog import load_catalog


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2, help="pairs per task")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    catalog = load_catalog()
    tasks = [task_id for task_id, task in catalog.tasks.items() if task.qk_pattern == "same-person"]
    pairs = [p for task in tasks for p in contrast_pairs(task, n=args.pairs, seed=0, tokenizer=model.tokenizer)]
    tokens = tokenize_pairs(pairs, model.tokenizer)
    lengths = tokens.position + 1
    print(
        f"{len(tasks)} same-person tasks x {args.pairs} prompts: {int(lengths.min())} to {int(lengths.max())} "
        f"tokens, right-padded to {tokens.clean.shape[1]}"
    )
    common = dict(position=tokens.position, target_type="logprob", ablation="mean")
    rules = {
        "pads counted": dict(lengths=torch.full_like(lengths, tokens.clean.shape[1])),
        "position": {},
        "position, per task": dict(templates=[p.task_id for p in pairs]),
        "token": dict(mean_over="token"),
    }
    frames = {
        name: branch_ablation(model, tokens.clean, tokens.clean_answer, **common, **extra)
        for name, extra in rules.items()
    }
    table = frames["position"][["layer", "stage", "branch"]].copy()
    for name, frame in frames.items():
        table[name] = frame["effect"].round(3)
    zero = branch_ablation(model, tokens.clean, tokens.clean_answer, position=tokens.position, target_type="logprob")
    table["zero"] = zero["effect"].round(3)
    if args.markdown:
        print("| " + " | ".join(table.columns) + " |\n|" + "---|" * len(table.columns))
        for row in table.itertuples(index=False):
            print("| " + " | ".join(str(v) for v in row) + " |")
    else:
        print(table.to_string(index=False))
    print()
    for a, b in [("pads counted", "position"), ("position", "position, per task"), ("position", "token")]:
        diff = (table[a] - table[b]).abs()
        row = table.loc[diff.idxmax()]
        print(
            f"{a} vs {b}: largest difference {diff.max():.3f} (layer {row.layer} {row.stage} {row.branch}: "
            f"{row[a]:.3f} vs {row[b]:.3f}), mean {diff.mean():.3f}; "
            f"rank correlation {pd.Series(table[a]).corr(table[b], method='spearman'):.3f}"
        )


if __name__ == "__main__":
    main()
