"""Forward-pass cost of HookedDCFormer, as ratios against baselines measured in the same run.

    python benchmarks/bench_forward.py [--official PATH/TO/DCFormer/pytorch/dcpythia] [--device cuda --dtype bfloat16]

Measures, on a random DCPythia-style model (default: 4 layers, d_model 256, 8 heads, 512 tokens, batch 2):
- the forward with no hooks attached;
- `run_with_cache` of every hook point (all branch outputs materialised);
- the plain-MHA model of the same size (`use_dcmha=False`);
- with --official, the authors' PyTorch DCPythia (`modeling_dcpythia.py` from a local clone of
  Caiyun-AI/DCFormer; its code is imported from that path, nothing is downloaded), prefill path, same config.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

from dcinterp import DCFormerConfig, HookedDCFormer


def timeit(fn, repeats: int, device: str) -> float:
    """Median wall time of fn() in seconds, after two warm-up calls."""

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def official_dcpythia(path: Path, args, dtype):
    """The authors' DCPythia with random weights, ready for a prefill forward without KV cache."""
    sys.path.insert(0, str(path))
    configuration = importlib.import_module("configuration_dcpythia")
    modeling = importlib.import_module("modeling_dcpythia")
    config = configuration.DCPythiaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_head=args.heads,
        n_local_heads=args.heads,
        head_dim=args.dim // args.heads,
        n_layer=args.layers,
        intermediate_size=4 * args.dim,
        block_size=args.tokens,
        rotary_pct=0.25,
        use_qk_norm=True,
        window_size=None,
        window_type=None,
        use_dcmha=True,
        is_training=False,
    )
    model = modeling.DCPythia(config).to(args.device, dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.setup_caches(max_batch_size=args.batch, max_seq_length=args.tokens, set_kv_cache=False)
    return lambda tokens: model(tokens, return_tensor=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--official", type=Path, help="folder holding the authors' modeling_dcpythia.py")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    cfg = DCFormerConfig(
        n_layers=args.layers,
        d_model=args.dim,
        n_heads=args.heads,
        d_head=args.dim // args.heads,
        d_mlp=4 * args.dim,
        d_vocab=args.vocab,
        n_ctx=args.tokens,
        rotary_pct=0.25,
        dtype=args.dtype,
    )
    dcmha = HookedDCFormer(cfg).to(args.device, dtype).eval()
    mha = HookedDCFormer(DCFormerConfig(**{**cfg.to_dict(), "use_dcmha": False})).to(args.device, dtype).eval()
    tokens = torch.randint(0, args.vocab, (args.batch, args.tokens), device=args.device)

    with torch.no_grad():
        results = {
            "HookedDCFormer, no hooks": timeit(lambda: dcmha(tokens), args.repeats, args.device),
            "HookedDCFormer, run_with_cache (all hooks)": timeit(
                lambda: dcmha.run_with_cache(tokens), args.repeats, args.device
            ),
            "plain MHA, same size": timeit(lambda: mha(tokens), args.repeats, args.device),
        }
        if args.official:
            official = official_dcpythia(args.official, args, dtype)
            results["authors' DCPythia (prefill)"] = timeit(lambda: official(tokens), args.repeats, args.device)

    base = results["HookedDCFormer, no hooks"]
    print(
        f"{args.layers} layers, d_model {args.dim}, {args.heads} heads, {args.tokens} tokens, batch {args.batch}, "
        f"{args.device} {args.dtype}, torch threads {torch.get_num_threads()}"
    )
    print(f"{'':45s} {'ms':>9s} {'ratio to no-hook forward':>26s}")
    for name, seconds in results.items():
        print(f"{name:45s} {1000 * seconds:9.1f} {seconds / base:26.2f}")


if __name__ == "__main__":
    main()
