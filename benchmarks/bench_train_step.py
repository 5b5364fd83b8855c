"""What makes a training step of the shipped recipe cheaper on this CPU: threads, batch shape, torch.compile.

    python benchmarks/bench_train_step.py [--steps 12] [--arch dcmha] [--settings 16x1,16x2,8x1,32x1,16x1c]

Times forward + backward + AdamW step of the default recipe's model (3 layers, d_model 64) on the trainer's own
batches (samples grouped by length, rows filled with knowledge sentences), after 2 warm-up steps, for each
setting BATCHxTHREADS (default: 1 and 2 threads at batch 16; batch 8 and 32 at 1 thread; the time per sample
compares batch shapes); a trailing `c` compiles the model with `torch.compile(dynamic=True)` (one compilation for
every batch length; its time is the warm-up's).
The same batches, in the same order, for every setting. Each time is the median step of `--steps`; on a shared
machine, run it when the machine is quiet.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from dcinterp.model import HookedDCFormer
from dcinterp.tokenizer import build_tokenizer
from dcinterp.train import Batcher, SampleStream, TrainConfig, make_optimizer


def batches(cfg: TrainConfig, tokenizer, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = random.Random(0)
    batcher = Batcher(tokenizer, SampleStream(cfg, None, rng), cfg, rng)
    return [next(batcher) for _ in range(n)]


def step_times(cfg: TrainConfig, tokenizer, data, threads: int, compile_model: bool) -> tuple[list[float], float]:
    """Seconds per step after the warm-up, and the seconds the warm-up (compilation included) took."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = HookedDCFormer(cfg.model_config(len(tokenizer)), tokenizer=tokenizer)
    opt = make_optimizer(model, cfg)
    forward = torch.compile(model, dynamic=True) if compile_model else model

    def step(x):
        loss = forward(x, return_type="loss")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    start = time.perf_counter()
    for x, _ in data[:2]:
        step(x)
    warmup = time.perf_counter() - start
    times = []
    for x, _ in data[2:]:
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
    return times, warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--arch", choices=("dcmha", "mha"), default="dcmha")
    parser.add_argument("--settings", default="16x1,16x2,8x1,32x1", help="BATCHxTHREADS[c], comma-separated")
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    print(f"{args.arch}, {args.steps} steps after 2 warm-up steps; torch {torch.__version__}")
    for setting in args.settings.split(","):
        batch_size, threads = (int(n) for n in setting.rstrip("c").split("x"))
        compile_model = setting.endswith("c")
        cfg = TrainConfig(arch=args.arch, batch_size=batch_size)
        data = batches(cfg, tokenizer, args.steps + 2)
        times, warmup = step_times(cfg, tokenizer, data, threads, compile_model)
        median = statistics.median(times)
        tokens = statistics.mean(x.numel() for x, _ in data[2:])
        print(
            f"batch {batch_size:2d}, {threads} thread{'s' if threads > 1 else ' '}"
            f"{', compiled' if compile_model else '          '}: {median * 1000:6.0f} ms/step, "
            f"{median / batch_size * 1000:5.1f} ms/sample, {tokens / median:7.0f} tokens/s; "
            f"warm-up (2 steps{', compile included' if compile_model else ''}) {warmup:.1f} s"
        )


if __name__ == "__main__":
    main()
