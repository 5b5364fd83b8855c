"""Run the project's notebooks with parameters (papermill), e.g. on your own checkpoint.

    python -m dcinterp.notebooks list
    python -m dcinterp.notebooks run case_study -p checkpoint /models/DCPythia-6.9B -p device cuda -p dtype bfloat16
    python -m dcinterp.notebooks run notebooks/head_diversity.ipynb --out out/head_diversity.ipynb

Each notebook has a cell tagged `parameters` (checkpoint, device, dtype, example, figures_dir, ...); `-p NAME VALUE`
overrides one (values are read as YAML, so numbers and booleans work). The executed copy is written to `--out`
(default: `out/notebooks/<name>.ipynb`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

# `notebooks/` of a checkout, or the copy an installed wheel carries.
_INSTALLED = Path(__file__).resolve().parent / "_notebooks"
NOTEBOOK_DIR = _INSTALLED if _INSTALLED.is_dir() else Path(__file__).resolve().parent.parent / "notebooks"


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


def run_notebook(notebook, parameters: dict | None = None, out=None, cwd=None, timeout: int = 1800) -> Path:
    """Execute a notebook top to bottom with papermill; returns the path of the executed copy."""
    import papermill

    notebook = resolve(str(notebook))
    parameters = dict(parameters or {})
    if notebook.parent == _INSTALLED:  # not in a checkout: figures go to ./figures, not into site-packages
        parameters.setdefault("figures_dir", str(Path.cwd() / "figures"))
    out = Path(out) if out is not None else Path("out/notebooks") / notebook.name
    out.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(notebook), str(out), parameters=parameters, cwd=str(cwd or notebook.parent),
        kernel_name="python3", progress_bar=False, request_save_on_cell_execute=False, execution_timeout=timeout,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dcinterp.notebooks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the notebooks")
    run = commands.add_parser("run", help="execute a notebook with parameters")
    run.add_argument("notebook", help="a notebook name (e.g. case_study) or path")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    run.add_argument("--out", type=Path, help="where to write the executed notebook")
    args = parser.parse_args(argv)

    if args.command == "list":
        for path in available():
            print(path.stem)
        return 0
    try:
        notebook = resolve(args.notebook)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parameters = {name: yaml.safe_load(value) for name, value in args.parameter}
    import papermill

    try:
        out = run_notebook(notebook, parameters, args.out)
    except papermill.PapermillExecutionError as e:
        print(f"error: {notebook}: cell {e.exec_count} raised {e.ename}: {e.evalue}", file=sys.stderr)
        return 1
    print(f"executed {notebook} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
