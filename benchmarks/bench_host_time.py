"""The host's time in a no-hook forward (or, with --decode, a cached decoding step) on CUDA's paths, DCMHA against its
SDPA twin, measured on this CPU (issue #37: at the short prompts most analyses use, and in decoding, a GPU waits on
the host, which spends its time in Python and in dispatching ops).

    python benchmarks/bench_host_time.py [--tokens 16] [--layers 2] [--runs 300] [--decode]

The models are told they are on CUDA (as in `bench_forward_launches.py`), so each call takes the path it takes on a
card, and every Triton launch is replaced by a no-op that counts it. What is timed is dcinterp's Python and torch's
dispatch of each op, on tensors small enough (d_model 64, 4 heads of 16) that the CPU's arithmetic is a small part of
it; Triton's own launch cost is not in it (its launcher needs a GPU). Reported: the median time of each layer's
attention module (its projections, rotary, dynamic weights and path included) and of the whole call, the two
models taking turns at every run; the ratio DCMHA / twin.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first decorated

import torch  # noqa: E402

from dcinterp.kv_cache import DCFormerKeyValueCache  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_forward_launches import TritonLaunches, as_on_cuda, small_model  # noqa: E402


class Model:
    """One model, its attention modules timed at every call, and a way to run the call this benchmark times."""

    def __init__(self, use_dcmha: bool, layers: int, tokens: int, decode: bool):
        self.model = small_model(use_dcmha, layers)
        self.attention: list[float] = []
        for block in self.model.blocks:
            block.attn.forward = self._timed(block.attn.forward)
        self.prompt = torch.randint(100, (1, tokens), generator=torch.Generator().manual_seed(0))
        self.decode = decode

    def _timed(self, forward):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            self.attention.append(time.perf_counter() - start)
            return out

        return timed

    @torch.no_grad()
    def call(self, launches: TritonLaunches) -> float:
        """The time of one call: a forward of the prompt, or a one-token step after it with the cache."""
        inputs, kwargs = (self.prompt,), {}
        if self.decode:
            cache = DCFormerKeyValueCache.init_cache(self.model.cfg, "cpu", batch_size=1)
            self.model(self.prompt, past_kv_cache=cache)
            self.model(self.prompt[:, -1:], past_kv_cache=cache)  # the first step may grow the cache's buffers
            self.attention.clear()
            inputs, kwargs = (self.prompt[:, -1:],), dict(past_kv_cache=cache)
        launches.counting = True
        start = time.perf_counter()
        self.model(*inputs, **kwargs)
        elapsed = time.perf_counter() - start
        launches.counting = False
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16, help="the prompt's tokens")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=300, help="timed calls of each model")
    parser.add_argument("--decode", action="store_true", help="time a cached step of one token after the prompt")
    args = parser.parse_args()
    if min(args.tokens, args.layers, args.runs) < 1:
        parser.error("--tokens, --layers and --runs must be at least 1")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the no-op launches leave their outputs as allocated: no slow denormals
    as_on_cuda()
    models = {
        name: Model(use, args.layers, args.tokens, args.decode) for name, use in (("DCMHA", True), ("twin", False))
    }
    launches = TritonLaunches(run=False)  # not run once entered; counted only in the timed calls
    launches.counting = False
    for model in models.values():
        model.call(launches)  # the first call decorates the kernels (under the interpreter: they run once, for real)
    calls = {name: [] for name in models}
    attention = {name: [] for name in models}
    with launches:
        for _ in range(args.runs):
            for name, model in models.items():
                model.attention.clear()
                calls[name].append(model.call(launches))
                attention[name].append(statistics.fmean(model.attention))
    what = f"a cached step of one token after {args.tokens}" if args.decode else f"a forward of {args.tokens}"
    print(f"Host time, no hook, {what} tokens, {args.layers} layer(s), on CUDA's paths with Triton's launches not run")
    print(f"(medians of {args.runs}; d_model 64, 4 heads of 16; torch {torch.__version__}, 1 thread):")
    print("| | DCMHA (us) | SDPA twin (us) | DCMHA / twin |")
    print("|---|---|---|---|")
    for label, times in (("attention module, a layer", attention), ("whole call", calls)):
        dcmha, twin = (statistics.median(times[name]) * 1e6 for name in models)
        print(f"| {label} | {dcmha:.0f} | {twin:.0f} | **{dcmha / twin:.2f}x** |")
    per_layer = sum(launches.launches.values()) / (args.runs * args.layers)
    print(f"Triton launches a layer (not run, not in the times): {per_layer:g}")


if __name__ == "__main__":
    main()
