"""`dockrl export CHECKPOINT OUT`: a Hugging Face model directory from a training checkpoint.

    CHECKPOINT  a checkpoint root RUN_DIR/checkpoints/step_NNNNNN (its policy's hf/ export) or a model directory
    OUT         config.json (recording the dtype written), model.safetensors (sharded past --max-shard-gb, with
                its index), generation_config.json and the tokenizer files: what transformers' from_pretrained
                and vLLM load

Tensors are streamed one at a time (CheckpointReader -> HFWriter), each cast to --dtype (default: the dtype the
checkpoint holds), so exporting never holds more than one tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dockrl.checkpoint.directory import resolve_model_path
from dockrl.models.hf import CONFIG_FILE, CheckpointReader, HFWriter, read_config

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, *, dtype: str | None = None, max_shard_gb: float = 2.0
) -> dict[str, Any]:
    """Write the Hugging Face directory `out` from `checkpoint`; returns what was written."""
    source = Path(resolve_model_path(str(checkpoint)))
    if not (source / CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"{checkpoint} holds no model: expected a checkpoint root (RUN_DIR/checkpoints/step_NNNNNN) or a "
            f"Hugging Face model directory with {CONFIG_FILE}"
        )
    out = Path(out)
    if out.exists() and out.resolve() == source.resolve():
        raise ValueError(f"{out} is the checkpoint's own model directory; export to another directory")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    reader = CheckpointReader(source)
    args = read_config(source)
    target = DTYPES[dtype] if dtype is not None else None

    def written_dtype(name: str) -> torch.dtype:
        stored = reader.dtypes[name]
        return target if target is not None and stored.is_floating_point else stored

    names = reader.names()
    specs = {name: (reader.shapes[name], written_dtype(name)) for name in names}
    writer = HFWriter(out, args, specs, max_shard_bytes=int(max_shard_gb * 2**30))
    for name in names:
        writer.write(name, reader.read(name).to(written_dtype(name)).contiguous())
    floating = target if target is not None else reader.floating_dtype()
    writer.finish(floating, tokenizer_dir=source)
    return {
        "source": str(source),
        "out": str(out),
        "dtype": str(floating).removeprefix("torch."),
        "tensors": len(names),
        "params": sum(int(torch.Size(reader.shapes[n]).numel()) for n in names),
    }
