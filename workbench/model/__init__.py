"""The Llama-family model: layers, attention over the paged cache, the transformer, HF checkpoint load/save."""

from workbench.model.checkpoint import load_checkpoint, load_model, save_random_checkpoint
from workbench.model.transformer import Transformer

__all__ = ["Transformer", "load_checkpoint", "load_model", "save_random_checkpoint"]
