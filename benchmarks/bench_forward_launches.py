"""How many device kernels a no-hook forward launches on CUDA's paths, DCMHA (the Triton kernels' path, without
gradients) against its SDPA twin, counted on this CPU (issue #37: at the short prompts most analyses use, a GPU waits
on launches, not arithmetic).

    python benchmarks/bench_forward_launches.py [--tokens 40] [--layers 1] [--verbose]

The model is told it is on CUDA (`choose_path` and `dynamic_weights_path` see a CUDA device) and the Triton kernels
run under Triton's interpreter (TRITON_INTERPRET=1, set here), so each call takes the path it takes on a card. Counted:
every ATen op that launches a kernel, by `bench_decode_ops.py`'s rule (views and allocations left out), except
those the interpreter itself runs; and every Triton kernel launch. Each op is attributed to the innermost dcinterp
function it was called from. Small shapes: the counts do not depend on the width.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first decorated

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import dcinterp.dcmha as dcmha  # noqa: E402
from dcinterp import DCFormerConfig, HookedDCFormer  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode_ops import launches_kernel  # noqa: E402

CUDA = torch.device("cuda")


class LaunchCounter(TorchDispatchMode):
    """Kernel-launching ATen ops per innermost dcinterp function (none of Triton's interpreter's own), and Triton
    kernel launches per kernel, while active."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.triton: Counter = Counter()

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
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self.run = InterpretedFunction.run
        counter = self

        def run(kernel, *args, **kwargs):
            counter.triton[kernel.fn.__name__] += 1
            return counter.run(kernel, *args, **kwargs)

        InterpretedFunction.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self.run
        return super().__exit__(*exc)


def as_on_cuda() -> None:
    """The dispatch's device checks see CUDA; where the kernels can run is judged on this CPU (the interpreter)."""
    choose, weights_path, unavailable = dcmha.choose_path, dcmha.dynamic_weights_path, dcmha.triton_unavailable
    dcmha.choose_path = lambda **facts: choose(**{**facts, "device": CUDA})
    dcmha.dynamic_weights_path = lambda **facts: weights_path(**{**facts, "device": CUDA})
    dcmha.triton_unavailable = lambda device: unavailable(torch.device("cpu"))


def count(use_dcmha: bool, layers: int, tokens: int) -> LaunchCounter:
    torch.manual_seed(0)
    cfg = DCFormerConfig(
        n_layers=layers, d_model=64, n_heads=4, d_head=16, d_mlp=256, d_vocab=100, n_ctx=4096, rotary_pct=0.25,
        use_dcmha=use_dcmha,
    )  # fmt: skip
    model = HookedDCFormer(cfg).eval().requires_grad_(False)
    prompt = torch.randint(100, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(prompt)  # the first call decorates the kernels
        with LaunchCounter() as counter:
            model(prompt)
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--verbose", action="store_true", help="every op and kernel by where it comes from")
    args = parser.parse_args()
    if args.tokens < 1 or args.layers < 1:
        parser.error("--tokens and --layers must be at least 1")
    as_on_cuda()
    counts = {"DCMHA": count(True, args.layers, args.tokens), "SDPA twin": count(False, args.layers, args.tokens)}
    print(f"A no-hook forward, {args.layers} layer(s), {args.tokens} tokens, as CUDA takes it (d_model 64, 4 heads):")
    print("| model | torch ops launching kernels | Triton launches | total |")
    print("|---|---|---|---|")
    for name, counter in counts.items():
        ops, kernels = sum(counter.ops.values()), sum(counter.triton.values())
        print(f"| {name} | {ops} | {kernels} | {ops + kernels} |")
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
