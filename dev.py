#!/usr/bin/env python3
"""Set up a virtual environment for dcinterp and run its main jobs.

    python3 dev.py demo      # the main job: score the embedded models on the released synthetic tasks
    python3 dev.py test      # the whole test suite, on every core (up to 4); `dev.py test ARGS` passes ARGS to pytest
    python3 dev.py notebook NOTEBOOK [-p NAME VALUE ...]   # run one notebook with parameters
    python3 dev.py notebook render [NAME ...]             # the docs site's copies of the notebooks, with outputs
    python3 dev.py docs      # serve the documentation site at http://127.0.0.1:8000, rebuilt on every save
    python3 dev.py docs build    # build it (strictly, as mkdocs.yml says) into site/

Needs only Python >= 3.10. The first call creates `.venv/` next to this file and installs the project
into it (editable, with its test and docs extras); later calls reuse it and reinstall only when `pyproject.toml`
changes. Set DCINTERP_TORCH to choose the torch requirement (default: torch==2.13.0, which on a machine
without a GPU takes the CPU build; use e.g. DCINTERP_TORCH="torch>=2.6" on a CUDA machine).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".dcinterp-installed"
TORCH = os.environ.get("DCINTERP_TORCH", "torch==2.13.0")


def sh(*args: str | Path) -> None:
    subprocess.run([str(a) for a in args], check=True, cwd=ROOT)


def ensure_venv() -> None:
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH.encode()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    if not PYTHON.exists():
        print(f"dev.py: creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = (PYTHON, "-m", "pip", "install", "--disable-pip-version-check", "-q")
    print(f"dev.py: installing {TORCH} and dcinterp[test,docs] into {VENV}", flush=True)
    sh(*pip, TORCH)
    sh(*pip, "-e", ".[test,docs]")
    STAMP.write_text(wanted)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"demo", "test", "notebook", "docs", "python"}:
        print(__doc__)
        return 2
    ensure_venv()
    command, rest = argv[0], argv[1:]
    if command == "demo":
        cmd = [PYTHON, "-m", "dcinterp.synth", "eval", *rest]
    elif command == "test":
        # The whole suite: a pytest-xdist worker a core, each test file kept on one worker (its module fixtures
        # built once) but for the Triton files, spread test by test; each worker's torch runs one thread (both in
        # tests/conftest.py). With arguments, pytest as told.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = ["-n", str(min(4, cores)), "--dist", "loadfile"] if not rest and cores > 1 else []
        cmd = [PYTHON, "-m", "pytest", "-q", *workers, *rest]
    elif command == "notebook" and rest[:1] == ["render"]:
        cmd = [PYTHON, "-m", "dcinterp.notebooks", *rest]
    elif command == "notebook":
        cmd = [PYTHON, "-m", "dcinterp.notebooks", "run", *rest]
    elif command == "docs":  # mkdocs from the venv (it is not on the PATH): `serve` unless told otherwise
        cmd = [PYTHON, "-m", "mkdocs", *(rest or ["serve"])]
    else:
        cmd = [PYTHON, *rest]
    return subprocess.run([str(c) for c in cmd], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
