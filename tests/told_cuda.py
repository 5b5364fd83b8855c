"""The model's choice of a Triton kernel told that the tensors are on CUDA, while they stay on this CPU, where the real
kernel runs under Triton's interpreter; what the tests of the dynamic weights' and the decoding kernels share."""

import torch

from dcinterp import dcmha

CUDA = torch.device("cuda")


def told_cuda(monkeypatch, path_function: str, module, fused: str, refused: str, device: torch.device) -> dict:
    """`dcmha.<path_function>` told the device is CUDA (whether the kernels can run judged on `device`), the calls of
    `module.<fused>` counted, and no warning or refusal (`dcmha.<refused>`) remembered from earlier tests. Returns
    {"paths": the paths chosen, in order, "calls": the fused function's calls}."""
    record = {"paths": [], "calls": 0}
    choose, run = getattr(dcmha, path_function), getattr(module, fused)

    def spy(**facts):
        record["paths"].append(choose(**{**facts, "device": CUDA}))
        return record["paths"][-1]

    def counted(*args, **kwargs):
        record["calls"] += 1
        return run(*args, **kwargs)

    real_unavailable = dcmha.triton_unavailable
    monkeypatch.setattr(dcmha, "triton_unavailable", lambda _: real_unavailable(device))
    monkeypatch.setattr(dcmha, path_function, spy)
    monkeypatch.setattr(module, fused, counted)
    monkeypatch.setattr(dcmha, "_warned", set())
    monkeypatch.setattr(dcmha, refused, {})
    return record
