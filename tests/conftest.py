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
    without hypothesis, as .ci/run's for the SAELens test, runs the tests that need none.)"""
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
