"""Run the project's notebooks with parameters (papermill), e.g. on your own checkpoint.

    python -m dcinterp.notebooks list
    python -m dcinterp.notebooks run case_study -p checkpoint /models/DCPythia-6.9B -p device cuda -p dtype bfloat16
    python -m dcinterp.notebooks run synthetic_eval -y "{limit: 74, checkpoints: [dcpythia-synth]}" --out out/eval.ipynb
    python -m dcinterp.notebooks run head_diversity --figures figures     # re-render the repository's figures

Parameters: each notebook has a cell tagged `parameters` (`run NAME --help-parameters` lists them).
`-p NAME VALUE` passes VALUE as typed, as a string (line breaks, quotes and ": " included); only where the
notebook's default is a number or a boolean is VALUE read as one. `-y YAML` passes a YAML mapping of parameters,
for lists, dicts, None and numbers where the default is None. A name the notebook does not have is refused.

Where things go: the executed notebook to `--out` (default `out/notebooks/<name>.ipynb`), its figures next to it
(or to `--figures DIR`); the repository's `figures/` is written only when `--figures` names it. Both are checked
before the notebook starts. The kernel runs in the current directory, so relative paths in parameters mean what
they mean here. Each cell's output streams to the console as it runs.

Exit status: 0 success, 1 a cell raised (one line: the cell and the error), 2 bad arguments (one line, nothing run).
"""

from __future__ import annotations

import ast
import logging
import sys
import time
from pathlib import Path

from .cli import Parser, check_writable_dir, check_writable_file

# `notebooks/` of a checkout, or the copy an installed wheel carries.
_INSTALLED = Path(__file__).resolve().parent / "_notebooks"
NOTEBOOK_DIR = _INSTALLED if _INSTALLED.is_dir() else Path(__file__).resolve().parent.parent / "notebooks"
DEFAULT_OUT_DIR = Path("out/notebooks")


class NotebookError(ValueError):
    """A notebook or parameter that cannot be run; the one-line message names the argument at fault."""


def available() -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def resolve(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidate = NOTEBOOK_DIR / f"{path.stem}.ipynb"
    if candidate.is_file():
        return candidate
    names = ", ".join(p.stem for p in available()) or "none found"
    raise FileNotFoundError(f"{name_or_path}: no such notebook (available: {names})")


# --------------------------------------------------------------------------------------------------
# Parameters
def notebook_parameters(notebook: Path) -> dict:
    """The notebook's parameters and their default values, from its cell tagged `parameters`."""
    import papermill

    return {name: _literal(info["default"]) for name, info in papermill.inspect_notebook(notebook).items()}


def _literal(source: str):
    try:
        return ast.literal_eval(source)
    except (ValueError, SyntaxError):
        return source  # an expression: its value is only known in the kernel


def parse_parameters(notebook: Path, pairs: list[tuple[str, str]] = (), yaml_texts: list[str] = ()) -> dict:
    """`-p NAME VALUE` pairs and `-y YAML` mappings -> parameters, checked against the notebook's parameter cell."""
    import yaml

    defaults = notebook_parameters(notebook)
    parameters = {}
    for text in yaml_texts:
        try:
            mapping = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise NotebookError(f"-y {text!r}: not YAML ({str(error).splitlines()[0]})") from None
        if not isinstance(mapping, dict):
            raise NotebookError(f"-y {text!r}: expected a YAML mapping such as 'limit: 74'")
        parameters.update(mapping)
    for name, value in pairs:
        if name in defaults:
            parameters[name] = _typed_like(defaults[name], value, name)
        else:
            parameters[name] = value  # reported with the other unknown names below
    unknown = [name for name in parameters if name not in defaults]
    if unknown:
        raise NotebookError(f"{notebook.stem} has no parameter {unknown[0]!r} (its parameters: {', '.join(defaults)})")
    return parameters


def _typed_like(default, value: str, name: str):
    """VALUE as a string, or as a number / boolean where the default is one."""
    if isinstance(default, bool):
        words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
        if value.lower() not in words:
            raise NotebookError(f"-p {name} {value!r}: expected true or false")
        return words[value.lower()]
    for kind in (int, float):
        if isinstance(default, kind):
            try:
                return kind(value)
            except ValueError:
                raise NotebookError(
                    f"-p {name} {value!r}: expected {'an integer' if kind is int else 'a number'}, "
                    f"like the default {default!r}"
                ) from None
    return value


def check_parameters(parameters: dict, notebook: Path | None = None) -> None:
    """Check, before the kernel starts, the parameters this machine can check: the device, and the case study's
    checkpoint, twin and head (`check_case_study`)."""
    from .devices import check_device

    if isinstance(parameters.get("device"), str):
        try:
            check_device(parameters["device"])
        except ValueError as error:
            raise NotebookError(f"-p device: {error}") from None
    if notebook is not None and notebook.stem == "case_study":
        values = {**notebook_parameters(notebook), **parameters}
        check_case_study(
            values["checkpoint"], values["prompt"], values["twin_checkpoint"], values["layer"], values["head"]
        )


# --------------------------------------------------------------------------------------------------
# The case study's parameters, checked before any model runs
# An embedded model's plain-MHA twin, explained beside it when the case study names no other.
EMBEDDED_TWINS = {"dcpythia-synth": "pythia-synth"}


def check_case_study(checkpoint, prompt: str, twin_checkpoint=None, layer=None, head=None):
    """Check the case study's checkpoint, twin and head from config.json and tokenizer alone (no weights loaded).

    Returns (twin, layer, head): the twin to explain beside the model (`twin_checkpoint`; None: the embedded model's
    own twin, none for a checkpoint directory; "": none) or None, and the head to follow as integers (or None: the
    head integrated gradients rank first). Raises a NotebookError naming the parameter at fault: a twin whose
    tokenizer reads the prompt as other tokens, a layer or head out of range, one given without the other."""
    cfg = _config(checkpoint, "checkpoint")
    if twin_checkpoint is None:
        twin_checkpoint = EMBEDDED_TWINS.get(str(checkpoint), "")
    twin = str(twin_checkpoint) or None
    if twin is not None:
        twin_cfg = _config(twin, "twin_checkpoint")
        ours = _prompt_pieces(checkpoint, cfg, prompt, "checkpoint")
        theirs = _prompt_pieces(twin, twin_cfg, prompt, "twin_checkpoint")
        if ours != theirs:
            pairs = enumerate(zip(ours, theirs, strict=False))
            at = next((i for i, (a, b) in pairs if a != b), min(len(ours), len(theirs)))
            raise NotebookError(
                f"twin_checkpoint={twin}: its tokenizer reads the prompt as other tokens than the model's "
                f"({len(theirs)} tokens against {len(ours)}; from token {at}: "
                f"{theirs[at : at + 3]} against {ours[at : at + 3]}); name a twin with the same tokenizer, "
                "or none with -p twin_checkpoint ''"
            )
    if (layer is None) != (head is None):
        given, missing = ("layer", "head") if head is None else ("head", "layer")
        raise NotebookError(f"{given} is given without {missing}: name both (e.g. -p layer 16 -p head 11), or neither")
    if layer is not None:
        layer = _index(layer, cfg.n_layers, "layer", "layers")
        head = _index(head, cfg.n_heads, "head", "heads")
    return twin, layer, head


def _config(checkpoint, name: str):
    from .loading import CheckpointError, load_config

    try:
        return load_config(checkpoint)
    except CheckpointError as error:
        raise NotebookError(f"{name}: {error}") from None


def _prompt_pieces(checkpoint, cfg, prompt: str, name: str) -> list[str]:
    """The prompt's tokens as `to_tokens` reads them (a BOS where the config prepends one), as strings."""
    from .loading import CheckpointError, load_tokenizer, resolve_checkpoint

    try:
        tokenizer = load_tokenizer(resolve_checkpoint(checkpoint))
    except CheckpointError as error:
        raise NotebookError(f"{name}: {error}") from None
    if tokenizer is None:
        raise NotebookError(f"{name}: the checkpoint has no tokenizer (tokenizer.json), so it cannot read the prompt")
    ids = tokenizer(prompt)["input_ids"]
    if cfg.default_prepend_bos and ids[:1] != [tokenizer.bos_token_id]:
        ids = [tokenizer.bos_token_id, *ids]
    return tokenizer.convert_ids_to_tokens(ids)


def _index(value, size: int, name: str, plural: str) -> int:
    """A layer or head index from a parameter (`-p layer 16` arrives as the string "16"), checked against the model."""
    try:
        index = int(value)
    except (TypeError, ValueError):
        raise NotebookError(f"{name}={value!r}: expected an integer from 0 to {size - 1}") from None
    if not 0 <= index < size:
        raise NotebookError(f"{name}={index}: the model has {size} {plural} (0 to {size - 1})")
    return index


# --------------------------------------------------------------------------------------------------
# Running
def run_notebook(
    notebook,
    parameters: dict | None = None,
    out=None,
    figures=None,
    cwd=None,
    timeout: int = 1800,
    log_output: bool = False,
) -> Path:
    """Execute a notebook top to bottom with papermill; returns the path of the executed copy.

    Figures go to `figures` (default: the executed copy's folder); the kernel runs in `cwd` (default: here).
    """
    import papermill

    notebook = resolve(str(notebook))
    out = Path(out) if out is not None else DEFAULT_OUT_DIR / notebook.name
    parameters = dict(parameters or {})
    figures = Path(figures if figures is not None else parameters.get("figures_dir", out.parent))
    parameters["figures_dir"] = str(figures.resolve())
    out.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(notebook),
        str(out),
        parameters=parameters,
        cwd=str(cwd or Path.cwd()),
        kernel_name="python3",
        progress_bar=False,
        log_output=log_output,
        request_save_on_cell_execute=False,
        execution_timeout=timeout,
        kernel_manager_class=_local_kernel_manager(),
        extra_arguments=["--IPKernelApp.log_level=CRITICAL"],  # the kernel's own start/shutdown log, not the cells'
    )
    return out


def _local_kernel_manager():
    """A kernel manager that talks to its kernel over Unix sockets (IPC) rather than TCP on localhost: nothing
    listens on a port, and the kernel has no reason to warn that it is "running over TCP without encryption"."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import CaselessStrEnum

    class LocalKernelManager(AsyncKernelManager):
        transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)

    return LocalKernelManager


def _stream_cells_to_console() -> None:
    """papermill logs each cell as it starts ("Executing Cell 3") and its output: print those as they come."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("papermill")
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def written_since(directory: Path, start: float) -> list[Path]:
    return sorted(p for p in directory.glob("*") if p.is_file() and p.stat().st_mtime >= start)


# --------------------------------------------------------------------------------------------------
# Command line
def build_parser() -> Parser:
    parser = Parser(
        prog="python -m dcinterp.notebooks",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=_RawDescription,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("list", help="list the notebooks")
    run = commands.add_parser(
        "run",
        help="execute a notebook with parameters",
        formatter_class=_RawDescription,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    run.add_argument("notebook", help="a notebook name (e.g. case_study) or path")
    run.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="a parameter, VALUE as typed (a string; a number or boolean where the default is one)",
    )
    run.add_argument(
        "-y",
        "--parameters-yaml",
        action="append",
        default=[],
        metavar="YAML",
        help="parameters as a YAML mapping, e.g. 'limit: 74' or '{layers: [1, 2], limit: null}'",
    )
    run.add_argument("--out", type=Path, help="the executed notebook (default: out/notebooks/<name>.ipynb)")
    run.add_argument(
        "--figures", type=Path, metavar="DIR", help="where the figures go (default: the executed notebook's folder)"
    )
    run.add_argument("--help-parameters", action="store_true", help="list the notebook's parameters and exit")
    run.add_argument("--quiet", action="store_true", help="do not stream the cells' output")
    return parser


def _RawDescription(prog):
    import argparse

    return argparse.RawDescriptionHelpFormatter(prog, width=118)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "list":
        for path in available():
            print(path.stem)
        return 0
    try:
        notebook = resolve(args.notebook)
        if args.help_parameters:
            for name, default in notebook_parameters(notebook).items():
                print(f"{name} = {default!r}")
            return 0
        parameters = parse_parameters(notebook, args.parameter, args.parameters_yaml)
        out = args.out if args.out is not None else DEFAULT_OUT_DIR / notebook.name
        figures = args.figures if args.figures is not None else Path(parameters.get("figures_dir", out.parent))
        check_writable_file(out, "--out")
        check_writable_dir(figures, "--figures")
        check_parameters(parameters, notebook)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    import papermill

    if not args.quiet:
        _stream_cells_to_console()
    start = time.time()
    try:
        run_notebook(notebook, parameters, out, figures, log_output=not args.quiet)
    except papermill.PapermillExecutionError as error:
        print(
            f"error: {notebook.stem}: cell {error.exec_count} raised {error.ename}: {error.evalue} "
            f"(the executed notebook, up to the error: {out})",
            file=sys.stderr,
        )
        return 1
    print(f"executed {notebook} -> {out}")
    for path in written_since(figures, start):
        print(f"  wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
