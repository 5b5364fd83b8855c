"""dcinterp: an interpretability toolkit for DCFormer (Dynamically Composable Multi-Head Attention)."""

from .config import DCFormerConfig
from .loading import CheckpointError, embedded_models
from .memory import CacheTooLarge, estimate_cache
from .model import HookedDCFormer

__all__ = ["DCFormerConfig", "HookedDCFormer", "CheckpointError", "embedded_models", "estimate_cache", "CacheTooLarge"]
