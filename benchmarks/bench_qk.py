"""QK attribution (`dcinterp.qk`) at DCPythia-6.9B's shape: time and peak memory against the forward it reads.

    python benchmarks/bench_qk.py [--layers 33] [--seq 32] [--keys 8] [--threads 2] [--max-terms 100000]

The model has DCPythia-6.9B's widths (`dcinterp.random_checkpoint.DCPYTHIA_6_9B`: d_model 4096, 32 heads of 128,
d_mlp 16384, a 50,257-token vocabulary, QK-norm, rotary on a quarter of each head, LayerNorm, parallel blocks)
and --layers blocks that share one block's random weights: the 27 GB of a whole float32 model would not fit this
machine, while the activations, the hooks and every computation are those of a model of that depth. The head
explained sits in the last block, so its query and key sides have 1 + 32 x 33 = 1,057 senders (the count of every
sender of the 32-layer model) and `bias`: 1,058 components, 32 source heads, 5 branches, 75 million terms per key.

Each step runs in a fresh process, which times the forward of layers 0..L-1 with the hooks the attribution reads
(`dcinterp.qk.layer_run`: the baseline, which every attribution runs first) and then the step on that run (its
own forward replaced by the run just made, so the decomposition is timed alone: on a shared machine two runs of a
33-block forward differ by more than the decomposition takes). It reports the step's time, its multiple of the
forward's, and the peak RssAnon of forward and step above what the process held once the model was built
(`dcinterp.memory.PeakAnonMemory`), beside the whole process's peak RssAnon:
  1 key       qk_attribution at one (query, key): every table exact, the top --max-terms terms kept
  K keys      qk_attribution at --keys keys of the query
  contrast    qk_contrast of two keys
  checks      causal_checks at one key (8 checks: 3 components per side through every head, 2 through one;
              26 forwards of layers 0..L-1 with split q/k/v inputs), only when asked (--steps ... checks)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

GiB = 2**30
STEPS = ("1 key", "K keys", "contrast", "checks")


def shared_model(n_layers: int):
    """DCPythia-6.9B's widths with n_layers blocks sharing block 0's random weights (float32, CPU)."""
    from dcinterp import HookedDCFormer
    from dcinterp.loading import config_from_official
    from dcinterp.random_checkpoint import DCPYTHIA_6_9B, scaled

    cfg = config_from_official(scaled(DCPYTHIA_6_9B, n_layer=n_layers), "config.json")
    with torch.device("meta"):
        model = HookedDCFormer(cfg, init=False)
    for module in (model.embed, model.ln_final, model.unembed, model.blocks[0]):
        module.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in [*model.blocks[0].named_parameters(), *model.embed.named_parameters()]:
            if name.endswith(".w"):
                p.fill_(1.0)
            elif name.split(".")[-1].startswith("b"):
                p.normal_(0, 0.02, generator=generator)
            else:
                p.normal_(0, 0.02, generator=generator)
        model.ln_final.w.fill_(1.0)
        model.ln_final.b.zero_()
        model.unembed.W_U.zero_()
    shared = dict(model.blocks[0].named_parameters())
    for block in model.blocks[1:]:
        for name, p in shared.items():
            owner, _, attribute = name.rpartition(".")
            setattr(block.get_submodule(owner) if owner else block, attribute, p)
    model.cfg.device = "cpu"
    return model.eval().requires_grad_(False)


def measure(step: str, layers: int, seq: int, keys: int, threads: int, max_terms: int) -> dict:
    """Run in a fresh process: build the model, time the forward the step reads, then the step on that run."""
    import dcinterp.qk.attribution
    import dcinterp.qk.contrast
    from dcinterp.memory import PeakAnonMemory
    from dcinterp.qk import causal_checks, component_names, layer_run, qk_attribution, qk_contrast

    torch.set_num_threads(threads)
    model = shared_model(layers)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    layer, head, t = layers - 1, 11, seq - 1
    key_positions = {"1 key": [0], "K keys": list(range(keys)), "contrast": [0, 1], "checks": [0]}[step]
    built = PeakAnonMemory.current()
    with PeakAnonMemory() as memory:
        start = time.perf_counter()
        run = layer_run(model, tokens, layer, t, [t, *key_positions])
        forward = time.perf_counter() - start
        if step != "checks":  # the step's own forward is this run: time the decomposition alone
            dcinterp.qk.attribution.layer_run = dcinterp.qk.contrast.layer_run = lambda *args: run
        work = {
            "1 key": lambda: qk_attribution(model, tokens, layer, head, t, 0, max_terms=max_terms),
            "K keys": lambda: qk_attribution(model, tokens, layer, head, t, key_positions, max_terms=max_terms),
            "contrast": lambda: qk_contrast(model, tokens, layer, head, t, 0, 1, max_terms=max_terms),
            "checks": lambda: causal_checks(model, qk_attribution(model, tokens, layer, head, t, 0, max_terms=1000)),
        }
        start = time.perf_counter()
        result = work[step]()
        seconds = time.perf_counter() - start
    extra = {}
    if step != "checks":
        extra = {"rows": len(result.terms), "relative_gap": result.relative_gap}
    else:
        extra = {"largest frozen - estimate": float((result["frozen"] - result["estimate"]).abs().max())}
    return {
        "step": step,
        "seconds": seconds,
        "forward_seconds": forward,
        "peak_above_model_gib": (memory.peak - built) / GiB,
        "process_peak_gib": memory.peak / GiB,
        "components": len(component_names(model, layer)),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=33, help="blocks; the head is in the last (default 33)")
    parser.add_argument("--seq", type=int, default=32, help="prompt length (default 32)")
    parser.add_argument("--keys", type=int, default=8, help="keys of the K-keys step (default 8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-terms", type=int, default=100_000)
    parser.add_argument("--steps", nargs="+", default=list(STEPS[:3]), choices=STEPS)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one step in this process (the fresh process)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.layers, args.seq, args.keys, args.threads, args.max_terms)))
        return
    print(
        f"DCPythia-6.9B widths, {args.layers} blocks (shared weights), head L{args.layers - 1}H11, prompt of "
        f"{args.seq} tokens, {args.threads} thread(s), float32, top {args.max_terms} terms kept"
    )
    rows = []
    for step in args.steps:
        command = [sys.executable, __file__, "--one", step, "--layers", str(args.layers), "--seq", str(args.seq)]
        command += ["--keys", str(args.keys), "--threads", str(args.threads), "--max-terms", str(args.max_terms)]
        row = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        rows.append(row)
        name = f"{args.keys} keys" if step == "K keys" else step
        extra = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in list(row.items())[6:])
        base = row["forward_seconds"]
        print(
            f"{name:>9}: {row['seconds']:7.2f} s after the forward it reads ({base:.2f} s, same process; "
            f"{row['seconds'] / base:.2f}x); peak RssAnon of both {row['peak_above_model_gib']:.2f} GiB above the "
            f"model ({row['process_peak_gib']:.2f} GiB in all); {row['components']} components"
            + (f"; {extra}" if extra else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
