"""Cost of `head_attribution` (integrated gradients over head gates) as a multiple of one forward+backward.

    python benchmarks/bench_attribution.py [--steps 16 50] [--batch 4] [--seq 64] [--repeats 3] [--threads 1]

For a small random DCPythia-like model (6 layers, d_model 256, 8 heads of 32) and the tiny fixture, it times
  fwd+bwd:       one forward and backward of the model (gradients of the target w.r.t. the parameters),
  gated fwd+bwd: one forward with the head gates hooked in, backward to the gates (one IG step's work),
  IG:            `head_attribution(n_steps)` on the same batch, with all steps in one pass
                 (internal_batch_size=None) and with one step per pass (internal_batch_size=batch);
and prints IG / fwd+bwd. The expected ratio is about n_steps (+ two forwards for f(input), f(baseline)).
Each time is the fastest of --repeats runs (the machine may be shared).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.attribution import gate_hooks, head_attribution, target_value

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/dcpythia-tiny"


def fastest(repeats: int, function) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def models() -> dict[str, HookedDCFormer]:
    torch.manual_seed(0)
    cfg = DCFormerConfig(n_layers=6, d_model=256, n_heads=8, d_head=32, d_mlp=1024, d_vocab=1000, rotary_pct=0.25)
    fixture = HookedDCFormer.from_pretrained(FIXTURE).requires_grad_(True)  # loaded frozen, as a pretrained model is
    return {"random 6L d256 8x32": HookedDCFormer(cfg), "fixture dcpythia-tiny": fixture}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[16, 50])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{args.threads} thread(s), batch {args.batch}, seq {args.seq}; "
        "target: the logit of one token at the last position"
    )
    for name, model in models().items():
        torch.manual_seed(1)
        tokens = torch.randint(0, model.cfg.d_vocab, (args.batch, min(args.seq, model.cfg.n_ctx)))
        answer = 7

        def forward_backward():
            model.zero_grad(set_to_none=True)
            target_value(model, tokens, answer).sum().backward()

        def gated_forward_backward():
            alpha = torch.ones(args.batch, model.cfg.n_layers, model.cfg.n_heads, requires_grad=True)
            value = target_value(model, tokens, answer, fwd_hooks=gate_hooks(alpha, None)).sum()
            torch.autograd.grad(value, alpha)

        base = fastest(args.repeats, forward_backward)
        gated = fastest(args.repeats, gated_forward_backward)
        model.zero_grad(set_to_none=True)
        print(f"\n{name}: fwd+bwd {base * 1e3:.1f} ms; gated fwd+bwd {gated * 1e3:.1f} ms ({gated / base:.2f}x)")
        for n_steps in args.steps:
            for internal in (None, args.batch):
                seconds = fastest(
                    args.repeats,
                    lambda: head_attribution(model, tokens, answer, n_steps=n_steps, internal_batch_size=internal),
                )
                label = "all steps in one pass" if internal is None else "one step per pass"
                print(
                    f"  IG n_steps={n_steps:3d} ({label:21s}): {seconds:7.3f} s = {seconds / base:6.1f}x fwd+bwd "
                    f"({seconds / base / n_steps:.2f}x per step)"
                )


if __name__ == "__main__":
    main()
