"""dcinterp: an interpretability toolkit for DCFormer (Dynamically Composable Multi-Head Attention).

The names below are imported on first use, so that the command lines (`python -m dcinterp.synth --help`, ...)
start without importing torch or transformer_lens.
"""

from importlib import import_module

_LAZY = {
    "DCFormerConfig": ".config",
    "HookedDCFormer": ".model",
    "CheckpointError": ".loading",
    "embedded_models": ".loading",
    "estimate_cache": ".memory",
    "CacheTooLarge": ".memory",
    "get_act_name": ".model",
    "logit_offset": ".processing",
    "DCFormerKeyValueCache": ".kv_cache",
}

__all__ = [
    "DCFormerConfig",
    "HookedDCFormer",
    "CheckpointError",
    "embedded_models",
    "estimate_cache",
    "CacheTooLarge",
    "get_act_name",
    "logit_offset",
    "DCFormerKeyValueCache",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
