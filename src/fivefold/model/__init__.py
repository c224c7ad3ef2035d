"""Plain PyTorch Llama-style decoder; no parallel code lives here."""

from fivefold.model.config import ModelConfig
from fivefold.model.llama import KVCache, Transformer, build_model, materialize
from fivefold.model.presets import PRESETS, get_preset

__all__ = ["ModelConfig", "Transformer", "KVCache", "PRESETS", "get_preset", "build_model", "materialize"]
