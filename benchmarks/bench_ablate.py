"""Speed of `synth ablate` (the post-hoc Table 9): one evaluation per ablation with the branch outputs zeroed, as the
command ran before, against `ablation_table` (dynamic weights zeroed on the compose's no-hook path, each ablation
started from the unablated stream entering its first ablated layer).

    python benchmarks/bench_ablate.py [--checkpoint dcpythia-synth] [--limit N] [--batch-size 8] [--threads N]
                                      [--layers L]

The samples (default: the 888 released ones) are cut into the batches `evaluate` forms (longest first). Batch by
batch, in turns whose order rotates, the same batch is scored three ways: one unhooked `evaluate` (what one plain
evaluation costs, so that 15 ablations read against 15 evaluations), the table as `synth ablate` computed it before
(`evaluate` under `ablation_hooks`, one ablation after the other) and `ablation_table`. Taking turns batch by batch
keeps a shared machine's load out of the ratios. Each batch's two tables are compared: which rows are equal bit for
bit, and the largest differences of accuracy and perplexity (float32 rounding of the compose's sum in another order).
`--layers L`: a random model of the checkpoint's shape and tokenizer with L layers instead (its scores mean nothing,
its time does: on a deep model the L per-layer ablations start further in, so they cost about (L + 1) / 2 forwards).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import pandas as pd
import torch

from dcinterp import HookedDCFormer
from dcinterp.patching import ablation_hooks
from dcinterp.synth.commands.ablate import ablation_table, ablations, label
from dcinterp.synth.evaluate import encode_all, evaluate, load_samples, resolve_data_path, sample_batches, summarize


def branch_output_table(model, samples, batch_size: int) -> pd.DataFrame:
    """The table as `synth ablate` computed it before: `evaluate` under `ablation_hooks` per ablation."""
    rows = []
    for component in ablations(model):
        hooks = [] if component is None else ablation_hooks(component)
        with model.hooks(fwd_hooks=hooks):
            results = evaluate(model, samples, batch_size=batch_size, name=label(component), progress=False)
        (summary,) = summarize(results).values()
        row = {"ablated": label(component), "accuracy": summary["accuracy"], "ppl": summary["ppl"]}
        row.update({f"qk:{key}": value for key, value in summary["by_qk_pattern"].items()})
        row.update({f"ov:{key}": value for key, value in summary["by_ov_transformation"].items()})
        rows.append(row)
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="dcpythia-synth")
    parser.add_argument("--limit", type=int, help="only the first N released samples (default: all 888)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--layers", type=int, help="a random model of the checkpoint's shape with this many layers")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = HookedDCFormer.from_pretrained(args.checkpoint).eval()
    if args.layers:
        torch.manual_seed(0)
        cfg = dataclasses.replace(model.cfg, n_layers=args.layers, model_name=f"random, {args.layers} layers")
        model = HookedDCFormer(cfg, model.tokenizer).eval()
    samples = load_samples(resolve_data_path("released"))[: args.limit]
    batches = [
        [samples[i] for i in batch] for batch in sample_batches(encode_all(model, samples, "-"), args.batch_size)
    ]
    n_ablations = len(ablations(model))
    print(
        f"{model.cfg.model_name}: {len(samples)} samples in {len(batches)} batches of {args.batch_size}, {n_ablations} "
        f"ablations (the full model included), {torch.get_num_threads()} threads; load {os.getloadavg()[0]:.1f}"
    )
    ways = {
        "plain": lambda batch: evaluate(model, batch, batch_size=args.batch_size, progress=False),
        "before": lambda batch: branch_output_table(model, batch, args.batch_size),
        "now": lambda batch: ablation_table(model, batch, batch_size=args.batch_size, progress=False),
    }
    seconds = dict.fromkeys(ways, 0.0)
    identical, accuracy_gap, ppl_gap = None, 0.0, 0.0
    for b, batch in enumerate(batches):
        names = list(ways)[b % 3 :] + list(ways)[: b % 3]
        result = {}
        for name in names:
            start = time.perf_counter()
            result[name] = ways[name](batch)
            seconds[name] += time.perf_counter() - start
        old, new = result["before"], result["now"]
        assert list(old["ablated"]) == list(new["ablated"])
        columns = [c for c in old.columns if c != "ablated"]
        equal = {old.loc[r, "ablated"] for r in range(len(old)) if all(old.loc[r, c] == new.loc[r, c] for c in columns)}
        identical = equal if identical is None else identical & equal
        accuracy = [c for c in columns if c != "ppl"]
        accuracy_gap = max(accuracy_gap, float((old[accuracy] - new[accuracy]).abs().to_numpy().max()))
        ppl_gap = max(ppl_gap, float(((old["ppl"] - new["ppl"]).abs() / old["ppl"]).max()))

    plain = seconds["plain"]
    print(f"one plain evaluation                    {plain:7.1f} s  (x {n_ablations}: {n_ablations * plain:.1f} s)")
    for name, what in (("before", "before: branch outputs zeroed"), ("now", "ablation_table")):
        print(
            f"{what:38s} {seconds[name]:7.1f} s  {seconds[name] / (n_ablations * plain):.2f}x {n_ablations} evaluations"
        )
    print(
        f"ablation_table is {seconds['before'] / seconds['now']:.2f}x faster; load at the end {os.getloadavg()[0]:.1f}"
    )
    print(f"rows equal bit for bit in every batch: {', '.join(r for r in old['ablated'] if r in identical)}")
    print(f"largest accuracy difference (any column, any batch): {accuracy_gap:.3g}")
    print(f"largest relative perplexity difference: {ppl_gap:.3g}")


if __name__ == "__main__":
    main()
