"""Qwen2.5-VL's vision side in torch: the dock's uint8 patches -> pixel values -> image embeddings.

    uint8 patches [P, C*t*p*p] --normalize_patches--> pixel values (fp32, the processor's pixel_values)
        --patch embed (Conv3d with stride = kernel, i.e. one linear)--> [P, E]
        --reorder by window (merge units grouped per window_size x window_size window)-->
        --blocks: RMSNorm, attention with 2-D rotary (h, w), RMSNorm, SwiGLU MLP; attention within a window,
          or within the whole image at fullatt_block_indexes-->
        --merger: RMSNorm, fold each merge x merge unit into one vector, MLP (GELU) to the LM's hidden size-->
        --undo the window order--> image embeddings [P / merge**2, H], one per <|image_pad|> token

Parameter names equal transformers' `model.visual.*` (without the `model.visual.` prefix), so state dicts map
1:1. Shape letters: P patches (all images of a row, concatenated), E vision hidden size, H the language
model's hidden size, U merge units (P / merge**2), D vision head dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from dockrl.models.vision_processing import ProcessorConfig, processor_config


def normalize_patches(patches: torch.Tensor, config: ProcessorConfig | str | Path | Mapping) -> torch.Tensor:
    """uint8 patches [P, 3*t*p*p] (vision_processing.process_images) -> fp32 pixel values [P, 3*t*p*p], equal
    bit for bit to transformers' processor: x * rescale_factor in float64 rounded to fp32 (its rescale), then
    (x - mean) / std per channel in fp32 (its normalize); each patch is channel-major."""
    config = config if isinstance(config, ProcessorConfig) else processor_config(config)
    num_patches = patches.shape[0]
    if config.do_rescale:
        pixels = (patches.to(torch.float64) * config.rescale_factor).to(torch.float32)
    else:
        pixels = patches.to(torch.float32)
    if config.do_normalize:
        mean = torch.tensor(config.image_mean, dtype=torch.float32, device=patches.device)[:, None]
        std = torch.tensor(config.image_std, dtype=torch.float32, device=patches.device)[:, None]
        pixels = (pixels.view(num_patches, 3, -1) - mean) / std
    return pixels.reshape(num_patches, config.patch_dim)
