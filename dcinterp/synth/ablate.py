"""A post-hoc Table 9: a checkpoint's accuracy on the synthetic tasks with parts of its compose switched off.

The paper values each part of DCMHA by training models without it (Table 9). On a trained checkpoint the
question can be asked directly: score it with each (stage, branch) zeroed in every layer, each stage zeroed in
every layer, the whole compose zeroed, and each layer's compose zeroed, through the model's hooks
(`dcinterp.patching.everywhere_components`, `layer_components`). Zeroing a branch output is the model built
without that branch, the same weights loaded (the reading of Table 9; tested).

    python -m dcinterp.synth ablate [--checkpoint PATH] [--data released|FILE] [--out DIR] [--device D]
                                    [--dtype T] [--batch-size N] [--tasks IDS] [--limit N]

Writes `ablation.csv` (one row per ablation: accuracy and perplexity overall, accuracy by QK pattern and by OV
transformation), `ablation.json` (the same, nested) and `ablation.png` (accuracy change against the full model).
Exit status 0, or 2 with one line on stderr for bad input, before anything is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# torch, pandas and the model are imported inside the functions that use them: `python -m dcinterp.synth --help`
# builds this command's parser and should stay fast.
if TYPE_CHECKING:
    import pandas as pd

    from ..patching import Component

DEFAULT_CHECKPOINT = "dcpythia-synth"
OUTPUTS = ("ablation.csv", "ablation.json", "ablation.png")


def ablations(model) -> list[Component | None]:
    """None (the full model), then each (stage, branch), each stage and all compose in every layer, then each layer."""
    from ..patching import everywhere_components, layer_components
    from .evaluate import EvalError

    if not model.cfg.use_dcmha:
        raise EvalError(f"{model.cfg.model_name}: the checkpoint has no DCMHA (use_dcmha is false), nothing to ablate")
    return [None, *everywhere_components(model), *layer_components(model)]


def label(component: Component | None) -> str:
    """'none', 'post.kp' (a branch in every layer), 'post' (a stage), 'all compose', 'layer 2'."""
    if component is None:
        return "none"
    if component.layer != "all":
        return f"layer {component.layer}"
    if component.stage == "all":
        return "all compose"
    return component.stage if component.branch == "all" else f"{component.stage}.{component.branch}"


def ablation_table(model, samples, batch_size: int = 8, progress: bool = True) -> pd.DataFrame:
    """One row per ablation: which part is off, accuracy, perplexity, accuracy by QK pattern and OV transformation."""
    import pandas as pd
    from tqdm import tqdm

    from ..patching import ablation_hooks
    from .evaluate import evaluate, summarize

    rows = []
    components = ablations(model)
    for component in tqdm(components, desc="ablations", unit="ablation", disable=not progress):
        hooks = [] if component is None else ablation_hooks(component)
        with model.hooks(fwd_hooks=hooks):
            results = evaluate(model, samples, batch_size=batch_size, name=label(component), progress=False)
        (summary,) = summarize(results).values()
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


def table_json(table: pd.DataFrame, checkpoint: str, data: Path) -> dict:
    rows = []
    for record in table.to_dict("records"):
        rows.append(
            {
                **{key: record[key] for key in ("ablated", "layer", "stage", "branch", "accuracy", "ppl")},
                "by_qk_pattern": {k[3:]: v for k, v in record.items() if k.startswith("qk:")},
                "by_ov_transformation": {k[3:]: v for k, v in record.items() if k.startswith("ov:")},
            }
        )
    return {"checkpoint": checkpoint, "data": str(data), "ablations": rows}


def write_outputs(table: pd.DataFrame, summary: dict, figure, out_dir: Path) -> None:
    """Write the CSV, the JSON and the figure, all or none (`evaluate.write_files`)."""
    from .evaluate import write_files

    write_files(
        out_dir,
        {
            "ablation.csv": lambda path: table.to_csv(path, index=False),
            "ablation.json": lambda path: path.write_text(json.dumps(summary, indent=2) + "\n"),
            "ablation.png": lambda path: figure.savefig(path, dpi=130, format="png"),
        },
    )


def _positive_int(text: str) -> int:
    from .evaluate import positive_int

    return positive_int(text)


def _task_selection(text: str) -> set[str]:
    from .evaluate import parse_task_selection

    return parse_task_selection(text)


def add_ablate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--checkpoint",
        default=DEFAULT_CHECKPOINT,
        metavar="PATH",
        help="checkpoint directory or embedded model name (default: %(default)s)",
    )
    parser.add_argument(
        "--data",
        default="released",
        metavar="released|FILE",
        help="'released' (the shipped synthetic_dataset.jsonl) or a JSON-lines file",
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="write " + ", ".join(OUTPUTS) + " here (default: only print the table)"
    )
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--batch-size", type=_positive_int, default=8, metavar="N")
    parser.add_argument(
        "--tasks",
        type=_task_selection,
        metavar="SEL",
        help="tasks to evaluate: ids and ranges, e.g. task0,task5 or 0-7",
    )
    parser.add_argument("--limit", type=_positive_int, metavar="N", help="only the first N samples (after --tasks)")
    return parser


def run_ablate(args: argparse.Namespace) -> int:
    """The `ablate` command: 0 on success, 2 (and one line on stderr) for bad input."""
    from ..plotting import plot_ablation_table
    from .catalog import CatalogError
    from .evaluate import (
        EvalError,
        check_out_dir,
        eval_device,
        load_checkpoint,
        load_samples,
        parse_sample,
        resolve_data_path,
        select_samples,
    )

    try:
        if args.out is not None:
            check_out_dir(args.out)
        device = eval_device(args.device)
        data_path = resolve_data_path(args.data)
        samples = select_samples(load_samples(data_path), args.tasks, args.limit, data_path)
        for sample in samples:
            parse_sample(sample)  # structural errors before the checkpoint is loaded
        model = load_checkpoint(args.checkpoint, args.dtype, device)
        table = ablation_table(model, samples, batch_size=args.batch_size)
        if args.out is not None:
            figure = plot_ablation_table(
                table, title=f"{args.checkpoint}: compose switched off, {len(samples)} samples"
            )
            write_outputs(table, table_json(table, args.checkpoint, data_path), figure, args.out)
    except (EvalError, CatalogError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{data_path}: {len(samples)} samples, checkpoint {args.checkpoint}")
    shown = table[["ablated", "accuracy", "ppl", *[c for c in table.columns if c.startswith("qk:")]]]
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.out is not None:
        print("wrote " + ", ".join(str(args.out / name) for name in OUTPUTS))
    return 0
