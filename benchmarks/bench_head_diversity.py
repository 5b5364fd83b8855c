"""`head_diversity` on one random layer of DCPythia-6.9B's shape: every component, the first k, and the naive
concatenate-then-SVD.

    python benchmarks/bench_head_diversity.py [--d-model 4096 --n-heads 32 --d-head 128] [--components 128]
                                              [--weights gaussian|decaying] [--naive-d-model 4096]
                                              [--threads 1] [--device cpu] [--layers 32] [--floor]

The first k components (`layer_diversity(components=k)`, block Lanczos with the total from the trace) are timed
on the whole layer and compared with every component (`components="all"`, full eigendecompositions): the largest
difference over the first k entries of both curves, and the error bound the Lanczos run reported. --weights:
"gaussian" (i.i.d. weights: a flat spectrum, the hardest case for Lanczos) or "decaying" (each d_model direction
scaled by i^-0.5, so that the circuits' spectra decay as trained weights' do).

Both sides compute the cumulative captured variance of one layer's concatenated QK circuits, in float32:
  ours:  `dcinterp.circuits.concat_spectrum` (per-head d_head x d_head Grams, then one
         min(d_model, n_heads * d_head)-sized Gram eigendecomposition; the concatenation is never built);
  naive: torch.cat of the n_heads d_model x d_model circuits (d_model x n_heads * d_model), then svdvals.
`ours` is also timed on the whole layer (QK and OV, `layer_diversity`). Each measurement runs in its own
subprocess, which reports its time and its peak memory above what it held after making the weights (peak RSS
on the CPU, `torch.cuda.max_memory_allocated` on a GPU). The naive side can be run at a smaller d_model
(`--naive-d-model`, same heads and head size ratio kept: d_head scaled with d_model) when the full shape does
not fit in time or memory; the ratio is then against ours at that same reduced shape, and ours is still
reported at full shape. At equal shapes the two curves are compared.

--layers N times the first k components of N layers in one process, each layer's random weights made before its
clock starts (a whole model's weights would not fit in memory): the time `head_diversity` takes on a model of
N such layers.

--floor measures what an exact answer costs at the least on one layer (QK and OV), against the budget of a
minute for 32 layers (1.875 s per layer): the dense path's two steps (the Gram matrix, `gram_lower`, and its
eigenvalues, `eigvalsh`), and block Lanczos on Z^T Z (blocks of 32, the local three-term recurrence then one
full Gram-Schmidt pass, Z and Z^T both row-major, as `top_spectrum`) stopped by an oracle, the exact spectrum,
at the first block where the true error of every cumulative share of the first k is below 1e-6; only its
products and orthogonalisation are timed (no Ritz values, no bound, no stopping rule), so no Krylov run that
checks its own error can be faster.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from dcinterp.circuits import concat_factor, concat_spectrum, cumulative_variance, gram_lower, layer_diversity


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def naive_spectrum(W_Q: torch.Tensor, W_K: torch.Tensor) -> torch.Tensor:
    M = torch.cat([W_Q[h] @ W_K[h].T for h in range(W_Q.shape[0])], dim=1)  # [d_model, n_heads * d_model]
    return torch.linalg.svdvals(M) ** 2


def random_layer(d_model: int, n_heads: int, d_head: int, device: str, weights: str, seed: int = 0):
    """W_Q, W_K, W_V, W_O of one layer: i.i.d. Gaussian, or each d_model direction scaled by i^-0.5."""
    torch.manual_seed(seed)
    W = [torch.randn(n_heads, d_model, d_head, device=device) * 0.02 for _ in range(3)]
    W_O = torch.randn(n_heads, d_head, d_model, device=device) * 0.02
    if weights == "decaying":
        scale = torch.arange(1, d_model + 1, device=device, dtype=torch.float32) ** -0.5
        W = [w * scale[:, None] for w in W]
        W_O = W_O * scale
    return (*W, W_O)


def measure_layers(
    layers: int, d_model: int, n_heads: int, d_head: int, device: str, threads: int, weights: str, components: int
) -> dict:
    """Run in a fresh process: the first k components of `layers` layers, timed without making the weights."""
    torch.set_num_threads(threads)
    base_rss, seconds, bound = rss_mib(), 0.0, 0.0
    for layer in range(layers):
        W_Q, W_K, W_V, W_O = random_layer(d_model, n_heads, d_head, device, weights, seed=layer)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        qk, ov, bounds = layer_diversity(W_Q, W_K, W_V, W_O, components=components, return_bounds=True)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - start
        bound = max(bound, *bounds)
    return {"layers": layers, "seconds": seconds, "peak_mib": peak_rss_mib() - base_rss, "bound": bound}


def timed(device: str, fn, *args):
    """(seconds, fn(*args))."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def oracle_krylov_seconds(
    Z: torch.Tensor, exact: torch.Tensor, k: int, device: str, tol: float = 1e-6, block: int = 32
):
    """Block Lanczos on the smaller Gram matrix of Z, grown until the first k Ritz values' cumulative shares are
    within `tol` of the exact ones (`exact`: every eigenvalue, descending): (seconds of the products and the
    orthogonalisation, Krylov vectors)."""
    small_side = Z.shape[1] <= Z.shape[0]
    n = min(Z.shape)
    seconds, (Z, Zt) = timed(device, lambda: (Z.contiguous(), Z.T.contiguous()))

    def apply(X):
        return Zt @ (Z @ X) if small_side else Z @ (Zt @ X)

    total, target = float(exact.sum()), exact[:k].cumsum(0) / float(exact.sum())
    V, AV = Z.new_empty(n, n), Z.new_empty(n, n)
    V[:, :block] = torch.linalg.qr(torch.randn(n, block, device=device))[0]
    seconds += timed(device, lambda: AV[:, :block].copy_(apply(V[:, :block])))[0]
    m = block
    while m + block <= n:
        if m >= k:  # the oracle: not timed
            theta = torch.linalg.eigvalsh((V[:, :m].T @ AV[:, :m]).double()).flip(0)[:k]
            if (theta.cumsum(0) / total - target).abs().max() <= tol:
                break

        def grow(m=m):
            last, local = slice(m - block, m), slice(max(0, m - 2 * block), m)
            W = AV[:, last] - V[:, local] @ (V[:, local].T @ AV[:, last])
            W -= V[:, :m] @ (V[:, :m].T @ W)
            V[:, m : m + block] = torch.linalg.qr(W)[0]
            AV[:, m : m + block] = apply(V[:, m : m + block])

        seconds += timed(device, grow)[0]
        m += block
    return seconds, m


def measure_floor(
    d_model: int, n_heads: int, d_head: int, device: str, threads: int, weights: str, components: int
) -> dict:
    """Run in a fresh process: the dense path's two steps and the oracle-stopped Krylov run on one layer."""
    torch.set_num_threads(threads)
    W_Q, W_K, W_V, W_O = random_layer(d_model, n_heads, d_head, device, weights)
    out = {"gram": 0.0, "eigvalsh": 0.0, "krylov": 0.0, "krylov_vectors": []}
    for left, right in ((W_Q, W_K.transpose(-2, -1)), (W_O.transpose(-2, -1), W_V.transpose(-2, -1))):
        Z = concat_factor(left, right)
        seconds, gram = timed(device, gram_lower, Z)
        out["gram"] += seconds
        seconds, eigenvalues = timed(device, torch.linalg.eigvalsh, gram)
        out["eigvalsh"] += seconds
        del gram
        exact = torch.linalg.eigvalsh(gram_lower(Z.double())).flip(0)
        seconds, vectors = oracle_krylov_seconds(Z, exact, components, device)
        out["krylov"] += seconds
        out["krylov_vectors"].append(vectors)
    return out


def measure(
    side: str,
    d_model: int,
    n_heads: int,
    d_head: int,
    device: str,
    threads: int,
    weights: str = "gaussian",
    components: int = 128,
) -> dict:
    """Run in a fresh process: time and peak memory of one side on one random layer."""
    torch.set_num_threads(threads)
    W_Q, W_K, W_V, W_O = random_layer(d_model, n_heads, d_head, device, weights)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss = rss_mib()
    start = time.perf_counter()
    if side == "ours":
        curve = cumulative_variance(concat_spectrum(W_Q, W_K.transpose(-2, -1)))
    elif side == "ours_layer":
        curve, ov, bounds = layer_diversity(W_Q, W_K, W_V, W_O, components="all", return_bounds=True)
    elif side == "top_layer":
        curve, ov, bounds = layer_diversity(W_Q, W_K, W_V, W_O, components=components, return_bounds=True)
    else:
        curve = cumulative_variance(naive_spectrum(W_Q, W_K))
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = peak_rss_mib() - base_rss
    k = min(d_model, n_heads * d_head)
    out = {
        "side": side,
        "shape": [d_model, n_heads, d_head],
        "seconds": seconds,
        "peak_mib": peak,
        "curve": curve[:k].cpu().tolist(),
    }
    if side in ("ours_layer", "top_layer"):
        out["ov"], out["bound"] = ov[:k].cpu().tolist(), max(bounds)
    return out


def run_child(side: str, d_model: int, n_heads: int, d_head: int, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        side,
        "--d-model",
        str(d_model),
        "--n-heads",
        str(n_heads),
        "--d-head",
        str(d_head),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        "--weights",
        args.weights,
        "--components",
        str(args.components),
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--n-heads", type=int, default=32)
    parser.add_argument("--d-head", type=int, default=128)
    parser.add_argument("--naive-d-model", type=int, help="d_model of the naive run (default: the full d_model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--weights", choices=("gaussian", "decaying"), default="gaussian")
    parser.add_argument("--components", type=int, default=128, help="k of the first-k run (default: 'auto''s 128)")
    parser.add_argument("--skip-naive", action="store_true", help="time every component and the first k only")
    parser.add_argument("--layers", type=int, help="time the first k components of this many layers instead")
    parser.add_argument("--floor", action="store_true", help="what an exact answer costs at the least, one layer")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.d_model, args.n_heads, args.d_head)
    if args.layers:
        r = measure_layers(args.layers, *shape, args.device, args.threads, args.weights, args.components)
        print(
            f"device {args.device}, {args.threads} thread(s); float32; {args.weights} weights; first "
            f"{args.components} components of {r['layers']} layers of d_model {shape[0]}, {shape[1]} heads of "
            f"{shape[2]}: {r['seconds']:.1f} s ({r['seconds'] / r['layers']:.2f} s per layer), peak "
            f"+{r['peak_mib']:.0f} MiB (one layer's weights included), largest bound {r['bound']:.1e}"
        )
        return
    if args.floor:
        r = measure_floor(*shape, args.device, args.threads, args.weights, args.components)
        dense, budget = r["gram"] + r["eigvalsh"], 60 / 32
        print(
            f"device {args.device}, {args.threads} thread(s); float32; {args.weights} weights; one layer (QK and OV) "
            f"of d_model {shape[0]}, {shape[1]} heads of {shape[2]}; budget 1.875 s per layer (32 in a minute)\n"
            f"dense: Gram matrices {r['gram']:.2f} s + eigvalsh {r['eigvalsh']:.2f} s = {dense:.2f} s "
            f"({dense / budget:.2f}x the budget; 32 layers {32 * dense:.0f} s)\n"
            f"block Lanczos stopped by the exact spectrum at {' and '.join(map(str, r['krylov_vectors']))} Krylov "
            f"vectors (first {args.components} within 1e-6), products and orthogonalisation only: {r['krylov']:.2f} s "
            f"({r['krylov'] / budget:.2f}x the budget; 32 layers {32 * r['krylov']:.0f} s)"
        )
        return
    if args.child:
        print(
            json.dumps(
                measure(
                    args.child,
                    args.d_model,
                    args.n_heads,
                    args.d_head,
                    args.device,
                    args.threads,
                    args.weights,
                    args.components,
                )
            )
        )
        return

    full = (args.d_model, args.n_heads, args.d_head)
    naive_d = args.naive_d_model or args.d_model
    reduced = (naive_d, args.n_heads, max(1, args.d_head * naive_d // args.d_model))
    print(f"device {args.device}, {args.threads} thread(s); float32; one random layer, {args.weights} weights")
    every, top = run_child("ours_layer", *full, args), run_child("top_layer", *full, args)
    results = [every, top]
    if not args.skip_naive:
        results.append(run_child("ours", *full, args))
        if reduced != full:
            results.append(run_child("ours", *reduced, args))
        results.append(run_child("naive", *reduced, args))
    for r in results:
        d, h, e = r["shape"]
        what = {
            "ours": "all, QK",
            "ours_layer": "all, QK+OV",
            "top_layer": f"first {args.components}, QK+OV",
            "naive": "naive, QK",
        }[r["side"]]
        print(f"{what:17s} d_model {d:5d}, {h} heads of {e:4d}: {r['seconds']:8.2f} s, peak +{r['peak_mib']:8.0f} MiB")
    k = len(top["curve"])
    gap = max(abs(a - b) for name in ("curve", "ov") for a, b in zip(top[name], every[name][:k], strict=True))
    print(
        f"time of every component / the first {k}: {every['seconds'] / top['seconds']:.1f}x; largest difference over "
        f"the first {k} entries of the QK and OV curves {gap:.1e} (reported bound {top['bound']:.1e})"
    )
    if args.skip_naive:
        return
    ours = next(r for r in results if r["side"] == "ours" and tuple(r["shape"]) == reduced)
    naive = results[-1]
    gap = max(abs(a - b) for a, b in zip(ours["curve"], naive["curve"], strict=True))
    print(
        f"at d_model {reduced[0]}: naive / ours = {naive['seconds'] / ours['seconds']:.1f}x time, "
        f"{naive['peak_mib'] / max(ours['peak_mib'], 1):.1f}x peak memory; max curve difference {gap:.1e}"
    )


if __name__ == "__main__":
    main()
