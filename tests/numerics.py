"""The equivalence rule for two ways of computing the same thing in float32, judged against float64.

Float32 rounding grows with what is summed (a gradient sums over every position, a logit over every layer), and
how much depends on the CPU's summation order, so a fixed tolerance tuned on one CPU fails on another. Instead,
both paths run in float32 and the reference path in float64 on the same inputs, and the new path may be at most
FACTOR times as far from float64 as the reference path's own float32 result, in the largest entry (max-norm):

    max |new32 - ref64| <= FACTOR * max |ref32 - ref64| + FLOOR_EPS * eps32 * max |ref64|

The floor (a few float32 units of the tensor's scale) covers a reference that happens to be nearly exact.
"""

from __future__ import annotations

import copy

import torch

FACTOR = 8  # the blocked path measured at most 2.7x the materialised path's error (tests/test_blocked.py)
FLOOR_EPS = 16
EPS32 = torch.finfo(torch.float32).eps


def float32_error_ratio(
    new: torch.Tensor,
    reference: torch.Tensor,
    exact: torch.Tensor,
    factor: float = FACTOR,
    floor_eps: float = FLOOR_EPS,
) -> float:
    """The new path's float32 error over what the rule allows it (at most 1 to pass)."""
    exact = exact.double()
    new_error = (new.double() - exact).abs().max().item()
    reference_error = (reference.double() - exact).abs().max().item()
    allowed = factor * reference_error + floor_eps * EPS32 * exact.abs().max().item()
    return new_error / allowed if allowed > 0 else (0.0 if new_error == 0 else float("inf"))


def assert_as_exact_as(
    new: torch.Tensor,
    reference: torch.Tensor,
    exact: torch.Tensor,
    what: str = "",
    factor: float = FACTOR,
    floor_eps: float = FLOOR_EPS,
) -> None:
    """`new` within `factor` times `reference`'s distance from `exact` (float64), max-norm, plus the floor (both
    computed in the same dtype, float32 unless a test says otherwise)."""
    assert new.shape == reference.shape == exact.shape, (what, new.shape, reference.shape, exact.shape)
    ratio = float32_error_ratio(new, reference, exact, factor, floor_eps)
    if not ratio <= 1:
        new_error = (new.double() - exact.double()).abs().max().item()
        reference_error = (reference.double() - exact.double()).abs().max().item()
        raise AssertionError(
            f"{what}: the new path is {new_error:.3g} from float64, the reference path {reference_error:.3g} "
            f"(allowed: {factor} times that, plus {floor_eps} float32 units of {exact.abs().max().item():.3g})"
        )


def float64_copy(model):
    """The model in float64, the same weights (frozen or not, as the original), for the reference run."""
    return copy.deepcopy(model).double()


def hessian_vector_product(model, tokens, direction: torch.Tensor) -> torch.Tensor:
    """H v for the loss on `tokens` as a function of their embeddings, v = `direction` [batch, pos, d_model]: a
    second derivative through every attention path (create_graph=True)."""
    x = model.embed(tokens).detach().requires_grad_(True)
    loss = model(x, start_at_layer=0, tokens=tokens, return_type="loss")
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    (second,) = torch.autograd.grad((grad * direction.to(x.dtype)).sum(), x)
    return second
