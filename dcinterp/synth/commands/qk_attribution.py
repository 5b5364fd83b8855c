"""QK attribution on the synthetic tasks' samples (`dcinterp.qk`): why a head attends where it does.

    python -m dcinterp.synth qk --layer L --head H --out DIR [--checkpoint C] [--tasks IDS] [--samples N]
                                [--query WORD|ROLE] [--key WORD|ROLE] [--contrast WORD|ROLE] [--seed S]
                                [--top K] [--checks K] [--device D] [--dtype T]

The samples are the clean prompts of the tasks' contrast pairs (`contrast_pairs`, seeded). In each, the head's
composed score from the query to the key is split into terms (query component, key component, source head,
branch), the top components are removed from the heads' inputs to check the terms (frozen and free), and, with
`--contrast`, the difference to a second key is split too. A position is a word (its last occurrence in the
prompt) or a role:

    last          the prompt's last token (default --query)
    top           the key the head scores highest from the query (default --key)
    source        the item the clean answer comes from
    other-source  the item the corrupted prompt's answer comes from (for a person corruption: another person's
                  item of the same line)
    person        the person the last line asks about (its last occurrence)
    after-person  the token after that person (where dcpythia-synth's layer 1 looks the person up)

Writes `terms.csv` (one row per kept term: sample, task, query_pos, key_pos, query_component, key_component,
source_head, branch, value; the `--top` largest per sample and one `rest` row, so each sample's rows add up to its
score), `summary.json` (per sample: the score, the sum of the terms, their gap, the top terms, the source head x
branch table, the causal checks, the contrast, and for a DCMHA model how much of the score's change from the
corrupted prompt comes from the scores and how much from the dynamic weights; their means) and `qk.png` (the mean
tables over the samples). Exit status 0, or 2 with one line on stderr for bad input, before anything is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...cli import non_negative_int, positive_int
from ..evaluate import EvalError
from . import common

DEFAULT_CHECKPOINT = "dcpythia-synth"
OUTPUTS = ("terms.csv", "summary.json", "qk.png")
ROLES = ("last", "top", "source", "other-source", "person", "after-person")
TERM_CSV_COLUMNS = [
    "sample",
    "task",
    "query_pos",
    "key_pos",
    "query_component",
    "key_component",
    "source_head",
    "branch",
    "value",
]


def add_qk_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `qk` command's options.

    Args:
        parser: The parser to add them to.

    Returns:
        The same parser.
    """
    parser.add_argument("--layer", type=non_negative_int, required=True, metavar="L", help="the head's layer")
    parser.add_argument("--head", type=non_negative_int, required=True, metavar="H", help="the head explained")
    common.add_out_argument(parser, OUTPUTS)
    common.add_checkpoint_argument(parser, DEFAULT_CHECKPOINT)
    common.add_contrast_tasks_argument(parser)
    parser.add_argument("--samples", type=positive_int, default=4, metavar="N", help="samples per task (default 4)")
    roles = ", ".join(ROLES)
    parser.add_argument("--query", default="last", metavar="WORD|ROLE", help=f"the query: a word or {roles}")
    parser.add_argument("--key", default="top", metavar="WORD|ROLE", help="the key (default: top)")
    parser.add_argument("--contrast", metavar="WORD|ROLE", help="a second key: why the key rather than this one")
    parser.add_argument("--seed", type=int, default=0, help="the samples' seed")
    parser.add_argument("--top", type=positive_int, default=200, metavar="K", help="terms kept per sample (200)")
    parser.add_argument(
        "--checks", type=non_negative_int, default=3, metavar="K", help="components checked per side (3)"
    )
    common.add_device_arguments(parser)
    return parser


# --------------------------------------------------------------------------------------------------
# Positions
def resolve(model, tokens, pair, spec: str, option: str, layer: int, head: int, query_pos: int | None = None) -> int:
    """A role or a word as a position in the pair's clean prompt [1, pos]; EvalError naming `option` and the
    sample. "top" needs the query's position.

    Args:
        model: The model.
        tokens: The pair's clean prompt [1, pos].
        pair: The contrast pair.
        spec: A role (`ROLES`) or a word.
        option: The option that gave it, in the error.
        layer: The head's layer.
        head: The head.
        query_pos: The query's position ("top" needs it).

    Returns:
        The position.

    Raises:
        EvalError: A word or role the prompt does not have.
    """
    from ...checks import find_word

    where = f"{pair.task_id} sample {pair.sample}"
    if spec == "last":
        return tokens.shape[1] - 1
    if spec == "top":
        return top_key(model, tokens, layer, head, query_pos)
    words = {
        "source": pair.clean_source,
        "other-source": pair.corrupt_source,
        "person": pair.query_person,
        "after-person": pair.query_person,
    }
    word = words.get(spec, spec)
    if word is None:
        raise EvalError(f"{option} {spec}: {where} ({pair.kind} pair) has no {spec.replace('-', ' ')}")
    try:
        position = find_word(model, tokens[0], word, name=option)
    except ValueError as error:
        raise EvalError(f"{error} ({where})") from None
    if spec == "after-person":
        position += 1
        if position >= tokens.shape[1]:
            raise EvalError(f"{option} after-person: nothing follows {word!r} in {where}")
    return position


def top_key(model, tokens, layer: int, head: int, query_pos: int) -> int:
    """The key the head scores highest from the query (its composed score; plain MHA: its score).

    Args:
        model: The model.
        tokens: One prompt [1, pos].
        layer: The head's layer.
        head: The head.
        query_pos: The query's position.

    Returns:
        The key's position.
    """
    import torch

    from ...model import visible_keys
    from ...qk import layer_run

    run = layer_run(model, tokens, layer, query_pos, [query_pos])
    scores = run["composed" if model.cfg.use_dcmha else "scores"][head].float().cpu()
    visible = visible_keys(tokens.shape[1], model.cfg.layer_window(layer), "cpu", model.cfg.window)[query_pos]
    return int(torch.where(visible, scores, -torch.inf).argmax())


# --------------------------------------------------------------------------------------------------
# The work
def explain(model, pairs, args, progress: bool = True) -> dict:
    """Per sample: the attribution, the contrast and the change from the corrupted prompt; then the same causal
    checks in every sample: the `--checks` components with the largest mean share on each side (and the top one
    through the source head with the largest mean share alone), so that their means stand beside the mean shares.

    Args:
        model: The model.
        pairs: The contrast pairs.
        args: The parsed options (the head, the roles, `--top`, `--checks`).
        progress: Say on stderr what runs.

    Returns:
        {samples: one dict per sample, terms: every sample's top terms in one frame}.
    """
    import pandas as pd

    from ...qk import causal_checks, qk_attribution, qk_contrast
    from ...qk_weights import compose_change

    layer, head = args.layer, args.head
    samples = []
    for index, pair in enumerate(pairs):  # positions first: a bad word or role fails before any attribution
        tokens = model.to_tokens(pair.clean).to(model.input_device)
        t = resolve(model, tokens, pair, args.query, "--query", layer, head)
        s = resolve(model, tokens, pair, args.key, "--key", layer, head, t)
        other = None
        if args.contrast is not None:
            other = resolve(model, tokens, pair, args.contrast, "--contrast", layer, head, t)
            if other == s:
                raise EvalError(
                    f"--contrast {args.contrast}: it is the key itself in {pair.task_id} sample {pair.sample}"
                )
        samples.append((index, pair, tokens, t, s, other))
    results, frames = [], []
    for index, pair, tokens, t, s, other in samples:
        try:
            attribution = qk_attribution(model, tokens, layer, head, t, s, max_terms=args.top + 1)
            contrast = None
            if other is not None:
                contrast = qk_contrast(model, tokens, layer, head, t, s, other, max_terms=args.top + 1)
        except ValueError as error:  # a key the query does not see in this layer
            raise EvalError(f"{error} ({pair.task_id} sample {pair.sample})") from None
        change = None
        if model.cfg.use_dcmha and "pre" in model.cfg.compose_stages:
            corrupt = model.to_tokens(pair.corrupt).to(model.input_device)
            change = compose_change(model, tokens, corrupt, layer, head, t, s)
        results.append(dict(index=index, pair=pair, attribution=attribution, contrast=contrast, change=change))
        terms = attribution.terms.copy()
        terms.insert(0, "query_pos", t)
        terms.insert(0, "task", pair.task_id)
        terms.insert(0, "sample", index)
        frames.append(terms[TERM_CSV_COLUMNS])
        if progress:
            print(f"sample {index}: {attribution}", file=sys.stderr, flush=True)
    checks = checks_to_run([r["attribution"] for r in results], args.checks, per_head=model.cfg.use_dcmha)
    for r in results:
        r["checks"] = causal_checks(model, r["attribution"], checks=checks) if checks else pd.DataFrame()
    return {"samples": results, "terms": pd.concat(frames, ignore_index=True)}


def checks_to_run(attributions: list, k: int, per_head: bool = True) -> list[tuple[str, str, int | None]]:
    """The k components with the largest mean |share| on each side (not `bias`), through every source head; and
    (per_head: DCMHA, where other heads' scores count) the first of each side through the source head with the
    largest mean |share| alone.

    Args:
        attributions: The samples' attributions.
        k: Components per side.
        per_head: Also check through one source head (DCMHA).

    Returns:
        (component, side, source_head) triples, as `causal_checks` takes them.
    """
    components = sum(a.component_table().set_index("component") for a in attributions) / len(attributions)
    components = components.drop(index="bias")
    head_branch = sum(a.head_branch_table() for a in attributions) / len(attributions)
    top_head = int(head_branch.abs().sum(1).idxmax())
    checks = []
    for side in ("query", "key"):
        chosen = list(components[side].abs().sort_values(ascending=False).index[:k])
        checks += [(component, side, None) for component in chosen]
        checks += [(component, side, top_head) for component in chosen[:1] if per_head]
    return checks


def mean_tables(results: list[dict], key: str = "attribution") -> dict:
    """The tables of the samples' attributions (or contrasts) averaged (their components and heads agree).

    Args:
        results: The samples' results (`explain`).
        key: "attribution" or "contrast".

    Returns:
        {pairs, head_branch, components, checks} averaged over the samples ({} where no sample has `key`).
    """
    import pandas as pd

    results = [r for r in results if r.get(key) is not None]
    if not results:
        return {}
    found = [r[key] for r in results]
    n = len(found)
    means = {
        "pairs": sum(a.pair_table() for a in found) / n,
        "head_branch": sum(a.head_branch_table() for a in found) / n,
        "components": (sum(a.component_table().set_index("component") for a in found) / n).reset_index(),
        "checks": None,
    }
    checks = [r["checks"] for r in results if key == "attribution" and len(r.get("checks", ()))]
    if checks:  # the same checks in every sample: one mean row per (component, side, source head)
        keys = ["component", "side", "source_head"]
        frame = pd.concat(checks, ignore_index=True)
        means["checks"] = (
            frame.groupby(keys, dropna=False, sort=False)[["estimate", "frozen", "norms", "weights"]]
            .mean()
            .reset_index()
        )
    return means


def _records(frame) -> list[dict]:
    import math

    def clean(value):
        if value is None or isinstance(value, float) and math.isnan(value):
            return None
        if hasattr(value, "item"):
            value = value.item()
        return None if isinstance(value, float) and math.isnan(value) else value

    return [{key: clean(value) for key, value in row.items()} for row in frame.to_dict("records")]


def summarise(model, args, result: dict, means: dict) -> dict:
    """What summary.json holds: each sample's score, terms and gap, the mean tables' top entries and the checks.

    Args:
        model: The model.
        args: The parsed options.
        result: `explain`'s result.
        means: `mean_tables`' result.

    Returns:
        The JSON-ready dict.
    """
    samples = []
    for r in result["samples"]:
        a, pair = r["attribution"], r["pair"]
        tokens = a.str_tokens
        entry = {
            "sample": r["index"],
            "task": pair.task_id,
            "prompt": pair.clean.split("\n")[-1],
            "query_pos": a.query_pos,
            "query_token": tokens[a.query_pos] if tokens else None,
            "key_pos": a.key_pos[0],
            "key_token": tokens[a.key_pos[0]] if tokens else None,
            "score": float(a.composed[0]),
            "sum_of_terms": float(a.sum_of_terms.iloc[0]),
            "gap": float(a.gap.iloc[0]),
            "relative_gap": a.relative_gap,
            "composed_pattern": float(a.composed_pattern[0]),
            "top_terms": _records(a.top_terms(10)),
            "head_branch": {b: [float(v) for v in a.head_branch_table()[b]] for b in a.branches},
            "checks": _records(r["checks"]),
        }
        if r["contrast"] is not None:
            c = r["contrast"]
            entry["contrast"] = {
                "other_key_pos": c.other_key_pos,
                "other_key_token": tokens[c.other_key_pos] if tokens else None,
                "difference": c.difference,
                "sum_of_terms": c.sum_of_terms,
                "gap": c.gap,
                "head_branch": {b: [float(v) for v in c.head_branch_table()[b]] for b in c.branches},
                "top_terms": _records(c.top_terms(10).drop(columns=["key_pos", "other_key_pos"])),
            }
        if r["change"] is not None:
            ch = r["change"]
            entry["change_from_corrupted"] = {
                "corrupted": ch.other,
                "change": ch.change,
                "scores_part": ch.scores_part,
                "weights_part": ch.weights_part,
                "weights_delta": ch.delta,
            }
        samples.append(entry)
    components = means["components"]
    top = components.reindex((components["query"].abs() + components["key"].abs()).sort_values(ascending=False).index)
    summary = {
        "checkpoint": str(args.checkpoint),
        "model": model.cfg.model_name,
        "dcmha": bool(model.cfg.use_dcmha),
        "layer": args.layer,
        "head": args.head,
        "tasks": args.tasks,
        "query": args.query,
        "key": args.key,
        "contrast": args.contrast,
        "samples": len(samples),
        "mean_score": sum(s["score"] for s in samples) / len(samples),
        "max_relative_gap": max(s["relative_gap"] for s in samples),
        "mean_head_branch": {b: [float(v) for v in means["head_branch"][b]] for b in means["head_branch"].columns},
        "mean_components": _records(top.head(10)),
        "mean_checks": _records(means["checks"]) if means["checks"] is not None else [],
        "per_sample": samples,
    }
    contrasts = [s["contrast"] for s in samples if "contrast" in s]
    if contrasts:
        summary["mean_contrast"] = {
            "difference": sum(c["difference"] for c in contrasts) / len(contrasts),
            "head_branch": {
                b: [sum(c["head_branch"][b][n] for c in contrasts) / len(contrasts) for n in range(len(values))]
                for b, values in contrasts[0]["head_branch"].items()
            },
        }
    changes = [s["change_from_corrupted"] for s in samples if "change_from_corrupted" in s]
    if changes:
        summary["mean_change_from_corrupted"] = {
            key: sum(c[key] for c in changes) / len(changes) for key in ("change", "scores_part", "weights_part")
        }
    return summary


ROLE_WORDS = {  # a role as the figure's title says it
    "last": "the last token",
    "top": "the key it scores highest",
    "source": "the answer's item",
    "other-source": "the other item",  # the corrupted prompt's answer: for a person swap, the other person's
    "person": "the queried person",
    "after-person": "the word after the queried person",
}


def _in_words(spec: str) -> str:
    """A position for a reader: a role in words, a word quoted."""
    return ROLE_WORDS.get(spec, repr(spec))


def _score_label(spec: str) -> str:
    return "score at " + ("the key" if spec == "top" else _in_words(spec))


def figure(args, means: dict, contrast: dict, summary: dict):
    """The mean attribution (and contrast) drawn, titled in words.

    Args:
        args: The parsed options.
        means: The mean attribution's tables.
        contrast: The mean contrast's tables ({} without `--contrast`).
        summary: `summarise`'s result.

    Returns:
        The figure.
    """
    from ...plotting import plot_qk_attribution

    label = Path(str(args.checkpoint)).name
    second = None
    if contrast:
        second = dict(contrast, label=f"{_score_label(args.key)} - {_score_label(args.contrast)}")
    tasks = ", ".join(task.removeprefix("task") for task in args.tasks)
    return plot_qk_attribution(
        means["pairs"],
        means["head_branch"],
        means["components"],
        means["checks"],
        layer=args.layer,
        label=_score_label(args.key),
        contrast=second,
        title=(
            f"{label} L{args.layer}H{args.head}: why it attends from {_in_words(args.query)} to "
            f"{_in_words(args.key)}"
            + (f" rather than to {_in_words(args.contrast)}" if args.contrast else "")
            + f" (mean over {summary['samples']} samples of task{'s' if len(args.tasks) > 1 else ''} {tasks}; "
            f"mean score {summary['mean_score']:.2f})"
        ),
    )


def run_qk(args: argparse.Namespace) -> int:
    """The `qk` command: 0 on success, 2 (and one line on stderr) for bad input.

    Args:
        args: The parsed options (`add_qk_arguments`).

    Returns:
        The exit status.
    """
    from ..catalog import CatalogError

    try:
        common.check_out_dir(args.out)
        device = common.eval_device(args.device)
        for option in ("query", "key", "contrast"):
            value = getattr(args, option)
            if value is not None and not value.strip():
                raise EvalError(f"--{option}: empty; pass a word or one of {', '.join(ROLES)}")
        if args.query == "top":
            raise EvalError("--query top: 'top' is a key; the query is a word, last, person or after-person")
        model = common.load_frozen_model(args.checkpoint, args.dtype, device, "the samples need one")
        if args.layer >= model.cfg.n_layers:
            raise EvalError(f"--layer {args.layer}: {args.checkpoint} has layers 0..{model.cfg.n_layers - 1}")
        if args.head >= model.cfg.n_heads:
            raise EvalError(f"--head {args.head}: {args.checkpoint} has heads 0..{model.cfg.n_heads - 1}")
        pairs = common.tasks_contrast_pairs(args.tasks, args.samples, args.seed, model.tokenizer)
        result = explain(model, pairs, args)
        means = mean_tables(result["samples"])
        summary = summarise(model, args, result, means)
        fig = figure(args, means, mean_tables(result["samples"], "contrast"), summary)
        common.write_files(
            args.out,
            {
                "terms.csv": common.csv_writer(result["terms"]),
                "summary.json": common.json_writer(summary),
                "qk.png": common.png_writer(fig),
            },
        )
    except (EvalError, CatalogError) as error:
        return common.refuse(error)
    print(
        f"{args.checkpoint} L{args.layer}H{args.head}: {summary['samples']} samples of {', '.join(args.tasks)}, "
        f"query {args.query}, key {args.key}; mean score {summary['mean_score']:.3f}, largest relative gap "
        f"{summary['max_relative_gap']:.1e}"
    )
    if "mean_contrast" in summary:
        print(f"  score({args.key}) - score({args.contrast}): {summary['mean_contrast']['difference']:+.3f} (mean)")
    if "mean_change_from_corrupted" in summary:
        change = summary["mean_change_from_corrupted"]
        print(
            f"  from the corrupted prompt: change {change['change']:+.3f} = scores {change['scores_part']:+.3f} "
            f"+ dynamic weights {change['weights_part']:+.3f} (mean)"
        )
    for row in summary["mean_checks"]:
        who = "every head" if row["source_head"] is None else f"head {row['source_head']}"
        print(
            f"  remove {row['component']} from the {row['side']} ({who}): terms {row['estimate']:+.3f}, "
            f"frozen {row['frozen']:+.3f}, norms free {row['norms']:+.3f}"
            + ("" if row["weights"] is None else f", weights free {row['weights']:+.3f}")
        )
    print(common.wrote_line(args.out, OUTPUTS))
    return 0
