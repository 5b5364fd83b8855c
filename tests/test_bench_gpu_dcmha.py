"""benchmarks/bench_gpu_dcmha.py runs in one command; on a CPU its smoke run says the GPU numbers are not measured."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_cpu_smoke_run_measures_every_model_and_claims_no_gpu_number(tmp_path):
    out = tmp_path / "rows.jsonl"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep where the deps are
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_gpu_dcmha.py"),
            "--cpu",
            "--repeats",
            "1",
            "--kernels",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("# GPU numbers not measured")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["measurement"] for r in rows] == [
        "forward",
        "forward + backward",
        "attention alone, forward",
        "attention alone, forward + backward",
        "decode, per token after 24 prompt tokens (each step synchronised)",
        "decode, per token after 24 prompt tokens (20 steps back to back)",
    ]
    for r in rows:
        assert r["device"] == "cpu smoke run: not GPU numbers"
        for name, model in r["models"].items():
            assert "ms" not in model and model["cpu_smoke_ms"] > 0 and model["peak_mib"] is None, name
            assert "host_ms" not in model and 0 < model["cpu_smoke_host_ms"] <= model["cpu_smoke_ms"], name
    attention = rows[2]["models"]
    for name in ("DCMHA fused", "SDPA twin"):  # one profiled call: its ops' own times, the longest first
        kernels = list(attention[name]["cpu_smoke_kernel_ms"].values())
        assert 0 < len(kernels) <= 10 and kernels == sorted(kernels, reverse=True), name
        assert sum(kernels) <= attention[name]["cpu_smoke_device_ms"], name
    assert "cpu_smoke_device_ms" not in rows[3]["models"]["DCMHA fused"]  # not with the backward
    paths = {r["measurement"]: r["models"]["DCMHA fused"]["paths"] for r in rows}
    assert paths["forward"] == ["blocked"]
    assert paths["decode, per token after 24 prompt tokens (each step synchronised)"] == [
        "few_queries",
        "pattern by torch",
    ]
    assert rows[-1]["models"]["DCMHA fused, torch's pattern"]["paths"] == ["few_queries", "pattern by torch"]
    assert {p for r in rows for p in r["models"]["SDPA twin"]["paths"]} == {"sdpa"}
    assert {p for r in rows for p in r["models"]["DCMHA materialised"]["paths"]} == {"materialised"}
    table = result.stdout[result.stdout.index("GPU numbers not measured (CPU smoke run") :]
    assert "ms" not in table and "x**" not in table  # no time and no ratio in the table


def test_each_aim_is_judged_by_the_largest_ratio_the_run_measured():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_gpu_dcmha
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def measured(measurement, tokens, fused, twin, shape="6.9b-wide", key="ms"):
        models = {"DCMHA fused": {key: fused}, "SDPA twin": {key: twin}, "MHA einsum": {key: 1.0}}
        return dict(shape=shape, measurement=measurement, tokens=tokens, models=models)

    rows = [
        measured("forward", 128, 1.1, 1.0),
        measured("forward", 2048, 1.5, 1.0),
        measured("forward", 4096, 9.0, 1.0),  # between the two aims' lengths: neither reads it
        measured("forward", 8192, 1.3, 1.0),
        measured("forward", 512, 5.0, 1.0, shape="d1024"),  # another shape
        measured("forward + backward", 2048, 2.6, 2.0),
        measured("forward + backward", 1024, 3.0, 2.0) | {"models": {"DCMHA fused": {"error": "out of memory"}}},
        measured("forward", 128, 100.0, 100.0, key="peak_mib"),
        measured("attention alone, forward", 2048, 2.9, 1.0),
        measured("decode, per token after 1024 prompt tokens (each step synchronised)", 1024, 1.1, 1.0),
        measured("decode, per token after 1024 prompt tokens (20 steps back to back)", 1024, 1.2, 1.0),
    ]
    assert bench_gpu_dcmha.against_the_aims(rows) == [
        "- forward, 128-2,048 tokens (aim 1.2x): 1.10-1.50x over 2 measurement(s): **not met**",
        "- forward, 8,192 tokens (aim 1.4x): 1.30x over 1 measurement(s): **met**",
        "- forward + backward, 128-2,048 tokens (aim 1.3x): 1.30x over 1 measurement(s): **met**",
        "- forward + backward, 8,192 tokens (aim 1.6x): not measured",
        "- peak memory, every length (aim 1.3x): 1.00x over 1 measurement(s): **met**",
        "- one layer's attention forward, 2,048-8,192 tokens (aim 3.0x): 2.90x over 1 measurement(s): **met**",
        "- one layer's attention forward + backward, 2,048-8,192 tokens (aim 3.5x): not measured",
        "- decoding, a token (aim 1.15x): 1.10-1.20x over 2 measurement(s): **not met**",
    ]


@pytest.mark.parametrize(
    "argument, message",
    [
        (["--tokens", "128,abc"], "argument --tokens: must be a positive whole number (got 'abc')"),
        (["--maps-mib", "0"], "argument --maps-mib: must be a positive whole number (got '0')"),
        (["--repeats", "-1"], "argument --repeats: must be a positive whole number (got '-1')"),
        (["--fused-min-keys", "-1"], "argument --fused-min-keys: must be a whole number, 0 or more (got '-1')"),
        (["--shapes", "6.9b-wide,d2048"], "argument --shapes: unknown shape 'd2048' (known: 6.9b-wide, d1024)"),
    ],
)
def test_bad_arguments_say_what_is_wrong_in_one_line(argument, message, monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_gpu_dcmha
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["bench_gpu_dcmha.py", "--cpu", *argument])
    with pytest.raises(SystemExit) as exit_:
        bench_gpu_dcmha.main()
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert err.strip().splitlines()[-1] == f"bench_gpu_dcmha.py: error: {message}"
