"""Decoder model code (llama / qwen2 / qwen3) shared by training, resharding and the rollout sampler."""

from dockrl.models.config import ModelArgs
from dockrl.models.decoder import KVCache, Transformer

__all__ = ["KVCache", "ModelArgs", "Transformer"]
