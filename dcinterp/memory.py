"""Memory: what a `run_with_cache` will hold, before it runs, and the guard that refuses an oversized one.

    from dcinterp import estimate_cache
    estimate_cache(model, tokens)                                          # every hook (docs/loading.md)
    estimate_cache(model, tokens, lambda name: name.startswith("blocks.16.attn"))

The estimate comes from the config and the input's shape alone (nothing runs); a test checks it against real
caches byte for byte. `PeakAnonMemory` samples a process's anonymous memory (what loading and caching allocate,
not the page cache of memory-mapped files), for the benchmarks and the loading tests.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .devices import free_memory  # noqa: F401 (re-exported: check_cache_fits and users read it here)
from .loading import module_device

GiB = 2**30

# Hooks whose tensors are [batch, pos, d_model].
_RESIDUAL = (
    "hook_embed",
    "hook_resid_pre",
    "hook_resid_mid",
    "hook_resid_post",
    "hook_attn_out",
    "hook_mlp_out",
    "hook_normalized",
)
_PER_HEAD = ("hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_rot_k", "hook_z")
_ATTENTION = ("hook_attn_scores", "hook_composed_scores", "hook_pattern", "hook_composed_pattern")
_BRANCH_OF = {
    "hook_qw1": "qp",
    "hook_qw2": "qp",
    "hook_kw1": "kp",
    "hook_kw2": "kp",
    "hook_qg": "qg",
    "hook_kg": "kg",
    "hook_o_qp": "qp",
    "hook_o_kp": "kp",
    "hook_o_qg": "qg",
    "hook_o_kg": "kg",
}


@dataclass
class CacheEstimate:
    """What a cache of the selected hooks holds: bytes per hook name, and the device each one lives on.

    Attributes:
        nbytes_by_hook: bytes, by hook name.
        device_by_hook: the device each hook's tensor lives on, by hook name.
    """

    nbytes_by_hook: dict[str, int] = field(default_factory=dict)
    device_by_hook: dict[str, str] = field(default_factory=dict)

    @property
    def n_tensors(self) -> int:
        return len(self.nbytes_by_hook)

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_by_hook.values())

    def nbytes_by_device(self) -> dict[str, int]:
        """The estimate's bytes summed by device."""
        totals: dict[str, int] = {}
        for name, nbytes in self.nbytes_by_hook.items():
            totals[self.device_by_hook[name]] = totals.get(self.device_by_hook[name], 0) + nbytes
        return totals

    def __repr__(self) -> str:
        return f"CacheEstimate({self.n_tensors} tensors, {self.nbytes / GiB:.2f} GiB)"


def hook_shape(model, name: str, batch: int, pos: int, past: int = 0) -> tuple[tuple[int, ...], torch.dtype] | None:
    """Shape and dtype of what a hook sees for a [batch, pos] input after `past` cached positions.

    Args:
        model: the model.
        name: the hook's name.
        batch: prompts.
        pos: new positions.
        past: positions in a `past_kv_cache`: attention-sized hooks have past + pos keys.

    Returns:
        (shape, dtype), or None for a hook that does not fire.
    """
    cfg = model.cfg
    dtype = cfg.torch_dtype
    suffix = name.rsplit(".", 1)[-1]
    H, E, D, R = cfg.n_heads, cfg.d_head, cfg.d_model, cfg.dcmha_rank
    if suffix in _RESIDUAL:
        return (batch, pos, D), dtype
    if suffix == "hook_scale":
        return (batch, pos, 1), torch.float32
    if suffix == "hook_inv_scale":  # the QK-norm's, per head
        return (batch, pos, H, 1), torch.float32
    if suffix in ("hook_pre", "hook_post", "hook_pre_linear"):
        return (batch, pos, cfg.d_mlp), dtype
    if suffix == "hook_mgate":
        return (batch, pos, cfg.mgate_dim), dtype
    if suffix in _PER_HEAD:
        return (batch, pos, H, E), dtype
    if suffix in ("hook_q_input", "hook_k_input", "hook_v_input"):
        return ((batch, pos, H, D), dtype) if cfg.use_split_qkv_input else None
    if suffix == "hook_attn_in":
        return ((batch, pos, H, D), dtype) if cfg.use_attn_in else None
    if suffix == "hook_mlp_in":
        return ((batch, pos, D), dtype) if cfg.use_hook_mlp_in else None
    if suffix == "hook_result":
        return ((batch, pos, H, D), dtype) if cfg.use_attn_result else None
    if suffix in _ATTENTION:
        return (batch, H, pos, past + pos), dtype
    if suffix in _BRANCH_OF:
        if _BRANCH_OF[suffix] not in cfg.active_branches:
            return None
        if suffix.startswith("hook_o_"):
            return (batch, H, pos, past + pos), dtype
        return ((batch, pos, R, H) if suffix[-1] in "12" else (batch, pos, H)), dtype
    raise KeyError(f"{name}: no shape rule for this hook (dcinterp.memory.hook_shape)")


def selected_hooks(model, names_filter) -> list[str]:
    """Hook names as TransformerLens' `run_with_cache` selects them.

    Args:
        model: the model.
        names_filter: None (all), a name, a list of names or a callable on a name.

    Returns:
        The selected hook names.
    """
    names = list(model.hook_dict)
    if names_filter is None:
        return names
    if isinstance(names_filter, str):
        return [n for n in names if n == names_filter]
    if isinstance(names_filter, (list, tuple, set)):
        return [n for n in names if n in names_filter]
    return [n for n in names if names_filter(n)]


def estimate_cache(
    model, tokens, names_filter=None, incl_bwd: bool = False, device=None, past_kv_cache=None
) -> CacheEstimate:
    """What `model.run_with_cache(tokens, names_filter=..., past_kv_cache=...)` would hold, from shapes alone.

    Args:
        model: the model.
        tokens: a [batch, pos] tensor, a string or list of strings (tokenized), or a (batch, pos) tuple.
        names_filter: as `run_with_cache`'s.
        incl_bwd: count each hook twice, for its gradient.
        device: where the cache is moved to (None: where each hook runs).
        past_kv_cache: its positions are added to the keys of the attention-sized hooks.

    Returns:
        Bytes and device per hook.
    """
    if isinstance(tokens, tuple):
        batch, pos = tokens
    else:
        if isinstance(tokens, str) or (isinstance(tokens, list) and tokens and isinstance(tokens[0], str)):
            tokens = model.to_tokens(tokens)
        tokens = torch.as_tensor(tokens)
        batch, pos = tokens.shape if tokens.ndim == 2 else (1, tokens.shape[-1])
    past = 0 if past_kv_cache is None else past_kv_cache.n_tokens
    estimate = CacheEstimate()
    for name in selected_hooks(model, names_filter):
        shape_dtype = hook_shape(model, name, batch, pos, past)
        if shape_dtype is None:
            continue
        shape, dtype = shape_dtype
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        estimate.nbytes_by_hook[name] = nbytes * (2 if incl_bwd else 1)
        estimate.device_by_hook[name] = str(device) if device is not None else hook_device(model, name)
    return estimate


def hook_device(model, name: str) -> str:
    """Where a hook's activations live: its module's execution device on a dispatched model, else the model's.

    Args:
        model: the model.
        name: the hook's name.

    Returns:
        The device's name.
    """
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        device = module_device(device_map, name)
        if isinstance(device, int):
            return f"cuda:{device}"
        if device not in (None, "cpu", "disk"):
            return str(device)
        return str(model.cfg.device or "cpu")
    return str(model.input_device)


class CacheTooLarge(MemoryError):
    """A `run_with_cache` that would not fit; the message gives the estimate and how to cache less."""


def check_cache_fits(model, estimate: CacheEstimate, fraction: float) -> None:
    """Refuse a cache above `fraction` of the free memory of any device it lands on.

    Args:
        model: the model.
        estimate: from `estimate_cache`.
        fraction: the share of free memory a cache may take.

    Raises:
        CacheTooLarge: one line with the estimate and how to cache less.
    """
    for device, nbytes in estimate.nbytes_by_device().items():
        free = free_memory(device)
        if nbytes > fraction * free:
            raise CacheTooLarge(
                f"run_with_cache would hold {nbytes / GiB:.2f} GiB in {estimate.n_tensors} tensors on {device}, more "
                f"than {fraction:.0%} of its {free / GiB:.1f} GiB free; cache fewer hooks with names_filter (e.g. "
                f"names_filter=lambda name: name.startswith('blocks.0.attn')), or pass allow_large_cache=True "
                f"(dcinterp.estimate_cache(model, tokens, names_filter) gives the estimate)"
            )


class PeakAnonMemory:
    """Samples this process's anonymous resident memory (RssAnon in /proc/self/status) in a background thread.

        with PeakAnonMemory() as memory:
            model = HookedDCFormer.from_pretrained(...)
        memory.peak, memory.baseline  # bytes

    Args:
        interval: seconds between samples.
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.baseline = self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def current() -> int:
        """This process's anonymous resident memory now, in bytes.

        Raises:
            RuntimeError: no RssAnon in /proc/self/status (Linux only).
        """
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("/proc/self/status has no RssAnon (Linux only)")

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakAnonMemory":
        self.baseline = self.peak = self.current()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def measure_load(checkpoint, dtype=None, device=None, device_map=None, *, model_class) -> dict:
    """Load a checkpoint in this process and report its peak anonymous memory against the weights' size.

    Args:
        checkpoint: a checkpoint directory or embedded model.
        dtype: as `from_pretrained`.
        device: as `from_pretrained`.
        device_map: as `from_pretrained`.
        model_class: the class whose `from_pretrained` loads it (the command line passes HookedDCFormer).

    Returns:
        seconds, weights_bytes, baseline_anon_bytes, peak_anon_bytes and peak_over_weights (the peak above the
        baseline over the weights' bytes).
    """
    start = time.perf_counter()
    with PeakAnonMemory() as memory:
        model = model_class.from_pretrained(checkpoint, dtype=dtype, device=device, device_map=device_map)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "seconds": time.perf_counter() - start,
        "weights_bytes": weights,
        "baseline_anon_bytes": memory.baseline,
        "peak_anon_bytes": memory.peak,
        "peak_over_weights": (memory.peak - memory.baseline) / weights,
    }


if __name__ == "__main__":  # python -m dcinterp.memory CHECKPOINT [DTYPE [DEVICE]]: one load, measured, as JSON
    import json
    import sys

    from dcinterp.model import HookedDCFormer

    print(json.dumps(measure_load(*sys.argv[1:4], model_class=HookedDCFormer)))
