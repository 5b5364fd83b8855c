"""benchmarks/bench_gpu_attention.py: the check it runs on a card before timing holds the fused kernels to the float64
rule (here under Triton's interpreter, at a tiny shape); without CUDA it says so in one line and measures nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = pytest.importorskip("bench_gpu_attention")


@pytest.fixture
def kernels(monkeypatch):
    """The kernels' module where they run here (natively or under the interpreter), the check's inputs on its device."""
    module = bench.load("maps")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if module.available(device) is not None:
        pytest.skip(module.available(device))
    monkeypatch.setattr(bench.inputs, "__defaults__", (0, torch.float32, 0, device.type))
    return module


def off_by_a_rounding(fused):
    return lambda q, k, v, pre, post, past=0: fused(q, k, v, pre, post, past) * (1 + 1e-5)


def test_the_cards_check_is_the_float64_rule_and_fails_a_wrong_kernel(kernels):
    def fused(q, k, v, pre, post, past=0):
        return kernels.fused_dcmha(q, k, v, pre, post, window=None, official=False, past=past, blocks=(16, 16))

    assert bench.check(fused, torch.float32, 2, 21, 3, 16, 2) <= 1
    assert bench.check(fused, torch.float32, 1, 3, 3, 16, 1, past=20) <= 1
    assert bench.check(off_by_a_rounding(fused), torch.float32, 1, 3, 3, 16, 1, past=20) > 1


def test_the_no_gradient_check_holds_the_forward_through_the_maps_to_the_rule(kernels):
    """benchmarks/sweep_gpu_maps.py checks the forward through the maps with `check(..., with_gradients=False)`."""

    def fused(q, k, v, pre, post, past=0):
        return kernels.fused_dcmha(q, k, v, pre, post, window=None, official=False, past=past, blocks=(16, 16))

    assert bench.check(fused, torch.float32, 2, 21, 3, 16, 2, with_gradients=False) <= 1
    assert bench.check(fused, torch.float32, 1, 3, 3, 16, 1, past=20) <= 1
    assert bench.check(off_by_a_rounding(fused), torch.float32, 2, 21, 3, 16, 2, with_gradients=False) > 1


@pytest.mark.parametrize(
    "script, arguments", [("bench_gpu_attention", []), ("sweep_gpu_maps", []), ("sweep_gpu_maps", ["--backward"])]
)
def test_without_cuda_one_line_and_no_number(script, arguments):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, str(ROOT / f"benchmarks/{script}.py"), *arguments], capture_output=True, text=True, env=env
    )
    assert result.returncode == 2
    assert result.stdout.strip() == f"{script}: no CUDA device: no GPU number is measured here"
