"""Load and save Hugging Face checkpoint directories (config.json + safetensors + tokenizer files).

dockrl's ``Transformer`` uses Hugging Face's parameter names, so the state dict goes through unchanged;
this module only handles the directory layout:

    config.json                      ModelArgs.to_hf_config()
    generation_config.json           bos / eos / pad ids
    model.safetensors                one file, or when larger than max_shard_bytes:
    model-00001-of-0000N.safetensors ... plus model.safetensors.index.json {"weight_map": {name: file}}
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja   (copied as found)

Tied embeddings: Hugging Face writes the shared matrix once, as ``model.embed_tokens.weight``; a tied
checkpoint that still carries ``lm_head.weight`` loads with that entry dropped.

Experts (Qwen3-MoE): dockrl's model holds each MoE layer's experts as two 3-D parameters,
``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I] (transformers 5's in-memory
layout); files hold one tensor per expert and projection, ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (the
hub's Qwen3-MoE checkpoints, and what transformers and vLLM load). `CheckpointReader` presents the per-expert
tensors of a file as the fused ones (reading only the experts a slice asks for), and `HFWriter` splits fused
tensors back into per-expert ones as it writes.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import torch
from safetensors import safe_open
from torch import Tensor, nn

from dockrl.models.config import (  # read_config lives there, torch-free: the driver checks configs with it
    _DIR_CONTENTS,
    CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    ModelArgs,
    read_config,
)
from dockrl.models.decoder import Transformer
from dockrl.models.tokenizer import copy_tokenizer_files
from dockrl.models.vision_processing import PREPROCESSOR_FILE

GENERATION_CONFIG_FILE = "generation_config.json"
LM_HEAD_KEY = "lm_head.weight"

# Older Hugging Face checkpoints store rotary inverse frequencies; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_NUM_KEYS_SHOWN = 5


def load_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Read all tensors of the model directory ``path`` (single file or shards) onto the CPU."""
    reader = CheckpointReader(path)
    return {name: reader.read(name) for name in reader.shapes}


@dataclass(frozen=True)
class ModelKind:
    """How a module is built from a checkpoint's config.json and which checkpoint tensors it uses.

    build(args): the module (called on the meta device by shard-sized loading); ignore(name, args): a
    checkpoint tensor the module does not have; fallback(args): whole tensors for parameters a checkpoint
    may lack (PPO's fresh value head), or None.
    """

    build: Callable[[ModelArgs], nn.Module]
    ignore: Callable[[str, ModelArgs], bool]
    fallback: Callable[[ModelArgs], dict[str, Tensor]] | None = None


CAUSAL_LM = ModelKind(
    build=lambda args: Transformer(args),
    # Tied checkpoints may still carry lm_head.weight; the model reads the embedding instead.
    ignore=lambda name, args: args.tie_word_embeddings and name == LM_HEAD_KEY,
)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$"
)
FUSED_EXPERT_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def split_experts(name: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
    """A fused expert tensor (module docstring) as its per-expert file tensors; any other tensor as itself."""
    prefix, _, leaf = name.rpartition(".")
    if not name.endswith(FUSED_EXPERT_SUFFIXES):
        return [(name, tensor)]
    out = []
    for expert in range(tensor.shape[0]):
        if leaf == "gate_up_proj":
            gate, up = tensor[expert].chunk(2, dim=0)
            out += [(f"{prefix}.{expert}.gate_proj.weight", gate), (f"{prefix}.{expert}.up_proj.weight", up)]
        else:
            out.append((f"{prefix}.{expert}.down_proj.weight", tensor[expert]))
    return out


class CheckpointReader:
    """Reads tensors, or slices of tensors, of a model directory without loading whole files.

    Only the headers are read up front (names, shapes, dtypes). `read(name, index)` opens the tensor's file,
    reads the requested slice and closes it again: safetensors memory-maps files, and mapped pages count as
    resident memory for as long as the map lives, so no map outlives a read. Per-expert tensors appear under
    their fused names (module docstring).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files = _weight_files(self.path)  # tensor name -> file
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    self.shapes[name] = tuple(view.get_shape())
                    self.dtypes[name] = _SAFETENSORS_DTYPES[view.get_dtype()]
        absent = sorted(set(self.files) - set(self.shapes))
        if absent:
            raise ValueError(
                f"{self.path / WEIGHTS_INDEX_FILE} lists {len(absent)} tensors its shards lack, "
                f"e.g. {absent[:_NUM_KEYS_SHOWN]}"
            )
        self.stored: dict[str, str] = {}  # dockrl's name -> the file's, where they differ (`_rename_vision`)
        self._rename_vision()
        self.fused: dict[str, list[list[str]]] = {}  # fused name -> per expert, the file tensors it stacks
        self._fuse_experts()

    def _rename_vision(self) -> None:
        """Qwen2.5-VL checkpoints of transformers 4.5x name the language model `model.language_model.*` and the
        tower `model.visual.*`; the hub's files and transformers 5's (and dockrl's) say `model.*`, `visual.*`."""
        for name in list(self.shapes):
            for old, new in (("model.language_model.", "model."), ("model.visual.", "visual.")):
                if name.startswith(old):
                    renamed = new + name[len(old) :]
                    self.stored[renamed] = name
                    self.shapes[renamed] = self.shapes.pop(name)
                    self.dtypes[renamed] = self.dtypes.pop(name)
                    self.files[renamed] = self.files.pop(name)

    def _fuse_experts(self) -> None:
        """Present per-expert tensors under their fused names: gate_up_proj [E, 2I, H] (each expert's gate rows
        then up rows), down_proj [E, H, I]."""
        groups: dict[str, dict[int, dict[str, str]]] = {}
        for name in list(self.shapes):
            match = _PER_EXPERT.match(name)
            if match is not None:
                experts = groups.setdefault(match["prefix"], {})
                experts.setdefault(int(match["expert"]), {})[match["proj"]] = name
        for prefix, experts in groups.items():
            count = len(experts)
            if sorted(experts) != list(range(count)) or any(len(p) != 3 for p in experts.values()):
                raise ValueError(
                    f"{self.path}: the experts of {prefix} are incomplete (experts {sorted(experts)}, each needs "
                    "gate_proj, up_proj and down_proj)"
                )
            gate_up = [[experts[e]["gate"], experts[e]["up"]] for e in range(count)]
            down = [[experts[e]["down"]] for e in range(count)]
            first_gate, first_down = gate_up[0][0], down[0][0]
            rows, width = self.shapes[first_gate]
            self.fused[f"{prefix}.gate_up_proj"] = gate_up
            self.shapes[f"{prefix}.gate_up_proj"] = (count, 2 * rows, width)
            self.fused[f"{prefix}.down_proj"] = down
            self.shapes[f"{prefix}.down_proj"] = (count, *self.shapes[first_down])
            for fused in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj"):
                parts = [n for per in self.fused[fused] for n in per]
                self.dtypes[fused] = self.dtypes[parts[0]]
                for part in parts:
                    del self.shapes[part]

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint (rotary buffers of old checkpoints excluded)."""
        return [n for n in self.shapes if not n.endswith(_IGNORED_SUFFIXES)]

    def floating_dtype(self) -> torch.dtype:
        """The dtype the checkpoint stores its floating tensors in (its source dtype)."""
        return next((d for d in self.dtypes.values() if d.is_floating_point), torch.float32)

    def read(self, name: str, index: tuple[slice, ...] = ()) -> Tensor:
        """Tensor `name`, or its sub-block `index` (one slice per leading dim), as a CPU tensor (it may map
        the file until it is freed: copy it where it must outlive a short use)."""
        if name in self.fused:
            experts = range(self.shapes[name][0])[index[0] if index else slice(None)]
            stacked = torch.stack(
                [torch.cat([self.read(part) for part in self.fused[name][e]]) for e in experts]
            )
            return stacked[(slice(None), *index[1:])] if len(index) > 1 else stacked
        stored = self.stored.get(name, name)
        with safe_open(str(self.files[name]), framework="pt", device="cpu") as f:
            return f.get_slice(stored)[index] if index else f.get_tensor(stored)


FINGERPRINT_SAMPLE_BYTES = 4096  # per tensor, from its first and its last bytes


def weights_fingerprint(path: str | Path) -> str:
    """A sha256 that tells model directories apart without reading their weights: config.json, each
    safetensors header (names, dtypes, shapes, offsets) and the first and last FINGERPRINT_SAMPLE_BYTES of
    every tensor. Two checkpoints of the same architecture differ in every trained tensor's bytes, so they
    differ here; an edit confined to the middle of one tensor does not show (reading it all would cost a full
    pass over the model on every save). What a LoRA checkpoint records of the base it was trained on."""
    import hashlib
    import struct

    path = Path(path)
    digest = hashlib.sha256((path / CONFIG_FILE).read_bytes())
    for file in sorted(set(_weight_files(path).values())):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header_bytes = f.read(size)
            digest.update(header_bytes)
            header = json.loads(header_bytes)
            for name in sorted(k for k in header if k != "__metadata__"):
                start, end = header[name]["data_offsets"]
                for offset in sorted({start, max(start, end - FINGERPRINT_SAMPLE_BYTES)}):
                    f.seek(8 + size + offset)
                    digest.update(f.read(min(FINGERPRINT_SAMPLE_BYTES, end - offset)))
    return digest.hexdigest()


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a single-file or sharded model directory."""
    if (path / WEIGHTS_FILE).is_file():
        with safe_open(str(path / WEIGHTS_FILE), framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), path / WEIGHTS_FILE)
    index_file = path / WEIGHTS_INDEX_FILE
    if not index_file.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} in {path}; {_DIR_CONTENTS}")
    with open(index_file, encoding="utf-8") as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    for shard_name in sorted(set(weight_map.values())):
        if not (path / shard_name).is_file():
            raise FileNotFoundError(f"{index_file} names shard {shard_name}, which is missing from {path}")
    return {name: path / shard for name, shard in weight_map.items()}


def load_model(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """Build a ``Transformer`` from the model directory ``path`` with its weights loaded strictly.

    The module is built on the meta device and the checkpoint tensors are assigned into it, so no memory
    is spent on a throwaway random init. Floating tensors are cast to ``dtype``.
    """
    args = read_config(path)
    state_dict = load_state_dict(path)
    if args.tie_word_embeddings:
        state_dict.pop(LM_HEAD_KEY, None)
    # assign=True is safe: tied models have no lm_head module, so no parameter is shared between names.
    return materialize(lambda: Transformer(args), state_dict, path, device=device, dtype=dtype)


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def materialize(
    build: Callable[[], ModuleT],
    state_dict: Mapping[str, Tensor],
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ModuleT:
    """`build()` on the meta device, then `state_dict` assigned into it strictly: buffers HF checkpoints
    carry are dropped, keys and shapes checked (errors name `path`), floating tensors cast to `dtype`."""
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith(_IGNORED_SUFFIXES)}
    with torch.device("meta"):
        model = build()
    _check_keys_and_shapes(model, state_dict, path)
    # copy=True: fresh storage from torch's (64-byte aligned) allocator. A safetensors tensor may be a view at
    # any byte offset of the file, and a misaligned operand takes other SIMD paths whose rounding differs, so
    # the same weights would compute different bits depending on the file's header length.
    state_dict = {
        k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
        for k, v in state_dict.items()
    }
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model


def _check_keys_and_shapes(model: nn.Module, state_dict: Mapping[str, Tensor], path: str | Path) -> None:
    check_shapes(
        {k: tuple(v.shape) for k, v in model.state_dict().items()},
        {k: tuple(v.shape) for k, v in state_dict.items()},
        path,
    )


def check_shapes(
    expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], path: str | Path
) -> None:
    """Raise ValueError naming a few missing / unexpected / mis-shaped tensors of checkpoint `path`."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing, e.g. {missing[:_NUM_KEYS_SHOWN]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected, e.g. {unexpected[:_NUM_KEYS_SHOWN]}")
    mismatched = [
        f"{k}: checkpoint {tuple(found[k])} vs model {tuple(shape)}"
        for k, shape in expected.items()
        if k in found and tuple(found[k]) != tuple(shape)
    ]
    if mismatched:
        problems.append(f"{len(mismatched)} with wrong shapes, e.g. {mismatched[:_NUM_KEYS_SHOWN]}")
    if problems:
        raise ValueError(f"checkpoint {path} does not match its config.json: " + "; ".join(problems))


def save_model(
    model_or_state_dict: nn.Module | Mapping[str, Tensor],
    args: ModelArgs,
    path: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 2 * 2**30,
    dtype: torch.dtype | None = None,
) -> None:
    """Write a Hugging Face model directory that transformers' ``from_pretrained`` loads.

    ``dtype`` casts floating tensors (default: keep each tensor's dtype). Weight files from an earlier save
    into the same directory are removed first, so a single file never coexists with stale shards.
    """
    state_dict = _prepare_for_saving(model_or_state_dict, args, dtype)
    specs = {name: (tuple(t.shape), t.dtype) for name, t in state_dict.items()}
    writer = HFWriter(path, args, specs, max_shard_bytes)
    for name, tensor in state_dict.items():
        writer.write(name, tensor)
    floating = next((t.dtype for t in state_dict.values() if t.is_floating_point()), None)
    writer.finish(floating, tokenizer_dir)


class HFWriter:
    """Streams a Hugging Face model directory to disk one tensor at a time, so a caller that gathers tensors
    from shards holds one tensor, never a file's worth: plan with every tensor's shape and dtype, `write` them
    in that order, then `finish`.

    One file when everything fits in ``max_shard_bytes``, else greedy shards of at most that size (a larger
    tensor gets its own) plus ``model.safetensors.index.json``. Each file is safetensors: an 8-byte
    little-endian header length, a JSON header (dtype, shape, byte offsets of each tensor, padded to 8 bytes),
    then the tensors' bytes in order; the header can be written first because the plan fixes every offset.
    """

    def __init__(
        self,
        path: str | Path,
        args: ModelArgs,
        specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        max_shard_bytes: int,
    ):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
        self.path, self.args = Path(path), args
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, (shape, dtype) in specs.items():  # fused experts are written one tensor per expert
            for part, meta in split_experts(name, torch.empty(shape, dtype=dtype, device="meta")):
                self.specs[part] = (tuple(meta.shape), dtype)
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in [*self.path.glob("model-*-of-*.safetensors"), self.path / WEIGHTS_FILE]:
            stale.unlink(missing_ok=True)
        (self.path / WEIGHTS_INDEX_FILE).unlink(missing_ok=True)
        self.shards: list[list[str]] = [[]]
        shard_bytes = 0
        for name in self.specs:
            size = self._nbytes(name)
            if self.shards[-1] and shard_bytes + size > max_shard_bytes:
                self.shards.append([])
                shard_bytes = 0
            self.shards[-1].append(name)
            shard_bytes += size
        self._order = [name for shard in self.shards for name in shard]
        self._next = 0  # index into _order of the next tensor to write
        self._file: IO[bytes] | None = None
        self._weight_map: dict[str, str] = {}

    def _nbytes(self, name: str) -> int:
        shape, dtype = self.specs[name]
        return int(torch.Size(shape).numel()) * dtype.itemsize

    def _file_name(self, shard: int) -> str:
        count = len(self.shards)
        return WEIGHTS_FILE if count == 1 else f"model-{shard + 1:05d}-of-{count:05d}.safetensors"

    def _open(self, shard: int) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in self.shards[shard]:
            shape, dtype = self.specs[name]
            size = self._nbytes(name)
            header[name] = {
                "dtype": _SAFETENSORS_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        file = self._file_name(shard)
        self._file = open(self.path / file, "wb")  # noqa: SIM115 - closed when its last tensor is written
        self._file.write(len(text).to_bytes(8, "little") + text)
        self._weight_map.update(dict.fromkeys(self.shards[shard], file))
        self._remaining = list(self.shards[shard])

    def write(self, name: str, tensor: Tensor) -> None:
        """Write the next planned tensor (a CPU tensor of its planned shape and dtype; a fused expert tensor as
        its per-expert parts)."""
        if name.endswith(FUSED_EXPERT_SUFFIXES):
            for part, piece in split_experts(name, tensor):
                self.write(part, piece)
            return
        expected = self._order[self._next]
        shape, dtype = self.specs[expected]
        if name != expected or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"HFWriter expected {expected} {shape} {dtype}, got {name} {tuple(tensor.shape)} {tensor.dtype}"
            )
        if self._file is None:
            self._open(next(i for i, shard in enumerate(self.shards) if name in shard))
        assert self._file is not None
        flat = tensor.detach().contiguous().reshape(-1)
        if flat.numel():
            self._file.write(flat.view(torch.uint8).numpy().data)  # the tensor's own bytes, no copy
        self._remaining.remove(name)
        self._next += 1
        if not self._remaining:
            self._file.close()
            self._file = None

    def finish(self, dtype: torch.dtype | None, tokenizer_dir: str | Path | None = None) -> None:
        """Write the index (sharded), config.json (recording `dtype`), generation_config.json and tokenizer."""
        assert self._next == len(self._order), "finish before every planned tensor was written"
        if len(self.shards) > 1:
            total = sum(self._nbytes(name) for name in self._order)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self._weight_map.items()))}
            _write_json(self.path / WEIGHTS_INDEX_FILE, index)
        config = self.args.to_hf_config()
        if dtype is not None:
            # Record the dtype actually written; transformers 5 reads "dtype", older versions "torch_dtype".
            config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
        _write_json(self.path / CONFIG_FILE, config)
        generation_config = {
            f"{name}_token_id": getattr(self.args, f"{name}_token_id")
            for name in ("bos", "eos", "pad")
            if getattr(self.args, f"{name}_token_id") is not None
        }
        _write_json(self.path / GENERATION_CONFIG_FILE, generation_config)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, self.path)
            processor = Path(tokenizer_dir) / PREPROCESSOR_FILE
            if self.args.vision is not None and processor.is_file():  # a vision model's image processor
                shutil.copyfile(processor, self.path / PREPROCESSOR_FILE)


def _prepare_for_saving(
    model_or_state_dict: nn.Module | Mapping[str, Tensor], args: ModelArgs, dtype: torch.dtype | None
) -> dict[str, Tensor]:
    """Detached, contiguous CPU tensors, each owning its storage (safetensors refuses shared memory)."""
    if isinstance(model_or_state_dict, nn.Module):
        source = model_or_state_dict.state_dict()
    else:
        source = dict(model_or_state_dict)
    if args.tie_word_embeddings:
        source.pop(LM_HEAD_KEY, None)
    prepared: dict[str, Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in source.items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen_storages or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()
        seen_storages.add(tensor.untyped_storage().data_ptr())
        prepared[name] = tensor
    return prepared


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
