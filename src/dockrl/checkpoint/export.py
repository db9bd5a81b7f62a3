"""`dockrl export CHECKPOINT OUT`: a Hugging Face model directory, or a PEFT adapter directory, from a checkpoint.

    CHECKPOINT  a checkpoint root RUN_DIR/checkpoints/step_NNNNNN (its policy's hf/ export, or under LoRA its
                adapter/ and the base it names), a model directory, or a PEFT adapter directory
    OUT         a model: config.json (recording the dtype written), model.safetensors (sharded past
                --max-shard-gb, with its index), generation_config.json and the tokenizer files: what
                transformers' from_pretrained and vLLM load. LoRA without --merge: a PEFT adapter directory
                (adapter_config.json naming the base, adapter_model.safetensors): what
                peft.PeftModel.from_pretrained loads onto the base. LoRA with --merge: the model with every
                adapter folded in (W + (alpha/r) B A, accumulated in fp32, then cast).

Tensors are streamed one at a time (CheckpointReader -> HFWriter), each cast to --dtype (default: the dtype the
checkpoint holds), so exporting never holds more than one tensor of the model (plus the adapters, which are
small).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dockrl.checkpoint.directory import adapter_base, lora_adapter_dir, resolve_model_path
from dockrl.models.hf import CONFIG_FILE, CheckpointReader, HFWriter, read_config
from dockrl.models.lora import (
    ADAPTER_CONFIG_FILE,
    merge_into,
    read_peft_adapters,
    read_peft_spec,
    save_peft_tensors,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    max_shard_gb: float = 2.0,
    merge: bool = False,
) -> dict[str, Any]:
    """Write `out` from `checkpoint` (a model directory, or a PEFT adapter directory for LoRA without
    `merge`); returns what was written."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    target = DTYPES[dtype] if dtype is not None else None
    out = Path(out)
    adapter = _adapter_of(checkpoint)
    if adapter is not None:
        base = adapter_base(adapter)
        _refuse_overwrite(out, [adapter, Path(base)])
        if not merge:
            return _export_adapter(adapter, base, out, target)
        return _export_model(Path(base), out, target, max_shard_gb, adapter=adapter)
    if merge:
        raise ValueError(
            f"--merge: {checkpoint} holds no LoRA adapters (a full model is exported as it is; drop --merge)"
        )
    source = Path(resolve_model_path(str(checkpoint)))
    if not (source / CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"{checkpoint} holds no model: expected a checkpoint root (RUN_DIR/checkpoints/step_NNNNNN), a "
            f"Hugging Face model directory with {CONFIG_FILE}, or a PEFT adapter directory"
        )
    _refuse_overwrite(out, [source])
    return _export_model(source, out, target, max_shard_gb)


def _adapter_of(checkpoint: str | Path) -> Path | None:
    """The PEFT adapter directory `checkpoint` is or holds (a LoRA checkpoint root's adapter/), else None."""
    if (Path(checkpoint) / ADAPTER_CONFIG_FILE).is_file():
        return Path(checkpoint)
    return lora_adapter_dir(checkpoint)


def _refuse_overwrite(out: Path, sources: list[Path]) -> None:
    for source in sources:
        if out.exists() and out.resolve() == Path(source).resolve():
            raise ValueError(f"{out} is the checkpoint's own directory {source}; export to another directory")


def _export_adapter(adapter: Path, base: str, out: Path, target: torch.dtype | None) -> dict[str, Any]:
    """A PEFT adapter directory at `out` (tensors cast to `target` when given) naming `base`."""
    spec = read_peft_spec(adapter)
    tensors = read_peft_adapters(adapter)
    dtype = target or torch.float32
    save_peft_tensors(tensors, out, spec, str(Path(base).resolve()), dtype=dtype)
    return {
        "source": str(adapter),
        "base": str(Path(base).resolve()),
        "out": str(out),
        "kind": "peft_adapter",
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": len(tensors),
        "params": sum(t.numel() for t in tensors.values()),
        "rank": spec.rank,
        "alpha": spec.alpha,
    }


def _export_model(
    source: Path, out: Path, target: torch.dtype | None, max_shard_gb: float, adapter: Path | None = None
) -> dict[str, Any]:
    """The model directory `source` at `out`, tensor by tensor, with `adapter`'s factors merged when given."""
    reader = CheckpointReader(source)
    args = read_config(source)
    adapters = read_peft_adapters(adapter) if adapter is not None else {}
    scaling = read_peft_spec(adapter).scaling if adapter is not None else 0.0
    names = reader.names()
    unmatched = sorted({k.rpartition(".")[0] for k in adapters} - {n.removesuffix(".weight") for n in names})
    if unmatched:
        raise ValueError(
            f"{adapter} adapts modules its base {source} does not have, e.g. {unmatched[:3]}: it was trained "
            "on another model"
        )

    def written_dtype(name: str) -> torch.dtype:
        stored = reader.dtypes[name]
        return target if target is not None and stored.is_floating_point else stored

    specs = {name: (reader.shapes[name], written_dtype(name)) for name in names}
    writer = HFWriter(out, args, specs, max_shard_bytes=int(max_shard_gb * 2**30))
    merged = 0
    for name in names:
        tensor = reader.read(name)
        if adapters:
            tensor = merge_into(name, tensor, adapters, scaling, dtype=written_dtype(name))
            merged += f"{name.removesuffix('.weight')}.lora_A" in adapters
        writer.write(name, tensor.to(written_dtype(name)).contiguous())
    floating = target if target is not None else reader.floating_dtype()
    writer.finish(floating, tokenizer_dir=source)
    written: dict[str, Any] = {
        "source": str(source),
        "out": str(out),
        "kind": "model",
        "dtype": str(floating).removeprefix("torch."),
        "tensors": len(names),
        "params": sum(int(torch.Size(reader.shapes[n]).numel()) for n in names),
    }
    if adapter is not None:
        written |= {"adapter": str(adapter), "merged_layers": merged}
    return written
