"""The names the notebooks import from here; the `ablate` command lives in `dcinterp.synth.commands.ablate`."""

from .commands.ablate import ablation_table, ablations, label

__all__ = ["ablation_table", "ablations", "label"]
