"""`torchrun --nproc-per-node 2 -m dcinterp.synth eval` (gloo on the CPU) writes what one process writes."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ARGS = [
    "-m",
    "dcinterp.synth",
    "eval",
    "--checkpoint",
    "dcpythia-synth",
    "--tasks",
    "8-11",
    "--limit",
    "30",
    "--batch-size",
    "4",
]


def test_two_processes_write_the_same_files_as_one(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.is_file():
        torchrun = shutil.which("torchrun")
    if not torchrun:
        pytest.skip("torchrun is not installed next to this Python")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, *ARGS, "--out", str(tmp_path / "one")], capture_output=True, text=True, env=env
    )
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", *ARGS, "--out", str(tmp_path / "two")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert two.returncode == 0, two.stderr[-2000:]
    assert "(2 processes)" in two.stdout
    for name in ("results.csv", "summary.json"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["results.csv", "summary.json"]
