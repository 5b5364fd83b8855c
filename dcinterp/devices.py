"""Which torch devices this machine has, checked before any work: `check_device("cuda")` on a CPU-only build is one
clear line (a ValueError naming the device and the available ones), not a traceback from deep inside a forward.

torch is imported when a device is checked, not when this module is, so command lines can import it while parsing
their arguments.
"""

from __future__ import annotations


def available_devices() -> list[str]:
    """The devices torch can use here: "cpu", then "cuda:0".., "mps", "xpu:0".. where present."""
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        devices.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        devices += [f"xpu:{i}" for i in range(xpu.device_count())]
    return devices


def default_device() -> str:
    """ "cuda" where a GPU is available, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(name: str | None) -> str:
    """`name` if torch can use it on this machine (None: `default_device()`); otherwise ValueError, one line.

    "cuda" means "cuda:0" (any GPU present), "cuda:1" needs a second GPU, and so on.
    """
    import torch

    if name is None:
        return default_device()
    available = available_devices()
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {name!r} is not a torch device; available: {', '.join(available)}") from None
    index = 0 if device.index is None else device.index
    wanted = device.type if device.type in ("cpu", "mps") else f"{device.type}:{index}"
    if wanted not in available:
        build = f"torch {torch.__version__}" + (
            " has no CUDA support" if device.type == "cuda" and torch.version.cuda is None else ""
        )
        raise ValueError(
            f"device {name!r} is not available on this machine ({build}); available: {', '.join(available)}"
        )
    return name


def free_memory(device) -> int:
    """Bytes free on a device.

    For a GPU, what its driver has free (`torch.cuda.mem_get_info`) and what torch's caching allocator holds unused
    (reserved, not allocated: freed tensors it keeps for the next), within the process's cap where
    `torch.cuda.set_per_process_memory_fraction` set one; for the CPU, the OS's available memory.

    Args:
        device: a torch device, or its name.

    Returns:
        The bytes.
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        driver_free, total = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats_as_nested_dict(device)  # {} before torch's first allocation there
        reserved, allocated = (
            stats[key]["all"]["current"] if stats else 0 for key in ("reserved_bytes", "allocated_bytes")
        )
        free = driver_free + reserved - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # not in every torch
        return free if fraction is None else min(free, int(fraction(device) * total) - allocated)
    import psutil

    return psutil.virtual_memory().available
