"""Start-up time of the command lines' `--help`, against a bare interpreter and against importing torch.

    python benchmarks/bench_cli.py [--repeats 5]

Each command runs in a fresh interpreter (`python -m ... --help`), as a user types it; each time is the fastest of
`--repeats` runs (the machine may be shared). Baselines measured in the same run: `python -c pass` (the floor)
and `python -c "import torch, transformer_lens"` (what `--help` cost when the CLIs imported the model up front).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {
    "synth --help": ["-m", "dcinterp.synth", "--help"],
    "synth eval --help": ["-m", "dcinterp.synth", "eval", "--help"],
    "synth generate --help": ["-m", "dcinterp.synth", "generate", "--help"],
    "notebooks run --help": ["-m", "dcinterp.notebooks", "run", "--help"],
    "train --help": ["-m", "dcinterp.train", "--help"],
}
BASELINES = {
    "python -c pass": ["-c", "pass"],
    "import torch, transformer_lens": ["-c", "import torch, transformer_lens"],
}


def fastest(arguments: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, *arguments], cwd=REPO, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    baselines = {name: fastest(arguments, args.repeats) for name, arguments in BASELINES.items()}
    heavy = baselines["import torch, transformer_lens"]
    for name, seconds in baselines.items():
        print(f"{name:32s} {seconds:6.2f} s")
    print(f"{'command':32s} {'time':>8s}  {'/ import torch+TL':>18s}")
    for name, arguments in COMMANDS.items():
        seconds = fastest(arguments, args.repeats)
        print(f"{name:32s} {seconds:6.2f} s  {seconds / heavy:17.2f}x")


if __name__ == "__main__":
    main()
