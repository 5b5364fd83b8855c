"""What the Triton kernels of dcmha share on the host: whether they can run, their jitting at first use, their grids.

Triton decides when a function is jitted whether it runs natively or under its CPU interpreter (`TRITON_INTERPRET=1`),
and it jits its own functions (tl.sum and the like) when triton is imported: the variable must be set before that.
So the kernels are written as plain functions and jitted by `LateJit` at their first call, not when dcinterp is
imported, and `available` says where the two disagree.

Triton's own `triton.cdiv` and `triton.next_power_of_2` are constexpr functions, slow on the host at a dozen calls a
layer, so the launches take `cdiv` and `next_power_of_2` here; a layer's argument checks are made once a signature
(`checked_once`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:  # dcinterp runs without triton (or an old one): `available` says why the kernels cannot
    triton = tl = None
    TRITON_UNUSABLE: str | None = f"triton is not installed ({error})"
else:
    TRITON_UNUSABLE = None
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 6):
        TRITON_UNUSABLE = f"the fused kernels need Triton 3.6 or newer (found {triton.__version__})"

T = TypeVar("T")

_jitted_interpreted: bool | None = None  # how the first kernels were jitted: under the interpreter or not


class LateJit:
    """Jits a module's kernels, written as plain functions, at their first call.

    Args:
        namespace: the module's globals, where each kernel's name is rebound to its jitted function.
        names: the kernels and the inner functions they call.
        uses: the `LateJit`s of the modules whose functions these kernels import and call: jitted first, and each
            function imported from them rebound here to its jitted one (Triton calls only jitted functions, and
            looks a name up in the calling function's own module).

    The namespace's `_INTERPRETED` is set to a `tl.constexpr` of whether they run under the interpreter: the kernels
    read it where the interpreter computes otherwise than a card.
    """

    def __init__(self, namespace: dict, names: Iterable[str], uses: Iterable[LateJit] = ()):
        self.namespace, self.names, self.uses, self.done = namespace, tuple(names), tuple(uses), False
        self.plain = {name: namespace[name] for name in self.names}  # the functions as written, before jitting
        namespace.setdefault("_INTERPRETED", False)

    def __call__(self) -> None:
        """Jit the kernels, once: natively, or under the interpreter where TRITON_INTERPRET=1 now."""
        global _jitted_interpreted
        if self.done:
            return
        for used in self.uses:
            used()
        interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        self.namespace["_INTERPRETED"] = tl.constexpr(interpreted)
        for name in self.names:
            self.namespace[name] = triton.jit(self.namespace[name])
        for used in self.uses:
            for name, plain in used.plain.items():
                if self.namespace.get(name) is plain:
                    self.namespace[name] = used.namespace[name]
        self.done = True
        if _jitted_interpreted is None:
            _jitted_interpreted = interpreted


def available(device: torch.device) -> str | None:
    """Whether the Triton kernels can run on a device.

    Args:
        device: CUDA, or a CPU where TRITON_INTERPRET=1 was set before triton was imported.

    Returns:
        None where they can, else the reason in one line.
    """
    device = torch.device(device)
    if TRITON_UNUSABLE is not None:
        return TRITON_UNUSABLE
    interpreted = kernels_interpreted()
    if interpreted and not triton_interpreted():
        return (
            "TRITON_INTERPRET=1 was set after triton was imported (Triton's own functions were built for a GPU "
            "then): set it before the first import of triton, or of anything that imports it"
        )
    if not interpreted and triton_interpreted():
        return "TRITON_INTERPRET=1 was unset after triton was imported under it: unset it before the first import"
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available"
    if device.type == "cpu":
        if not interpreted:
            return "the Triton kernels run on a CPU only under TRITON_INTERPRET=1 (set before triton is imported)"
        return None
    return f"the Triton kernels do not run on {device.type}"


def kernels_interpreted() -> bool:
    """Whether the kernels run, or once jitted would run, under Triton's interpreter.

    Returns:
        How the first kernels were jitted; before any was, what TRITON_INTERPRET says now.
    """
    if _jitted_interpreted is not None:
        return _jitted_interpreted
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_interpreted() -> bool:
    """Whether Triton's own functions (tl.sum, tl.max, ...), jitted when triton was imported, run under its interpreter.

    Returns:
        Whether TRITON_INTERPRET was 1 when triton was imported. The kernels calling them must run the same way.
    """
    interpreter = sys.modules.get("triton.runtime.interpreter")  # never imported by a native run
    return interpreter is not None and isinstance(tl.sum, interpreter.InterpretedFunction)


def cdiv(n: int, d: int) -> int:
    """n / d rounded up.

    Args:
        n: the numerator.
        d: the denominator, positive.

    Returns:
        The quotient, rounded up.
    """
    return -(-n // d)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least n.

    Args:
        n: at least 1.

    Returns:
        The power of two.
    """
    return 1 << (n - 1).bit_length()


def signature(*tensors) -> tuple:
    """What a launch's checks and settings depend on.

    Args:
        *tensors: tensors, or None.

    Returns:
        Each tensor's shape, dtype and device (None for None).
    """
    return tuple(None if x is None else (x.shape, x.dtype, x.device) for x in tensors)


def checked_once(seen: dict, key: tuple, check: Callable[[], T]) -> T:
    """What `check()` gives for arguments of this key, calling it only the first time the key is seen.

    A layer called again with the same shapes, as every layer of a forward is, skips its checks. Arguments that fail
    raise every time (their key is not kept); the 256 latest keys are.

    Args:
        seen: the keys seen, and what `check` gave for each.
        key: the arguments' `signature` and options.
        check: checks the arguments, and gives what the launch needs of them.

    Returns:
        What `check` gave.
    """
    if key not in seen:
        value = check()
        if len(seen) >= 256:
            seen.clear()
        seen[key] = value
    return seen[key]
