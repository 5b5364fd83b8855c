"""The real workload on one GPU: a DCPythia-6.9B-shaped checkpoint (random float16 shards, the official layout),
loaded and analysed as the README's workflows do, with host and GPU memory measured at each step.

    python benchmarks/bench_gpu_workload.py [--dir /tmp/dcpythia-6.9b] [--neox] [--json OUT.json]

Each step prints: host peak anonymous memory (RssAnon) during the step, GPU peak allocated memory during it,
and its time. Steps: load (bfloat16, straight to the GPU); a forward of 2048 tokens (frozen weights: no graph);
run_with_cache of one layer's attention at 2048 tokens; the guard's verdict on a full cache; a compose breakdown
at layer 16 (the case study); integrated gradients over all 1,024 heads on a 24-token prompt; a synth-eval-sized
batch (8 x 128 tokens). With --neox the same load for a Pythia-6.9B-shaped GPT-NeoX checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from dcinterp import CacheTooLarge, HookedDCFormer, estimate_cache
from dcinterp.memory import PeakAnonMemory
from dcinterp.random_checkpoint import DCPYTHIA_6_9B, PYTHIA_6_9B, n_parameters, write_random_checkpoint

GiB = 2**30
results: list[dict] = []


def step(name: str, fn):
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before_gpu = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with PeakAnonMemory() as host:
        try:
            out, error = fn(), None
        except Exception as e:  # report and go on with the other steps
            out, error = None, f"{type(e).__name__}: {str(e)[:300]}"
    torch.cuda.synchronize()
    row = {
        "step": name,
        "seconds": round(time.perf_counter() - start, 2),
        "host_peak_anon_gib": round((host.peak - host.baseline) / GiB, 2),
        "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / GiB, 2),
        "gpu_peak_above_start_gib": round((torch.cuda.max_memory_allocated() - before_gpu) / GiB, 2),
        "gpu_after_gib": round(torch.cuda.memory_allocated() / GiB, 2),
        "error": error,
    }
    results.append(row)
    print(json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dcpythia-6.9b"))
    parser.add_argument("--neox", action="store_true")
    parser.add_argument(
        "--offload",
        action="store_true",
        help="also a device_map='auto' load capped at 10 GiB of GPU memory (the rest offloaded to the "
        "CPU), and loads to the CPU in bfloat16 and float32 (the 24 GB workstation question)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; "
        f"DCPythia-6.9B shape: {n_parameters(DCPYTHIA_6_9B) / 1e9:.2f}B parameters",
        flush=True,
    )
    if not (args.dir / "config.json").is_file():
        step(
            "write random float16 safetensors shards",
            lambda: write_random_checkpoint(args.dir, DCPYTHIA_6_9B, "safetensors", device="cuda"),
        )
    model = step(
        "load bfloat16 to cuda", lambda: HookedDCFormer.from_pretrained(args.dir, dtype=torch.bfloat16, device="cuda")
    )
    tokens = torch.randint(0, 50257, (1, 2048), device="cuda")
    step("forward 1 x 2048 (frozen, no graph)", lambda: model(tokens).shape)
    step(
        "run_with_cache blocks.16.attn at 2048",
        lambda: len(model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.16.attn"))[1]),
    )

    def full_cache():
        try:
            model.run_with_cache(tokens)
        except CacheTooLarge as refused:
            return str(refused)
        return "accepted"

    verdict = step("run_with_cache of every hook at 2048 (guard)", full_cache)
    print("#", verdict, "| estimate:", estimate_cache(model, tokens), flush=True)

    from dcinterp.attribution import head_attribution
    from dcinterp.composition import compose_breakdown

    prompt = torch.randint(0, 50257, (1, 24), device="cuda")
    step("compose_breakdown layer 16 (24 tokens)", lambda: compose_breakdown(model, prompt, 16, 23, 3).composed.shape)
    step(
        "head_attribution, 1024 heads, 16 steps, internal batch 4",
        lambda: head_attribution(model, prompt, target=42, n_steps=16, internal_batch_size=4).scores.shape,
    )
    step(
        "synth-eval batch 8 x 128 (inference_mode)",
        lambda: _inference(model, torch.randint(0, 50257, (8, 128), device="cuda")),
    )
    del model
    if args.offload:
        model = step(
            "load bfloat16, device_map=auto, max_memory 10 GiB GPU",
            lambda: HookedDCFormer.from_pretrained(
                args.dir, dtype=torch.bfloat16, device_map="auto", max_memory={0: "10GiB", "cpu": "100GiB"}
            ),
        )
        print(
            "# placed on the GPU:",
            sum(d == 0 for d in model.hf_device_map.values()),
            "of",
            len(model.hf_device_map),
            "modules",
            flush=True,
        )
        short = tokens[:, :512]
        step("offloaded forward 1 x 512", lambda: model(short).shape)
        step(
            "offloaded compose_breakdown layer 16 (24 tokens)",
            lambda: compose_breakdown(model, prompt, 16, 23, 3).composed.shape,
        )
        del model
        for dtype in ("bfloat16", "float32"):
            step(f"load {dtype} to the CPU", lambda: _cpu_load(args.dir, dtype))
    if args.neox:
        neox_dir = args.dir.with_name(args.dir.name + "-neox")
        if not (neox_dir / "config.json").is_file():
            step(
                "write random Pythia-6.9B (GPT-NeoX) shards",
                lambda: write_random_checkpoint(neox_dir, PYTHIA_6_9B, "safetensors", device="cuda"),
            )
        model = step(
            "load Pythia-6.9B bfloat16 to cuda",
            lambda: HookedDCFormer.from_pretrained(neox_dir, dtype=torch.bfloat16, device="cuda"),
        )
        step("Pythia forward 1 x 2048", lambda: model(tokens).shape)
        del model
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def _cpu_load(directory: Path, dtype: str) -> str:
    import subprocess
    import sys

    command = [sys.executable, "-W", "ignore", "-m", "dcinterp.memory", str(directory), dtype, "cpu"]
    measured = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    print("#", dtype, "on the CPU, fresh process:", json.dumps(measured), flush=True)
    return measured


def _inference(model, tokens):
    with torch.inference_mode():
        return model(tokens).shape


if __name__ == "__main__":
    main()
