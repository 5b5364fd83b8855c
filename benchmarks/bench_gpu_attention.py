"""The fused DCMHA attention alone on a GPU: equal to DCMHA's formulas, and its time and memory against torch's SDPA.

    python benchmarks/bench_gpu_attention.py            # checks, then the table (one H100: about 3 minutes)
    python benchmarks/bench_gpu_attention.py --quick    # 2,048 tokens and one decoding step only

One attention layer at DCPythia-6.9B's width (32 heads of 128, rank 2, every branch of both stages), bfloat16, batch 1,
causal: the fused Triton kernels (`dcinterp.dcmha.maps.fused_dcmha`: the forward, and with gradients the forward and
backward, through the cross-head maps), the materialised path's arithmetic with every [b, h, t, s] tensor
(`dcinterp.dcmha.materialised.attend`: no hook), and plain attention by
`scaled_dot_product_attention` (SDPA) on the same q, k, v. Forward; forward + backward to q, k, v (and to every
dynamic weight for DCMHA); one decoding step (1 new query against a cache). Medians of 10 timed runs after warm-up (CUDA
events); peak memory above the inputs. The dynamic weights' projections and the rest of the model are not in these
numbers (benchmarks/bench_gpu_dcmha.py times whole models).

Before timing, the fused path is checked on this GPU against the formulas in float64 (float32 inputs: at most 4 times
the float32 formulas' own error plus 8 float32 units of the scale; bfloat16: at most 2 times the bfloat16 formulas').

Needs only torch and triton: where dcinterp's other dependencies are not installed, the kernels' file is loaded by
its path. Prints JSON lines, then a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def load(module: str):
    """dcinterp.dcmha.<module>; where dcinterp's other dependencies are not installed, its file by path (the kernels'
    and the materialised forms' modules need only torch, triton and jaxtyping)."""
    try:
        return importlib.import_module(f"dcinterp.dcmha.{module}")
    except ImportError:
        path = Path(__file__).resolve().parents[1] / "dcinterp" / "dcmha" / f"{module}.py"
        spec = importlib.util.spec_from_file_location(module, path)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module] = loaded
        spec.loader.exec_module(loaded)
        return loaded


def inputs(b, t, h, e, rank, past=0, dtype=torch.float32, seed=0, device="cuda"):
    """q, k, v and both stages' dynamic weights of the sizes the model gives them (w1 RMS-normalised, gates tanh)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device)

    s = past + t
    q, k, v = draw(b, t, h, e), draw(b, s, h, e), draw(b, s, h, e)
    stages = []
    for _ in ("pre", "post"):
        qw1, kw1 = draw(b, t, rank, h), draw(b, s, rank, h)
        qw1, kw1 = (w / w.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() for w in (qw1, kw1))
        stages.append((qw1, draw(b, t, rank, h, scale=0.3), kw1, draw(b, s, rank, h, scale=0.3),
                       draw(b, t, h).tanh(), draw(b, s, h).tanh()))  # fmt: skip
    return [x.to(dtype) for x in (q, k, v)], [tuple(w.to(dtype) for w in st) for st in stages]


def compose(x, weights):
    qw1, qw2, kw1, kw2, qg, kg = weights
    out = x * (1 + qg.transpose(1, 2)[:, :, :, None] + kg.transpose(1, 2)[:, :, None, :])
    out = out + torch.einsum("brts,btrm->bmts", torch.einsum("bnts,btrn->brts", x, qw1), qw2)
    return out + torch.einsum("brts,bsrm->bmts", torch.einsum("bnts,bsrn->brts", x, kw1), kw2)


def formulas(q, k, v, pre, post, past=0):
    """DCMHA with every [b, h, t, s] tensor, causal."""
    t, s = q.shape[1], k.shape[1]
    scores = compose(torch.einsum("bthe,bshe->bhts", q, k) / math.sqrt(q.shape[-1]), pre)
    hidden = torch.arange(s, device=q.device)[None, :] > torch.arange(past, past + t, device=q.device)[:, None]
    pattern = scores.masked_fill(hidden, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhts,bshe->bthe", compose(pattern, post), v)


def sdpa(q, k, v, pre=None, post=None, past=0):
    causal = q.shape[1] == k.shape[1]
    return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal).transpose(1, 2)


def gradients(fn, q, k, v, pre, post, past=0):
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, *pre, *post)]
    z = fn(*leaves[:3], tuple(leaves[3:9]), tuple(leaves[9:]), past)
    dz = torch.randn(z.shape, generator=torch.Generator(device="cpu").manual_seed(1), dtype=torch.float64)
    return [z.detach(), *torch.autograd.grad(z, leaves, dz.to(z))]


def check(fused, dtype, b, t, h, e, rank, past=0, with_gradients=True):
    """Largest error ratio (fused error / allowed) over z and every gradient; forward only if past > 0 or not
    `with_gradients` (then no input requires grad: the kernels' no-gradient forward)."""
    exact_in = inputs(b, t, h, e, rank, past, torch.float64)
    cast = inputs(b, t, h, e, rank, past, dtype)
    if past or not with_gradients:
        outs = [[fn(*x[0], *x[1], past=past)] for fn, x in ((fused, cast), (formulas, cast), (formulas, exact_in))]
    else:
        outs = [gradients(fn, *x[0], *x[1]) for fn, x in ((fused, cast), (formulas, cast), (formulas, exact_in))]
    factor, floor = (4, 8 * torch.finfo(torch.float32).eps) if dtype == torch.float32 else (2, 0.0)
    worst = 0.0
    for new, single, exact in zip(*outs, strict=True):
        error = (new.double() - exact).abs().max().item()
        allowed = factor * (single.double() - exact).abs().max().item() + floor * exact.abs().max().item()
        worst = max(worst, error / allowed)
    return worst


def timed(fn, repeats=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(name, fn, tokens, past, backward, h=32, e=128, rank=2):
    (q, k, v), (pre, post) = inputs(1, tokens, h, e, rank, past, torch.bfloat16)
    if backward:
        leaves = [x.requires_grad_(True) for x in (q, k, v, *pre, *post)]
        leaves = leaves[:3] if fn is sdpa else leaves

        def step():
            z = fn(q, k, v, pre, post, past)
            torch.autograd.grad(z, leaves, torch.ones_like(z))
    else:

        def step():
            with torch.no_grad():
                fn(q, k, v, pre, post, past)

    try:
        step()  # the kernels' compilation, outside the measurement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = timed(step)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return dict(
            model=name, tokens=tokens, past=past, backward=backward, ms=None, peak_mib=None, note="out of memory"
        )
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return dict(model=name, tokens=tokens, past=past, backward=backward, ms=round(ms, 3), peak_mib=round(peak, 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,048 tokens and one decoding step only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_attention: no CUDA device: no GPU number is measured here")
        return 2
    kernels, materialised = load("maps"), load("materialised")
    reason = kernels.available(torch.device("cuda"))
    if reason:
        print(f"bench_gpu_attention: the fused kernels cannot run: {reason}")
        return 2

    def fused(q, k, v, pre, post, past=0):
        return kernels.fused_dcmha(q, k, v, pre, post, window=None, official=False, past=past)

    def materialised_path(q, k, v, pre, post, past=0):  # what dcinterp's materialised path computes, without hooks
        t, s = q.shape[1], k.shape[1]
        hidden = torch.arange(s, device=q.device)[None, :] > torch.arange(past, past + t, device=q.device)[:, None]
        mask = torch.zeros(t, s, device=q.device, dtype=q.dtype).masked_fill(hidden, torch.finfo(q.dtype).min)
        return materialised.attend(q, k, v, mask, pre, post)

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {sys.modules['triton'].__version__}")
    checks = [(torch.float32, 2, 77, 6, 64, 2, 0), (torch.float32, 1, 200, 32, 128, 2, 0),
              (torch.float32, 2, 5, 4, 64, 1, 300), (torch.bfloat16, 1, 300, 32, 128, 2, 0)]  # fmt: skip
    for dtype, b, t, h, e, rank, past in checks:
        ratio = check(fused, dtype, b, t, h, e, rank, past)
        shape = dict(dtype=str(dtype).split(".")[1], batch=b, tokens=t, heads=h, head_dim=e, rank=rank, past=past)
        print(json.dumps(dict(check="fused vs formulas, judged by float64", **shape, ratio=round(ratio, 3),
                              passed=ratio <= 1)))  # fmt: skip
    rows = []
    prompts = [2048] if args.quick else [1024, 2048, 4096, 8192]
    for tokens in prompts:
        for backward in (False, True):
            models = [("fused", fused), ("materialised", materialised_path), ("sdpa", sdpa)]
            for name, fn in models:
                rows.append(measure(name, fn, tokens, 0, backward))
                print(json.dumps(rows[-1]), flush=True)
    for past in [1024] if args.quick else [1024, 4096]:
        for name, fn in (("fused", fused), ("materialised", materialised_path), ("sdpa", sdpa)):
            rows.append(measure(name, fn, 1, past, False))
            print(json.dumps(rows[-1]), flush=True)
    columns = [
        "tokens (past)",
        "pass",
        "fused ms",
        "materialised ms",
        "SDPA ms",
        "fused / SDPA",
        "fused / materialised",
        "fused maps ms (fwd+bwd)",
        "fused maps / SDPA",
    ]
    print(
        "\n| "
        + " | ".join([*columns, "peak MiB fused / materialised / SDPA / fused maps"])
        + " |\n"
        + "|---" * (len(columns) + 1)
        + "|"
    )
    keys = sorted({(r["tokens"], r["past"], r["backward"]) for r in rows})
    for tokens, past, backward in keys:
        got = {r["model"]: r for r in rows if (r["tokens"], r["past"], r["backward"]) == (tokens, past, backward)}
        ms = {m: got[m]["ms"] if m in got else None for m in ("fused", "materialised", "sdpa", "fused maps")}

        def ratio(a, b):
            return f"{ms[a] / ms[b]:.2f}x" if ms[a] and ms[b] else "-"

        peaks = " / ".join(
            str(got[m]["peak_mib"]) if m in got else "-" for m in ("fused", "materialised", "sdpa", "fused maps")
        )
        cells = [f"{tokens} ({past})", "fwd+bwd" if backward else "fwd", ms["fused"], ms["materialised"] or "-"]
        cells += [ms["sdpa"], ratio("fused", "sdpa"), ratio("fused", "materialised")]
        cells += [ms["fused maps"] or "-", ratio("fused maps", "sdpa"), peaks]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
