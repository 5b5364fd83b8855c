"""How many device kernels a no-hook forward (or, with --decode, a cached decoding step) launches on CUDA's paths, DCMHA
(the Triton kernels' paths, without gradients) against its SDPA twin, counted on this CPU (issue #37: at the short
prompts most analyses use, and in decoding, a GPU waits on launches, not arithmetic).

    python benchmarks/bench_forward_launches.py [--tokens 40] [--layers 1] [--decode] [--verbose]

The model is told it is on CUDA (`choose_path`, `dynamic_weights_path` and `decoding_pattern_path` see a CUDA device)
and the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here), so each call takes the path it
takes on a card. Counted: every ATen op that launches a kernel, by `bench_decode_ops.py`'s rule, except those the
interpreter itself runs; every Triton kernel launch; and, apart, the views and allocations, which launch nothing but
cost the host a dispatch each. Each op is attributed to the innermost dcinterp function it was called from. Small
shapes: the counts do not depend on the width. With --decode: the second cached step of one token after a
`--tokens` prompt (the first may grow the cache's buffers).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import dcinterp.dcmha as dcmha  # noqa: E402
from dcinterp import DCFormerConfig, HookedDCFormer, devices  # noqa: E402
from dcinterp.dcmha import families, few_queries  # noqa: E402
from dcinterp.kv_cache import DCFormerKeyValueCache  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode_ops import launches_kernel  # noqa: E402

CUDA = torch.device("cuda")


class TritonLaunches:
    """While active, every Triton launch is counted per kernel (while `counting`); with `run=False` a launch does
    nothing else (its outputs are left as allocated)."""

    def __init__(self, run: bool = True):
        self.launches: Counter = Counter()
        self.counting, self.run = True, run

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self.interpreted_run = InterpretedFunction.run

        def launch(kernel, *args, **kwargs):
            self.launches[kernel.fn.__name__] += self.counting
            if self.run:
                return self.interpreted_run(kernel, *args, **kwargs)

        InterpretedFunction.run = launch
        return self

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self.interpreted_run


class LaunchCounter(TorchDispatchMode):
    """Kernel-launching ATen ops per innermost dcinterp function (none of Triton's interpreter's own), and Triton
    kernel launches per kernel, while active."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.host_only = 0  # views and allocations
        self.triton_launches = TritonLaunches()
        self.triton = self.triton_launches.launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame, caller = sys._getframe(1), None
        while frame is not None:
            name = frame.f_code.co_filename
            if f"{os.sep}triton{os.sep}" in name:
                break  # inside the interpreter: part of a Triton kernel, counted as its launch
            if caller is None and f"{os.sep}dcinterp{os.sep}" in name:
                caller = frame.f_code.co_name
            frame = frame.f_back
        else:
            if launches_kernel(func):
                self.ops[caller, func._schema.name.removeprefix("aten::")] += 1
            elif any("Tensor" in str(r.type) for r in func._schema.returns):
                self.host_only += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.triton_launches.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self.triton_launches.__exit__(*exc)
        return super().__exit__(*exc)


def as_on_cuda() -> None:
    """The dispatch's device checks see CUDA; where the kernels can run is judged on this CPU (the interpreter), and
    the card's free memory, which the dispatch asks with gradients, is this CPU's, read once (on a card, a driver
    call and torch's allocator statistics)."""
    choose, weights_path = dcmha.choose_path, dcmha.dynamic_weights_path
    pattern_path = few_queries.decoding_pattern_path
    unavailable, available = families.triton_unavailable, devices.free_memory("cpu")
    devices.free_memory = lambda device: available
    dcmha.choose_path = lambda **facts: choose(**{**facts, "device": CUDA})
    dcmha.dynamic_weights_path = lambda **facts: weights_path(**{**facts, "device": CUDA})
    few_queries.decoding_pattern_path = lambda **facts: pattern_path(**{**facts, "device": CUDA})
    families.triton_unavailable = lambda device: unavailable(torch.device("cpu"))


def small_model(use_dcmha: bool, layers: int) -> HookedDCFormer:
    """A model of `layers` layers small enough that the CPU's arithmetic is a small part of a call (d_model 64, 4
    heads of 16, vocabulary 100), seeded, frozen, in eval mode."""
    torch.manual_seed(0)
    cfg = DCFormerConfig(
        n_layers=layers, d_model=64, n_heads=4, d_head=16, d_mlp=256, d_vocab=100, n_ctx=4096, rotary_pct=0.25,
        use_dcmha=use_dcmha,
    )  # fmt: skip
    return HookedDCFormer(cfg).eval().requires_grad_(False)


def count(use_dcmha: bool, layers: int, tokens: int, decode: bool) -> LaunchCounter:
    model = small_model(use_dcmha, layers)
    prompt = torch.randint(100, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if not decode:
            model(prompt)  # the first call decorates the kernels
            with LaunchCounter() as counter:
                model(prompt)
            return counter
        cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu", batch_size=1)
        model(prompt, past_kv_cache=cache)
        model(prompt[:, -1:], past_kv_cache=cache)
        with LaunchCounter() as counter:
            model(prompt[:, -1:], past_kv_cache=cache)
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--decode", action="store_true", help="a cached step of one token after the prompt")
    parser.add_argument("--verbose", action="store_true", help="every op and kernel by where it comes from")
    args = parser.parse_args()
    if args.tokens < 1 or args.layers < 1:
        parser.error("--tokens and --layers must be at least 1")
    as_on_cuda()
    counts = {
        name: count(use, args.layers, args.tokens, args.decode) for name, use in (("DCMHA", True), ("SDPA twin", False))
    }
    what = f"a cached step of one token after {args.tokens}" if args.decode else f"a forward of {args.tokens}"
    print(f"No hook, {what} tokens, {args.layers} layer(s), as CUDA takes it (d_model 64, 4 heads):")
    print("| model | torch ops launching kernels | Triton launches | total | views and allocations (no kernel) |")
    print("|---|---|---|---|---|")
    for name, counter in counts.items():
        ops, kernels = sum(counter.ops.values()), sum(counter.triton.values())
        print(f"| {name} | {ops} | {kernels} | {ops + kernels} | {counter.host_only} |")
    if args.verbose:
        for name, counter in counts.items():
            print(f"\n{name}: Triton " + ", ".join(f"{k} {n}" for k, n in counter.triton.most_common()))
            by_caller = Counter()
            for (caller, _op), n in counter.ops.items():
                by_caller[caller] += n
            for caller, n in by_caller.most_common():
                ops = ", ".join(f"{op} {m}" for (c, op), m in counter.ops.most_common() if c == caller)
                print(f"  {caller}: {n} ({ops})")


if __name__ == "__main__":
    main()
