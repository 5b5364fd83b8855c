"""Run the project's notebooks with parameters (papermill), e.g. on your own checkpoint.

    python -m dcinterp.notebooks list
    python -m dcinterp.notebooks run case_study -p checkpoint /models/DCPythia-6.9B -p device cuda -p dtype bfloat16 \
        -p twin_checkpoint /models/pythia-6.9b -p layer 16 -p head 11 -p prompt "... Michelle owns a kind of"
    python -m dcinterp.notebooks run synthetic_eval -y "{limit: 74, checkpoints: [dcpythia-synth]}" --out out/eval.ipynb
    python -m dcinterp.notebooks run head_diversity --figures figures     # re-render the repository's figures
    python -m dcinterp.notebooks render                  # the docs site's copies, with outputs (docs/notebooks/)

Parameters: each notebook has a cell tagged `parameters` (`run NAME --help-parameters` lists them).
`-p NAME VALUE` passes VALUE as typed, as a string (line breaks, quotes and ": " included); only where the
notebook's default is a number or a boolean is VALUE read as one, and where it is a list or a dict `-p` is refused
with the `-y` to type. `-y YAML` passes a YAML mapping of parameters, for lists, dicts, None and numbers where the
default is None. A name the notebook does not have is refused; the
case study's twin, layer and head are checked against the checkpoints before the kernel starts (`check_case_study`).

Where things go: the executed notebook to `--out` (default `out/notebooks/<name>.ipynb`), its figures next to it
(or to `--figures DIR`); the repository's `figures/` is written only when `--figures` names it. Both are checked
before the notebook starts. The kernel runs in the current directory, so relative paths in parameters mean what
they mean here. Each cell's output streams to the console as it runs.

`render [NAME ...]` executes the notebooks on the embedded models with the parameters the site shows
(`SITE_PARAMETERS`) and writes the executed copies, outputs included, to `docs/notebooks/<name>.ipynb`: the site's
notebook pages. Run it after changing a notebook, a figure or the code they call; the tests re-execute each notebook
and compare its outputs with the committed copy (`rendered_differences`).
`render --check` does that comparison without writing anything.

Exit status: 0 success, 1 a cell raised (one line: the cell and the error; for a GPU out of memory, torch's account
of it and the parameters that would hold less), 2 bad arguments (one line, nothing run).
"""

from __future__ import annotations

import ast
import logging
import re
import sys
import time
from pathlib import Path

from .cli import Parser, check_writable_dir, check_writable_file, out_of_memory_line

# `notebooks/` of a checkout, or the copy an installed wheel carries.
_INSTALLED = Path(__file__).resolve().parent / "_notebooks"
NOTEBOOK_DIR = _INSTALLED if _INSTALLED.is_dir() else Path(__file__).resolve().parent.parent / "notebooks"
DEFAULT_OUT_DIR = Path("out/notebooks")


class NotebookError(ValueError):
    """A notebook or parameter that cannot be run; the one-line message names the argument at fault."""


def available() -> list[Path]:
    """The notebooks of the project, sorted."""
    return sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def resolve(name_or_path: str) -> Path:
    """A notebook's path from its name or path.

    Args:
        name_or_path: a notebook's name (`case_study`) or the path of an .ipynb file.

    Returns:
        Its path.

    Raises:
        FileNotFoundError: no such notebook, naming those available.
    """
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
    """The notebook's parameters and their default values, from its cell tagged `parameters`.

    Args:
        notebook: the notebook's path.

    Returns:
        {name: default}; a default that is an expression stays its source text.
    """
    import papermill

    return {name: _literal(info["default"]) for name, info in papermill.inspect_notebook(notebook).items()}


def _literal(source: str):
    try:
        return ast.literal_eval(source)
    except (ValueError, SyntaxError):
        return source  # an expression: its value is only known in the kernel


def parse_parameters(notebook: Path, pairs: list[tuple[str, str]] = (), yaml_texts: list[str] = ()) -> dict:
    """`-p NAME VALUE` pairs and `-y YAML` mappings -> parameters, checked against the notebook's parameter cell.

    Args:
        notebook: the notebook's path.
        pairs: (name, value) of each `-p`, typed as the module docstring says.
        yaml_texts: each `-y`'s YAML mapping.

    Returns:
        {name: value}.

    Raises:
        NotebookError: a name the notebook does not have, a value that is not of its default's kind, or bad YAML.
    """
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
    """VALUE as a string, or as a number / boolean where the default is one; refused where the default is a list or
    a mapping (a string there would be read a character at a time: `-y` takes those)."""
    if isinstance(default, (list, tuple, dict)):
        kind = "a mapping" if isinstance(default, dict) else "a list"
        example = f"{name}: {{key: value}}" if isinstance(default, dict) else f"{name}: [{value}]"
        raise NotebookError(f"-p {name} {value!r}: {name} is {kind} (default {default!r}); pass it with -y '{example}'")
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
    """Check, before the kernel starts, the parameters this machine can check.

    The device, and the case study's checkpoint, twin and head (`check_case_study`).

    Args:
        parameters: {name: value}.
        notebook: the notebook (None: no notebook-specific check).

    Raises:
        NotebookError: the parameter at fault, named.
    """
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

    Args:
        checkpoint: the model's checkpoint directory or embedded model.
        prompt: the prompt.
        twin_checkpoint: the twin to explain beside the model (None: the embedded model's own twin, none for a
            checkpoint directory; "": none).
        layer: the head's layer (None: with `head` None, the head integrated gradients rank first).
        head: the head.

    Returns:
        (twin or None, layer, head), layer and head as integers or None.

    Raises:
        NotebookError: naming the parameter at fault: a twin whose tokenizer reads the prompt as other tokens, a
            prompt longer than the model's context, a layer or head out of range, one given without the other.
    """
    cfg = _config(checkpoint, "checkpoint")
    ours = _prompt_pieces(checkpoint, cfg, prompt, "checkpoint")
    if len(ours) > cfg.n_ctx:  # to_tokens would cut it, and the words it looks for with it
        raise NotebookError(
            f"prompt: {len(ours)} tokens, more than the model's context of {cfg.n_ctx} (checkpoint={checkpoint}); "
            "give a shorter one with -p prompt"
        )
    if twin_checkpoint is None:
        twin_checkpoint = EMBEDDED_TWINS.get(str(checkpoint), "")
    twin = str(twin_checkpoint) or None
    if twin is not None:
        twin_cfg = _config(twin, "twin_checkpoint")
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
    """Execute a notebook top to bottom with papermill.

    Args:
        notebook: a notebook's name or path.
        parameters: {name: value} (None: the defaults).
        out: the executed copy's path (None: `out/notebooks/<name>.ipynb`).
        figures: where figures go (None: the `figures_dir` parameter, else the executed copy's folder).
        cwd: where the kernel runs (None: here).
        timeout: seconds a cell may run.
        log_output: stream each cell's output to the console.

    Returns:
        The path of the executed copy.
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
    listens on a port, and the kernel has no reason to warn that it is "running over TCP without encryption". The
    sockets lie in a temporary folder of their own (`_socket_folder`): jupyter_client's default puts them in the
    working directory (kernel-ipc-1, ...), where two notebooks run at once from one folder would take the same
    names."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import CaselessStrEnum, default

    class LocalKernelManager(AsyncKernelManager):
        transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)

        @default("ip")
        def _sockets_in_a_folder_of_their_own(self) -> str:
            return str(Path(_socket_folder()) / "ipc")

    return LocalKernelManager


def _socket_folder() -> str:
    """A new temporary folder for a kernel's Unix sockets, removed when the process ends: in the temporary
    directory, or in /tmp where that path is too long for a socket's (107 bytes at most, `ipc-N` included)."""
    import atexit
    import os
    import shutil
    import tempfile

    parent = tempfile.gettempdir()
    if len(os.fsencode(os.path.join(parent, "dcinterp-kernel-12345678"))) > 90 and os.path.isdir("/tmp"):
        parent = "/tmp"
    folder = tempfile.mkdtemp(prefix="dcinterp-kernel-", dir=parent)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _stream_cells_to_console() -> None:
    """papermill logs each cell as it starts ("Executing Cell 3") and its output: print those as they come."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("papermill")
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def written_since(directory: Path, start: float) -> list[Path]:
    """The files of `directory` modified since `start`, sorted.

    Args:
        directory: the folder.
        start: a time, as `time.time()` gives it.

    Returns:
        The files.
    """
    return sorted(p for p in directory.glob("*") if p.is_file() and p.stat().st_mtime >= start)


# --------------------------------------------------------------------------------------------------
# The docs site's copies, with outputs
RENDERED_DIR = Path(__file__).resolve().parent.parent / "docs" / "notebooks"
# What the site's copies are run with: the notebook's defaults where they are quick on the CPU; smaller where the
# full run is long (each page says so, and gives the command of the full run). The tests run the same.
SITE_PARAMETERS = {
    "case_study": {"n_steps": 16},
    "synthetic_eval": {"limit": 74},
    "composition_maps": {},
    "head_diversity": {},
    "branch_analysis": {"tasks": "2,10", "pairs_per_task": 2, "ablation_samples": 12},
    "circuit_discovery": {"tasks": "2", "pairs_per_task": 2, "n_steps": 2, "exact_top": 6},
    "attribution_graph": {},
}
_FIGURES_SHOWN_AS = "figures"  # the figures folder, as the site's copies name it (the run's is a temporary one)


def render(names=None, out_dir=RENDERED_DIR, log_output: bool = False) -> list[Path]:
    """Execute each notebook with its `SITE_PARAMETERS` and write its site copy (`site_copy`) to `out_dir`.

    Args:
        names: the notebooks (None: every one of `SITE_PARAMETERS`).
        out_dir: where the site copies go.
        log_output: stream each cell's output to the console.

    Returns:
        The site copies written.
    """
    import tempfile

    import nbformat

    written = []
    for name in names or sorted(SITE_PARAMETERS):
        with tempfile.TemporaryDirectory(prefix=f"render-{name}-") as scratch:
            figures = Path(scratch) / "figures"
            executed = run_notebook(
                name,
                SITE_PARAMETERS[name],
                Path(scratch) / f"{name}.ipynb",
                figures,
                cwd=scratch,
                log_output=log_output,
            )
            copy = site_copy(nbformat.read(executed, as_version=4), name, figures)
        out = Path(out_dir) / f"{name}.ipynb"
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(copy, out)
        written.append(out)
    return written


def site_copy(executed, name: str, figures: Path):
    """The executed notebook as the site shows it.

    A note of the parameters it ran with (and the full run's command) after the title; the run's figures folder named
    `figures`; no stderr (progress bars, timings) and no execution timestamps, so that rendering twice gives the same
    file.

    Args:
        executed: the executed notebook (nbformat).
        name: its name.
        figures: the run's figures folder.

    Returns:
        The site copy (nbformat).
    """
    import nbformat

    notebook = nbformat.from_dict(executed)  # a copy
    for cell in notebook.cells:
        for key in ("execution", "papermill"):
            cell.metadata.pop(key, None)
        cell.source = cell.source.replace(str(figures.resolve()), _FIGURES_SHOWN_AS)
        if cell.cell_type != "code":
            continue
        outputs = []
        for output in cell.outputs:
            if output.output_type == "stream" and output.name == "stderr":
                continue
            if output.output_type == "stream":
                output.text = output.text.replace(str(figures.resolve()), _FIGURES_SHOWN_AS)
                if outputs and outputs[-1].output_type == "stream":  # one print split by when it was flushed
                    outputs[-1].text += output.text
                    continue
            outputs.append(output)
        cell.outputs = outputs
    notebook.metadata.pop("papermill", None)
    for cell in notebook.cells:
        if "injected-parameters" in cell.metadata.get("tags", []):  # papermill's: the run's scratch figures_dir
            cell.source = "\n".join(line for line in cell.source.splitlines() if not line.startswith("figures_dir ="))
            cell.id = f"{name}-injected-parameters"  # papermill draws a new one each run
    notebook.cells = [cell for cell in notebook.cells if cell.source.strip() not in ("", "# Parameters")]
    notebook.cells.insert(1, nbformat.v4.new_markdown_cell(_site_note(name), id=f"{name}-site-note"))
    return notebook


def _site_note(name: str) -> str:
    parameters = SITE_PARAMETERS[name]
    defaults = notebook_parameters(resolve(name))
    command = f"python -m dcinterp.notebooks run {name}"
    if not parameters:
        how = "with its default parameters"
    else:
        changed = ", ".join(f"`{key}={value!r}` (default `{defaults[key]!r}`)" for key, value in parameters.items())
        how = f"with {changed}, smaller than its default run to keep the page's run short"
    return (
        f"*This page is the notebook as `python -m dcinterp.notebooks render` executed it on the embedded models, "
        f"{how}; figures went to a scratch folder (shown as `{_FIGURES_SHOWN_AS}`). "
        f"To run it yourself at full size: `{command}` (`--help-parameters` lists what it takes).*"
    )


_NUMBER = re.compile(r"(?<![\w.])[-+]?(\d+)(?:\.(\d+))?(?:[eE]([-+]?\d+))?(?!\w)")


def rendered_differences(fresh, committed) -> list[str]:
    """What differs between two site copies of a notebook (`site_copy`), one line each.

    Cells' sources must be identical. Text outputs (streams and `text/plain`) must read the same once runs of
    whitespace are collapsed, word for word, and number for number within the rounding of another CPU: integers
    (counts, indices) exactly; other numbers when they differ by at most 2 units of their last printed digit plus 1e-4
    of their size (a float32 printed in full, 22.153275, after long sums that another CPU orders otherwise), or when
    both are below 1e-4 (float32 rounding errors themselves, "relative gap 1.5e-07"). Where both copies end a number in
    zeros, the unit is that of its last digit before them: a value rounded to fewer digits than pandas prints
    (-2.574000 after `.round(3)`) may come out one step of that rounding apart on another CPU. Each cell must show as
    many images (PNG) as before; their pixels are not compared.

    Args:
        fresh: the copy just rendered (nbformat).
        committed: the committed copy (nbformat).

    Returns:
        The differences; [] when they agree.
    """
    problems = []
    if len(fresh.cells) != len(committed.cells):
        return [f"{len(fresh.cells)} cells, the committed copy {len(committed.cells)}"]
    for index, (new, old) in enumerate(zip(fresh.cells, committed.cells, strict=True)):
        where = f"cell {index}"
        if new.source != old.source:
            problems.append(f"{where}: the source differs")
            continue
        if new.cell_type != "code":
            continue
        if _images(new) != _images(old):
            problems.append(f"{where}: {_images(new)} images, the committed copy {_images(old)}")
        new_text, old_text = _text(new), _text(old)
        new_words, new_numbers = _skeleton(new_text)
        old_words, old_numbers = _skeleton(old_text)
        if new_words != old_words:
            problems.append(f"{where}: the text differs: {_first_difference(new_words, old_words)}")
            continue
        for (a, a_unit, a_rounded), (b, b_unit, b_rounded) in zip(new_numbers, old_numbers, strict=True):
            unit = max(a_unit, b_unit, min(a_rounded, b_rounded))
            if not (abs(a - b) <= 2 * unit + 1e-4 * max(abs(a), abs(b)) or max(abs(a), abs(b)) < 1e-4):
                problems.append(f"{where}: {a!r} where the committed copy has {b!r}")
                break
    return problems


def _images(cell) -> int:
    return sum("image/png" in output.get("data", {}) for output in cell.outputs)


def _text(cell) -> str:
    parts, previous = [], None
    for output in cell.outputs:
        if output.output_type == "stream" and previous == "stream":
            parts[-1] += output.text  # one print may come in two streams, split by when it was flushed
        elif output.output_type == "stream":
            parts.append(output.text)
        elif "text/plain" in output.get("data", {}):
            parts.append(output.data["text/plain"])
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}")
        previous = output.output_type
    return "\n".join(parts)


def _skeleton(text: str) -> tuple[str, list[tuple[float, float, float]]]:
    """The text with every number replaced by '#' and whitespace collapsed; the numbers, each with the size of a
    unit of its last printed digit and of its last digit before trailing zeros (0 and 0 for an integer)."""
    numbers = []

    def take(match):
        decimals, exponent = match.group(2), match.group(3)
        if decimals is None and exponent is None:  # an integer: a count or an index, exact
            numbers.append((float(match.group(0)), 0.0, 0.0))
        else:
            exponent, decimals = int(exponent or 0), decimals or ""
            unit, rounded = 10.0 ** (exponent - len(decimals)), 10.0 ** (exponent - len(decimals.rstrip("0")))
            numbers.append((float(match.group(0)), unit, rounded))
        return "#"

    return " ".join(_NUMBER.sub(take, text).split()), numbers


def _first_difference(new: str, old: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(new, old, strict=False)) if a != b), min(len(new), len(old)))
    return f"{new[max(0, at - 40) : at + 40]!r}, the committed copy {old[max(0, at - 40) : at + 40]!r}"


# --------------------------------------------------------------------------------------------------
# Command line
def build_parser() -> Parser:
    """The command line's parser (list, run, render)."""
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
    render_command = commands.add_parser(
        "render", help="execute the notebooks as the docs site shows them and write docs/notebooks/<name>.ipynb"
    )
    render_command.add_argument("notebooks", nargs="*", metavar="NAME", help="which (default: all)")
    render_command.add_argument(
        "--check", action="store_true", help="compare fresh runs with the committed copies instead of writing"
    )
    return parser


def _RawDescription(prog):
    import argparse

    return argparse.RawDescriptionHelpFormatter(prog, width=118)


def main(argv: list[str] | None = None) -> int:
    """The command line: `python -m dcinterp.notebooks ...` (the module docstring).

    Args:
        argv: the arguments (None: sys.argv's).

    Returns:
        The exit status: 0 success, 1 a cell raised, 2 bad arguments.
    """
    args = build_parser().parse_args(argv)
    if args.command == "list":
        for path in available():
            print(path.stem)
        return 0
    if args.command == "render":
        return _render_command(args.notebooks, args.check)
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
        what = error.evalue
        if error.ename == "OutOfMemoryError":
            what = out_of_memory_line(what, out_of_memory_remedies({**notebook_parameters(notebook), **parameters}))
        print(
            f"error: {notebook.stem}: cell {error.exec_count} raised {error.ename}: {what} "
            f"(the executed notebook, up to the error: {out})",
            file=sys.stderr,
        )
        return 1
    print(f"executed {notebook} -> {out}")
    for path in written_since(figures, start):
        print(f"  wrote {path}")
    return 0


def out_of_memory_remedies(parameters: dict) -> list[str]:
    """The notebook's parameters, as the run had them, that would hold less on the GPU.

    Args:
        parameters: {name: value} of the run.

    Returns:
        Remedies, as `-p` options to try.
    """
    remedies = []
    if parameters.get("dtype") == "float32":
        remedies.append("-p dtype bfloat16 (half the memory of float32)")
    if parameters.get("twin_checkpoint") is not None:
        remedies.append("no -p twin_checkpoint (the twin's weights beside the model's)")
    for name, value in parameters.items():
        if name.endswith("batch_size") and isinstance(value, int) and value > 1:
            remedies.append(f"a -p {name} below {value}")
    return remedies


def _render_command(names: list[str], check: bool) -> int:
    import tempfile

    import nbformat
    import papermill

    if not RENDERED_DIR.parent.is_dir():
        print(f"error: render writes the docs site's copies into a checkout: no {RENDERED_DIR.parent}", file=sys.stderr)
        return 2
    unknown = [name for name in names if name not in SITE_PARAMETERS]
    if unknown:
        print(
            f"error: render {unknown[0]}: no such notebook (available: {', '.join(SITE_PARAMETERS)})", file=sys.stderr
        )
        return 2
    failed = 0
    for name in names or sorted(SITE_PARAMETERS):
        start = time.time()
        with tempfile.TemporaryDirectory() as scratch:
            try:
                (out,) = render([name], Path(scratch) if check else RENDERED_DIR)
            except papermill.PapermillExecutionError as error:
                print(f"error: {name}: cell {error.exec_count} raised {error.ename}: {error.evalue}", file=sys.stderr)
                return 1
            if not check:
                print(f"rendered {name} -> {out} ({time.time() - start:.0f} s)")
                continue
            committed = RENDERED_DIR / f"{name}.ipynb"
            if not committed.is_file():
                problems = [f"{committed} is missing"]
            else:
                fresh = nbformat.read(out, as_version=4)
                problems = rendered_differences(fresh, nbformat.read(committed, as_version=4))
        for problem in problems:
            print(f"{name}: {problem}", file=sys.stderr)
        failed += bool(problems)
        print(f"{name}: {'differs' if problems else 'matches'} the committed copy ({time.time() - start:.0f} s)")
    if failed:
        print("error: re-render with: python -m dcinterp.notebooks render", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
