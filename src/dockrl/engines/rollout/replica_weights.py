"""The weights of one separate rollout replica (`rollout.placement=separate`) and the versions it holds.

    trainer rank 0 ── broadcast_bucket, bucket by bucket ──▶ receive(v): into the live buffers, or a staged copy
    generate(step, v) ──▶ take(v): staged copy of v into the live buffers (waits for it to arrive) ──▶ finish()

The model's parameters are views of flat buffers laid out like the trainer's buckets (planned from the same
model config and `reshard.bucket_mb`), so a sync is one gloo broadcast per bucket straight into them: no state
dict. What is sent depends on the run:

- full fine-tuning: every weight, in the rollout dtype. The replica builds its model on the meta device and
  every parameter is a view of a bucket buffer.
- LoRA (actor.lora): the adapters only, fp32 (r x (in + out) per adapted layer: bytes proportional to the
  rank). The replica reads the frozen base from model.path once, wraps the target layers as the trainer does
  (models.lora.apply_lora), and only the adapter factors are views of the buffers; it generates with the
  adapters unmerged (x W^T + s (x A^T) B^T, the trainer's own forward), so switching versions copies adapters,
  never a weight.

Versions: with rollout.max_staleness <= 1 and full weights a replica is idle whenever weights arrive, so they go
straight into the live buffers; with k >= 2 the next version arrives while an earlier step still generates, so
it lands in a staged copy and `take(v)` copies version v in when its step starts: which weights generate a step
is fixed by its step number, never by arrival time. Adapters are always staged (they are small): up to k + 1
adapter versions are alive, the live one and one per step in flight.

Threads: `receive` runs on the replica's weights thread, `take` / `finish` on its generating thread; one
condition guards the version bookkeeping. Pure torch: the Ray actor is workers.rollout.RolloutWorker.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from dockrl.engines.reshard.switch import (
    adapter_buckets,
    broadcast_bucket,
    full_model_buckets,
    set_param,
)
from dockrl.models.config import ModelArgs
from dockrl.models.decoder import Transformer
from dockrl.models.hf import load_model
from dockrl.models.lora import LoraSpec, apply_lora


class ReplicaWeights:
    """A rollout replica's model and the weight versions it holds (see the module docstring)."""

    def __init__(
        self,
        args: ModelArgs,
        model_path: str,
        *,
        dtype: torch.dtype,
        device: torch.device,
        bucket_bytes: int | None,
        lora: LoraSpec | None,
        lead: int,
        name: str = "rollout",
    ):
        self.name, self.lora = name, lora
        with torch.device("meta"):
            model = Transformer(args)
        self.buckets, resolved_bytes = full_model_buckets(model, bucket_bytes, dtype)
        buffer_dtype = dtype
        if lora is not None:  # the frozen base once, from disk; the adapters come with every version
            model = load_model(model_path, device=device, dtype=dtype)
            apply_lora(model, lora)
            self.buckets = adapter_buckets(args, lora, resolved_bytes)
            buffer_dtype = torch.float32
        self.buffers = [torch.empty(b.numel, dtype=buffer_dtype, device=device) for b in self.buckets]
        for bucket, buffer in zip(self.buckets, self.buffers):
            for spec in bucket.specs:
                set_param(model, spec.name, buffer[spec.offset : spec.offset + spec.numel].view(spec.shape))
        self.model = model.requires_grad_(False).eval()
        self.staging = lora is not None or lead >= 2
        self.lead = lead
        self.version = -1  # updates behind the weights in the live buffers; -1: none received yet
        self.staged: dict[int, list[torch.Tensor]] = {}  # version -> received copy not yet taken
        self.spare: list[list[torch.Tensor]] = []  # staged copies already taken, reused
        self.arrived = threading.Condition()
        self.generating = False

    @property
    def bytes_per_version(self) -> int:
        """Bytes one sync sends (and one staged version holds)."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def versions_alive(self) -> int:
        """Weight versions held now: the live one and the staged ones."""
        with self.arrived:
            return (self.version >= 0) + len(self.staged)

    def receive(self, version: int, group: dist.ProcessGroup) -> int:
        """Receive the trainer's weights after `version` updates from rank 0 of `group`, bucket by bucket;
        returns the bytes received."""
        with self.arrived:
            if not self.staging and self.generating:
                raise RuntimeError(
                    f"{self.name}: weights of version {version} arrived while a step generates, with the rollout "
                    f"{self.lead} steps ahead (the recipe syncs between steps then)"
                )
            target = self.buffers
            if self.staging:
                target = self.spare.pop() if self.spare else [torch.empty_like(b) for b in self.buffers]
        for buffer in target:
            broadcast_bucket(group, buffer)
        with self.arrived:
            if self.staging:
                self.staged[version] = target
            else:
                self.version = version
            self.arrived.notify_all()
        return sum(b.numel() * b.element_size() for b in target)

    def take(self, version: int, timeout_s: float) -> None:
        """Make the weights of `version` the model's (waiting up to `timeout_s` for them to arrive), recycle
        staged copies of older versions, and mark the replica generating until `finish`."""
        with self.arrived:
            if not self.arrived.wait_for(
                lambda: self.version == version or version in self.staged, timeout=timeout_s
            ):
                raise RuntimeError(
                    f"{self.name}: the weights of version {version} did not arrive within {timeout_s:.0f} s "
                    f"(run.worker_timeout_s); it holds version {self.version}, staged {sorted(self.staged)}"
                )
            if self.version != version:
                received = self.staged.pop(version)
                for live, new in zip(self.buffers, received):
                    live.copy_(new)
                self.spare.append(received)
                self.version = version
            for old in [v for v in self.staged if v < version]:
                self.spare.append(self.staged.pop(old))
            self.generating = True

    def finish(self) -> None:
        """The step that `take` started is done generating."""
        with self.arrived:
            self.generating = False

    def named_weights(self):
        """The live weights as (HF name, tensor) pairs, one at a time, LoRA adapters merged (W + s B A, one
        layer's merge alive at a time): what a vLLM engine on this replica loads (rollout.backend=vllm)."""
        from dockrl.models.lora import adapter_state, merge_into

        adapters = adapter_state(self.model) if self.lora is not None else {}
        scaling = self.lora.scaling if self.lora is not None else 1.0
        for name, param in self.model.named_parameters():
            if name.endswith((".lora_A", ".lora_B")):
                continue
            yield name, merge_into(name, param.detach(), adapters, scaling)
