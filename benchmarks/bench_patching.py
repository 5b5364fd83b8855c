"""Attribution patching against exhaustive activation patching on the embedded DCFormer: time and rank agreement.

    python benchmarks/bench_patching.py [--tasks 2,10,18,34] [--pairs 4] [--direction noising] [--threads 1]

On contrast pairs of the given tasks (the queried person swapped, `dcinterp.synth.contrast_pairs`), it runs
  exact:       `activation_patching` of every (layer, stage, site, head): one forward pass per row,
  attribution: `attribution_patching` of the same rows: one forward+backward and one forward in all, with
               softmax="linear" (first order) and "exact" (pre-compose sites carried through the softmax),
for the per-site table and the per-head table, and prints the time ratio (exact / attribution), the rank
agreement (Spearman's rho) of the two effects over all rows and over the --top rows exact patching finds largest,
and how many of those --top rows are among attribution patching's --top.
"""

from __future__ import annotations

import argparse
import time

import torch
from scipy.stats import spearmanr

from dcinterp import HookedDCFormer
from dcinterp.patching import activation_patching, attribution_patching
from dcinterp.synth import contrast_pairs, tokenize_pairs


def timed(function):
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="dcpythia-synth")
    parser.add_argument("--tasks", default="2,10,18,34", help="comma separated task ids (same-person by default)")
    parser.add_argument("--pairs", type=int, default=4, help="contrast pairs per task")
    parser.add_argument("--direction", default="noising", choices=["noising", "denoising"])
    parser.add_argument("--top", type=int, default=10, help="also compare on the N rows with the largest |effect|")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = HookedDCFormer.from_pretrained(args.checkpoint).eval().requires_grad_(False)
    pairs = [
        pair
        for task in args.tasks.split(",")
        for pair in contrast_pairs(task, n=args.pairs, seed=0, tokenizer=model.tokenizer)
    ]
    tokens = tokenize_pairs(pairs, model.tokenizer)
    print(
        f"{args.checkpoint}: {len(pairs)} contrast pairs (tasks {args.tasks}), {tokens.clean.shape[1]} positions, "
        f"{args.direction}, {args.threads} thread(s)"
    )
    print(
        f"{'table':<10}{'softmax':>8}{'rows':>6}{'exact s':>10}{'attrib. s':>11}{'ratio':>8}{'rho all':>9}"
        f"{'rho top':>9}{'top found':>11}"
    )
    for per_head in (False, True):
        exact, exact_s = timed(lambda: activation_patching(model, tokens, args.direction, per_head=per_head))
        top = exact["effect"].abs().nlargest(args.top).index
        for softmax in ("linear", "exact"):
            estimate, estimate_s = timed(
                lambda: attribution_patching(model, tokens, args.direction, per_head=per_head, softmax=softmax)
            )
            rho_all = spearmanr(exact["effect"], estimate["effect"]).statistic
            rho_top = spearmanr(exact.loc[top, "effect"], estimate.loc[top, "effect"]).statistic
            found = len(set(top) & set(estimate["effect"].abs().nlargest(args.top).index))
            print(
                f"{'per head' if per_head else 'per site':<10}{softmax:>8}{len(exact):>6}{exact_s:>10.2f}"
                f"{estimate_s:>11.2f}{exact_s / estimate_s:>7.1f}x{rho_all:>9.2f}{rho_top:>9.2f}"
                f"{found:>8}/{args.top}"
            )


if __name__ == "__main__":
    main()
