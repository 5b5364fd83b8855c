"""The host's time in a no-hook forward (or, with --decode, a cached decoding step; with --gradients, a forward and
backward to the input) on CUDA's paths, DCMHA against its SDPA twin, measured on this CPU (issue #37: at the short
prompts most analyses use, and in decoding, a GPU waits on the host, which spends its time in Python and in
dispatching ops).

    python benchmarks/bench_host_time.py [--tokens 16] [--layers 2] [--runs 300] [--decode]
    python benchmarks/bench_host_time.py --gradients [--fused-min-keys N]

The models are told they are on CUDA (as in `bench_forward_launches.py`), so each call takes the path it takes on a
card, and every Triton launch is replaced by a no-op that counts it. What is timed is dcinterp's Python and torch's
dispatch of each op, on tensors small enough (d_model 64, 4 heads of 16) that the CPU's arithmetic is a small part of
it; Triton's own launch cost is not in it (its launcher needs a GPU). Reported: the median time of each layer's
attention module (its projections, rotary, dynamic weights and path included) and of the whole call, the two
models taking turns at every run; the ratio DCMHA / twin. With --gradients, the call is a forward and a backward to the
input embeddings (an integrated-gradients step, the weights frozen), and the attention row times the modules'
forward only; the gradients take the path CUDA gives them: the materialised one below `dcinterp.dcmha.
FUSED_MIN_KEYS` keys (2,048), the fused kernels' from there (`--fused-min-keys 0`: at every length). Their no-op
launches leave the outputs as allocated: the gradients are meaningless, their host time is not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

import dcinterp.dcmha as dcmha  # noqa: E402
from dcinterp.kv_cache import DCFormerKeyValueCache  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_forward_launches import TritonLaunches, as_on_cuda, small_model  # noqa: E402


class Model:
    """One model, its attention modules timed at every call, and a way to run the call this benchmark times."""

    def __init__(self, use_dcmha: bool, layers: int, tokens: int, decode: bool, gradients: bool):
        self.model = small_model(use_dcmha, layers)
        self.attention: list[float] = []
        for block in self.model.blocks:
            block.attn.forward = self._timed(block.attn.forward)
        self.prompt = torch.randint(100, (1, tokens), generator=torch.Generator().manual_seed(0))
        self.decode, self.gradients = decode, gradients

    def _timed(self, forward):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            self.attention.append(time.perf_counter() - start)
            return out

        return timed

    def call(self, launches: TritonLaunches) -> float:
        """The time of one call: a forward of the prompt, a one-token step after it with the cache, or a forward and
        backward to the prompt's embeddings."""
        with nullcontext() if self.gradients else torch.no_grad():
            run = self._prepared()
            launches.counting = True
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            launches.counting = False
        return elapsed

    def _prepared(self):
        """The call to time, what comes before it done (the embeddings, the cache filled)."""
        if self.gradients:
            embeddings = self.model.embed(self.prompt).detach().requires_grad_(True)
            return lambda: self.model(embeddings, start_at_layer=0)[0, -1].logsumexp(-1).backward()
        if self.decode:
            cache = DCFormerKeyValueCache.init_cache(self.model.cfg, "cpu", batch_size=1)
            self.model(self.prompt, past_kv_cache=cache)
            self.model(self.prompt[:, -1:], past_kv_cache=cache)  # the first step may grow the cache's buffers
            self.attention.clear()
            return lambda: self.model(self.prompt[:, -1:], past_kv_cache=cache)
        return lambda: self.model(self.prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16, help="the prompt's tokens")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=300, help="timed calls of each model")
    parser.add_argument("--decode", action="store_true", help="time a cached step of one token after the prompt")
    parser.add_argument("--gradients", action="store_true", help="time a forward and backward to the input")
    parser.add_argument(
        "--fused-min-keys",
        type=int,
        metavar="N",
        help="with --gradients, the fused kernels from N keys on (default: dcinterp.dcmha.FUSED_MIN_KEYS; 0: always)",
    )
    args = parser.parse_args()
    if min(args.tokens, args.layers, args.runs) < 1:
        parser.error("--tokens, --layers and --runs must be at least 1")
    if args.decode and args.gradients:
        parser.error("--decode and --gradients time different calls: give one")
    if args.fused_min_keys is not None and not args.gradients:
        parser.error("--fused-min-keys chooses the gradients' path: give --gradients too")
    if args.fused_min_keys is not None and args.fused_min_keys < 0:
        parser.error("--fused-min-keys must be at least 0")
    if args.fused_min_keys is not None:
        dcmha.FUSED_MIN_KEYS = args.fused_min_keys
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the no-op launches leave their outputs as allocated: no slow denormals
    as_on_cuda()
    models = {
        name: Model(use, args.layers, args.tokens, args.decode, args.gradients)
        for name, use in (("DCMHA", True), ("twin", False))
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
    what = f"a forward of {args.tokens} tokens"
    if args.decode:
        what = f"a cached step of one token after {args.tokens} tokens"
    elif args.gradients:
        fused = args.tokens >= dcmha.FUSED_MIN_KEYS
        path = "the fused kernels" if fused else "the materialised path"
        what = f"a forward and backward to the input of {args.tokens} tokens, through {path}"
    print(f"Host time, no hook, {what}, {args.layers} layer(s), on CUDA's paths with Triton's launches not run")
    print(f"(medians of {args.runs}; d_model 64, 4 heads of 16; torch {torch.__version__}, 1 thread):")
    print("| | DCMHA (us) | SDPA twin (us) | DCMHA / twin |")
    print("|---|---|---|---|")
    module = "attention module's forward, a layer" if args.gradients else "attention module, a layer"
    for label, times in ((module, attention), ("whole call", calls)):
        ours, twin = (statistics.median(times[name]) * 1e6 for name in models)
        print(f"| {label} | {ours:.0f} | {twin:.0f} | **{ours / twin:.2f}x** |")
    per_layer = sum(launches.launches.values()) / (args.runs * args.layers)
    print(f"Triton launches a layer (not run, not in the times): {per_layer:g}")


if __name__ == "__main__":
    main()
