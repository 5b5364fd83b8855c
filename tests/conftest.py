import os
import random

import numpy as np
import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # notebook kernels too (they inherit it): see below

# The tests run tiny models: one thread is fastest for their tensors, and far faster than two when the
# machine's cores are busy with anything else.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fixed_random_state():
    """Every test starts from the same random state, whatever ran before it (or was deselected): a draw from the
    global generators (torch.randn, a model's random init, numpy, `random`) gives the same numbers in every run and in
    any order. Fixtures shared by a module or the session seed their own draws (torch.manual_seed, a Generator);
    hypothesis' draws are fixed by @seed."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
