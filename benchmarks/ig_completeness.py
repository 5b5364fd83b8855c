"""IG completeness gap of `head_attribution` against n_steps, precision and integration rule.

    python benchmarks/ig_completeness.py [--quick] [--random-shape 512,32,32,16]

The gap is |sum of the head scores - (f(input) - f(baseline))| / |f(input) - f(baseline)|, per prompt (the share
of the total effect that the scores fail to account for); the table gives its mean and max over the prompts.
Models: the embedded `dcpythia-synth` (the case study's prompts: the clean prompts of 4 contrast pairs of task 2,
target the answer's logit), and a random checkpoint of DCPythia-6.9B's layout (`dcinterp.random_checkpoint`:
std-0.02 noise; 32 heads of a layer, rank 2, QK-norm, rotary 25%) at a CPU-sized width and depth, one random
prompts of 16 tokens. "float32 gates" is dcinterp's default; "model-dtype gates" is the gate arithmetic before
#24 (alpha and z * alpha rounded to the model's dtype), for comparison (the target is read out in float32 in
both). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from contextlib import contextmanager

import torch

import dcinterp.attribution as attribution
from dcinterp import HookedDCFormer
from dcinterp.random_checkpoint import DCPYTHIA_6_9B, scaled, write_random_checkpoint
from dcinterp.synth import contrast_pairs, tokenize_pairs

METHODS = ("gausslegendre", "riemann_trapezoid", "riemann_middle", "riemann_right")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextmanager
def model_dtype_gates():
    """The gate hooks as they were before #24: the gate cast to the activation's dtype."""
    original = attribution.gate_hooks

    def gate_hooks(alpha, baseline):
        def make_hook(layer):
            def hook(z, hook):
                return z * alpha[:, layer, None, :, None].to(z.dtype)

            return hook

        return [(f"blocks.{l}.attn.hook_z", make_hook(l)) for l in range(alpha.shape[1])]

    attribution.gate_hooks = gate_hooks
    try:
        yield
    finally:
        attribution.gate_hooks = original


def gap(model, inputs, n_steps, method) -> tuple[float, float, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = attribution.head_attribution(model, **inputs, n_steps=n_steps, method=method)
    total = (result.f_input - result.f_baseline).abs()
    share = result.delta.abs() / total
    return share.mean().item(), share.max().item(), total.mean().item()


def load(path, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HookedDCFormer.from_pretrained(path, dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer settings (a smoke run)")
    parser.add_argument(
        "--random-shape",
        default="256,32,32,8",
        help="d_model,n_layers,n_heads,d_head of the random DCPythia-6.9B-layout checkpoint",
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = (16, 50) if args.quick else (8, 16, 32, 50, 128)

    synth = load("dcpythia-synth", torch.float32)
    pairs = tokenize_pairs(contrast_pairs(2, n=4, seed=0, tokenizer=synth.tokenizer), synth.tokenizer)
    synth_inputs = dict(tokens=pairs.clean, target=pairs.clean_answer, position=pairs.position)

    d_model, n_layers, n_heads, d_head = (int(v) for v in args.random_shape.split(","))
    shape = scaled(
        DCPYTHIA_6_9B,
        dim=d_model,
        n_layer=n_layers,
        n_head=n_heads,
        head_dim=d_head,
        intermediate_size=4 * d_model,
        vocab_size=512,
        block_size=64,
        window_size=8,
    )
    random_dir = tempfile.mkdtemp(prefix="dcinterp-ig-")
    write_random_checkpoint(random_dir, shape)
    random_inputs = dict(
        tokens=torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0)), target=torch.tensor([7, 300])
    )
    # (label, checkpoint, inputs, n_steps, rules per dtype): float16 matmuls are the slowest on a CPU
    random_label = f"random 6.9B layout {n_layers}L d{d_model} {n_heads}x{d_head}"
    cases = [
        ("dcpythia-synth", "dcpythia-synth", synth_inputs, steps, {}),
        (random_label, random_dir, random_inputs, (16, 50), {"float16": ("gausslegendre",)}),
    ]

    print(f"threads {args.threads}; the machine may be shared (timings are indicative)\n")
    print("| model | dtype | gates | rule | n_steps | gap mean | gap max | total effect | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, path, inputs, case_steps, rules in cases:
        for dtype_name, dtype in DTYPES.items():
            model = load(path, dtype)
            gate_kinds = ("float32",) if dtype == torch.float32 else ("float32", "model-dtype")
            for gates in gate_kinds:
                methods = rules.get(dtype_name, METHODS) if gates == "float32" else ("gausslegendre",)
                for method in methods:
                    for n_steps in case_steps if dtype != torch.float16 or label == "dcpythia-synth" else (16,):
                        start = time.perf_counter()
                        if gates == "float32":
                            mean, worst, total = gap(model, inputs, n_steps, method)
                        else:
                            with model_dtype_gates():
                                mean, worst, total = gap(model, inputs, n_steps, method)
                        print(
                            f"| {label} | {dtype_name} | {gates} | {method} | {n_steps} | {mean:.2%} | {worst:.2%} "
                            f"| {total:.3f} | {time.perf_counter() - start:.1f} |",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
