"""Generation engine: the native batched KV-cache sampler (an optional vLLM backend may sit beside it)."""

from dockrl.workers.rollout.sampler import Generation, SamplingParams, generate

__all__ = ["Generation", "SamplingParams", "generate"]
