"""Peak memory and time of weight processing (fold_ln, centring, value biases) at load, on a random checkpoint.

    python benchmarks/bench_processing.py [--layers 8] [--dim 2048] [--dtype float32] [--keep DIR]

Builds a random DCPythia checkpoint (the official layout) and loads it twice, each in a fresh process: as released,
and with `fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True`. Prints the peak
anonymous memory (RssAnon, sampled) above the baseline over the weights' size, and the time: processing works in
place, so the two peaks should be the same (1.0x the weights), the time a little longer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from dcinterp.random_checkpoint import DCPYTHIA_6_9B, scaled, write_random_checkpoint

PROCESS = "dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)"
MEASURE = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
from dcinterp import HookedDCFormer
from dcinterp.memory import PeakAnonMemory
start = time.perf_counter()
with PeakAnonMemory() as memory:
    model = HookedDCFormer.from_pretrained(sys.argv[1], dtype=sys.argv[2], **{processing})
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({{"seconds": time.perf_counter() - start, "weights": weights,
                  "ratio": (memory.peak - memory.baseline) / weights}}))
"""


def measure(directory: Path, dtype: str, processing: str) -> dict:
    command = [sys.executable, "-c", MEASURE.format(processing=processing), str(directory), dtype]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--keep", type=Path, help="build the checkpoint here and keep it")
    args = parser.parse_args()
    config = scaled(
        DCPYTHIA_6_9B,
        dim=args.dim,
        n_layer=args.layers,
        n_head=args.dim // 128,
        head_dim=128,
        intermediate_size=4 * args.dim,
    )
    directory = (args.keep or Path(tempfile.mkdtemp(prefix="bench_processing_"))) / "dcpythia"
    if not (directory / "config.json").is_file():
        write_random_checkpoint(directory, config, "safetensors")
    raw, processed = measure(directory, args.dtype, "{}"), measure(directory, args.dtype, PROCESS)
    print(f"weights {raw['weights'] / 2**30:.2f} GiB ({args.dtype}, {args.layers} layers, d_model {args.dim})")
    print(f"{'load':<28} {'peak-base / weights':>20} {'time':>8}")
    print(f"{'as released':<28} {raw['ratio']:>19.3f}x {raw['seconds']:>7.1f}s")
    print(f"{'processed (in place)':<28} {processed['ratio']:>19.3f}x {processed['seconds']:>7.1f}s")
    print(f"peak ratio processed / raw: {processed['ratio'] / raw['ratio']:.3f}")


if __name__ == "__main__":
    main()
