"""Where a person swap reaches the key-wise weights: patching `kw1`/`kw2`/`kg` only at some key positions.

    python benchmarks/keywise_positions.py [--pairs 4]

The README's same-person study (`dcpythia-synth`, `--pairs` pairs of each of the 14 same-person tasks, the queried
person swapped, noising): each key-wise dynamic weight of layers 1-2 is patched from the corrupted prompt (a) at
every position, (b) only at the positions before the first token that differs (the shots and the query line up to
the name: what both prompts share), (c) only from that token on (the swapped name and the rest of the query line,
up to the answer position, which is also a key: s = t). The effect is the share of the clean-minus-corrupted
logit difference removed, as in `activation_patching`.
"""

from __future__ import annotations

import argparse

import torch

from dcinterp import HookedDCFormer
from dcinterp.patching import LogitDiff, cache_sites
from dcinterp.synth import contrast_pairs, tokenize_pairs
from dcinterp.synth.catalog import load_catalog


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    catalog = load_catalog()
    tasks = [task_id for task_id, task in catalog.tasks.items() if task.qk_pattern == "same-person"]
    pairs = tokenize_pairs(
        [p for t in tasks for p in contrast_pairs(t, n=args.pairs, seed=0, tokenizer=model.tokenizer)], model.tokenizer
    )
    first_diff = (pairs.clean != pairs.corrupt).int().argmax(1)  # [batch]
    metric = LogitDiff(pairs.clean_answer, pairs.corrupt_answer, pairs.position)
    with torch.no_grad():
        clean, corrupt = metric(model, pairs.clean).mean(), metric(model, pairs.corrupt).mean()
    scale = clean - corrupt
    positions = torch.arange(pairs.clean.shape[1])[None]
    masks = {
        "every key": torch.ones_like(positions, dtype=torch.bool).expand_as(pairs.clean),
        "keys before the swapped name": positions < first_diff[:, None],
        "keys from the swapped name on": positions >= first_diff[:, None],
    }
    print(
        f"{len(pairs.clean)} pairs; first differing token at {int(first_diff.min())}..{int(first_diff.max())}, "
        f"answer positions {int(pairs.position.min())}..{int(pairs.position.max())}"
    )
    print("| site | " + " | ".join(masks) + " |\n|---|" + "---|" * len(masks))
    for layer in (1, 2):
        for stage in ("pre", "post"):
            for name in ("kw1", "kw2", "kg"):
                hook_name = f"blocks.{layer}.attn.{stage}_compose.hook_{name}"
                source = cache_sites(model, pairs.corrupt, [hook_name])[hook_name]
                effects = []
                for mask in masks.values():

                    def patch(x, hook, mask=mask):
                        where = mask.reshape(*mask.shape, *[1] * (x.ndim - 2))
                        return torch.where(where, source.to(x.dtype), x)

                    with torch.no_grad():
                        patched = metric(model, pairs.clean, [(hook_name, patch)]).mean()
                    effects.append(((patched - clean) / scale).item())
                print(f"| L{layer} {stage} `{name}` | " + " | ".join(f"{e:+.3f}" for e in effects) + " |")


if __name__ == "__main__":
    main()
