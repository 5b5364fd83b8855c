"""Measure how much each convention of docs/conventions.md moves the numbers on the embedded models, and write the
table into docs/conventions.md (between its `<!-- conventions-table -->` markers).

    python benchmarks/conventions_table.py            # print the table
    python benchmarks/conventions_table.py --write    # and replace the table in docs/conventions.md

CPU, float32, about 2-4 minutes (two passes over the 888 released samples per model dominate).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from dcinterp import HookedDCFormer
from dcinterp.attribution import head_attribution
from dcinterp.checks import find_word, word_token
from dcinterp.circuits import head_diversity
from dcinterp.composition import compose_breakdown, donor_heads
from dcinterp.model import attention_mask
from dcinterp.synth.evaluate import PPL_POOLINGS, evaluate, load_samples, perplexity, resolve_data_path

DOC = Path(__file__).resolve().parents[1] / "docs" / "conventions.md"
PROMPT = (
    "\n< Ruth has a sweater. Steven has a taxi. Brian has a dog. >. Steven owns a kind of vehicle"
    "\n< Brian has a violin. Barbara has a pistol. Nancy has a banana. >. Nancy owns a kind of fruit"
    "\n< Michelle has a burger. Helen has a papaya. Carol has a cannon. >. Michelle owns a kind of"
)


def head(layer_head) -> str:
    return f"L{layer_head[0]}H{layer_head[1]}"


def ig_rows(model: HookedDCFormer) -> list[tuple[str, str, str]]:
    """The case study's head under each IG convention: ranked first, followed (first to reach the key), sum/total."""
    tokens = model.to_tokens(PROMPT)
    answer = word_token(model, "food", piece="first")
    query, key = tokens.shape[1] - 1, find_word(model, tokens[0], "burger")
    reaches = lambda layer: bool(attention_mask(query + 1, model.cfg.layer_window(layer), "cpu")[query, key] == 0)  # noqa: E731
    rows = []
    for path in ("joint", "per-layer"):
        for target_type in ("logit", "logprob", "prob"):
            result = head_attribution(model, tokens, answer, target_type=target_type, path=path, n_steps=32)
            ranked = result.top_heads(model.cfg.n_layers * model.cfg.n_heads)
            followed = next(lh for lh in ranked if reaches(lh[0]))
            b = compose_breakdown(model, tokens, followed[0], query, key)
            by_contribution = donor_heads(b, followed[1]).donors
            by_w_k1 = donor_heads(b, followed[1], rule="w_k1").donors
            rows.append(
                (
                    f"IG target / path: `{target_type}`, `{path}`"
                    + (" (default)" if (path, target_type) == ("joint", "logit") else ""),
                    f"first {head(ranked[0])}, followed {head(followed)}; scores sum to "
                    f"{result.per_prompt.sum():.2f} for a total effect of "
                    f"{(result.f_input - result.f_baseline).item():.2f}",
                    f"donors by contribution {', '.join(f'H{n}' for n in by_contribution) or 'none'}, by w_k1 "
                    f"{', '.join(f'H{n}' for n in by_w_k1)}; A {b.before[followed[1]]:.2f} -> A' "
                    f"{b.composed[followed[1]]:.2f}",
                )
            )
    return rows


def diversity_rows(models: dict[str, HookedDCFormer]) -> list[tuple[str, str, str]]:
    """Mean captured variance at k = 4 components under each head-diversity option, per model."""
    options = [
        ("default: QK-norm folded, no normalisation, side by side, sigma^2", {}),
        ('`qk_norm="ignore"` (raw W_Q W_K^T)', {"qk_norm": "ignore"}),
        ('`normalize="head"`', {"normalize": "head"}),
        ('`axis="rows"` (stacked)', {"axis": "rows"}),
        ('`spectrum="sigma"`', {"spectrum": "sigma"}),
    ]
    rows = []
    for label, kwargs in options:
        cells = [
            f"{name}: QK {d.qk_mean[3]:.3f}, OV {d.ov_mean[3]:.3f}"
            for name, d in ((n, head_diversity(m, **kwargs)) for n, m in models.items())
        ]
        rows.append((f"head diversity at k = 4: {label}", cells[0], cells[1]))
    # Rescale one head's W_Q (and b_Q) of a QK-norm model: logits do not move, the raw QK curve does.
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    tokens = model.to_tokens(PROMPT)
    with torch.no_grad():
        before, raw, normed = model(tokens), head_diversity(model), head_diversity(model, normalize="head")
        model.blocks[1].attn.W_Q[0] *= 4
        model.blocks[1].attn.b_Q[0] *= 4
        after = model(tokens)
    raw2, normed2 = head_diversity(model), head_diversity(model, normalize="head")
    rows.append(
        (
            f"dcpythia-synth, L1H0's W_Q x 4 (QK-norm: logits move by {(after - before).abs().max():.1e})",
            f"raw QK at k = 4 (layer 1): {raw.qk[1, 3]:.3f} -> {raw2.qk[1, 3]:.3f}",
            f'normalize="head": {normed.qk[1, 3]:.3f} -> {normed2.qk[1, 3]:.3f}',
        )
    )
    return rows


def eval_rows(models: dict[str, HookedDCFormer]) -> list[tuple[str, str, str]]:
    """Perplexity under each pooling, and the window semantics' effect, on the 888 released samples."""
    samples = load_samples(resolve_data_path("released"))
    results = {name: evaluate(model, samples, progress=False) for name, model in models.items()}
    rows = [
        (
            f"perplexity pooling `{pooling}`" + (" (default)" if pooling == "token" else ""),
            *(f"{name}: {perplexity(frame, pooling):.2f}" for name, frame in results.items()),
        )
        for pooling in PPL_POOLINGS
    ]
    dc = models["dcpythia-synth"]
    dc.cfg.window = "official-inference"
    official = evaluate(dc, samples, progress=False)
    dc.cfg.window = "training"
    tokens = dc.to_tokens(PROMPT)
    with torch.no_grad():
        trained = dc(tokens)
        dc.cfg.window = "official-inference"
        inference = dc(tokens)
        dc.cfg.window = "training"
    training = results["dcpythia-synth"]
    rows.append(
        (
            "window `official-inference` vs `training` (dcpythia-synth, window 4 in layer 0)",
            f"accuracy {training['correct'].mean():.1%} -> {official['correct'].mean():.1%}; "
            f"ppl (token) {perplexity(training):.2f} -> {perplexity(official):.2f}",
            f"case-study prompt: logits move by up to {(inference - trained).abs().max():.2f}",
        )
    )
    return rows


def table() -> str:
    models = {name: HookedDCFormer.from_pretrained(name) for name in ("dcpythia-synth", "pythia-synth")}
    rows = ig_rows(models["dcpythia-synth"]) + diversity_rows(models) + eval_rows(models)
    lines = ["| convention | result | detail |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/conventions.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    text = table()
    print(text)
    if args.write:
        doc = DOC.read_text()
        pattern = r"(<!-- conventions-table -->\n).*?(\n<!-- /conventions-table -->)"
        DOC.write_text(re.sub(pattern, lambda m: m.group(1) + text + m.group(2), doc, count=1, flags=re.S))
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
