"""DCMHA against plain MHA of the same size: forward, forward + backward, and peak memory, in one run.

    python benchmarks/bench_dcmha.py [--shapes d1024,6.9b] [--tokens 512,1024,2048] [--repeats 5] [--threads 2]
                                     [--einsum] [--official DIR] [--no-memory] [--memory-only]

Random DCPythia-style models (LayerNorm, parallel residual, GELU MLP, QK-norm, rotary on a quarter of each head,
vocabulary 8192, batch 1, float32, frozen weights as analyses load them) and their plain-MHA twins
(`use_dcmha=False`, the same weights otherwise; with no hook on their scores or pattern they run torch's
`scaled_dot_product_attention`, dcinterp.dcmha; `--einsum` times them on the einsum-softmax-einsum path as well,
what a hook on `hook_pattern` makes them take):
- `d1024`: 4 layers, d_model 1024, 16 heads of 64, windows of 256 keys on every other layer (as DCPythia-6.9B);
- `6.9b`: one layer of DCPythia-6.9B's width, d_model 4096, 32 heads of 128, global (the harder case: a local
  layer's blocks read only their window's keys).
For each number of prompt tokens the two models take turns (in alternating order) at every measurement:
- forward: `model(tokens)` with no hook (the blocked path, dcinterp.dcmha.blocked);
- forward + backward to the activations: `set_use_activation_grads(True)`, then the mean next-token loss's
  backward, as attribution patching reads activation gradients;
- forward + backward to an input: the embeddings as a leaf that requires grad, `model(embeddings,
  start_at_layer=0)`, as integrated gradients steps.
The ratios of the medians over `--repeats` runs are reported, and of the minima (each model's least disturbed run:
on a machine shared with other work, the steadier of the two). Peak memory: the peak anonymous memory
(RssAnon) above the weights of one no-hook forward at the largest number of tokens, each model in a fresh process.
With `--official` (default: the DCFORMER_OFFICIAL environment variable), the authors' PyTorch DCPythia
(`modeling_dcpythia.py` from a local clone of Caiyun-AI/DCFormer) is timed on the same shape too (prefill path).
The machine's load average is printed before and after: other processes on the cores move the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.memory import PeakAnonMemory

SHAPES = {
    "d1024": dict(n_layers=4, d_model=1024, n_heads=16, d_head=64, window_size=256, window_type="LG"),
    "6.9b": dict(n_layers=1, d_model=4096, n_heads=32, d_head=128, window_size=None, window_type=None),
}
VOCAB = 8192
KINDS = ("forward", "forward + backward (activations)", "forward + backward (input)")


def config(shape: str, tokens: int, use_dcmha: bool) -> DCFormerConfig:
    s = SHAPES[shape]
    return DCFormerConfig(
        **s, d_mlp=4 * s["d_model"], d_vocab=VOCAB, n_ctx=tokens, rotary_pct=0.25, use_dcmha=use_dcmha
    )


def make_model(shape: str, tokens: int, use_dcmha: bool) -> HookedDCFormer:
    torch.manual_seed(0)  # the shared weights are drawn first, so the twins share them (init_weights)
    return HookedDCFormer(config(shape, tokens, use_dcmha)).eval().requires_grad_(False)


def make_einsum_model(shape: str, tokens: int) -> HookedDCFormer:
    """The plain-MHA model on dcinterp's einsum-softmax-einsum path (a no-op hook on every layer's pattern keeps
    it there), what TransformerLens computes so that its hooks can see the scores and the pattern."""
    model = make_model(shape, tokens, False)
    for block in model.blocks:
        block.attn.hook_pattern.add_hook(lambda x, hook: None)
    return model


def run(model: HookedDCFormer, kind: str, tokens: torch.Tensor) -> None:
    if kind == "forward":
        model(tokens)
    elif kind == "forward + backward (activations)":
        model.set_use_activation_grads(True)
        model(tokens, return_type="loss").backward()
        model.set_use_activation_grads(False)
    else:
        embeddings = model.embed(tokens).detach().requires_grad_(True)
        model(embeddings, start_at_layer=0, tokens=tokens, return_type="loss").backward()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(models: dict, tokens: torch.Tensor, repeats: int, kinds) -> dict[str, dict[str, list[float]]]:
    """Seconds per (model, kind), the models taking turns in alternating order; one warm-up call each."""
    times = {name: {kind: [] for kind in kinds} for name in models}
    names = list(models)
    for kind in kinds:
        for name in names:
            run(models[name], kind, tokens)
    for repeat in range(repeats):
        for kind in kinds:
            for name in names[::-1] if repeat % 2 else names:
                times[name][kind].append(timed(lambda: run(models[name], kind, tokens)))  # noqa: B023
    return times


def official_forward(path: Path, shape: str, tokens: int):
    """The authors' DCPythia (bench_forward.py's loader) on the same shape, or None where it cannot be built."""
    from bench_forward import official_dcpythia

    s = SHAPES[shape]
    args = argparse.Namespace(
        vocab=VOCAB, dim=s["d_model"], heads=s["n_heads"], layers=s["n_layers"], tokens=tokens, batch=1, device="cpu"
    )
    return official_dcpythia(path, args, torch.float32)


def memory_child(shape: str, tokens: int, use_dcmha: bool) -> None:
    """In a fresh process: peak RssAnon above the weights of one no-hook forward (printed as JSON)."""
    model = make_model(shape, tokens, use_dcmha)
    batch = torch.randint(0, VOCAB, (1, tokens))
    with PeakAnonMemory() as memory:
        model(batch)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"peak_above_weights": memory.peak - memory.baseline, "weights": weights}))


def peak_memory(shape: str, tokens: int, threads: int) -> dict[str, dict]:
    out = {}
    for name, flag in (("DCMHA", "1"), ("MHA", "0")):
        command = [sys.executable, __file__, "--memory-child", shape, str(tokens), flag, "--threads", str(threads)]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        out[name] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="d1024,6.9b")
    parser.add_argument("--tokens", default="512,1024,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--official", type=Path, default=os.environ.get("DCFORMER_OFFICIAL") or None)
    parser.add_argument("--einsum", action="store_true", help="time plain MHA on the einsum path too")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--memory-only", action="store_true", help="only the peak-memory processes")
    parser.add_argument("--memory-child", nargs=3, metavar=("SHAPE", "TOKENS", "DCMHA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        shape, tokens, flag = args.memory_child
        memory_child(shape, int(tokens), flag == "1")
        return
    shapes, token_counts = args.shapes.split(","), [int(t) for t in args.tokens.split(",")]
    print(f"torch {torch.__version__}, {args.threads} threads, load average {os.getloadavg()} at the start")

    if not args.memory_only:
        rows = []
        for shape in shapes:
            for n in token_counts:
                models = {"DCMHA": make_model(shape, n, True), "MHA": make_model(shape, n, False)}
                if args.einsum:
                    models["MHA (einsum)"] = make_einsum_model(shape, n)
                tokens = torch.randint(0, VOCAB, (1, n))
                times = measure(models, tokens, args.repeats, KINDS)
                median = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
                least = {m: {k: min(v) for k, v in t.items()} for m, t in times.items()}
                cells = [
                    f"**{median['DCMHA'][k] / median['MHA'][k]:.2f}x** ({median['DCMHA'][k]:.2f} s / "
                    f"{median['MHA'][k]:.2f} s; minima {least['DCMHA'][k] / least['MHA'][k]:.2f}x)"
                    for k in KINDS
                ]
                rows.append(f"| {shape} | {n:,} | " + " | ".join(cells) + f" | {os.getloadavg()[0]:.1f} |")
                print(rows[-1], flush=True)
                if args.einsum:
                    print(
                        "  DCMHA / MHA (einsum): "
                        + ", ".join(f"{k} {median['DCMHA'][k] / median['MHA (einsum)'][k]:.2f}x" for k in KINDS)
                        + "; MHA (einsum) / MHA (SDPA): "
                        + ", ".join(f"{k} {median['MHA (einsum)'][k] / median['MHA'][k]:.2f}x" for k in KINDS),
                        flush=True,
                    )
                if args.official:
                    official = official_forward(args.official, shape, n)
                    with torch.no_grad():
                        official(tokens)
                        authors = statistics.median(timed(lambda: official(tokens)) for _ in range(args.repeats))  # noqa: B023
                    print(
                        f"  authors' forward {authors:.2f} s: {authors / median['MHA']['forward']:.2f}x MHA, "
                        f"{authors / median['DCMHA']['forward']:.2f}x DCMHA",
                        flush=True,
                    )
                rounded = {m: {k: [round(x, 3) for x in v] for k, v in t.items()} for m, t in times.items()}
                print("  seconds:", json.dumps(rounded), flush=True)
                del models
        print(
            f"\nratios of the medians (and of the minima) over {args.repeats} runs, the two models in turns; "
            f"load average {os.getloadavg()} at the end"
        )
        print("| shape | tokens | " + " | ".join(f"{k}: DCMHA / MHA" for k in KINDS) + " | load |")
        print("|---|---|" + "---|" * len(KINDS) + "---|")
        print("\n".join(rows))

    if not args.no_memory:
        shape = "6.9b" if "6.9b" in shapes else shapes[-1]
        n = max(token_counts)
        memory = peak_memory(shape, n, args.threads)
        dc, mha = (memory[m]["peak_above_weights"] / 2**20 for m in ("DCMHA", "MHA"))
        print(
            f"\npeak RssAnon above the weights, one no-hook forward, {shape}, {n} tokens, fresh processes: "
            f"DCMHA {dc:.0f} MiB, MHA {mha:.0f} MiB, DCMHA / MHA {dc / mha:.2f}x "
            f"(weights {memory['DCMHA']['weights'] / 2**20:.0f} MiB)"
        )


if __name__ == "__main__":
    main()
