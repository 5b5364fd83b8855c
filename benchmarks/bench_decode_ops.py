"""How many device kernels one cached decoding step launches, DCMHA against its plain-MHA twin, and where they come
from (issue #37, point 3); and the CPU wall time of a step.

    python benchmarks/bench_decode_ops.py [--prompt 32 --steps 200] [--shapes global,lg-training,...] [--no-time]
                                          [--dtype bfloat16] [--verbose]

At one new token a GPU step costs the operations launched (each ~5-20 us of Python and launch), not arithmetic.
This counts them on the CPU, where the same torch ops run, except two that CUDA replaces with Triton kernels: the
dynamic weights (one launch instead of torch's dozen, `dcinterp.dcmha.dynamic_weights_path`) and the step's pattern
between the two matmuls, its compose, mask and softmax (two launches instead of about twenty,
`dcinterp.dcmha.few_queries.decoding_pattern_path`); the table's "as on CUDA" row counts those as CUDA takes them.

Counting rule (the same for both models): every ATen op that reaches the backend (a `TorchDispatchMode` sees each
op after autograd and after composite ops such as `einsum` or `matmul` decomposed into what runs: `bmm`, `view`,
...) counts, except
- ops whose output aliases an input without writing it (views and metadata: `view`, `permute`, `expand`, `narrow`,
  `select`, `slice`, `unsqueeze`, `detach`, ..., read from the op's schema), and `_unsafe_view`/`_reshape_alias`
  (views whose schema does not say so);
- allocations that launch nothing (`empty`, `empty_strided`, `empty_like`, `new_empty`);
- ops that return no tensor (`promote_types`: a dtype).
In-place ops (`copy_`, `fill_`, `add_`) count: they write memory, so they launch a kernel.

Each op is attributed to the innermost function of the model's code it was called from:
- `dynamic weights`: the FFN from the layer's input to qw1, ..., kg (`dynamic_weights`, `torch_dynamic_weights`);
- `compose, mask, softmax`: the pattern between the two matmuls (`torch_decoding_pattern`: the compose of the few
  queries, `compose_decoding`, the mask and the softmax; `Compose.forward`, `compose_few_queries`, ... when hooked);
- `cache appends`: the key-value cache (`dcinterp/kv_cache.py`);
- `rotary`: the tables and the rotation (`rotary_tables`, `rotate`, `apply_rotary`);
- `attention`: the scores and P V (`few_queries_z`), or all of plain MHA's attention (`sdpa_z`);
- `rest of block`: projections, norms, QK-norm, MLP, residual adds;
- `model`: outside the blocks (embedding, the step's masks and rotary positions, final norm, unembedding).
Per layer, since global and local layers may differ. Then the CPU time of a step: the median over `--steps` cached
steps after a `--prompt`-token prompt, the two models taking turns at every step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.kv_cache import DCFormerKeyValueCache
from dcinterp.model import TransformerBlock

# The structure of the GPU benchmark's shapes (benchmarks/bench_gpu_dcmha.py), at a width the CPU steps quickly:
# the op count does not depend on the width.
SHAPES = {
    "global": dict(n_layers=2, d_model=256, n_heads=32, d_head=8, window_size=None, window_type=None),
    "lg-training": dict(n_layers=2, d_model=256, n_heads=16, d_head=16, window_size=16, window_type="LG"),
    "lg-official": dict(
        n_layers=2, d_model=256, n_heads=16, d_head=16, window_size=16, window_type="LG", window="official-inference"
    ),
}
VOCAB = 512
PATTERN = "compose, mask, softmax"
CATEGORIES = ("dynamic weights", PATTERN, "cache appends", "rotary", "attention", "rest of block", "model")
VIEWS = "views (no kernel)"  # not in the totals: each costs a dispatch on the host, no kernel
# innermost function name -> category; a frame of kv_cache.py is a cache append whatever its function
FUNCTION_CATEGORY = {
    "torch_dynamic_weights": "dynamic weights",
    "fused_dynamic_weights": "dynamic weights",
    "compute_dynamic_weights": "dynamic weights",
    "dynamic_weights": "dynamic weights",
    "torch_decoding_pattern": PATTERN,
    "compose_few_queries": PATTERN,
    "compose_decoding": PATTERN,
    "compose_fused": PATTERN,
    "branch_outputs": PATTERN,
    "apply_rotary": "rotary",
    "rotary_tables": "rotary",
    "rotate": "rotary",
    "model_rotary_tables": "rotary",
    "materialised_z": "attention",
    "sdpa_z": "attention",
    "blocked_z": "attention",
    "few_queries_z": "attention",
}
UNSEEN_VIEWS = {"_unsafe_view", "_reshape_alias"}
ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


def launches_kernel(func) -> bool:
    """The counting rule of the module docstring."""
    name = func._schema.name.split("::")[-1]
    if name in UNSEEN_VIEWS or name in ALLOCATIONS:
        return False
    returns = func._schema.returns
    if not any("Tensor" in str(r.type) for r in returns):
        return False  # a dtype, a scalar, nothing: no kernel (promote_types, ...)
    aliases = [r.alias_info for r in returns if r.alias_info is not None]
    return not (aliases and all(not a.is_write for a in aliases))


class OpCounter(TorchDispatchMode):
    """Counts kernel-launching ops per (layer or None, category, op name) while active."""

    def __init__(self, blocks):
        super().__init__()
        self.layer_of = {id(block): layer for layer, block in enumerate(blocks)}
        self.counts: Counter = Counter()

    def where(self) -> tuple[int | None, str]:
        frame, category, layer = sys._getframe(2), None, None
        while frame is not None:
            code = frame.f_code
            if category is None:
                if code.co_filename.endswith("kv_cache.py"):
                    category = "cache appends"
                elif code.co_filename.endswith(("compose.py", "attention.py")) and code.co_name == "forward":
                    owner = type(frame.f_locals.get("self")).__name__
                    category = {"Compose": PATTERN, "Attention": "rest of block"}.get(owner)
                category = category or FUNCTION_CATEGORY.get(code.co_name)
            if code.co_name == "forward" and isinstance(frame.f_locals.get("self"), TransformerBlock):
                layer = self.layer_of[id(frame.f_locals["self"])]
                break
            frame = frame.f_back
        if layer is None:
            return None, "model"
        return layer, category or "rest of block"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not any("Tensor" in str(r.type) for r in func._schema.returns):
            return func(*args, **(kwargs or {}))  # a dtype query (promote_types): neither a kernel nor a view
        layer, category = self.where()
        if not launches_kernel(func):
            category = "views (no kernel)"
        self.counts[layer, category, func._schema.name.removeprefix("aten::")] += 1
        return func(*args, **(kwargs or {}))


def make_model(shape: dict, use_dcmha: bool, dtype: torch.dtype = torch.float32) -> HookedDCFormer:
    torch.manual_seed(0)
    cfg = DCFormerConfig(
        **shape, d_mlp=4 * shape["d_model"], d_vocab=VOCAB, n_ctx=4096, rotary_pct=0.25, use_dcmha=use_dcmha
    )
    return HookedDCFormer(cfg).to(dtype).eval().requires_grad_(False)


@torch.no_grad()
def prefilled(model: HookedDCFormer, prompt: torch.Tensor) -> DCFormerKeyValueCache:
    cache = DCFormerKeyValueCache.init_cache(model.cfg, "cpu", batch_size=prompt.shape[0])
    model(prompt, past_kv_cache=cache)
    return cache


@torch.no_grad()
def count_step(model: HookedDCFormer, prompt: torch.Tensor) -> Counter:
    """The ops of the second cached step after the prompt (the first may grow the cache's buffers)."""
    cache = prefilled(model, prompt)
    token = prompt[:, -1:]
    model(token, past_kv_cache=cache)
    with OpCounter(model.blocks) as counter:
        model(token, past_kv_cache=cache)
    return counter.counts


@torch.no_grad()
def step_times(models: dict[str, HookedDCFormer], prompt: torch.Tensor, steps: int) -> dict[str, float]:
    """Median seconds of a cached step per model, the models taking turns (alternating order) at every step."""
    caches = {name: prefilled(model, prompt) for name, model in models.items()}
    token, names, times = prompt[:, -1:], list(models), {name: [] for name in models}
    for step in range(steps):
        for name in names[::-1] if step % 2 else names:
            start = time.perf_counter()
            models[name](token, past_kv_cache=caches[name])
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[steps // 10 :]) for name, t in times.items()}  # the first tenth: warm-up


def by(counts: Counter, layer, category=None) -> int:
    """Ops of a layer (None: outside the blocks) launching kernels, of one category or all."""
    return sum(
        n for (l_, c, _), n in counts.items() if l_ == layer and (c == category or (category is None and c != VIEWS))
    )


def print_table(shape_name: str, shape: dict, counts: dict[str, Counter]) -> None:
    dc, mha = counts["DCMHA"], counts["MHA"]
    layers = list(range(shape["n_layers"]))
    kinds = ["local" if shape.get("window_type") and i % 2 == 0 else "global" for i in layers]
    print(f"\n### {shape_name}: {shape}, ops of one cached step (DCMHA / MHA)")
    header = ["where"] + [f"L{i} ({kinds[i]}) DCMHA / MHA" for i in layers] + ["model DCMHA / MHA"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for category in CATEGORIES:
        cells = [f"{by(dc, i, category)} / {by(mha, i, category)}" for i in layers]
        cells.append(f"{by(dc, None, category)} / {by(mha, None, category)}")
        print(f"| {category} | " + " | ".join(cells) + " |")
    totals = [f"**{by(dc, i)} / {by(mha, i)}** ({by(dc, i) / max(by(mha, i), 1):.2f}x)" for i in layers]
    totals.append(f"**{by(dc, None)} / {by(mha, None)}**")
    print("| total | " + " | ".join(totals) + " |")
    # On CUDA the dynamic weights are one Triton launch and the pattern two (the module docstring), the rest the same.
    on_cuda = [by(dc, i) - by(dc, i, "dynamic weights") - by(dc, i, PATTERN) + 1 + 2 for i in layers]
    cells = [f"{n} / {by(mha, i)} ({n / max(by(mha, i), 1):.2f}x)" for i, n in zip(layers, on_cuda, strict=True)]
    print("| total as on CUDA (dynamic weights 1 launch, pattern 2) | " + " | ".join(cells) + " | |")
    cells = [f"{by(dc, i, VIEWS)} / {by(mha, i, VIEWS)}" for i in layers] + [
        f"{by(dc, None, VIEWS)} / {by(mha, None, VIEWS)}"
    ]
    print(f"| {VIEWS}, not counted | " + " | ".join(cells) + " |")
    step_dc = sum(by(dc, layer) for layer in [*layers, None])
    step_mha = sum(by(mha, layer) for layer in [*layers, None])
    print(f"\nwhole step: DCMHA {step_dc} ops, MHA {step_mha} ({step_dc / step_mha:.2f}x)", end="; ")
    step_dc_cuda = sum(on_cuda) + by(dc, None)
    print(f"as on CUDA: DCMHA {step_dc_cuda}, MHA {step_mha} ({step_dc_cuda / step_mha:.2f}x)")


def print_ops(counts: Counter, layer: int) -> None:
    """One layer's ops by category and name (--verbose)."""
    for category in (*CATEGORIES, VIEWS):
        ops = Counter({op: n for (l_, c, op), n in counts.items() if l_ == layer and c == category})
        if ops:
            print(f"  {category}: " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens in the cache before the step")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per model")
    parser.add_argument("--no-time", action="store_true", help="count only")
    parser.add_argument("--verbose", action="store_true", help="each layer's ops by name")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    if min(args.batch, args.steps) < 1 or args.prompt < 0:
        parser.error("--batch and --steps must be at least 1, --prompt at least 0")
    torch.set_num_threads(1)
    for shape_name in args.shapes.split(","):
        if shape_name not in SHAPES:
            parser.error(f"--shapes: unknown shape {shape_name!r} (known: {list(SHAPES)})")
        shape = SHAPES[shape_name]
        dtype = getattr(torch, args.dtype)
        models = {"DCMHA": make_model(shape, True, dtype), "MHA": make_model(shape, False, dtype)}
        prompt = torch.randint(VOCAB, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
        counts = {name: count_step(model, prompt) for name, model in models.items()}
        print_table(shape_name, shape, counts)
        if args.verbose:
            for name in models:
                for layer in range(shape["n_layers"]):
                    print(f"{name} layer {layer}:")
                    print_ops(counts[name], layer)
        if not args.no_time:
            seconds = step_times(models, prompt, args.steps)
            print(
                f"CPU step (1 thread, median of {args.steps}): DCMHA {1e3 * seconds['DCMHA']:.3f} ms, "
                f"MHA {1e3 * seconds['MHA']:.3f} ms, ratio {seconds['DCMHA'] / seconds['MHA']:.2f}x"
            )


if __name__ == "__main__":
    main()
