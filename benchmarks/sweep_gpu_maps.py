"""The forward through the cross-head maps on a GPU: its launch settings swept, each kernel's time, and the forward
against SDPA's at 512-8,192 tokens.

    python benchmarks/sweep_gpu_maps.py [--json OUT.jsonl]    # one H200: about 2.5 minutes

One layer at DCPythia-6.9B's width (32 heads of 128, rank 2, every branch of both stages), bfloat16, batch 1, causal,
no gradient (the forward through the maps is the no-gradient forward of `dcinterp.dcmha.triton_kernels`). First it
checks the forward on the card against DCMHA's formulas in float64 (float32: at most 4 times the float32 formulas'
error plus 8 float32 units of the scale; half dtypes: at most 2 times the half formulas'). Then, at 4,096 tokens, it
times each pair of launch settings (`MAPS_KERNELS` for the two kernels that sum the maps over the heads,
`HEAD_KERNELS` for the two of one head a program) and reads each kernel's time from torch's profiler; it keeps the
fastest settings of each pair of kernels, and times the forward with them against SDPA's from 512 to 8,192 tokens.
JSON lines; the chosen settings are the ones to put in triton_kernels.py.
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

MAPS_LAUNCHES = [(64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 4, 2), (64, 32, 4, 3)]
HEAD_LAUNCHES = [(64, 32, 4, 2), (32, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 8, 2), (64, 32, 4, 3)]
CHECKS = [(torch.float32, 2, 77, 6, 64, 2, 0), (torch.float32, 1, 200, 32, 128, 2, 0),
          (torch.float32, 2, 5, 4, 64, 1, 300), (torch.bfloat16, 1, 300, 32, 128, 2, 0),
          (torch.float16, 1, 300, 32, 128, 2, 0), (torch.bfloat16, 1, 1000, 32, 128, 2, 0)]  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the JSON lines to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_gpu_maps: no CUDA device: no GPU number is measured here")
        return 2
    kernels = bench.load("triton_kernels")
    log = args.json.open("w") if args.json else None

    def emit(**row):
        print(json.dumps(row), flush=True)
        if log:
            log.write(json.dumps(row) + "\n")

    def fused(q, k, v, pre, post, past=0):
        return kernels.fused_dcmha(q, k, v, pre, post, window=None, official=False, past=past, forward="maps")

    start = time.time()
    emit(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=sys.modules["triton"].__version__)
    for dtype, b, t, h, e, rank, past in CHECKS:
        ratio = bench.check(fused, dtype, b, t, h, e, rank, past, with_gradients=False)
        shape = dict(dtype=str(dtype).split(".")[1], batch=b, tokens=t, heads=h, head_dim=e, rank=rank, past=past)
        emit(check="forward through the maps vs formulas, judged by float64", **shape, ratio=round(ratio, 3))

    (q, k, v), (pre, post) = bench.inputs(1, 4096, 32, 128, 2, 0, torch.bfloat16)
    best = {}
    for index in range(max(len(MAPS_LAUNCHES), len(HEAD_LAUNCHES))):
        launches = {}
        for name, sweep in (("MAPS_KERNELS", MAPS_LAUNCHES), ("HEAD_KERNELS", HEAD_LAUNCHES)):
            bq, bk, warps, stages = sweep[index % len(sweep)]
            launches[name] = dict(BQ=bq, BK=bk, num_warps=warps, num_stages=stages)
            setattr(kernels, name, launches[name])
        kernels._launches.clear()  # the launches built with the settings before
        with torch.no_grad():
            fused(q, k, v, pre, post)  # compiles
            ms = bench.timed(lambda: fused(q, k, v, pre, post), repeats=5, warmup=1)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                fused(q, k, v, pre, post)
                torch.cuda.synchronize()
        times = {e.key: round(e.device_time_total / 1000, 3) for e in profile.key_averages() if "kernel" in e.key}
        emit(tokens=4096, **launches, ms=round(ms, 3), kernel_ms=times)
        for name, which in (("MAPS_KERNELS", "maps"), ("HEAD_KERNELS", "statistics output")):
            spent = sum(t for kernel, t in times.items() if any(word in kernel for word in which.split()))
            if name not in best or spent < best[name][0]:
                best[name] = (spent, launches[name])
    for name, (_, launch) in best.items():
        setattr(kernels, name, launch)
    kernels._launches.clear()
    emit(chosen={name: launch for name, (_, launch) in best.items()}, seconds=round(time.time() - start, 1))

    for tokens in (512, 1024, 2048, 4096, 8192):
        rows = {name: bench.measure(name, fn, tokens, 0, False) for name, fn in (("maps", fused), ("sdpa", bench.sdpa))}
        for row in rows.values():
            emit(**row)
        emit(tokens=tokens, maps_over_sdpa=round(rows["maps"]["ms"] / rows["sdpa"]["ms"], 2))
    emit(seconds=round(time.time() - start, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
