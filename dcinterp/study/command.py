"""The paired study's table: the accuracies of a folder of runs, and the paired difference DCMHA - MHA per seed.

`python -m dcinterp.train summarize`: `main` reads a folder of runs (`dcinterp.study.tables`) and writes its table
and figures, or prints the study page's tables from its committed data (`dcinterp.study.page`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..cli import Parser, check_writable_dir
from .figures import write_figures, write_table_figures
from .page import page_tables, read_table_data
from .tables import read_study, write_study


def main(argv: list[str] | None = None) -> None:
    """`python -m dcinterp.train summarize`: a study's table (and figures) from its runs, or the page's from its data.

    Args:
        argv: the command's arguments; None: `sys.argv[1:]`.

    Raises:
        SystemExit: a bad argument or a study that cannot be read: one line on stderr, exit 2.
    """
    parser = Parser(prog="python -m dcinterp.train summarize", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs_dir", metavar="RUNS_DIR", nargs="?", help="a folder of runs (recipe.json files, at any depth)"
    )
    parser.add_argument(
        "--from-table",
        metavar="DATA_DIR",
        default=None,
        help="instead of RUNS_DIR: the study page's committed data (docs/study-data); prints the page's tables "
        "(and writes them to --out DIR as tables.md; --figures DIR: the figures its data can draw)",
    )
    parser.add_argument("--out", default=None, help="write summary.csv and summary.md here (default: RUNS_DIR)")
    parser.add_argument("--level", type=float, default=0.95, help="the interval's level (default %(default)s)")
    parser.add_argument(
        "--head-diversity",
        action="store_true",
        help="load each run's model and add its head diversity (Fig. 5) as rows of the table",
    )
    parser.add_argument(
        "--trained-on",
        metavar="DIR",
        default=None,
        help="the same seeds' runs trained on every task: adds what each run lost on the combinations it left out "
        "(held_out_change rows)",
    )
    parser.add_argument(
        "--figures",
        metavar="DIR",
        default=None,
        help="write the study's figures (PNG) to DIR; computes the head diversity too",
    )
    args = parser.parse_args(argv)
    if not 0 < args.level < 1:
        parser.error(f"--level {args.level}: expected a number between 0 and 1")
    if (args.runs_dir is None) == (args.from_table is None):
        parser.error("give a folder of runs (RUNS_DIR) or --from-table DATA_DIR, one of the two")
    if args.from_table is not None:
        return summarize_table(parser, args)
    runs_dir = Path(args.runs_dir)
    out_dir = Path(args.out) if args.out else runs_dir
    figures_dir = Path(args.figures) if args.figures else None
    try:
        if figures_dir is not None:
            check_writable_dir(figures_dir, "--figures")
        study = read_study(
            runs_dir,
            head_diversity=args.head_diversity or figures_dir is not None,
            trained_on=Path(args.trained_on) if args.trained_on else None,
            level=args.level,
        )
        write_study(study, out_dir)
    except ValueError as e:
        parser.error(str(e))
    written = [out_dir / "summary.csv", out_dir / "summary.md"]
    if not study.screen.empty:
        written.append(out_dir / "screen.csv")
    if figures_dir is not None:
        written += write_figures(study, figures_dir)
    print((out_dir / "summary.md").read_text())
    print(f"written: {', '.join(map(str, written))}", file=sys.stderr)


def summarize_table(parser: Parser, args) -> None:
    """`summarize --from-table`: the study page's tables printed (and written to --out), its figures drawn.

    Args:
        parser: the command's parser, for its errors.
        args: the parsed arguments.

    Raises:
        SystemExit: a folder that cannot be written or data that cannot be read: one line on stderr, exit 2.
    """
    out_dir, figures_dir = (Path(d) if d else None for d in (args.out, args.figures))
    try:
        for folder, flag in ((out_dir, "--out"), (figures_dir, "--figures")):
            if folder is not None:
                check_writable_dir(folder, flag)
        data = read_table_data(Path(args.from_table))
        text = "".join(f"<!-- {name} -->\n{table}\n" for name, table in page_tables(data, args.level).items())
        written = write_table_figures(data, figures_dir, args.level) if figures_dir is not None else []
    except ValueError as e:
        parser.error(str(e))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tables.md").write_text(text)
        written.insert(0, out_dir / "tables.md")
    print(text)
    if written:
        print(f"written: {', '.join(map(str, written))}", file=sys.stderr)
