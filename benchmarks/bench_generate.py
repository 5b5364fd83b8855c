"""Generation speed with and without the key-value cache, DCMHA against plain MHA of the same size, in one run.

    python benchmarks/bench_generate.py [--layers 8 --dim 1024 --heads 16 --prompt 1024 --new 32]
                                        [--window 256 --window-type LG] [--device cuda --dtype bfloat16]

A random DCPythia-style model (LayerNorm, parallel residual, GELU MLP, QK-norm, rotary on a quarter of each head,
local windows of `--window` keys in every other layer as DCPythia-6.9B) and its plain-MHA twin (`use_dcmha=False`,
same windows). For each: `generate` greedily from a `--prompt`-token prompt,
- with the cache: the prefill (the prompt's forward into the cache) and the time per new token (each new token
  alone against the cache), over `--new` tokens, `--repeats` times;
- without the cache: the time per new token over `--uncached` tokens (each step reruns prompt and new tokens).
The two models take turns at every step, so that a change in the machine's load hits both alike; medians are
reported, and ratios of times measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.kv_cache import DCFormerKeyValueCache


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn, *args, **kwargs):
    """(seconds, result) of fn(*args, **kwargs)."""
    sync(device)
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    sync(device)
    return time.perf_counter() - start, out


@torch.no_grad()
def measure(models: dict[str, HookedDCFormer], prompt: torch.Tensor, args) -> dict[str, dict[str, list[float]]]:
    """Per model: prefill seconds, and seconds of each cached and uncached generation step (greedy). The models
    take turns at every step (in alternating order), so that a change in the machine's load hits both alike."""
    times = {name: {"prefill": [], "decode": [], "uncached": []} for name in models}
    names = list(models)
    for repeat in range(args.repeats):
        caches, tokens = {}, {}
        for name in names[::-1] if repeat % 2 else names:
            caches[name] = DCFormerKeyValueCache.init_cache(models[name].cfg, args.device, prompt.shape[0])
            seconds, logits = timed(args.device, models[name], prompt, past_kv_cache=caches[name])
            times[name]["prefill"].append(seconds)
            tokens[name] = logits[:, -1].argmax(-1, keepdim=True)
        for step in range(args.new - 1):
            for name in names[::-1] if step % 2 else names:
                seconds, logits = timed(args.device, models[name], tokens[name], past_kv_cache=caches[name])
                times[name]["decode"].append(seconds)
                tokens[name] = logits[:, -1].argmax(-1, keepdim=True)
    sequence = prompt
    for step in range(args.uncached):  # what generate(use_past_kv_cache=False) runs at each step
        for name in names[::-1] if step % 2 else names:
            seconds, logits = timed(args.device, models[name], sequence)
            times[name]["uncached"].append(seconds)
        sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--window-type", default="LG", help="LG (DCPythia), LGLL (DCFormer++), none: all global")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=32, help="new tokens with the cache")
    parser.add_argument("--uncached", type=int, default=2, help="new tokens without the cache")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    window_type = None if args.window_type.lower() == "none" else args.window_type
    cfg = DCFormerConfig(
        n_layers=args.layers,
        d_model=args.dim,
        n_heads=args.heads,
        d_head=args.dim // args.heads,
        d_mlp=4 * args.dim,
        d_vocab=args.vocab,
        n_ctx=args.prompt + args.new,
        rotary_pct=0.25,
        use_qk_norm=True,
        window_size=args.window if window_type else None,
        window_type=window_type,
        dtype=args.dtype,
    )
    models = {}
    for name, use_dcmha in (("DCMHA", True), ("MHA", False)):
        torch.manual_seed(0)
        models[name] = (
            HookedDCFormer(DCFormerConfig(**{**cfg.to_dict(), "use_dcmha": use_dcmha})).to(args.device, dtype).eval()
        )
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), device=args.device)

    warm_up = argparse.Namespace(**{**vars(args), "repeats": 1, "new": 3, "uncached": 0})
    measure(models, prompt[:, :64], warm_up)
    runs = measure(models, prompt, args)
    result = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in runs.items()}

    print(
        f"{args.layers} layers, d_model {args.dim}, {args.heads} heads, vocab {args.vocab}, window "
        f"{args.window if window_type else '-'} ({window_type or 'all global'}), prompt {args.prompt}, batch "
        f"{args.batch}, {args.device} {args.dtype}, torch threads {torch.get_num_threads()}; median of "
        f"{args.repeats} prefills, {args.repeats * (args.new - 1)} cached steps, {args.uncached} uncached steps"
    )
    print(
        f"{'':6s} {'prefill s':>10s} {'cached ms/token':>16s} {'tokens/s':>9s} {'uncached ms/token':>18s} "
        f"{'tokens/s':>9s} {'uncached / cached':>18s}"
    )
    for name, r in result.items():
        print(
            f"{name:6s} {r['prefill']:10.2f} {1000 * r['decode']:16.1f} {1 / r['decode']:9.2f} "
            f"{1000 * r['uncached']:18.1f} {1 / r['uncached']:9.3f} {r['uncached'] / r['decode']:17.1f}x"
        )
    dc, mha = result["DCMHA"], result["MHA"]
    print(
        f"DCMHA / MHA time per token: cached {dc['decode'] / mha['decode']:.2f}x, prefill "
        f"{dc['prefill'] / mha['prefill']:.2f}x, uncached {dc['uncached'] / mha['uncached']:.2f}x"
    )


if __name__ == "__main__":
    main()
