"""dcinterp: an interpretability toolkit for DCFormer (Dynamically Composable Multi-Head Attention)."""

from .config import DCFormerConfig
from .loading import CheckpointError, embedded_models
from .model import HookedDCFormer, get_act_name

__all__ = ["DCFormerConfig", "HookedDCFormer", "CheckpointError", "embedded_models", "get_act_name"]
