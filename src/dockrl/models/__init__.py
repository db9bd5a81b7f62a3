"""Decoder model code (families: models/families/) shared by training, resharding and the rollout sampler.

The package itself imports nothing heavy: `dockrl.models.tokenizer` and `dockrl.models.config` are read by
the driver before any worker starts, and must not pay for torch (KVCache and Transformer load it on first use).
"""

from dockrl.models.config import ModelArgs

_TORCH_EXPORTS = {"KVCache": "dockrl.models.kv_cache", "Transformer": "dockrl.models.decoder"}


def __getattr__(name: str):
    if name in _TORCH_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_TORCH_EXPORTS[name]), name)
    raise AttributeError(f"module 'dockrl.models' has no attribute {name!r}")


__all__ = ["KVCache", "ModelArgs", "Transformer"]
