"""Training layout -> rollout layout weight transfer (data-parallel FSDP2 shards -> full rollout weights).

Every rank all-gathers each parameter's shards in the same order (a collective) and copies the result
into its rollout model, one parameter at a time, so the transient cost is one full parameter. Tensor-
parallel inference layouts and offloading of training state build on this in `reshard/`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def copy_full_weights(train_model: nn.Module, rollout_model: nn.Module) -> int:
    """Gather every (possibly sharded) training parameter into `rollout_model`; returns bytes copied."""
    targets = dict(rollout_model.named_parameters())
    copied = 0
    for name, param in train_model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        target = targets[name]
        target.copy_(full.to(target.device, target.dtype))
        copied += target.numel() * target.element_size()
    return copied
