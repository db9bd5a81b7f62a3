"""The training engine: a model sharded with FSDP2 over the data-parallel mesh, its optimizer and schedule.

Shapes: B rows, T tokens, V vocab.

Lifecycle: built once per worker (loads a Hugging Face directory on CPU in fp32, shards it, moves the shards
to the device); then `logprobs` (no grad) and `train_step` (one optimizer step over a list of micro-batches)
as often as the recipe asks. Gradient sync: FSDP2 averages gradients over dp ranks, so a loss that must be a
global mean is scaled by the caller (see `ActorWorker.update`) to sum to the right value.
Without a mesh (`dockrl sft`, tests) the same code runs on one process with autocast for bf16.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dockrl.algos.logprobs import token_entropy, token_logprobs
from dockrl.config.schema import ActorConfig
from dockrl.models.hf import load_model
from dockrl.workers.train.batch import MicroBatch, make_micro_batch, split_indices

LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, float]]]


class TrainEngine:
    """A (possibly sharded) causal LM with AdamW; `trainable=False` builds a frozen reference model."""

    def __init__(
        self,
        model_path: str,
        *,
        device: torch.device | str,
        precision: str,
        mesh: DeviceMesh | None = None,
        optim: ActorConfig | None = None,
        total_optimizer_steps: int = 1,
        trainable: bool = True,
    ):
        self.device = torch.device(device)
        self.precision = precision
        self.mesh = mesh
        model = load_model(model_path, device="cpu", dtype=torch.float32)
        self.args = model.args
        if not trainable:
            model.requires_grad_(False)
        if mesh is not None:
            _shard(model, mesh, precision)
        model.to(self.device)
        self.model = model
        self.optimizer = self.scheduler = None
        if trainable:
            assert optim is not None, "a trainable engine needs optimizer settings"
            self.optim_cfg = optim
            self.optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=optim.lr,
                betas=(optim.adam_beta1, optim.adam_beta2),
                eps=optim.adam_eps,
                weight_decay=optim.weight_decay,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, _lr_lambda(optim.warmup_steps, total_optimizer_steps, optim.min_lr_ratio)
            )

    def autocast(self):
        """bf16 autocast for the unsharded path (FSDP2's mixed-precision policy covers the sharded one)."""
        if self.mesh is None and self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def logits(self, mb: MicroBatch) -> torch.Tensor:
        """Forward pass: logits on the shifted grid [B, T-1, V]."""
        with self.autocast():
            return self.model(mb.input_ids)[:, :-1]

    @torch.no_grad()
    def logprobs(
        self,
        prompts: list[torch.Tensor],
        responses: list[torch.Tensor],
        *,
        temperature: float,
        micro_batch_size: int,
        pad_token_id: int,
        with_entropy: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-row response log-probs [R_i] (and entropies) under softmax(logits / temperature)."""
        self.model.eval()
        logps, ents = [], [] if with_entropy else None
        temp = temperature if temperature > 0 else 1.0
        for idx in split_indices(len(prompts), micro_batch_size):
            mb = make_micro_batch(
                [prompts[i] for i in idx],
                [responses[i] for i in idx],
                pad_token_id=pad_token_id,
                device=self.device,
            )
            logits = self.logits(mb)  # [B, T-1, V]
            logps += mb.unpad(token_logprobs(logits, mb.input_ids[:, 1:], temp))
            if with_entropy:
                ents += mb.unpad(token_entropy(logits, temp))
        return logps, ents

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients over the micro-batches, clip, take one optimizer step; returns summed metrics."""
        assert self.optimizer is not None, "train_step on a frozen engine"
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for mb in micro_batches:
            loss, metrics = loss_fn(self.logits(mb), mb)
            loss.backward()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v
        max_norm = self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        totals["grad_norm"] = grad_norm
        totals["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return totals

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 CPU state dict (a collective: every rank must call it)."""
        out = {}
        for name, tensor in self.model.state_dict().items():
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            out[name] = tensor.detach().to("cpu", torch.float32)
        return out


def _shard(model: torch.nn.Module, mesh: DeviceMesh, precision: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16" else None,
        reduce_dtype=torch.float32,
    )
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def _lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
