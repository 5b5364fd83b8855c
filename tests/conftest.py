import os

import torch

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # notebook kernels too (they inherit it): see below

# The tests run tiny models: one thread is fastest for their tensors, and far faster than two when the
# machine's cores are busy with anything else.
torch.set_num_threads(1)
