"""Peak memory and time of loading an official-format checkpoint of about 1B parameters.

    python benchmarks/bench_load.py [--layers 16] [--dim 2048] [--formats safetensors,bin] [--dtypes ...]
                                    [--device cpu] [--keep DIR]

Builds a random DCPythia checkpoint (float16 shards of 2 GiB, the official layout and index) in each file
format, then loads it once per (format, dtype) in a fresh process and prints the peak anonymous memory
(RssAnon, sampled) above the process's baseline, divided by the size of the loaded weights. 1.0 means the
weights alone; the target is at most 1.3. With --neox it also builds and loads a GPT-NeoX (Pythia) checkpoint.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dcinterp.random_checkpoint import DCPYTHIA_6_9B, PYTHIA_6_9B, n_parameters, scaled, write_random_checkpoint

GiB = 2**30


def measure(directory: Path, dtype: str, device: str) -> dict:
    command = [sys.executable, "-W", "ignore", "-m", "dcinterp.memory", str(directory), dtype, device]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--formats", default="safetensors,bin")
    parser.add_argument("--dtypes", default="float16,bfloat16,float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--neox", action="store_true", help="also a GPT-NeoX checkpoint of the same shape")
    parser.add_argument("--keep", type=Path, help="build the checkpoints here and keep them")
    args = parser.parse_args()

    heads = args.dim // 128
    configs = {
        "dcpythia": scaled(
            DCPYTHIA_6_9B, dim=args.dim, n_layer=args.layers, n_head=heads, head_dim=128, intermediate_size=4 * args.dim
        )
    }
    if args.neox:
        configs["gpt_neox"] = scaled(
            PYTHIA_6_9B,
            hidden_size=args.dim,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            intermediate_size=4 * args.dim,
        )
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_load_"))
    print(
        f"{'checkpoint':<10} {'format':<12} {'dtype':<9} {'params':>7} {'weights':>9} {'peak-base':>10} "
        f"{'ratio':>6} {'time':>7}"
    )
    for name, config in configs.items():
        for file_format in args.formats.split(","):
            directory = root / f"{name}-{file_format}"
            if not (directory / "config.json").is_file():
                start = time.perf_counter()
                write_random_checkpoint(directory, config, file_format)
                print(f"# built {directory} in {time.perf_counter() - start:.0f} s", flush=True)
            for dtype in args.dtypes.split(","):
                m = measure(directory, dtype, args.device)
                print(
                    f"{name:<10} {file_format:<12} {dtype:<9} {n_parameters(config) / 1e9:>6.2f}B "
                    f"{m['weights_bytes'] / GiB:>7.2f}Gi "
                    f"{(m['peak_anon_bytes'] - m['baseline_anon_bytes']) / GiB:>8.2f}Gi "
                    f"{m['peak_over_weights']:>6.3f} {m['seconds']:>6.1f}s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
