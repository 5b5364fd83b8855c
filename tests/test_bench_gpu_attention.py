"""benchmarks/bench_gpu_attention.py: the check it runs on a card before timing holds the fused kernels to the float64
rule (here under Triton's interpreter, at a tiny shape); without CUDA it says so in one line and measures nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = pytest.importorskip("bench_gpu_attention")


def test_the_cards_check_is_the_float64_rule_and_fails_a_wrong_kernel(monkeypatch):
    kernels = bench.load("triton_kernels")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kernels.available(device) is not None:
        pytest.skip(kernels.available(device))
    monkeypatch.setattr(bench.inputs, "__defaults__", (0, torch.float32, 0, device.type))

    def fused(q, k, v, pre, post, past=0):
        return kernels.fused_dcmha(q, k, v, pre, post, window=None, official=False, past=past, blocks=(16, 16, 16))

    assert bench.check(fused, torch.float32, 2, 21, 3, 16, 2) <= 1
    assert bench.check(fused, torch.float32, 1, 3, 3, 16, 1, past=20) <= 1

    def off_by_a_rounding(q, k, v, pre, post, past=0):
        return fused(q, k, v, pre, post, past) * (1 + 1e-5)

    assert bench.check(off_by_a_rounding, torch.float32, 1, 3, 3, 16, 1, past=20) > 1


def test_without_cuda_one_line_and_no_number():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_gpu_attention.py")], capture_output=True, text=True, env=env
    )
    assert result.returncode == 2
    assert result.stdout.strip() == "bench_gpu_attention: no CUDA device: no GPU number is measured here"


def test_the_no_gradient_check_holds_the_forward_through_the_maps_to_the_rule(monkeypatch):
    """benchmarks/sweep_gpu_maps.py checks the forward through the maps with `check(..., with_gradients=False)`."""
    kernels = bench.load("triton_kernels")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kernels.available(device) is not None:
        pytest.skip(kernels.available(device))
    monkeypatch.setattr(bench.inputs, "__defaults__", (0, torch.float32, 0, device.type))

    def fused(q, k, v, pre, post, past=0):
        return kernels.fused_dcmha(q, k, v, pre, post, window=None, official=False, past=past, map_blocks=(16, 16))

    assert bench.check(fused, torch.float32, 2, 21, 3, 16, 2, with_gradients=False) <= 1
    assert bench.check(fused, torch.float32, 1, 3, 3, 16, 1, past=20) <= 1

    def off_by_a_rounding(q, k, v, pre, post, past=0):
        return fused(q, k, v, pre, post, past) * (1 + 1e-5)

    assert bench.check(off_by_a_rounding, torch.float32, 2, 21, 3, 16, 2, with_gradients=False) > 1


def test_the_sweep_without_cuda_says_so_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/sweep_gpu_maps.py")], capture_output=True, text=True, env=env
    )
    assert result.returncode == 2
    assert result.stdout.strip() == "sweep_gpu_maps: no CUDA device: no GPU number is measured here"
