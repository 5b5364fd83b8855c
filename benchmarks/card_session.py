"""A GPU session for issue 37 in one command: the CUDA tests natively on the card, then the benchmarks, each output
kept in a file named by card, date and what ran (benchmarks/results/'s convention), within a time limit.

    python benchmarks/card_session.py [--minutes 9] [--out benchmarks/results] [--steps cuda-tests,quick,...]
    python benchmarks/card_session.py --list      # the steps and their commands; nothing runs

The steps, in order (`STEPS`; each with the minutes it took or is expected to take on an H100):
- `cuda-tests`: the tests that take CUDA's paths where a card is present (the kernels, the decoding kernels, the
  dynamic weights, the dispatch, placement, the GPU benchmarks' helpers), natively, not under the interpreter;
- `quick`: `bench_gpu_dcmha.py --quick --fused-min-keys 0`: 128 and 2,048 tokens, gradients through the kernels at
  both (what changed since the last card run, first);
- `full`: `bench_gpu_dcmha.py` with no argument: the whole table, ending with a line for each of the issue's aims;
- `backward`: `sweep_gpu_maps.py --backward`: the backward through the maps checked against float64, its launches
  swept, one layer against SDPA's;
- `graph`: `bench_graph.py --parts 6.9b --device cuda --layers 32 --twin`: an attribution graph of DCPythia-6.9B's
  and Pythia-6.9B's whole shapes (float32, random transcoders of 16,384 features a layer) on a 64-token prompt.
The default 9 minutes hold the first three (a command of 10 minutes at most); `--steps backward` and `--steps graph`
the others, after.
A step starts only if its expected minutes fit in what is left of `--minutes`, and is stopped at the limit (what it
wrote so far is kept); a step that fails does not stop the others. Written to `--out`: `<card>-<date>-<step>.txt`
(what the step printed) and, for the benchmarks, `.jsonl` (their JSON lines), beside `<card>-<date>-session.txt`
(the card, the versions, the commit, each step's exit status and seconds; a later call the same day adds
its own). Exit 1 if a step failed or was stopped.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
CUDA_TESTS = [
    "tests/test_triton_dcmha.py",
    "tests/test_triton_decoding.py",
    "tests/test_triton_dynamic_weights.py",
    "tests/test_dcmha_dispatch.py",
    "tests/test_placement.py",
    "tests/test_bench_gpu_dcmha.py",
    "tests/test_bench_gpu_attention.py",
]
BENCH_GPU_DCMHA = [sys.executable, str(BENCHMARKS / "bench_gpu_dcmha.py")]
BENCH_GRAPH = [sys.executable, str(BENCHMARKS / "bench_graph.py")]


@dataclass
class Step:
    name: str
    minutes: float  # expected on an H100: a step starts only if it fits in what is left
    command: list[str]  # "{jsonl}" stands for the step's JSON lines file


@dataclass
class Outcome:
    step: str
    status: str  # "exit N", "stopped at the time limit" or "not run (...)"
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status != "exit 0" and not self.status.startswith("not run")

    def __str__(self) -> str:
        return f"{self.step}: {self.status}" + ("" if self.status.startswith("not run") else f", {self.seconds:.0f} s")


def _pytest() -> list[str]:
    """pytest as the suite runs it, a worker a core up to 8 where pytest-xdist is installed (the kernels compile in
    each worker)."""
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:benchmark", "-p", "no:cacheprovider", *workers]


STEPS = [
    Step("cuda-tests", 4.0, [*_pytest(), *CUDA_TESTS]),
    Step("quick", 1.5, [*BENCH_GPU_DCMHA, "--quick", "--fused-min-keys", "0", "--json", "{jsonl}"]),
    Step("full", 3.5, [*BENCH_GPU_DCMHA, "--json", "{jsonl}"]),
    Step("backward", 3.0, [sys.executable, str(BENCHMARKS / "sweep_gpu_maps.py"), "--backward", "--json", "{jsonl}"]),
    Step(
        "graph",
        10.0,
        [*BENCH_GRAPH, "--parts", "6.9b", "--device", "cuda", "--layers", "32", "--twin", "--json", "{jsonl}"],
    ),
]


def card_slug(device_name: str) -> str:
    """A card's file-name prefix from torch's name for it: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA GeForce RTX
    4090" -> "rtx-4090", "NVIDIA A100-SXM4-80GB" -> "a100-sxm4-80gb": the words up to the first with a digit, the
    vendor's and brand's left out."""
    words = [w for w in device_name.split() if w.lower() not in {"nvidia", "geforce", "tesla", "quadro", "amd"}]
    kept = []
    for word in words:
        kept.append(word)
        if any(c.isdigit() for c in word):
            break
    return re.sub(r"[^a-z0-9]+", "-", "-".join(kept).lower()).strip("-") or "gpu"


def run_steps(steps: list[Step], prefix: Path, minutes: float) -> list[Outcome]:
    """Run the steps in order within `minutes`, each one's output to `<prefix>-<name>.txt` (printed when it ends) and
    its JSON lines to `<prefix>-<name>.jsonl`."""
    deadline, outcomes = time.monotonic() + 60 * minutes, []
    for step in steps:
        left = deadline - time.monotonic()
        if step.minutes * 60 > left:
            outcomes.append(Outcome(step.name, f"not run (expected {step.minutes:g} min, {left / 60:.1f} left)"))
            continue
        jsonl = prefix.with_name(f"{prefix.name}-{step.name}.jsonl")
        command = [part.replace("{jsonl}", str(jsonl)) for part in step.command]
        log = prefix.with_name(f"{prefix.name}-{step.name}.txt")
        print(f"--- {step.name}: {' '.join(command)}", flush=True)
        start = time.monotonic()
        with open(log, "w") as out:
            # A session of its own, so that a step stopped at the limit takes its children (pytest's workers) along
            process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                status = f"exit {process.wait(timeout=left)}"
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                status = "stopped at the time limit"
        print(log.read_text(), end="", flush=True)
        outcomes.append(Outcome(step.name, status, time.monotonic() - start))
    return outcomes


def environment() -> list[str]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (not a git checkout)"
    return [
        f"card: {torch.cuda.get_device_name(0)}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}",
        f"commit: {commit}",
    ]


def main(argv: list[str] | None = None) -> int:
    names = [step.name for step in STEPS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=9.0, help="the session's time limit (default 9)")
    parser.add_argument("--out", type=Path, default=BENCHMARKS / "results", help="where the files go")
    parser.add_argument("--steps", default=",".join(names), help=f"which, in order (default {','.join(names)})")
    parser.add_argument("--list", action="store_true", help="print the steps and their commands; run nothing")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.steps.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in names]
    if unknown or not chosen:
        parser.error(f"--steps: {', '.join(unknown) or 'none given'}: not a step (the steps: {', '.join(names)})")
    if args.minutes <= 0:
        parser.error("--minutes must be more than 0")
    steps = [step for step in STEPS if step.name in chosen]
    if args.list:
        for step in steps:
            print(f"{step.name} ({step.minutes:g} min): {' '.join(step.command)}")
        return 0

    import torch

    if not torch.cuda.is_available():
        print(
            "card_session.py: no CUDA device here: it runs on a card (--list shows what it would run)", file=sys.stderr
        )
        return 2
    if not args.out.is_dir():
        print(f"card_session.py: --out {args.out}: not a directory", file=sys.stderr)
        return 2
    prefix = args.out / f"{card_slug(torch.cuda.get_device_name(0))}-{datetime.date.today().isoformat()}"
    header = environment()
    print("\n".join(header), flush=True)
    outcomes = run_steps(steps, prefix, args.minutes)
    summary = "\n".join([*header, *map(str, outcomes)]) + "\n"
    with open(prefix.with_name(f"{prefix.name}-session.txt"), "a") as session:  # a second call of the day adds
        session.write(summary + "\n")
    print("--- the session\n" + summary, end="")
    return 1 if any(outcome.failed for outcome in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
