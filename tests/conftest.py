import atexit
import os
import random
import shutil
import tempfile

import numpy as np
import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # notebook kernels too (they inherit it): see below
# Without CUDA the Triton kernels run under Triton's interpreter. Triton reads the variable as it is imported (its own
# tl.sum, tl.max, ... are built then), so it is set here, before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests run tiny models: one thread is fastest for their tensors, and far faster than two when the
# machine's cores are busy with anything else.
torch.set_num_threads(1)


def _hypothesis_without_files() -> None:
    """No examples database (hypothesis' draws are fixed by @seed, and a run never replays another run's failures),
    and what hypothesis still writes (its cache of the code's constants, as the test modules are imported) goes to a
    temporary folder, not to .hypothesis/ in the working directory: tests/test_docs.py checks that nothing appears
    in the repository while the docs build, and another worker's tests may be running then. (An environment
    without hypothesis, as .ci/run's for the SAELens and circuit-tracer tests, runs the tests that need none.)"""
    try:
        from hypothesis import settings
        from hypothesis.configuration import set_hypothesis_home_dir
    except ImportError:
        return
    settings.register_profile("dcinterp", database=None)
    settings.load_profile("dcinterp")
    home = tempfile.mkdtemp(prefix="dcinterp-hypothesis-")
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    set_hypothesis_home_dir(home)


_hypothesis_without_files()


@pytest.fixture(autouse=True)
def fixed_random_state():
    """Every test starts from the same random state, whatever ran before it (or was deselected): a draw from the
    global generators (torch.randn, a model's random init, numpy, `random`) gives the same numbers in every run and in
    any order. Fixtures shared by a module or the session seed their own draws (torch.manual_seed, a Generator);
    hypothesis' draws are fixed by @seed."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


# Under `python3 dev.py test` (pytest-xdist, --dist loadfile) each test file runs whole on one worker, its module
# fixtures built once, but for these: their tests run Triton's kernels under the interpreter, up to minutes each, and
# share no costly fixture, so they spread over the workers test by test (a file of them would pin one worker).
SPREAD_OVER_WORKERS = {
    "tests/test_dcmha_dispatch.py",
    "tests/test_triton_dcmha.py",
    "tests/test_triton_decoding.py",
    "tests/test_triton_dynamic_weights.py",
}


@pytest.hookimpl(optionalhook=True)  # an environment without pytest-xdist has no such hook
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile's scheduler, each test of SPREAD_OVER_WORKERS a unit of work of its own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SpreadingTheTritonFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return nodeid if path in SPREAD_OVER_WORKERS else path

    return SpreadingTheTritonFiles(config, log)
