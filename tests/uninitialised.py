"""Uninitialised memory as a card may hand it out: NaN in every float tensor that `torch.empty`, `torch.empty_like` and
`Tensor.new_empty` give.

On a CPU a fresh allocation often holds zeros, so a kernel that reads memory before writing it (or keeps an entry it
should drop) may pass a test here and give NaN on a card, where the caching allocator hands back what an earlier tensor
left. The kernels' tests run with this in place (an autouse fixture in each of tests/test_triton_*.py): a read of
memory never written reaches the result as NaN, which no float64-judged comparison and no comparison of bits lets
pass."""

import torch


def allocate_nan(monkeypatch) -> None:
    """From now on (until the monkeypatch is undone), float tensors from torch.empty, torch.empty_like and
    Tensor.new_empty hold NaN."""
    for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty")):
        allocate = getattr(owner, name)

        def poisoned(*args, allocate=allocate, **kwargs):
            x = allocate(*args, **kwargs)
            return x.fill_(float("nan")) if x.is_floating_point() and x.device.type != "meta" else x

        monkeypatch.setattr(owner, name, poisoned)
    assert torch.isnan(torch.empty(2)).all() and torch.isnan(torch.zeros(2).new_empty(2)).all()
