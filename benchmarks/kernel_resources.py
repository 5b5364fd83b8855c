"""What each of DCMHA's Triton kernels takes of a GPU, compiled for it on a machine without one: registers a thread,
bytes spilled to local memory, what an iteration of its main loop executes, shared memory a block, and whether that
fits the card.

    python benchmarks/kernel_resources.py [--arch 90] [--head-dim 128] [--heads 32] [--dtype bfloat16] [--padding]
                                          [--json OUT]

Each kernel is built by Triton's compiler as a launch builds it (`triton.compile` for the target: pointers aligned
and every size divisible by 16 specialised, as at 4,096 tokens; every branch of both stages on, rank 2; no padding
unless --padding), with the launch settings the model takes (`MAPS_KERNELS`, `HEAD_KERNELS`, `GRADIENT_KERNELS`,
`KEY_GRADIENT_KERNELS` for the kernels through the maps). A kernel through the maps that needs more shared memory
than the card's block may take is built again unpipelined (num_stages=1), as
its launch does (`dcinterp.dcmha.maps`): "unpipelined" in the table. Registers and spills are ptxas' report (the
ptxas Triton ships; "n/a" where it cannot run): a thread holds at most 255 registers, and what does not fit spills
to local memory, slow on every card. The main loop (`main_loop`: the kernel's longest, over key or query blocks, or
over the heads of a tile) is read in the binary by the nvdisasm Triton ships: a warp's instructions an iteration,
and of them barriers, shuffles and local-memory accesses ("n/a" without nvdisasm). The kernels of `UNMASKED` have a
second such loop, for the blocks seen whole, without masks (none with padding): its instructions an iteration,
"unmasked loop". Numbers from this machine's Triton: the card's own Triton may build the kernels otherwise. Exit 1
(one line each) when a kernel does not fit even unpipelined: the model would take the materialised path there
(`dcinterp.dcmha.choose_path`); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said (it warns where it is not)

# the shared memory a block may take (opt-in) on each architecture, in bytes
SHARED_MEMORY = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
CARDS = {80: "A100", 86: "RTX 3090, A5000, A10", 89: "RTX 4090, L4", 90: "H100, H200"}
# the kernels whose blocks seen whole take a loop of their own, without masks (the shorter of their two loops)
UNMASKED = (
    "row_statistics_kernel", "head_output_kernel", "row_gradient_kernel", "head_query_gradient_kernel",
    "head_key_gradient_kernel",
)  # fmt: skip
MAPS = {
    "product_maps_kernel": "MAPS_KERNELS",
    "row_statistics_kernel": "HEAD_KERNELS",
    "post_maps_kernel": "MAPS_KERNELS",
    "head_output_kernel": "HEAD_KERNELS",
    "row_gradient_kernel": "GRADIENT_KERNELS",
    "pre_gradient_maps_kernel": "GRADIENT_KERNELS",
    "head_query_gradient_kernel": "GRADIENT_KERNELS",
    "head_key_gradient_kernel": "key_gradient_kernels",  # (of the head dim)
}
# the pointers in the inputs' dtype (the rest float32, `real` int8)
BACKWARD_STRIDES = ("dw1_c", "dw1_p", "dw2_c", "dw2_p", "dgates_c", "dgates_p")  # the dynamic weights' backward's
HALF_POINTERS = ("q", "k", "v", "dz", "z", "maps", "grads", "a", "b", "x", "W_in", "b_in", "W_out", "W_gate", "b_gate",
                 "w1", "w2", "gates", "scores", "pattern", "qw1", "qw2", "qg", "kw1", "kw2", "kg")  # fmt: skip


def build(kernel, signature: dict, constants: dict, options: dict, arch: int, sizes: dict):
    """The kernel compiled for sm_<arch>, specialised as a launch with these sizes would be."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if signature[name].startswith("*") or (name in sizes and sizes[name] % 16 == 0)
    }
    paths = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=paths, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def assembled(compiled, arch: int) -> dict:
    """The kernel as ptxas (the one Triton ships and calls) assembles its PTX: registers a thread and bytes it spills
    to local memory (ptxas' report), and its main loop's instructions (`main_loop`); None for what cannot be had
    (another Triton's layout of its tools)."""
    out = dict(registers=None, spilled_bytes=None, main_loop=None, unmasked_loop=None)
    try:
        from triton.backends.nvidia import compiler

        ptxas = compiler.get_ptxas(arch).path
        gpu = f"--gpu-name={compiler.sm_arch_from_capability(arch)}"
    except (ImportError, AttributeError, TypeError):
        return out
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(compiled.asm["ptx"])
        command = [ptxas, "-v", gpu, str(source), "-o", str(source.with_suffix(".o"))]
        # Triton 3.9's own options (--regAllocOptLevel=2 works around a bug of ptxas 13); an older ptxas, without
        report = subprocess.run([*command[:2], "--regAllocOptLevel=2", *command[2:]], capture_output=True, text=True)
        if report.returncode != 0:
            report = subprocess.run(command, capture_output=True, text=True)
        nvdisasm = Path(ptxas).with_name("nvdisasm")
        if report.returncode == 0 and nvdisasm.exists():
            sass = subprocess.run([nvdisasm, "-c", str(source.with_suffix(".o"))], capture_output=True, text=True)
            if sass.returncode == 0:
                out["main_loop"], out["unmasked_loop"] = main_loop(sass.stdout), unmasked_loop(sass.stdout)
    registers = re.search(r"Used (\d+) registers", report.stderr)
    spilled = re.search(r"(\d+) bytes spill stores", report.stderr)
    out["registers"] = int(registers[1]) if registers else None
    out["spilled_bytes"] = int(spilled[1]) if spilled else None
    return out


def main_loop(sass: str) -> dict:
    """The longest loop of a kernel's SASS (nvdisasm's listing: from a label to the branch back to it), what one
    iteration of a warp executes: its instructions, and of them the block's barriers (a layout conversion or an
    operand's staging through shared memory), shuffles between lanes (sums across a tile's rows) and accesses to
    local memory (spills); {} without a loop. A static count, not a time: it did not rank the H100's times of the
    key side's launches (benchmarks/results/gpu-log.md, "Read without a card")."""
    found = loops(sass)
    if not found:
        return {}
    opcodes = found[0]
    return dict(
        instructions=len(opcodes),
        barriers=opcodes.count("BAR"),
        shuffles=opcodes.count("SHFL"),
        local=opcodes.count("LDL") + opcodes.count("STL"),
    )


def unmasked_loop(sass: str) -> int | None:
    """The instructions of the second-longest loop (a kernel of `UNMASKED`'s loop of the blocks seen whole), None
    without one."""
    found = loops(sass)
    return len(found[1]) if len(found) > 1 else None


def loops(sass: str) -> list[list[str]]:
    """Every loop of nvdisasm's listing (its opcodes, the label's to the branch back to it's), the longest first."""
    lines = sass.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\.L_x_\d+:", line.strip())}
    found = []
    for i, line in enumerate(lines):
        branch = re.search(r"\bBRA\s+`\((\.L_x_\d+)\)", line)
        if branch and labels.get(branch[1], i) < i:
            opcodes = [found[1] for found in map(OPCODE.match, lines[labels[branch[1]] : i + 1]) if found is not None]
            if len(opcodes) > 1:  # not the branch to itself that ends every kernel
                found.append(opcodes)
    return sorted(found, key=len, reverse=True)


# an instruction of nvdisasm's listing: its address in a comment, an optional predicate, the opcode (its modifiers cut)
OPCODE = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def kernels(head_dim: int, heads: int, dtype: str, padding: bool = False):
    """(name, kernel, signature, constants, options) of every kernel, as the model launches them."""
    from dcinterp.dcmha import decoding, dynamic_weights, maps, maps_backward_kernels, maps_kernels

    for module in (maps_kernels, maps_backward_kernels, dynamic_weights, decoding):
        module.jit()
    pointer = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}[dtype]
    half = dtype != "float32"
    every = dict(HP=heads, PADDING=padding, HALF=half, R=2, RP=2, EP=max(16, head_dim), FIRST=0)
    every.update(QP=True, KP=True, QG=True, KG=True)
    every.update({f"{stage}_{branch}": True for stage in ("PRE", "POST") for branch in ("QP", "KP", "QG", "KG")})
    scalars = dict(T="i32", S="i32", H="i32", E="i32", R="i32", past="i32", span="i32", scale="fp32")

    def signature(kernel, constants, half_pointers=HALF_POINTERS, floats=()):
        return {
            name: "constexpr" if name in constants else scalars.get(name) or ("fp32" if name in floats else
                  pointer if name in half_pointers else "*i8" if name == "real" else "*fp32")
            for name in kernel.arg_names
        }  # fmt: skip

    for name in MAPS:
        kernel = getattr(maps_kernels if hasattr(maps_kernels, name) else maps_backward_kernels, name)
        constants = {arg: value for arg, value in every.items() if arg in kernel.arg_names}
        settings = getattr(maps, MAPS[name])
        settings = settings(head_dim) if callable(settings) else settings
        constants.update({key: value for key, value in settings.items() if key in kernel.arg_names})
        options = {key: value for key, value in settings.items() if key.startswith("num_")}
        yield name, kernel, signature(kernel, constants), constants, options
    kernel = dynamic_weights._dynamic_weights_kernel
    constants = dict(BP=dynamic_weights.BLOCK_POSITIONS, BD=dynamic_weights.BLOCK_DIM, KP=4 * heads, HP=heads,
                     IN_BIAS=True, GATE_BIAS=True, HALF=half, SAVE=True)  # fmt: skip
    sizes = ("P", "D", "K", "H", "R")
    yield (kernel.fn.__name__, kernel, {**signature(kernel, constants), **dict.fromkeys(sizes, "i32")}, constants,
           dict(num_warps=4))  # fmt: skip
    kernel = dynamic_weights._dynamic_weights_backward_kernel
    constants = dict(BP=dynamic_weights.BLOCK_POSITIONS, KP=4 * heads, HP=heads, WEIGHTS=False)
    types = signature(kernel, constants, half_pointers=("gates", "W_out", "dw1", "dw2", "dgates", "dpre", "dgate"))
    types.update({name: "i32" for name in (*sizes, *BACKWARD_STRIDES) if name in types})
    yield kernel.fn.__name__, kernel, types, constants, dict(num_warps=dynamic_weights.BACKWARD_WARPS)
    constants = dict(HP=heads, BK=max(16, decoding.TILE // heads), R=2, QP=True, KP=True, QG=True, KG=True)
    for kernel in (decoding._decoding_logits_kernel, decoding._decoding_pattern_kernel):
        stage = ("scores", "pattern", "qw1", "qw2", "qg", "kw1", "kw2", "kg")
        types = signature(kernel, constants, half_pointers=stage, floats=("scale",))
        types.update({name: "i32" for name in types if re.fullmatch(r"[a-z]+_s[a-z]", name) or name == "n_blocks"})
        yield kernel.fn.__name__, kernel, types, constants, dict(num_warps=4)


def measure(arch: int, head_dim: int, heads: int, dtype: str, padding: bool = False) -> list[dict]:
    """One row a kernel: its launch, registers, spilled bytes, shared memory, and how it fits the card."""
    limit, rows = SHARED_MEMORY[arch], []
    sizes = dict(T=4096, S=4096, H=heads, E=head_dim, past=0, span=4097, P=4096, D=32 * heads, K=4 * heads)
    # the dynamic weights' backward reads its gradients as the model gives them: [b, p, 4, R, H] and [b, p, 4, H]
    sizes.update(dict(zip(BACKWARD_STRIDES, (2 * heads, 8 * heads) * 2 + (heads, 4 * heads), strict=True)))
    for name, kernel, signature, constants, options in kernels(head_dim, heads, dtype, padding):
        compiled = build(kernel, signature, constants, options, arch, sizes)
        fits = "yes"
        if compiled.metadata.shared > limit and name in MAPS and options.get("num_stages", 1) > 1:
            options = {**options, "num_stages": 1}
            compiled = build(kernel, signature, constants, options, arch, sizes)
            fits = "unpipelined"
        if compiled.metadata.shared > limit:
            fits = "no"
        launch = {key: constants[key] for key in ("BQ", "BK") if key in constants} | options
        resources = assembled(compiled, arch)
        if name not in UNMASKED or padding:
            resources["unmasked_loop"] = None
        rows.append(dict(kernel=name, launch=launch, **resources, shared_bytes=compiled.metadata.shared, fits=fits))
    return rows


def table(rows: list[dict], arch: int, heads: int, head_dim: int, dtype: str, padding: bool = False) -> str:
    lines = [
        f"sm_{arch} ({CARDS[arch]}, {SHARED_MEMORY[arch] // 1024} KiB of shared memory a block), {dtype}, "
        f"{heads} heads of {head_dim}, {'padding' if padding else 'no padding'}",
        "",
        "| kernel | launch | registers | spilled bytes | main loop: instructions, barriers, shuffles, local | "
        "unmasked loop | shared KiB | fits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        launch = ", ".join(f"{key} {value}" for key, value in row["launch"].items())
        registers, spilled = ("n/a" if row[key] is None else row[key] for key in ("registers", "spilled_bytes"))
        shared = f"{row['shared_bytes'] / 1024:.1f}"
        loop = "n/a" if row["main_loop"] is None else ", ".join(map(str, row["main_loop"].values())) or "no loop"
        unmasked = "-" if row["unmasked_loop"] is None else row["unmasked_loop"]
        cells = (f"`{row['kernel']}`", launch, registers, spilled, loop, unmasked, shared, row["fits"])
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help=f"the card's sm_ number, one of {sorted(SHARED_MEMORY)}")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--heads", type=int, default=32, help="a power of two (the padded heads of the [heads, keys] tiles)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--padding", action="store_true", help="build the kernels for a batch with padding")
    parser.add_argument("--json", type=Path, help="also write the rows, one JSON line each, to this file")
    args = parser.parse_args(argv)
    if args.arch not in SHARED_MEMORY:
        parser.error(f"--arch must be one of {sorted(SHARED_MEMORY)} (got {args.arch})")
    if args.head_dim not in (16, 32, 64, 128, 256):
        parser.error(f"--head-dim must be a power of two from 16 to 256 (got {args.head_dim})")
    if args.heads < 1 or args.heads & (args.heads - 1):
        parser.error(f"--heads must be a power of two (got {args.heads})")
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("the kernels are compiled for a GPU here: run it without TRITON_INTERPRET=1")
    try:
        import triton  # noqa: F401
    except ImportError as error:
        print(f"kernel_resources: triton is not installed ({error})", file=sys.stderr)
        return 2
    rows = measure(args.arch, args.head_dim, args.heads, args.dtype, args.padding)
    if args.json:
        args.json.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(table(rows, args.arch, args.heads, args.head_dim, args.dtype, args.padding))
    refused = [row for row in rows if row["fits"] == "no"]
    for row in refused:
        print(f"kernel_resources: {row['kernel']} needs {row['shared_bytes']} bytes of shared memory, sm_{args.arch} "
              f"gives a block {SHARED_MEMORY[args.arch]}", file=sys.stderr)  # fmt: skip
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
