"""The names the notebooks import from here; the `circuit` command lives in `dcinterp.synth.commands.circuit`."""

from .commands.circuit import discover, figures

__all__ = ["discover", "figures"]
