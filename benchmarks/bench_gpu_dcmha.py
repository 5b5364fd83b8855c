"""DCMHA on one GPU against its plain-MHA twin: the fused (Triton) path, the materialised path, dcinterp's einsum
MHA and the SDPA twin, in one run (issue 37's table).

    python benchmarks/bench_gpu_dcmha.py [--quick] [--tokens 128,512,...] [--shapes 6.9b-wide,d1024]
                                         [--repeats 10] [--json OUT.jsonl] [--cpu] [--maps-mib 256]
                                         [--fused-min-keys N] [--kernels]
                                         [--dtype bfloat16|float16|float32]

Random DCPythia-style models (LayerNorm, parallel residual, GELU MLP, QK-norm, rotary on a quarter of each head,
vocabulary 8192), bfloat16 (or --dtype), batch 1, frozen weights as analyses load them:
- `6.9b-wide`: 2 layers of DCPythia-6.9B's width, d_model 4096, 32 heads of 128, global;
- `d1024`: 4 layers, d_model 1024, 16 heads of 64, windows of 256 keys on every other layer.
Four models, the same weights, taking turns at every measurement:
- `DCMHA fused`: the DCMHA model with no hook (on CUDA the Triton path where the kernels run, dcinterp.dcmha);
- `DCMHA materialised`: the same model with a no-op hook on every `hook_pattern` (every [b, h, t, s] tensor built);
- `MHA einsum`: the plain-MHA twin (`use_dcmha=False`) with that hook (einsum-softmax-einsum, as TransformerLens);
- `SDPA twin`: the twin with no hook (`scaled_dot_product_attention`).
Measured: the forward (logits), the forward + backward to the input embeddings (as integrated gradients steps), the
peak memory above the weights of each (`torch.cuda.max_memory_allocated`), at each prompt length; decoding, per new
token after a 1,024-token prompt with the key-value cache, each step synchronised and 20 steps back to back (as a
generation loop that never waits on the GPU runs them), the DCMHA model also with its step's pattern by torch's ops
in place of the decoding kernels (`dcinterp.dcmha.decoding`); and one layer's attention call alone (`Attention`, the
fused path against SDPA's). Medians of `--repeats` timed runs after a warm-up, CUDA-synchronised; beside each, the
host's time (`host_ms`: until the call returned, before the wait for the GPU; close to the wall time where the GPU
waits on the host, as at short prompts and in decoding). With `--kernels`, one more call of each layer's attention
forward under torch's profiler gives the card's kernels: `device_ms`, how long they computed (the rest of the wall
time the card waited on the host), and `kernel_ms`, the ten longest (the profiler may slow what runs after it: take
the times from a run without `--kernels`). With gradients the fused model takes the kernels from `FUSED_MIN_KEYS`
keys on (2,048), the materialised path below: `--fused-min-keys 0` times the kernels' forward + backward at every
length. Each measurement is a JSON line (with the path every layer took: a "fused" model without the kernels says
"materialised"); a
markdown table of the medians and the ratios to the SDPA twin ends the run, then one line for each of issue 37's aims
at the 6.9B width (`AIMS`): met, not met, or not measured in the run. A measurement that runs out of GPU memory is
reported as such and the run goes on.

With no CUDA device (or `--cpu`) the harness runs on this CPU on tiny shapes in float32, in seconds, as a smoke
test: its numbers are not GPU numbers, and it says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext

import torch

import dcinterp.dcmha as dcmha
from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.dcmha import few_queries, maps
from dcinterp.kv_cache import DCFormerKeyValueCache
from dcinterp.model import attention_mask

SHAPES = {
    "6.9b-wide": dict(n_layers=2, d_model=4096, n_heads=32, d_head=128, window_size=None, window_type=None),
    "d1024": dict(n_layers=4, d_model=1024, n_heads=16, d_head=64, window_size=256, window_type="LG"),
}
SMOKE_SHAPES = {"tiny": dict(n_layers=2, d_model=32, n_heads=4, d_head=8, window_size=8, window_type="LG")}
VOCAB = 8192
TOKENS = [128, 512, 1024, 2048, 4096, 8192]
QUICK_TOKENS = [128, 2048]
DECODE_PROMPT, SMOKE_DECODE_PROMPT = 1024, 24
DECODE_STEPS = 20  # tokens decoded back to back in one measurement (and one, synchronised, in the other)
TORCH_PATTERN = "DCMHA fused, torch's pattern"  # decoding only: the step's pattern by torch's ops
MODELS = ("DCMHA fused", "DCMHA materialised", "MHA einsum", "SDPA twin")
MiB = 2**20
# Issue 37's aims, each the most the no-hook DCMHA model ("DCMHA fused") may take of the SDPA twin's, at the 6.9B
# width: (what, the measurements it reads, their prompt lengths, the aim, the key compared). Decoding's twin is plain
# MHA with the cache; "attention alone" is one layer's `Attention` call against SDPA's.
AIMS = [
    ("forward, 128-2,048 tokens", ("forward",), (128, 2048), 1.2, "ms"),
    ("forward, 8,192 tokens", ("forward",), (8192, 8192), 1.4, "ms"),
    ("forward + backward, 128-2,048 tokens", ("forward + backward",), (128, 2048), 1.3, "ms"),
    ("forward + backward, 8,192 tokens", ("forward + backward",), (8192, 8192), 1.6, "ms"),
    ("peak memory, every length", ("forward", "forward + backward"), (1, 1 << 62), 1.3, "peak_mib"),
    ("one layer's attention forward, 2,048-8,192 tokens", ("attention alone, forward",), (2048, 8192), 3.0, "ms"),
    (
        "one layer's attention forward + backward, 2,048-8,192 tokens",
        ("attention alone, forward + backward",),
        (2048, 8192),
        3.5,
        "ms",
    ),
    ("decoding, a token", ("decode",), (1, 1 << 62), 1.15, "ms"),
]
AIMS_SHAPE = "6.9b-wide"


def make_model(shape: dict, use_dcmha: bool, device, dtype) -> HookedDCFormer:
    torch.manual_seed(0)  # the shared weights are drawn first, so the twins share them (init_weights)
    cfg = DCFormerConfig(
        **shape, d_mlp=4 * shape["d_model"], d_vocab=VOCAB, n_ctx=8192, rotary_pct=0.25, use_dcmha=use_dcmha
    )
    return HookedDCFormer(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)


def materialised(model: HookedDCFormer):
    """A no-op hook on every layer's pattern: the layer then builds its [b, h, t, s] tensors."""
    return model.hooks(fwd_hooks=[(lambda name: name.endswith("hook_pattern"), lambda x, hook: None)])


def four_models(dc: HookedDCFormer, mha: HookedDCFormer) -> dict[str, tuple]:
    """name -> (model, the context it runs in): the two models, each with no hook and on its materialised path."""
    return {
        "DCMHA fused": (dc, nullcontext),
        "DCMHA materialised": (dc, lambda: materialised(dc)),
        "MHA einsum": (mha, lambda: materialised(mha)),
        "SDPA twin": (mha, nullcontext),
    }


class Paths:
    """The paths the attention calls took (dcinterp.dcmha.choose_path) and, for a decoding step's pattern, which way
    it was computed ("pattern by triton" or "by torch", dcinterp.dcmha.few_queries.decoding_pattern_path), while
    recording."""

    def __init__(self):
        self.seen: list[str] = []
        self.choose, self.choose_pattern = dcmha.choose_path, few_queries.decoding_pattern_path

    def __enter__(self):
        def spy(**facts):
            self.seen.append(self.choose(**facts))
            return self.seen[-1]

        def pattern_spy(**facts):
            path = self.choose_pattern(**facts)
            self.seen.append(f"pattern by {path}")
            return path

        dcmha.choose_path, few_queries.decoding_pattern_path = spy, pattern_spy
        return self

    def __exit__(self, *exc):
        dcmha.choose_path, few_queries.decoding_pattern_path = self.choose, self.choose_pattern


class Clock:
    """Wall time of a call, synchronised on CUDA; peak memory above what was allocated before it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn) -> tuple[float, float]:
        """The call's wall time, and the host's: until `fn` returned, before waiting for the GPU (when the two are
        close, the GPU waited on the host)."""
        self.sync()
        start = time.perf_counter()
        fn()
        returned = time.perf_counter()
        self.sync()
        return time.perf_counter() - start, returned - start

    def peak_above(self, fn) -> float | None:
        if not self.cuda:
            return None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / MiB


def forward(model, tokens):
    with torch.no_grad():
        model(tokens)


def forward_backward(model, tokens):
    embeddings = model.embed(tokens).detach().requires_grad_(True)
    model(embeddings, start_at_layer=0)[0, -1].float().logsumexp(-1).backward()


def kernel_times(fn, cuda: bool) -> dict[str, float]:
    """Milliseconds by kernel in one call of fn, from torch's profiler, longest first: on CUDA the card's kernels
    (their sum is how long the card computed; beside the call's wall time, how long it waited on the host), on the
    CPU its ops' own times (the smoke run)."""
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as profile:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = profile.key_averages()
    spent = {e.key: (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1000 for e in events}
    return {name: ms for name, ms in sorted(spent.items(), key=lambda item: -item[1]) if ms > 0}


def measure(models: dict, fn, clock: Clock, repeats: int, profile: bool = False) -> dict[str, dict]:
    """fn(model) for each model in turns (alternating order): median milliseconds, peak MiB, the paths taken; with
    `profile`, also one call's kernels (`kernel_times`: `device_ms` their sum, `kernel_ms` the longest ten)."""
    out, times, host_times = {}, {name: [] for name in models}, {name: [] for name in models}
    for name, (model, context) in models.items():
        try:
            with context(), Paths() as paths:
                fn(model)  # warm-up (and Triton's compilation)
                peak = clock.peak_above(lambda: fn(model))  # noqa: B023
            out[name] = {"paths": sorted(set(paths.seen)), "peak_mib": peak}
        except torch.OutOfMemoryError:
            out[name] = {"error": "out of GPU memory"}
        if clock.cuda:
            torch.cuda.empty_cache()
    names = [name for name in models if "error" not in out[name]]
    for repeat in range(repeats):
        for name in names[::-1] if repeat % 2 else names:
            model, context = models[name]
            with context():
                wall, host = clock.time(lambda: fn(model))  # noqa: B023
                times[name].append(wall)
                host_times[name].append(host)
    for name in names:
        out[name]["ms"] = 1000 * statistics.median(times[name])
        out[name]["host_ms"] = 1000 * statistics.median(host_times[name])
        if profile:
            model, context = models[name]
            with context():
                kernels = kernel_times(lambda: fn(model), clock.cuda)  # noqa: B023
            out[name]["device_ms"] = sum(kernels.values())
            out[name]["kernel_ms"] = {kernel: round(ms, 4) for kernel, ms in list(kernels.items())[:10]}
    return out


def decode_steps(model, prompt: torch.Tensor, steps: int):
    """A function that decodes `steps` tokens a call, one after another with no synchronisation between them, after
    `prompt` went into a fresh cache."""
    cache = DCFormerKeyValueCache.init_cache(model.cfg, prompt.device, batch_size=1)
    with torch.no_grad():
        model(prompt, past_kv_cache=cache)
    next_token = prompt[:, -1:]

    def run(_model):
        with torch.no_grad():
            for _ in range(steps):
                _model(next_token, past_kv_cache=cache)

    return run


@contextmanager
def torch_pattern():
    """A decoding step's pattern by torch's ops (`dcinterp.dcmha.decoding`), as before its kernels."""
    choose = few_queries.decoding_pattern_path
    few_queries.decoding_pattern_path = lambda **facts: "torch"
    try:
        yield
    finally:
        few_queries.decoding_pattern_path = choose


def attention_call(model, x, mask, backward: bool) -> None:
    """One layer's attention call on x (layer 0), forward or forward + backward to x."""
    attn = model.blocks[0].attn
    if backward:
        attn(x.detach().requires_grad_(True), mask).float().sum().backward()
    else:
        with torch.no_grad():
            attn(x, mask)


def row(shape, what, tokens, result) -> dict:
    return {"shape": shape, "measurement": what, "tokens": tokens, **result}


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number (got {text!r})")
    return int(text)


def whole_number(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number, 0 or more (got {text!r})")
    return int(text)


def prompt_lengths(text: str) -> list[int]:
    return [positive_int(count) for count in text.split(",")]


def shape_names(text: str) -> list[str]:
    names = text.split(",")
    unknown = [name for name in names if name not in SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shape {unknown[0]!r} (known: {', '.join(SHAPES)})")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS}, 3 repeats")
    parser.add_argument("--tokens", type=prompt_lengths, help=f"prompt lengths (default {','.join(map(str, TOKENS))})")
    parser.add_argument("--shapes", type=shape_names, default=list(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed runs per measurement (default 10)")
    parser.add_argument("--json", help="also write the JSON lines to this file")
    parser.add_argument("--cpu", action="store_true", help="the smoke run on this CPU (tiny shapes, float32)")
    parser.add_argument(
        "--maps-mib",
        type=positive_int,
        help="the kernels through the maps hold this many MiB of maps at a time, whatever the prompt (default: "
        "dcinterp.dcmha.maps.maps_room, 4 times the queries' bytes within 32-256 MiB; 256 is the rule "
        "before that); less memory, more launches",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also one call of each layer's attention forward under torch's profiler: the card's kernels, their sum "
        "against the wall time (the profiler may slow what runs after it)",
    )
    parser.add_argument(
        "--fused-min-keys",
        type=whole_number,
        metavar="N",
        help="with gradients, the fused kernels from this many keys on, the materialised path below (default: "
        "dcinterp.dcmha.FUSED_MIN_KEYS, 2,048); 0 times the kernels' forward + backward at every length",
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="the models' dtype on the card (default bfloat16; the smoke run is float32)",
    )
    args = parser.parse_args()
    if args.fused_min_keys is not None:
        dcmha.FUSED_MIN_KEYS = args.fused_min_keys
    if args.maps_mib is not None:
        maps.MAPS_BYTES = maps.MAPS_MIN_BYTES = args.maps_mib * 2**20

    smoke = args.cpu or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else getattr(torch, args.dtype)
    if smoke:
        shapes, token_counts, repeats, prompt_length = SMOKE_SHAPES, [20], args.repeats or 2, SMOKE_DECODE_PROMPT
        print(
            "# GPU numbers not measured: no CUDA device here (or --cpu). A smoke run of the harness on this CPU, "
            "tiny shapes, float32; its times say nothing about a GPU.",
            flush=True,
        )
    else:
        shapes = {name: SHAPES[name] for name in args.shapes}
        token_counts = QUICK_TOKENS if args.quick else TOKENS
        repeats, prompt_length = args.repeats or (3 if args.quick else 10), DECODE_PROMPT
        reason = dcmha.triton_unavailable(device)
        print(
            f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, batch 1, medians of "
            f"{repeats}; "
            f"Triton kernels: {'available' if reason is None else 'NOT available: ' + reason}; "
            f"maps held {maps.MAPS_TIMES_QUERIES}x the queries' bytes within "
            f"{maps.MAPS_MIN_BYTES / 2**20:g}-{maps.MAPS_BYTES / 2**20:g} MiB; "
            f"gradients through the maps from {dcmha.FUSED_MIN_KEYS} keys",
            flush=True,
        )
    if args.tokens:
        token_counts = args.tokens
    clock = Clock(device)
    rows: list[dict] = []
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115

    def emit(entry: dict) -> None:
        if smoke:  # the CPU's times under another name, so that nothing reads them as a GPU's
            for result in entry["models"].values():
                for key in ("ms", "host_ms", "device_ms", "kernel_ms"):
                    if key in result:
                        result[f"cpu_smoke_{key}"] = result.pop(key)
        device_name = "cpu smoke run: not GPU numbers" if smoke else torch.cuda.get_device_name()
        entry = {"device": device_name, "dtype": str(dtype).split(".")[1], **entry}
        rows.append(entry)
        print(json.dumps(entry), flush=True)
        if sink:
            sink.write(json.dumps(entry) + "\n")
            sink.flush()  # each line kept, should the run be cut

    for shape_name, shape in shapes.items():
        models = four_models(make_model(shape, True, device, dtype), make_model(shape, False, device, dtype))
        generator = torch.Generator().manual_seed(0)
        for n in token_counts:
            tokens = torch.randint(0, VOCAB, (1, n), generator=generator).to(device)
            for what, fn in (("forward", forward), ("forward + backward", forward_backward)):
                result = measure(models, lambda m: fn(m, tokens), clock, repeats)  # noqa: B023
                emit(row(shape_name, what, n, {"models": result}))
            x = torch.randn(1, n, shape["d_model"], generator=generator).to(device, dtype)
            mask = attention_mask(n, models["DCMHA fused"][0].blocks[0].attn.window, device, dtype)
            attention = {name: models[name] for name in ("DCMHA fused", "DCMHA materialised", "SDPA twin")}
            for what, backward in (("attention alone, forward", False), ("attention alone, forward + backward", True)):
                call = lambda m: attention_call(m, x, mask, backward)  # noqa: B023, E731
                result = measure(attention, call, clock, repeats, profile=args.kernels and not backward)
                emit(row(shape_name, what, n, {"models": result}))
        prompt = torch.randint(0, VOCAB, (1, prompt_length), generator=generator).to(device)
        decoders = {**models, TORCH_PATTERN: (models["DCMHA fused"][0], torch_pattern)}
        for steps, how in ((1, "each step synchronised"), (DECODE_STEPS, f"{DECODE_STEPS} steps back to back")):
            result = {}
            for name, (model, context) in decoders.items():  # each with its own cache: one model at a time
                with context():
                    run = decode_steps(model, prompt, steps)
                result.update(measure({name: (model, context)}, run, clock, repeats))
            for measured in result.values():
                for key in ("ms", "host_ms"):
                    if key in measured:
                        measured[key] /= steps
            decode = f"decode, per token after {prompt_length} prompt tokens ({how})"
            emit(row(shape_name, decode, prompt_length, {"models": result}))
        del models
        if clock.cuda:
            torch.cuda.empty_cache()
    if sink:
        sink.close()
    print_table(rows, smoke)


def cell(result: dict, name: str, key: str = "ms") -> str:
    r = result.get(name, {})
    if "error" in r:
        return r["error"]
    return "n/a" if r.get(key) is None else f"{r[key]:,.1f}"


def ratio(result: dict, name: str, key: str = "ms") -> str:
    a, b = result.get(name, {}).get(key), result.get("SDPA twin", {}).get(key)
    return f"**{a / b:.2f}x**" if a is not None and b else "n/a"


def against_the_aims(rows: list[dict]) -> list[str]:
    """One line an aim (`AIMS`): the fused model's ratios to the SDPA twin where this run measured them, their
    largest against the aim, "met" or "not met"; "not measured" where the run has none (another shape, other
    lengths, a model out of memory)."""
    lines = []
    for label, measurements, (low, high), aim, key in AIMS:
        ratios = []
        for r in rows:
            fused, twin = (r["models"].get(name, {}).get(key) for name in ("DCMHA fused", "SDPA twin"))
            kind = "decode" if r["measurement"].startswith("decode") else r["measurement"]  # of either timing
            measured = kind in measurements and low <= r["tokens"] <= high
            if r["shape"] == AIMS_SHAPE and measured and fused is not None and twin:
                ratios.append(fused / twin)
        if not ratios:
            lines.append(f"- {label} (aim {aim}x): not measured")
            continue
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}x" if len(ratios) > 1 else f"{ratios[0]:.2f}x"
        verdict = "met" if max(ratios) <= aim else "not met"
        lines.append(f"- {label} (aim {aim}x): {spread} over {len(ratios)} measurement(s): **{verdict}**")
    return lines


def print_table(rows: list[dict], smoke: bool) -> None:
    if smoke:
        print("\nGPU numbers not measured (CPU smoke run: every model ran; the paths the fused model took):")
        print("| shape | measurement | tokens | " + " | ".join(MODELS) + " | paths of the fused model |")
        print("|---|---|---|" + "---|" * len(MODELS) + "---|")
        for r in rows:
            ran = ["not measured" if name in r["models"] else "n/a" for name in MODELS]
            paths = ", ".join(r["models"]["DCMHA fused"].get("paths", []))
            print(f"| {r['shape']} | {r['measurement']} | {r['tokens']:,} | " + " | ".join(ran) + f" | {paths} |")
        return
    heading = f"{rows[0]['device']}, {rows[0]['dtype']}, batch 1"
    print(f"\n{heading}: milliseconds (medians); peak memory above the weights in MiB; ratios to the SDPA twin")
    print(
        "| shape | measurement | tokens | DCMHA fused | DCMHA materialised | MHA einsum | SDPA twin | fused / SDPA "
        "| peak MiB fused / materialised / SDPA | paths of the fused model |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["models"]
        peaks = " / ".join(cell(m, name, "peak_mib") for name in ("DCMHA fused", "DCMHA materialised", "SDPA twin"))
        paths = ", ".join(m.get("DCMHA fused", {}).get("paths", []))
        print(
            f"| {r['shape']} | {r['measurement']} | {r['tokens']:,} | "
            + " | ".join(cell(m, name) for name in MODELS)
            + f" | {ratio(m, 'DCMHA fused')} | {peaks} | {paths} |"
        )
    for r in rows:
        m = r["models"]
        if "device_ms" in m.get("DCMHA fused", {}):
            busy = "; ".join(
                f"{name} {m[name]['device_ms']:.2f} of {m[name]['ms']:.2f} ms"
                for name in MODELS
                if "device_ms" in m.get(name, {})
            )
            print(f"{r['shape']}, {r['tokens']:,} tokens, one layer's attention: the card computed {busy}")
    print(f"\nAgainst issue 37's aims ({AIMS_SHAPE}, DCMHA fused / SDPA twin):")
    for line in against_the_aims(rows):
        print(line)
    for r in rows:
        if TORCH_PATTERN in r["models"]:
            m = r["models"]
            print(
                f"{r['shape']}, {r['measurement']}: DCMHA with the pattern by torch's ops {cell(m, TORCH_PATTERN)} ms "
                f"({ratio(m, TORCH_PATTERN)} the SDPA twin), against {cell(m, 'DCMHA fused')} ms with the kernels"
            )


if __name__ == "__main__":
    sys.exit(main())
