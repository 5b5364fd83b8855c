"""A post-hoc Table 9: a checkpoint's accuracy on the synthetic tasks with parts of its compose switched off.

The paper values each part of DCMHA by training models without it (Table 9). On a trained checkpoint the
question can be asked directly: score it with each (stage, branch) zeroed in every layer, each stage zeroed in
every layer, the whole compose zeroed, and each layer's compose zeroed, through the model's hooks
(`dcinterp.ablation.everywhere_components`, `layer_components`). Zeroing a branch is the model built without that
branch, the same weights loaded (the reading of Table 9; tested). The ablations share work (`ablation_table`):
branches are zeroed through their dynamic weights, on the compose's no-hook path, and each ablation starts from the
unablated stream entering its first ablated layer. Under `torchrun` the processes share the batches of samples
(docs/synthetic-tasks.md, "Several GPUs").

    python -m dcinterp.synth ablate [--checkpoint PATH] [--data released|FILE] [--out DIR] [--device D]
                                    [--dtype T] [--batch-size N] [--tasks IDS] [--limit N]

Writes `ablation.csv` (one row per ablation: accuracy and perplexity overall, accuracy by QK pattern and by OV
transformation), `ablation.json` (the same, nested, with `world_size`) and `ablation.png` (accuracy change against
the full model).
Exit status 0, or 2 with one line on stderr for bad input, before anything is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ...cli import positive_int
from ..evaluate import (
    EvalError,
    encode_all,
    load_samples,
    pad_token_id,
    padded_tokens,
    parse_sample,
    resolve_data_path,
    results_frame,
    sample_batches,
    score_batch,
    summarize,
)
from . import common

# torch and the model are imported inside the functions that use them: `python -m dcinterp.synth --help`
# builds this command's parser and should stay fast.
if TYPE_CHECKING:
    import pandas as pd

    from ...ablation import Component

DEFAULT_CHECKPOINT = "dcpythia-synth"
OUTPUTS = ("ablation.csv", "ablation.json", "ablation.png")


def ablations(model) -> list[Component | None]:
    """None (the full model), then each (stage, branch), each stage and all compose in every layer, then each layer.

    Args:
        model: The model (it must have DCMHA).

    Returns:
        The components, None first (the full model).

    Raises:
        EvalError: A model without DCMHA: nothing to ablate.
    """
    from ...ablation import everywhere_components, layer_components

    if not model.cfg.use_dcmha:
        raise EvalError(f"{model.cfg.model_name}: the checkpoint has no DCMHA (use_dcmha is false), nothing to ablate")
    return [None, *everywhere_components(model), *layer_components(model)]


def label(component: Component | None) -> str:
    """'none', 'post.kp' (a branch in every layer), 'post' (a stage), 'all compose', 'layer 2'.

    Args:
        component: A component of `ablations`, or None.

    Returns:
        Its row's name in the table.
    """
    if component is None:
        return "none"
    if component.layer != "all":
        return f"layer {component.layer}"
    if component.stage == "all":
        return "all compose"
    return component.stage if component.branch == "all" else f"{component.stage}.{component.branch}"


def ablation_table(model, samples, batch_size: int = 8, progress: bool = True, components=None) -> pd.DataFrame:
    """One row per ablation: which part is off, accuracy, perplexity, accuracy by QK pattern and OV transformation.

    components: default `ablations(model)` (None in the list is the full model). Each batch of samples runs once
    unablated, keeping the residual stream entering every layer; an ablation starts at its first ablated layer
    from there (nothing before it changes), and switches its branches off through their dynamic weights

    (`ablation.zero_weight_hooks`: the model built without the branch, on the compose's no-hook path). The rows are
    those of `evaluate` under `ablation_hooks` (zeroed branch outputs) for each ablation in turn, up to float32
    rounding (the full model bit for bit).

    Under `torchrun` each process takes every world_size-th batch of the batches one process forms, with every
    ablation; the scores are gathered, so every process returns the table one process computes, bit for bit.

    Args:
        model: The model.
        samples: The samples scored (`dcinterp.synth.evaluate.as_samples` reads records).
        batch_size: Samples a forward pass.
        progress: Show a progress bar.
        components: The ablations (default `ablations(model)`; None in the list is the full model).

    Returns:
        The table, one row per ablation.
    """
    import pandas as pd
    import torch
    from tqdm import tqdm

    from ...ablation import check_components
    from ...distributed import gather, in_order, my_batches

    if components is None:
        components = ablations(model)
    else:
        components = list(components)
        given = [component for component in components if component is not None]
        if given or not components:  # None alone is the full model
            check_components(model, given)
    encoded = encode_all(model, samples, model.cfg.model_name)
    batches = sample_batches(encoded, batch_size)
    mine = my_batches(len(batches))
    scores = {}  # (ablation, sample) -> the sample's answer scores
    total = sum(len(batches[i]) for i in mine) * len(components)
    with torch.inference_mode(), tqdm(total=total, desc="ablations", unit="sample", disable=not progress) as bar:
        for i in mine:
            tokens = padded_tokens([encoded[j].token_ids for j in batches[i]], pad_token_id(model))
            for c, logits in enumerate(ablated_logits(model, tokens, components)):
                for j, sample_scores in score_batch(model, encoded, batches[i], logits).items():
                    scores[(c, j)] = sample_scores
                bar.update(len(batches[i]))
    scores = gather(scores)
    rows = []
    for c, component in enumerate(components):
        by_sample = in_order({j: scores[(c, j)] for j in range(len(encoded)) if (c, j) in scores}, len(encoded))
        (summary,) = summarize(results_frame(label(component), encoded, by_sample)).values()
        row = {
            "ablated": label(component),
            "layer": "-" if component is None else component.layer,
            "stage": "-" if component is None else component.stage,
            "branch": "-" if component is None else component.branch,
            "accuracy": summary["accuracy"],
            "ppl": summary["ppl"],
        }
        row.update({f"qk:{key}": value for key, value in summary["by_qk_pattern"].items()})
        row.update({f"ov:{key}": value for key, value in summary["by_ov_transformation"].items()})
        rows.append(row)
    return pd.DataFrame(rows)


def ablated_logits(model, tokens, components):
    """The logits [batch, pos, vocab] of `tokens` with each component switched off (None: the full model), in
    order. The unablated run goes layer by layer, keeping the stream entering each layer; each ablation starts
    from the stream entering its first ablated layer.

    Args:
        model: The model.
        tokens: Token ids [batch, pos].
        components: The ablations, in order (None: the full model).

    Returns:
        One logits tensor [batch, pos, vocab] per component.
    """
    from ...ablation import zero_weight_hooks

    n_layers = model.cfg.n_layers
    streams = [model(tokens, stop_at_layer=0)]
    for layer in range(n_layers):
        streams.append(model(streams[layer], start_at_layer=layer, stop_at_layer=layer + 1))
    for component in components:
        if component is None:
            logits = model(streams[n_layers], start_at_layer=n_layers)
        else:
            first = min(site.layer for site in component.sites)
            with model.hooks(fwd_hooks=zero_weight_hooks(component)):
                logits = model(streams[first], start_at_layer=first)
        yield logits


def table_json(table: pd.DataFrame, checkpoint: str, data: Path, world_size: int = 1) -> dict:
    """The table nested per ablation, with the checkpoint, the data file and how many processes shared the work.

    Args:
        table: `ablation_table`'s result.
        checkpoint: The checkpoint's name.
        data: The data file.
        world_size: How many processes shared the work.

    Returns:
        The JSON-ready dict.
    """
    rows = []
    for record in table.to_dict("records"):
        rows.append(
            {
                **{key: record[key] for key in ("ablated", "layer", "stage", "branch", "accuracy", "ppl")},
                "by_qk_pattern": {k[3:]: v for k, v in record.items() if k.startswith("qk:")},
                "by_ov_transformation": {k[3:]: v for k, v in record.items() if k.startswith("ov:")},
            }
        )
    return {"checkpoint": checkpoint, "data": str(data), "world_size": world_size, "ablations": rows}


def write_outputs(table: pd.DataFrame, summary: dict, figure, out_dir: Path) -> None:
    """Write the CSV, the JSON and the figure, all or none (`common.write_files`).

    Args:
        table: `ablation_table`'s result.
        summary: `table_json`'s result.
        figure: The table's figure.
        out_dir: The output directory.
    """
    common.write_files(
        out_dir,
        {
            "ablation.csv": common.csv_writer(table),
            "ablation.json": common.json_writer(summary),
            "ablation.png": common.png_writer(figure),
        },
    )


def add_ablate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `ablate` command's options.

    Args:
        parser: The parser to add them to.

    Returns:
        The same parser.
    """
    common.add_checkpoint_argument(parser, DEFAULT_CHECKPOINT)
    common.add_data_argument(parser)
    common.add_out_argument(parser, OUTPUTS, required=False)
    common.add_device_arguments(parser)
    parser.add_argument("--batch-size", type=positive_int, default=8, metavar="N")
    common.add_sample_selection_arguments(parser)
    return parser


def run_ablate(args: argparse.Namespace) -> int:
    """The `ablate` command: 0 on success, 2 (and one line on stderr) for bad input.

    Under `torchrun --nproc-per-node N` the N processes share the batches of samples (each runs every ablation on
    its batches); rank 0 writes what one process writes, and ablation.json records `world_size`.

    Args:
        args: The parsed options (`add_ablate_arguments`).

    Returns:
        The exit status.
    """
    from ...distributed import finish, start

    rank, world_size, rank_device = start()
    try:
        model, data_path, samples = common.agreed(lambda: ablate_inputs(args, rank_device))
        table = ablation_table(model, samples, batch_size=args.batch_size, progress=rank == 0)
        if args.out is not None and rank == 0:
            from ...plotting import plot_ablation_table

            figure = plot_ablation_table(
                table, title=f"{args.checkpoint}: compose switched off, {len(samples)} samples"
            )
            write_outputs(table, table_json(table, args.checkpoint, data_path, world_size), figure, args.out)
    except EvalError as error:
        return common.refuse(error, rank)
    finally:
        finish(world_size)
    if rank == 0:
        print(f"{data_path}: {len(samples)} samples, checkpoint {args.checkpoint}{common.processes_note(world_size)}")
        shown = table[["ablated", "accuracy", "ppl", *[c for c in table.columns if c.startswith("qk:")]]]
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        if args.out is not None:
            print(common.wrote_line(args.out, OUTPUTS))
    return 0


def ablate_inputs(args: argparse.Namespace, rank_device: str | None):
    """The checked checkpoint (loaded on this process's device, with DCMHA), data file and samples.

    Args:
        args: The parsed options.
        rank_device: This process's device under torchrun, else None.

    Returns:
        (model, data file, samples).

    Raises:
        EvalError: An input that cannot be scored (one line).
    """
    from ...distributed import process_device

    if args.out is not None:
        common.check_out_dir(args.out)
    device = process_device(common.eval_device(args.device), rank_device)
    data_path = resolve_data_path(args.data)
    samples = common.select_samples(load_samples(data_path), args.tasks, args.limit, data_path)
    for sample in samples:
        parse_sample(sample)  # structural errors before the checkpoint is loaded
    model = common.load_checkpoint(args.checkpoint, args.dtype, device)
    ablations(model)  # EvalError for a checkpoint without DCMHA
    return model, data_path, samples
