"""benchmarks/card_session.py: a GPU session's steps run in order within its time limit, each one's output kept in a
file named by card and date; a step that fails or overruns is reported and the others still run."""

import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import card_session
    from card_session import Step
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize(
    "device_name, slug",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
        ("Tesla T4", "t4"),
        ("NVIDIA RTX A5000", "rtx-a5000"),
    ],
)
def test_a_card_is_named_as_the_results_files_name_it(device_name, slug):
    assert card_session.card_slug(device_name) == slug


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_steps_run_in_order_and_a_failing_or_overrunning_one_does_not_stop_the_rest(tmp_path):
    grandchild = tmp_path / "grandchild.pid"
    steps = [
        Step(
            "writes", 0.001, python("import sys; print('hello'); open(sys.argv[1], 'w').write('{}\\n')") + ["{jsonl}"]
        ),
        Step("fails", 0.001, python("print('about to fail'); raise SystemExit(3)")),
        Step("too-long", 60, python("print('never')")),
        Step(
            "overruns",
            0.001,
            python(
                "import subprocess, sys, time; "
                "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                f"open({str(grandchild)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(60)"
            ),
        ),
    ]
    outcomes = card_session.run_steps(steps, tmp_path / "h100-2026-11-28", minutes=0.1)

    assert [(o.step, o.status) for o in outcomes] == [
        ("writes", "exit 0"),
        ("fails", "exit 3"),
        ("too-long", "not run (expected 60 min, 0.1 left)"),
        ("overruns", "stopped at the time limit"),
    ]
    assert [o.failed for o in outcomes] == [False, True, False, True]
    assert (tmp_path / "h100-2026-11-28-writes.txt").read_text() == "hello\n"
    assert (tmp_path / "h100-2026-11-28-writes.jsonl").read_text() == "{}\n"
    assert (tmp_path / "h100-2026-11-28-fails.txt").read_text() == "about to fail\n"
    assert not (tmp_path / "h100-2026-11-28-too-long.txt").exists()
    assert (tmp_path / "h100-2026-11-28-overruns.txt").read_text() == "started\n"
    # stopped with its own children (pytest's workers, in the real session): gone once the kill is delivered
    status = Path(f"/proc/{grandchild.read_text()}/status")
    for _ in range(100):
        if not status.exists() or "State:\tZ" in status.read_text():
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the overrunning step's child is still running: {status.read_text()[:200]!r}")


def test_list_prints_each_step_and_its_command_and_runs_nothing(capsys):
    assert card_session.main(["--list", "--steps", "quick,full"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["quick", "full"]
    assert lines[0].endswith("bench_gpu_dcmha.py --quick --fused-min-keys 0 --json {jsonl}")


def test_an_unknown_step_is_one_line_naming_it(capsys):
    with pytest.raises(SystemExit) as exit:
        card_session.main(["--steps", "quick,nope"])
    assert exit.value.code == 2
    assert "--steps: nope: not a step (the steps: cuda-tests, quick, full, backward, graph)" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="says so only without a card")
def test_without_a_card_it_says_so_and_runs_nothing(tmp_path, capsys):
    assert card_session.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "card_session.py: no CUDA device here: it runs on a card (--list shows what it would run)\n"
    )
    assert list(tmp_path.iterdir()) == []
