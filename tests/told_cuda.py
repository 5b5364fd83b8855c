"""The model's choice of a Triton kernel told that the tensors are on CUDA, while they stay on this CPU, where the real
kernel runs under Triton's interpreter; what the tests of the dynamic weights' and the decoding kernels share."""

import torch

from dcinterp.dcmha import families

CUDA = torch.device("cuda")


def forget_refusals(monkeypatch) -> None:
    """No warning or refusal of any kernel family remembered from earlier tests."""
    for family in families.FAMILIES:
        monkeypatch.setattr(family, "refused", {})
        monkeypatch.setattr(family, "said", set())


def told_cuda(monkeypatch, rules, path_function: str, module, fused: str, device: torch.device) -> dict:
    """`rules.<path_function>` told the device is CUDA (whether the kernels can run judged on `device`), the calls of
    `module.<fused>` counted, and no warning or refusal remembered from earlier tests. Returns {"paths": the paths
    chosen, in order, "calls": the fused function's calls}."""
    record = {"paths": [], "calls": 0}
    choose, run = getattr(rules, path_function), getattr(module, fused)

    def spy(**facts):
        record["paths"].append(choose(**{**facts, "device": CUDA}))
        return record["paths"][-1]

    def counted(*args, **kwargs):
        record["calls"] += 1
        return run(*args, **kwargs)

    real_unavailable = families.triton_unavailable
    monkeypatch.setattr(families, "triton_unavailable", lambda _: real_unavailable(device))
    monkeypatch.setattr(rules, path_function, spy)
    monkeypatch.setattr(module, fused, counted)
    forget_refusals(monkeypatch)
    return record
