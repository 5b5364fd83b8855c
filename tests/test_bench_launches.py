"""The launch-counting benchmarks run, and what they count holds: on CUDA's paths a no-hook DCMHA forward launches no
torch op its SDPA twin does not (no copy of the dynamic weights before the kernels) and five Triton kernels a layer;
a decoding step takes the dynamic weights' kernel and the pattern's two, and none of torch's compose ops; the
arithmetic count of bench_decode_ops.py takes the pattern as its two kernels."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_a_forward_on_the_kernels_path_launches_what_its_twin_does_and_five_kernels_a_layer():
    out = run("bench_forward_launches.py", "--layers", "2", "--tokens", "20")
    rows = dict(re.findall(r"^\| (DCMHA|SDPA twin) \| (\d+ \| \d+) \|", out, re.MULTILINE))
    (dcmha_ops, dcmha_kernels), (twin_ops, twin_kernels) = (map(int, rows[m].split(" | ")) for m in rows)
    assert dcmha_kernels == 5 * 2 and twin_kernels == 0
    assert dcmha_ops <= twin_ops, out


def test_a_decoding_step_on_the_kernels_path_launches_three_kernels_a_layer_and_no_torch_compose():
    out = run("bench_forward_launches.py", "--layers", "2", "--tokens", "20", "--decode", "--verbose")
    rows = dict(re.findall(r"^\| (DCMHA|SDPA twin) \| (\d+ \| \d+) \|", out, re.MULTILINE))
    dcmha_kernels = int(rows["DCMHA"].split(" | ")[1])
    assert dcmha_kernels == 3 * 2  # the dynamic weights and the pattern's two, a layer
    assert "_decoding_logits_kernel 2" in out and "_decoding_pattern_kernel 2" in out
    assert "compose_decoding" not in out and "torch_decoding_pattern" not in out


def test_bad_arguments_give_one_line():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_forward_launches.py"), "--layers", "0"], capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith("must be at least 1")


def test_a_decoding_steps_count_takes_the_pattern_as_two_kernels_on_cuda():
    out = run("bench_decode_ops.py", "--no-time", "--shapes", "global")
    cpu = re.search(r"^\| compose, mask, softmax \| (\d+) / 0 \|", out, re.MULTILINE)
    dynamic = re.search(r"^\| dynamic weights \| (\d+) / 0 \|", out, re.MULTILINE)
    total = re.search(r"^\| total \| \*\*(\d+) / (\d+)\*\*", out, re.MULTILINE)
    on_cuda = re.search(r"^\| total as on CUDA [^|]* \| (\d+) / (\d+) ", out, re.MULTILINE)
    assert cpu and dynamic and total and on_cuda, out
    assert int(on_cuda[1]) == int(total[1]) - int(cpu[1]) - int(dynamic[1]) + 2 + 1
    assert on_cuda[2] == total[2]


@pytest.mark.parametrize(
    "mode, kernels, module",
    [
        ([], 5, "attention module"),
        (["--decode"], 3, "attention module"),
        # with gradients, the dynamic weights' kernel and its backward's (two), and 20 keys take the materialised path
        (["--gradients"], 2, "attention module's forward"),
        # and the forward through the maps (four), its backward (the maps again, their gradients, D, both sides: seven)
        (["--gradients", "--fused-min-keys", "0"], 13, "attention module's forward"),
    ],
    ids=["forward", "decoding-step", "gradients", "gradients-through-the-maps"],
)
def test_the_host_time_benchmark_times_both_models_on_cudas_paths(mode, kernels, module):
    out = run("bench_host_time.py", "--runs", "3", "--layers", "2", "--tokens", "20", *mode)
    rows = re.findall(r"^\| ([^|]+, a layer|whole call) \| (\d+) \| (\d+) \| \*\*([\d.]+)x\*\* \|$", out, re.M)
    assert [row[0] for row in rows] == [f"{module}, a layer", "whole call"], out
    assert all(int(dcmha) > 0 and int(twin) > 0 for _, dcmha, twin, _ in rows)
    assert f"Triton launches a layer (not run, not in the times): {kernels}\n" in out


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--runs", "0"], "--tokens, --layers and --runs must be at least 1"),
        (["--decode", "--gradients"], "--decode and --gradients time different calls: give one"),
        (["--fused-min-keys", "0"], "--fused-min-keys chooses the gradients' path: give --gradients too"),
        (["--gradients", "--fused-min-keys", "-1"], "--fused-min-keys must be at least 0"),
    ],
)
def test_the_host_time_benchmark_says_what_is_wrong_in_one_line(arguments, message, monkeypatch, capsys):
    """In this process (the script's own process is test_the_host_time_benchmark_times_both_models_on_cudas_paths's):
    exit status 2, the error its last line."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as the script sets it on import: unset again after the test
    import bench_host_time

    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "bench_host_time.py"), *arguments])
    with pytest.raises(SystemExit) as exit:
        bench_host_time.main()
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"bench_host_time.py: error: {message}"


def test_the_decode_ops_count_says_what_is_wrong_in_one_line():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_decode_ops.py"), "--no-time", "--batch", "0"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "bench_decode_ops.py: error: --batch and --steps must be at least 1, --prompt at least 0"
    )
