"""A model directory or checkpoint root loaded for inference in this process: `dockrl eval`, `dockrl serve`.

The path is resolved as `checkpoint.directory.resolve_lora` does: a Hugging Face model directory, a checkpoint
root (its hf/ export), or a LoRA checkpoint root (its base, with the adapters of its adapter/ merged in).
"""

from __future__ import annotations

import torch

from dockrl.checkpoint.directory import resolve_lora
from dockrl.models.config import ModelArgs
from dockrl.models.decoder import Transformer
from dockrl.models.hf import load_model
from dockrl.models.lora import load_peft, merge_lora
from dockrl.models.tokenizer import Tokenizer
from dockrl.models.vision import VisionInputs


def vision_inputs(path: str, args: ModelArgs) -> VisionInputs | None:
    """A vision model's inputs (its image processor beside the weights `path` resolves to), None for text."""
    if args.vision is None:
        return None
    return VisionInputs.for_model(resolve_lora(path)[0], args)


def load_for_inference(path: str, *, device: str) -> tuple[Transformer, Tokenizer]:
    """(model in eval mode, its tokenizer) of `path` (module docstring): fp32 on a CPU, bf16 on an accelerator;
    a LoRA checkpoint's adapters are merged, so the model is a plain Transformer."""
    model_path, adapter = resolve_lora(path)
    tokenizer = Tokenizer.from_dir(model_path)
    model = load_model(model_path, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    if adapter is not None:
        load_peft(model, adapter)
        merge_lora(model)
    return model.eval(), tokenizer
