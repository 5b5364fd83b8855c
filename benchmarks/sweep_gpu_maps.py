"""The forward (or, with --backward, the backward) through the cross-head maps on a GPU: its launch settings swept,
each kernel's time, and the whole against SDPA's at 512-8,192 tokens.

    python benchmarks/sweep_gpu_maps.py [--json OUT.jsonl]               # one H200: about 2.5 minutes
    python benchmarks/sweep_gpu_maps.py --backward [--json OUT.jsonl]    # one H100: over 6.5 minutes

One layer at DCPythia-6.9B's width (32 heads of 128, rank 2, every branch of both stages), bfloat16, batch 1, causal.
First it checks the kernels on the card against DCMHA's formulas in float64 (float32: at most 4 times the float32
formulas' error plus 8 float32 units of the scale; half dtypes: at most 2 times the half formulas'): without
--backward z, with it z and every gradient. Then, at 4,096 tokens, it times each set of launch settings and reads
each kernel's time from torch's profiler:
- the forward, no gradient (`dcinterp.dcmha.maps.fused_dcmha` under no_grad): `MAPS_KERNELS` for the
  two kernels that sum the maps over the heads, `HEAD_KERNELS` for the two of one head a program;
- with --backward, the forward and backward to every input through the maps:
  `GRADIENT_KERNELS` for the three gradient kernels of the query side, `KEY_GRADIENT_KERNELS` for the key side's.
It keeps the fastest settings of each group of kernels and times the whole with them against SDPA's from 512 to 8,192
tokens. JSON lines; the chosen settings are the ones to put in dcinterp/dcmha/maps.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu_attention as bench  # noqa: E402

# (BQ, BK, num_warps, num_stages) of each group's launches; the backward's all compile for an H100 (sm_90) within its
# shared memory at 32 heads of 128 (Triton 3.9), its defaults first
FORWARD_SETTINGS = {
    "MAPS_KERNELS": [(64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 4, 2), (64, 32, 4, 3)],
    "HEAD_KERNELS": [(64, 32, 4, 2), (32, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 8, 2), (64, 32, 4, 3)],
}
BACKWARD_SETTINGS = {
    "GRADIENT_KERNELS": [(64, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2)],
    "KEY_GRADIENT_KERNELS": [(16, 32, 8, 2), (16, 32, 4, 2), (32, 32, 8, 2), (16, 64, 8, 2), (32, 64, 8, 2)],
}
# the kernels each group launches, as torch's profiler names them
FORWARD_KERNELS = {
    "MAPS_KERNELS": ("product_maps_kernel", "post_maps_kernel"),
    "HEAD_KERNELS": ("row_statistics_kernel", "head_output_kernel"),
}
BACKWARD_KERNELS = {
    "GRADIENT_KERNELS": ("row_gradient_kernel", "pre_gradient_maps_kernel", "head_query_gradient_kernel"),
    "KEY_GRADIENT_KERNELS": ("head_key_gradient_kernel",),
}
CHECKS = [(torch.float32, 2, 77, 6, 64, 2, 0), (torch.float32, 1, 200, 32, 128, 2, 0),
          (torch.float32, 2, 5, 4, 64, 1, 300), (torch.bfloat16, 1, 300, 32, 128, 2, 0),
          (torch.float16, 1, 300, 32, 128, 2, 0), (torch.bfloat16, 1, 1000, 32, 128, 2, 0)]  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backward", action="store_true", help="sweep the backward through the maps instead")
    parser.add_argument("--json", type=Path, help="also write the JSON lines to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_gpu_maps: no CUDA device: no GPU number is measured here")
        return 2
    kernels = bench.load("maps")
    log = args.json.open("w") if args.json else None

    def emit(**row):
        print(json.dumps(row), flush=True)
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()  # each line kept, should the run be cut

    def maps(q, k, v, pre, post, past=0):
        return kernels.fused_dcmha(q, k, v, pre, post, window=None, official=False, past=past)

    start = time.time()
    emit(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=sys.modules["triton"].__version__)
    what = "z and every gradient through the maps" if args.backward else "forward through the maps"
    for dtype, b, t, h, e, rank, past in CHECKS:
        if args.backward and past:
            continue  # gradients are for prompts, not for a cached step
        ratio = bench.check(maps, dtype, b, t, h, e, rank, past, with_gradients=args.backward)
        shape = dict(dtype=str(dtype).split(".")[1], batch=b, tokens=t, heads=h, head_dim=e, rank=rank, past=past)
        emit(check=f"{what} vs formulas, judged by float64", **shape, ratio=round(ratio, 3))

    (q, k, v), (pre, post) = bench.inputs(1, 4096, 32, 128, 2, 0, torch.bfloat16)
    if args.backward:
        leaves = [x.requires_grad_(True) for x in (q, k, v, *pre, *post)]

        def step():
            z = maps(q, k, v, pre, post)
            torch.autograd.grad(z, leaves, torch.ones_like(z))

        settings, groups = BACKWARD_SETTINGS, BACKWARD_KERNELS
    else:

        def step():
            with torch.no_grad():
                maps(q, k, v, pre, post)

        settings, groups = FORWARD_SETTINGS, FORWARD_KERNELS
    chosen = sweep(kernels, settings, groups, step, emit)
    emit(chosen=chosen, seconds=round(time.time() - start, 1))

    compared = (("maps", maps), ("sdpa", bench.sdpa))
    for tokens in (512, 1024, 2048, 4096, 8192):
        rows = {name: bench.measure(name, fn, tokens, 0, args.backward) for name, fn in compared}
        for row in rows.values():
            emit(**row)
        ratios = {f"{name}_over_sdpa": _ratio(rows[name], rows["sdpa"]) for name in rows if name != "sdpa"}
        emit(tokens=tokens, backward=args.backward, **ratios)
    emit(seconds=round(time.time() - start, 1))
    return 0


def sweep(kernels, settings: dict[str, list[tuple]], groups: dict[str, tuple[str, ...]], step, emit) -> dict:
    """The i-th launch settings of every group set together (a group's list repeated where it is the shorter), `step`
    timed and profiled once for each i; each group's fastest settings (the sum of its kernels' times) are left set
    in `kernels` and returned."""
    best = {}
    for index in range(max(len(sweep) for sweep in settings.values())):
        launches = {}
        for name, sweep in settings.items():
            bq, bk, warps, stages = sweep[index % len(sweep)]
            launches[name] = dict(BQ=bq, BK=bk, num_warps=warps, num_stages=stages)
            setattr(kernels, name, launches[name])
        kernels._launches.clear()  # the launches built with the settings before
        step()  # compiles
        ms = bench.timed(step, repeats=5, warmup=1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            step()
            torch.cuda.synchronize()
        times = {e.key: round(e.device_time_total / 1000, 3) for e in profile.key_averages() if "kernel" in e.key}
        emit(tokens=4096, **launches, ms=round(ms, 3), kernel_ms=times)
        for name, names in groups.items():
            spent = sum(t for kernel, t in times.items() if any(kernel.startswith(n) for n in names))
            if name not in best or spent < best[name][0]:
                best[name] = (spent, launches[name])
    for name, (_, launch) in best.items():
        setattr(kernels, name, launch)
    kernels._launches.clear()
    return {name: launch for name, (_, launch) in best.items()}


def _ratio(row: dict, sdpa: dict) -> float | None:
    return None if row["ms"] is None or sdpa["ms"] is None else round(row["ms"] / sdpa["ms"], 2)


if __name__ == "__main__":
    sys.exit(main())
