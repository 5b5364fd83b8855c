"""How exactly the QK terms add up to the model's composed score, per model shape and dtype (docs/qk-attribution.md).

    python benchmarks/qk_identity.py

For tiny random models of each shape dcinterp runs (those of tests/test_qk.py: a compose strong enough that
every branch matters, norms and biases off their init) and the two fixtures, in float32, float16 and bfloat16:
the largest |sum of terms - hook_composed_scores| over every key of the last query of a 14-token prompt, relative to
the largest |score| of that query's row (`QKAttribution.relative_gap`); the same for the contrast of two keys; and
the largest |frozen causal check - its terms| over `causal_checks`' default checks, relative to the same scale.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.qk import causal_checks, qk_attribution, qk_contrast

FIXTURES = Path(__file__).resolve().parents[1] / "tests/fixtures"
SHAPES = {
    "parallel LN, partial rotary (DCPythia)": dict(rotary_pct=0.5),
    "sequential RMS, SwiGLU + mgate, windows (DCFormer++)": dict(
        parallel_residual=False,
        normalization_type="RMS",
        act_fn="swiglu",
        use_bias=False,
        mgate_dim=2,
        window_size=3,
        window_type="LG",
    ),
    "query-wise": dict(query_wise=True),
    "post-compose only": dict(compose_stages=("post",)),
    "plain MHA (Pythia)": dict(use_dcmha=False),
    "plain MHA without QK-norm (GPT-NeoX)": dict(use_dcmha=False, use_qk_norm=False, rotary_pct=0.25),
}


def tiny(overrides: dict) -> HookedDCFormer:
    torch.manual_seed(0)
    cfg = DCFormerConfig(
        n_layers=3, d_model=16, n_heads=3, d_head=4, d_mlp=16, d_vocab=23, dyn_hidden_dim=6, **overrides
    )
    model = HookedDCFormer(cfg)
    model.init_weights(std=0.3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "W_dyn_out" in name:
                p.mul_(400.0)
            elif "W_dyn_gate" in name:
                p.mul_(20.0)
            elif name.endswith(".w"):
                p.add_(0.2 * torch.randn_like(p))
            elif name.split(".")[-1].startswith("b"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval().requires_grad_(False)


def main() -> None:
    models = {name: tiny(overrides) for name, overrides in SHAPES.items()}
    models |= {
        f"fixture {name}": HookedDCFormer.from_pretrained(FIXTURES / name)
        for name in ("dcpythia-tiny", "dcformer-tiny")
    }
    print("| model | dtype | terms vs score | contrast | frozen check vs terms |")
    print("|---|---|---|---|---|")
    for name, model in models.items():
        tokens = torch.randint(0, model.cfg.d_vocab, (1, 14), generator=torch.Generator().manual_seed(2))
        layer = model.cfg.n_layers - 1
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            converted = model.to(dtype)
            result = qk_attribution(converted, tokens, layer, 1, 13)
            contrast = qk_contrast(converted, tokens, layer, 1, 13, 13, 11)
            checks = causal_checks(converted, result, key_pos=11)
            check_gap = float((checks["frozen"] - checks["estimate"]).abs().max()) / result.scale
            print(
                f"| {name} | {str(dtype).removeprefix('torch.')} | {result.relative_gap:.1e} | "
                f"{contrast.relative_gap:.1e} | {check_gap:.1e} |",
                flush=True,
            )
        model.to(torch.float32)


if __name__ == "__main__":
    main()
