"""Attribution graphs (`dcinterp.attribution_graph`): time and peak memory on the embedded models and at
DCPythia-6.9B's shape with random transcoders of 16,384 features a layer.

    python benchmarks/bench_graph.py [--parts embedded,6.9b] [--repeats 3] [--layers 1] [--seq 64] [--l0 16]
                                     [--d-transcoder 16384] [--d-model 4096] [--batch-size 32] [--twin]
                                     [--dtype float32] [--device cpu] [--threads 2] [--json OUT]

Parts, each row in a fresh process (peak memory is that process's own):
  embedded  `dcpythia-synth` and `pythia-synth` with their shipped transcoders, on the prompt `python -m dcinterp.synth
            graph` explains by default (task 2's first contrast pair, seed 0: the person lookup); the median of
            --repeats graphs.
  6.9b      DCPythia-6.9B's widths (`dcinterp.random_checkpoint.DCPYTHIA_6_9B`: d_model 4096, 32 heads of 128, d_mlp
            16384, a 50,257-token vocabulary, QK-norm, parallel blocks) with --layers blocks of random weights (normal,
            std 0.02; norm scales 1) and a random ReLU transcoder of --d-transcoder features a layer (unit encoder
            columns and decoder rows, as `dcinterp.transcoders.random_transcoders` draws them), its encoder bias -z
            with P(N(0, 1) > z) = l0 / d_transcoder, so that on the normed stream the MLP reads (unit variance a
            coordinate) a token has about --l0 active features a layer (16 by default: the goal of the embedded
            models' trained transcoders is an L0 under 16; the row prints the L0 measured). A prompt of --seq random
            tokens. --twin adds Pythia-6.9B's (`PYTHIA_6_9B`, plain MHA) row of the same depth.

What is timed (each graph: `attribution_graph` with --batch-size target rows a backward pass, then `prune_graph` and
`graph_scores`): `run`, the model's forward on the prompt with the hooks the replacement freezes and the
transcoders' encoding (`replacement_run`); `forward`, the replacement's forward of --batch-size copies with
gradients; `backward`, the backward passes and the edge rows they give (the rest of `attribution_graph` but
`inputs`, the two forwards of the nodes' inputs and constants); `prune` and `scores`. `cpu` is the process's CPU
time over the graph (all threads): on a shared machine it moves less than the wall time. Peak memory: RssAnon above
what the process held once the model and transcoders were built (`dcinterp.memory.PeakAnonMemory`), and on CUDA the
GPU's peak allocated memory above the weights (the adjacency matrix and pruning stay on the host).

The whole DCPythia-6.9B with 32 transcoders does not fit a 24 GiB CPU machine: the header prints the arithmetic
(weights, transcoders, the dense adjacency matrix at 32 layers). With fewer layers the cost scales: features and
backward passes grow with the layers, each pass runs through every layer, so the backward passes take about
(32 / layers)^2 their time at 32 layers; each 6.9b row ends with that estimate beside what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time

import torch

GiB = 2**30
EMBEDDED = ("dcpythia-synth", "pythia-synth")
FULL_LAYERS = 32  # DCPythia-6.9B's and Pythia-6.9B's depth


# ----------------------------------------------------------------------------------------------
# The models


def shape_config(kind: str, layers: int, d_model: int) -> dict:
    """The official config of DCPythia-6.9B ("dcpythia") or Pythia-6.9B ("pythia") with `layers` blocks; a
    d_model other than 4096 keeps heads of 128 and d_mlp = 4 d_model (tiny shapes, to test the script)."""
    from dcinterp.random_checkpoint import DCPYTHIA_6_9B, PYTHIA_6_9B, scaled

    if kind == "dcpythia":
        return scaled(DCPYTHIA_6_9B, n_layer=layers, dim=d_model, n_head=d_model // 128, intermediate_size=4 * d_model)
    return scaled(
        PYTHIA_6_9B,
        num_hidden_layers=layers,
        hidden_size=d_model,
        num_attention_heads=d_model // 128,
        intermediate_size=4 * d_model,
    )


def random_model(config: dict, dtype: torch.dtype, device: str):
    """A HookedDCFormer of `config` with random weights made where it runs: normal (std 0.02), norm scales 1."""
    from dcinterp import HookedDCFormer
    from dcinterp.loading import config_from_gpt_neox, config_from_official

    convert = config_from_gpt_neox if config["model_type"] == "gpt_neox" else config_from_official
    with torch.device("meta"):
        model = HookedDCFormer(convert(config, "config.json"), init=False).to(dtype)
    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".w"):  # LayerNorm and QK-norm scales
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator, device=device) * 0.02)
    return model.eval().requires_grad_(False)


def transcoders_at_l0(model, d_transcoder: int, l0: float) -> list:
    """Random ReLU transcoders (`dcinterp.transcoders.Transcoder`), made where the model runs and in its dtype: unit
    encoder columns and decoder rows, as `random_transcoders` draws them, and an encoder bias -z with
    P(N(0, 1) > z) = l0 / d_transcoder: on a unit-variance input, about `l0` active features a token."""
    from dcinterp.transcoders import Transcoder

    device, dtype, d_model = model.unembed.W_U.device, model.unembed.W_U.dtype, model.cfg.d_model
    z = -torch.special.ndtri(torch.tensor(l0 / d_transcoder, dtype=torch.float64)).item()
    generator = torch.Generator(device).manual_seed(0)
    transcoders = []
    for layer in range(model.cfg.n_layers):
        with torch.device("meta"):
            tc = Transcoder(d_model, d_transcoder, layer).to(dtype)
        tc.to_empty(device=device)
        with torch.no_grad():
            enc = torch.randn(d_model, d_transcoder, generator=generator, device=device)
            tc.W_enc.copy_(enc / enc.norm(dim=0))
            dec = torch.randn(d_transcoder, d_model, generator=generator, device=device)
            tc.W_dec.copy_(dec / dec.norm(dim=1, keepdim=True))
            tc.b_enc.fill_(-z)
            tc.b_dec.zero_()
        transcoders.append(tc.requires_grad_(False))
    return transcoders


# ----------------------------------------------------------------------------------------------
# One measurement (in a fresh process)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_graph(model, transcoders, tokens, batch_size: int, device: str) -> tuple:
    """`attribution_graph`, `prune_graph` and `graph_scores` on one prompt, with the graph's time split: the
    module's `replacement_run` and `replacement_forward` are wrapped by timers while it runs."""
    import dcinterp.attribution_graph as ag

    seconds = {"run": 0.0, "forward": 0.0, "inputs": 0.0}

    def timer(function, key_of):
        def timed(*args, **kwargs):
            synchronize(device)
            start = time.perf_counter()
            result = function(*args, **kwargs)
            synchronize(device)
            seconds[key_of(kwargs)] += time.perf_counter() - start
            return result

        return timed

    originals = ag.replacement_run, ag.replacement_forward
    ag.replacement_run = timer(originals[0], lambda kwargs: "run")
    ag.replacement_forward = timer(originals[1], lambda kwargs: "forward" if kwargs.get("requires_grad") else "inputs")
    try:
        synchronize(device)
        start, cpu = time.perf_counter(), time.process_time()
        graph = ag.attribution_graph(model, transcoders, tokens, batch_size=batch_size)
        synchronize(device)
        seconds["graph"], seconds["cpu"] = time.perf_counter() - start, time.process_time() - cpu
    finally:
        ag.replacement_run, ag.replacement_forward = originals
    seconds["backward"] = seconds["graph"] - seconds["run"] - seconds["forward"] - seconds["inputs"]
    start = time.perf_counter()
    node_mask, edge_mask, _ = ag.prune_graph(graph)
    seconds["prune"] = time.perf_counter() - start
    start = time.perf_counter()
    ag.graph_scores(graph)
    seconds["scores"] = time.perf_counter() - start
    counts = {
        "tokens": graph.n_pos,
        "features": graph.n_features,
        "nodes": graph.adjacency_matrix.shape[0],
        "logits": graph.n_logits,
        "passes": math.ceil((graph.n_features + graph.n_logits) / batch_size),
        "l0": graph.n_features / (graph.n_layers * graph.n_pos),
        "kept_nodes": int(node_mask.sum()),
        "kept_edges": int(edge_mask.sum()),
    }
    return seconds, counts


def measure(spec: dict) -> dict:
    """Build the spec's model and transcoders, then time its graph(s) and their peak memory."""
    from dcinterp.memory import PeakAnonMemory

    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    if spec["part"] == "embedded":
        from dcinterp import HookedDCFormer
        from dcinterp.synth.contrast import contrast_pairs
        from dcinterp.transcoders import load_transcoders

        model = HookedDCFormer.from_pretrained(spec["model"], dtype=dtype, device=device).eval().requires_grad_(False)
        transcoders = load_transcoders(spec["model"], device=device, dtype=dtype)
        prompt = contrast_pairs(2, n=1, seed=0, tokenizer=model.tokenizer)[0].clean
        tokens = model.to_tokens(prompt)[0]
    else:
        config = shape_config(spec["model"], spec["layers"], spec["d_model"])
        model = random_model(config, dtype, device)
        transcoders = transcoders_at_l0(model, spec["d_transcoder"], spec["l0"])
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, model.cfg.d_vocab, (spec["seq"],), generator=generator)
    built = PeakAnonMemory.current()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    weights_gpu = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    runs = []
    with PeakAnonMemory() as memory:
        for _ in range(spec["repeats"]):
            runs.append(timed_graph(model, transcoders, tokens, spec["batch_size"], device))
    seconds = {key: statistics.median(run[0][key] for run in runs) for key in runs[0][0]}
    row = {**spec, **seconds, **runs[0][1]}
    row["peak_above_model_gib"] = (memory.peak - built) / GiB
    row["process_peak_gib"] = memory.peak / GiB
    if device.startswith("cuda"):
        row["gpu_peak_above_weights_gib"] = (torch.cuda.max_memory_allocated() - weights_gpu) / GiB
        row["gpu_weights_gib"] = weights_gpu / GiB
    return row


# ----------------------------------------------------------------------------------------------
# The report


def full_shape_arithmetic(args) -> str:
    """What DCPythia-6.9B with 32 transcoders holds, in --dtype: weights, transcoders, adjacency at --l0."""
    from dcinterp.random_checkpoint import n_parameters

    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    config = shape_config("dcpythia", FULL_LAYERS, args.d_model)
    d, f = args.d_model, args.d_transcoder
    weights = n_parameters(config) * itemsize
    coders = FULL_LAYERS * (2 * d * f + f + d) * itemsize
    nodes = round(args.l0 * args.seq) * FULL_LAYERS + (FULL_LAYERS + 1) * args.seq + 10
    return (
        f"DCPythia-6.9B's shape in {args.dtype}: weights {weights / GiB:.1f} GiB + {FULL_LAYERS} transcoders of "
        f"{f} features {coders / GiB:.1f} GiB = {(weights + coders) / GiB:.1f} GiB; at L0 {args.l0:g} on "
        f"{args.seq} tokens about {nodes:,} nodes (features, errors, tokens, 10 logits): a dense adjacency matrix of "
        f"{nodes**2 * itemsize / GiB:.1f} GiB"
    )


def report(row: dict) -> str:
    name = row["model"] if row["part"] == "embedded" else f"{row['model']} x{row['layers']}"
    split = ", ".join(f"{key} {row[key]:.2f}" for key in ("run", "forward", "backward", "inputs"))
    line = (
        f"{name:>15}: {row['tokens']} tokens, {row['features']:,} features (L0 {row['l0']:.1f} a token a layer), "
        f"{row['nodes']:,} nodes, {row['logits']} logits, {row['passes']} backward passes | graph {row['graph']:.2f} s "
        f"({split}; cpu {row['cpu']:.2f}), prune {row['prune']:.2f} s, scores {row['scores']:.2f} s | kept "
        f"{row['kept_nodes']} nodes, {row['kept_edges']} edges | peak RssAnon {row['peak_above_model_gib']:.2f} GiB "
        f"above the model ({row['process_peak_gib']:.2f} GiB in all)"
    )
    if "gpu_peak_above_weights_gib" in row:
        line += f"; GPU {row['gpu_peak_above_weights_gib']:.2f} GiB above the weights' {row['gpu_weights_gib']:.2f}"
    if row["part"] == "6.9b" and row["layers"] < FULL_LAYERS:
        scale, per_pass_layer = FULL_LAYERS / row["layers"], row["backward"] / row["passes"] / row["layers"]
        line += (
            f"\n{'':>15}  estimate at {FULL_LAYERS} layers: backward passes x{scale:g}, each x{scale:g}: "
            f"{row['backward'] * scale**2 / 60:.0f} min of backward ({per_pass_layer:.3f} s a pass a layer)"
        )
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="embedded,6.9b", help="embedded and/or 6.9b (default both)")
    parser.add_argument("--repeats", type=int, default=3, help="graphs of an embedded model, the median (default 3)")
    parser.add_argument("--layers", default="1", help="6.9b: blocks, or a list of depths, a row each (default 1)")
    parser.add_argument("--seq", type=int, default=64, help="6.9b: prompt length (default 64)")
    parser.add_argument("--l0", type=float, default=16.0, help="6.9b: active features a token a layer (default 16)")
    parser.add_argument("--d-transcoder", type=int, default=16384, help="6.9b: features a layer (default 16384)")
    parser.add_argument("--d-model", type=int, default=4096, help="6.9b: width (default 4096; heads of 128)")
    parser.add_argument("--batch-size", type=int, default=32, help="target rows a backward pass (default 32)")
    parser.add_argument("--twin", action="store_true", help="6.9b: also Pythia-6.9B's shape (plain MHA)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--threads", type=int, help="torch threads (default 2 on the CPU, torch's own on CUDA)")
    parser.add_argument("--json", help="also write each row as a JSON line to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one row's spec, measured in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return
    parts = args.parts.split(",")
    if not set(parts) <= {"embedded", "6.9b"}:
        parser.error(f"--parts {args.parts}: expected embedded and/or 6.9b")
    threads = args.threads if args.threads is not None else (2 if args.device == "cpu" else 0)
    common = dict(device=args.device, dtype=args.dtype, threads=threads, batch_size=args.batch_size)
    specs = []
    if "embedded" in parts:
        specs += [dict(common, part="embedded", model=name, repeats=args.repeats) for name in EMBEDDED]
    if "6.9b" in parts:
        shape = dict(seq=args.seq, l0=args.l0, d_transcoder=args.d_transcoder, d_model=args.d_model, repeats=1)
        for layers in map(int, args.layers.split(",")):
            for kind in ("dcpythia", "pythia") if args.twin else ("dcpythia",):
                specs.append(dict(common, part="6.9b", model=kind, layers=layers, **shape))
    print(
        f"{args.device}, {args.dtype}, {threads or 'torch default'} thread(s), batch {args.batch_size} target rows a "
        f"backward pass; embedded: median of {args.repeats}; times in seconds"
    )
    if "6.9b" in parts:
        print(full_shape_arithmetic(args))
    sink = open(args.json, "a") if args.json else None  # noqa: SIM115
    failed = False
    for spec in specs:
        command = [sys.executable, __file__, "--one", json.dumps(spec)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            print(f"{spec['model']}: failed: {result.stderr.strip().splitlines()[-1:]}", flush=True)
            failed = True
            continue
        row = json.loads(result.stdout.splitlines()[-1])
        print(report(row), flush=True)
        if sink:
            sink.write(json.dumps(row) + "\n")
    if sink:
        sink.close()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
