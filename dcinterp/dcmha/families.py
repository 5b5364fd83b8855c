"""Whether a family of Triton kernels can run on a device, and the refusals a card gave, each said once.

Three families: `FUSED` (the attention's forward and backward, `dcinterp.dcmha.maps`), `DYNAMIC_WEIGHTS`
(`dcinterp.dcmha.dynamic_weights`) and `DECODING` (a decoding step's pattern, `dcinterp.dcmha.decoding`). A family
cannot run where Triton is missing or too old, where TRITON_INTERPRET changed after triton was imported, on a device
other than CUDA (or a CPU under the interpreter), or on a device where Triton refused to build one of its kernels at
its first launch (past the card's shared memory or registers). A refusal of the fused kernels holds for the two other
families too. Each reason is warned once per process.

Triton is imported only when a family is first asked about a device, never when dcinterp is imported.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the Triton kernels compute in


def triton_unavailable(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on a device, ignoring any refusal a card gave.

    Args:
        device: the device the tensors are on.

    Returns:
        None where they can run, else the reason in one line.
    """
    try:
        from . import maps
    except ImportError as error:
        return f"the Triton kernels cannot be imported ({error})"
    return maps.available(device)


def compile_refusals() -> tuple[type[Exception], ...]:
    """The errors by which Triton says it cannot build a kernel for the card at hand, as opposed to a bug.

    Returns:
        Triton's OutOfResources and CompilationError; none where Triton is not installed.
    """
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:
        return ()
    return (OutOfResources, CompilationError)


class KernelFamily:
    """Kernels that run together: whether they can run on a device, and what a card refused of them.

    Args:
        kernels: what the kernels are, as a refusal names them ("the fused kernels").
        fallback: what the device's calls take once the kernels cannot run, with `{device}` in it.
        base: a family whose refusal this one shares (the fused kernels' holds for every family).

    Attributes:
        refused: per device, why Triton refused to build one of the kernels for it.
        said: the warnings given, so that each is said once.
    """

    def __init__(self, kernels: str, fallback: str, base: KernelFamily | None = None):
        self.kernels, self.fallback, self.base = kernels, fallback, base
        self.refused: dict[str, str] = {}
        self.said: set[str] = set()

    def unavailable(self, device: torch.device) -> str | None:
        """Why the kernels cannot run on `device`.

        Args:
            device: the device the tensors are on.

        Returns:
            None where they can run, else the reason in one line.
        """
        if str(device) in self.refused:
            return self.refused[str(device)]
        if self.base is not None:
            return self.base.unavailable(device)
        return triton_unavailable(device)

    def warn(self, reason: str, device: torch.device) -> None:
        """Say once per process that the device's calls take the fallback, and why.

        Args:
            reason: why the kernels cannot run.
            device: the device the tensors are on.
        """
        message = f"{self.fallback.format(device=device)}: {reason}"
        if message not in self.said:
            self.said.add(message)
            warnings.warn(message, stacklevel=3)

    def refuse(self, refusal: Exception, device: torch.device) -> None:
        """Remember that Triton refused to build a kernel for the device, and say so once.

        Args:
            refusal: Triton's error, raised at the kernel's first launch.
            device: the device the tensors are on.
        """
        reason = f"Triton cannot build {self.kernels} for it ({str(refusal).splitlines()[0]})"
        self.refused[str(device)] = reason
        self.warn(reason, device)

    def run(self, device: torch.device, kernels: Callable[[], T], fallback: Callable[[], T]) -> T:
        """`kernels()`, or `fallback()` where Triton refuses to build a kernel for the card (remembered, said once).

        Args:
            device: the device the tensors are on.
            kernels: the call by the kernels.
            fallback: the same result by other means.

        Returns:
            What the call returned.
        """
        try:
            return kernels()
        except compile_refusals() as refusal:
            self.refuse(refusal, device)
            return fallback()


FUSED = KernelFamily("the fused kernels", "DCMHA on {device} takes the materialised path")
DYNAMIC_WEIGHTS = KernelFamily(
    "the dynamic weights' kernels", "DCMHA's dynamic weights on {device} take torch's ops", base=FUSED
)
DECODING = KernelFamily("the decoding kernels", "DCMHA's decoding steps on {device} take torch's ops", base=FUSED)
FAMILIES = (FUSED, DYNAMIC_WEIGHTS, DECODING)
