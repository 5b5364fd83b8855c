"""The sweeps under `torchrun --nproc-per-node 2` (gloo on the CPU) write what one process writes.

Each command runs once as one process and once as two; every output file is compared byte for byte (the processes
share the batches one process forms and combine the results in its order, so nothing is left to float32 reduction
order), except that summary.json / ablation.json record `world_size`, 1 against 2.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dcinterp import distributed
from dcinterp.synth.__main__ import main

COMMANDS = {  # arguments (tiny: a few samples, pairs, steps), outputs, the file that records world_size
    "eval": (
        ["eval", "--checkpoint", "dcpythia-synth", "--tasks", "8-11", "--limit", "12", "--batch-size", "4"],
        {"results.csv", "summary.json"},
        "summary.json",
    ),
    "ablate": (
        ["ablate", "--tasks", "2,40", "--limit", "4", "--batch-size", "2"],
        {"ablation.csv", "ablation.json", "ablation.png"},
        "ablation.json",
    ),
    "circuit": (
        ["circuit", "--tasks", "2", "--pairs", "2", "--n-steps", "2", "--exact-top", "2", "--batch-size", "1"],
        {"edges.csv", "faithfulness.csv", "summary.json", "faithfulness.png", "circuit.png"},
        "summary.json",
    ),
    "attribute": (
        ["attribute", "--tasks", "2,3", "--prompts", "1", "--n-steps", "4", "--batch-size", "1", "--baseline", "mean"],
        {"heads.csv", "prompts.csv", "summary.json", "heads.png"},
        "summary.json",
    ),
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # as conftest sets for this process
TIMEOUT = 600  # seconds: a hang fails the test instead of the suite


def torchrun() -> str:
    found = Path(sys.executable).with_name("torchrun")
    found = str(found) if found.is_file() else shutil.which("torchrun")
    if not found:
        pytest.skip("torchrun is not installed next to this Python")
    return found


def two_processes(*commands: list[str]) -> subprocess.CompletedProcess:
    """The commands in turn under `torchrun --standalone` (a free port) with 2 processes."""
    script = Path(__file__).with_name("synth_commands.py")
    return subprocess.run(
        [torchrun(), "--standalone", "--nproc-per-node=2", str(script), *map(json.dumps, commands)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=TIMEOUT,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every command run as one process (here) and as two (torchrun, one launch for all): the output folders."""
    root = tmp_path_factory.mktemp("sweeps")
    for command in COMMANDS:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert main([*COMMANDS[command][0], "--out", str(root / "one" / command)]) == 0, command
    two = two_processes(
        *([*arguments, "--out", str(root / "two" / command)] for command, (arguments, _, _) in COMMANDS.items())
    )
    assert two.returncode == 0, two.stderr[-3000:]
    return root, two.stdout


def test_each_command_says_it_shared_the_work_and_rank_0_alone_writes(runs):
    _, stdout = runs
    assert stdout.count("(2 processes)") == len(COMMANDS)
    assert stdout.count("wrote ") == len(COMMANDS)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_two_processes_write_the_same_files_as_one(runs, command):
    root, _ = runs
    _, outputs, summary = COMMANDS[command]
    one, two = root / "one" / command, root / "two" / command
    for folder in (one, two):
        assert {p.name for p in folder.iterdir()} == outputs  # no partial file left behind
    for name in sorted(outputs - {summary}):
        assert (two / name).read_bytes() == (one / name).read_bytes(), name
    one_summary, two_summary = (one / summary).read_bytes(), (two / summary).read_bytes()
    assert b'"world_size": 1' in one_summary and b'"world_size": 2' not in one_summary
    assert two_summary.count(b'"world_size": 2') == one_summary.count(b'"world_size": 1')
    assert two_summary.replace(b'"world_size": 2', b'"world_size": 1') == one_summary


def test_bad_input_stops_every_process_with_one_line_and_nothing_written(tmp_path):
    out = tmp_path / "out"
    two = two_processes(["circuit", "--tasks", "0", "--kind", "person", "--out", str(out)])
    assert two.returncode != 0
    ours = [line for line in two.stderr.splitlines() if line.startswith("error: ")]
    assert ours == [
        "error: --kind person does not apply to task0 (other-person); it applies to same-person, "
        "matching-person, not-matching-person"
    ]
    assert "exitcode  : 2" in two.stderr and "exitcode  : 1" not in two.stderr  # the workers' status, not a crash
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# The helpers, in two processes joined through a file (no port to choose)
def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        results = {
            "rank_and_size": distributed.rank_and_size(),
            "my_batches": distributed.my_batches(5),
            "first_error": distributed.first_error("rank 1 refuses" if rank == 1 else None),
            "no_error": distributed.first_error(None),
        }
        generator = torch.Generator().manual_seed(0)
        parts = torch.randn(5, 1000, generator=generator) * 10.0 ** torch.arange(5)[:, None]
        mine = {i: parts[i] for i in distributed.my_batches(5)}
        results["sum"] = distributed.sum_in_order(mine, 5, torch.zeros(1000))
        torch.save(results, Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_helpers_share_batches_and_agree_on_errors(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    assert [r["rank_and_size"] for r in results] == [(0, 2), (1, 2)]
    assert [r["my_batches"] for r in results] == [[0, 2, 4], [1, 3]]
    assert [r["first_error"] for r in results] == ["rank 1 refuses"] * 2  # both stop, though rank 0 had no error
    assert [r["no_error"] for r in results] == [None, None]
    generator = torch.Generator().manual_seed(0)
    parts = torch.randn(5, 1000, generator=generator) * 10.0 ** torch.arange(5)[:, None]
    one_process = torch.zeros(1000)
    for part in parts:
        one_process += part
    for r in results:
        assert torch.equal(r["sum"], one_process)  # batch order, not per-process partial sums


def test_without_a_process_group_the_helpers_are_the_identity():
    assert distributed.rank_and_size() == (0, 1)
    assert distributed.my_batches(3) == [0, 1, 2]
    assert distributed.gather({0: "a"}) == {0: "a"}
    assert distributed.first_error("bad") == "bad"
    with pytest.raises(RuntimeError, match="no result for batch 1 of 2"):
        distributed.in_order({0: "a"}, 2)
