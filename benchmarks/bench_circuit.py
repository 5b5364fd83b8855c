"""EAP and EAP-IG against exact edge patching: time and peak memory, edges counted.

    python benchmarks/bench_circuit.py [--shapes synth,1b] [--pairs 16] [--n-steps 5] [--sample 8] [--threads 2]

For each shape, in a fresh process per measurement (peak RSS is the process's own, `ru_maxrss`):
  eap:     edge scores from one forward on each prompt and one forward+backward (`discovery.edge_scores`),
  eap-ig:  the same with --n-steps interpolation steps, --ig-batch-size steps per pass,
  exact:   exact patching of --sample single edges (one forward over the pairs each, after the corrupted run),
           extrapolated to every edge of the graph.
Shapes: `synth` is the embedded dcpythia-synth on same-person : superclass contrast pairs (2 tasks x --pairs/2);
`1b` a random DCPythia with Pythia-1B's shape (16 layers, d_model 2048, 8 heads, d_mlp 8192) in float32 on the CPU,
on random token pairs of 48 positions (1 pair); `6.9b-4l` DCPythia-6.9B's width with 4 of its layers, the same way
(activation memory per layer, to extrapolate to 32). Prints one row per (shape, measurement) and the ratios
exact-all / eap and exact-all / eap-ig measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

SHAPES = {
    "synth": None,
    "1b": dict(
        n_layers=16,
        d_model=2048,
        n_heads=8,
        d_head=256,
        d_mlp=8192,
        d_vocab=50304,
        window_size=256,
        window_type="LG",
        dcmha_rank=2,
        dyn_hidden_dim=32,
    ),
    # DCPythia-6.9B's width (d_model 4096, 32 heads, d_mlp 16384) with 4 of its 32 layers: activation memory per layer
    "6.9b-4l": dict(
        n_layers=4,
        d_model=4096,
        n_heads=32,
        d_head=128,
        d_mlp=16384,
        d_vocab=50304,
        window_size=256,
        window_type="LG",
        dcmha_rank=2,
        dyn_hidden_dim=128,
    ),
}


def setup(shape: str, pairs: int):
    import torch

    from dcinterp import DCFormerConfig, HookedDCFormer
    from dcinterp.synth import contrast_pairs, tokenize_pairs
    from dcinterp.synth.contrast import PairTokens

    if shape == "synth":
        model = HookedDCFormer.from_pretrained("dcpythia-synth")
        tokens = tokenize_pairs(
            [p for task in (2, 3) for p in contrast_pairs(task, n=max(1, pairs // 2), tokenizer=model.tokenizer)],
            model.tokenizer,
        )
    else:
        torch.manual_seed(0)
        model = HookedDCFormer(DCFormerConfig(**SHAPES[shape]))
        generator = torch.Generator().manual_seed(0)
        clean = torch.randint(0, model.cfg.d_vocab, (1, 48), generator=generator)
        corrupt = clean.clone()
        corrupt[:, 20] = (corrupt[:, 20] + 1) % model.cfg.d_vocab
        tokens = PairTokens(clean, corrupt, torch.tensor([5]), torch.tensor([6]), torch.tensor([47]))
    return model.eval().requires_grad_(False), tokens


def worker(
    shape: str, what: str, pairs: int, n_steps: int, sample: int, threads: int, ig_batch_size: int | None
) -> dict:
    import torch

    from dcinterp.discovery import CircuitEvaluator, build_graph, edge_scores

    torch.set_num_threads(threads)
    model, tokens = setup(shape, pairs)
    graph = build_graph(model)
    start = time.perf_counter()
    if what in ("eap", "eap-ig"):
        edge_scores(model, tokens, what, n_steps=n_steps, graph=graph, batch_size=None, ig_batch_size=ig_batch_size)
        seconds = time.perf_counter() - start
        per_edge = None
    else:
        evaluator = CircuitEvaluator(model, graph, tokens)
        setup_seconds = time.perf_counter() - start
        step = max(1, len(graph) // sample)
        chosen = list(range(0, len(graph), step))[:sample]
        start = time.perf_counter()
        evaluator.single_edge_effects(chosen)
        per_edge = (time.perf_counter() - start) / len(chosen)
        seconds = setup_seconds + per_edge * len(graph)
    return {
        "shape": shape,
        "what": what,
        "edges": len(graph),
        **graph.counts(),
        "pairs": int(tokens.clean.shape[0]),
        "positions": int(tokens.clean.shape[1]),
        "seconds": seconds,
        "per_edge": per_edge,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="synth,1b")
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--n-steps", type=int, default=5)
    parser.add_argument("--sample", type=int, default=8, help="edges patched exactly, to extrapolate")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ig-batch-size", type=int, default=1, help="EAP-IG steps per pass (memory bound)")
    parser.add_argument("--worker", nargs=2, metavar=("SHAPE", "WHAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.pairs, args.n_steps, args.sample, args.threads, args.ig_batch_size)))
        return
    print(f"{'shape':6} {'what':7} {'edges':>7} {'compose':>7} {'pairs':>5} {'seconds':>9} {'peak RSS':>9}")
    for shape in args.shapes.split(","):
        rows = {}
        for what in ("eap", "eap-ig", "exact"):
            command = [
                sys.executable,
                __file__,
                "--worker",
                shape,
                what,
                "--pairs",
                str(args.pairs),
                "--n-steps",
                str(args.n_steps),
                "--sample",
                str(args.sample),
                "--threads",
                str(args.threads),
                "--ig-batch-size",
                str(args.ig_batch_size),
            ]
            row = json.loads(
                subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            )
            rows[what] = row
            label = "exact*" if what == "exact" else what
            print(
                f"{shape:6} {label:7} {row['edges']:>7} {row['compose_edges']:>7} {row['pairs']:>5} "
                f"{row['seconds']:>9.1f} {row['peak_rss_gib']:>7.2f} GiB",
                flush=True,
            )
        exact = rows["exact"]
        print(
            f"{shape}: exact patching of all {exact['edges']} edges (extrapolated from {args.sample}, "
            f"{exact['per_edge']:.3f} s each) / eap = {exact['seconds'] / rows['eap']['seconds']:.0f}x, "
            f"/ eap-ig ({args.n_steps} steps) = {exact['seconds'] / rows['eap-ig']['seconds']:.0f}x"
        )


if __name__ == "__main__":
    main()
