"""The weight digest: after each update, every module of a vLLM engine must hold exactly what the trainer sent.

```
 trainer side (as the pairs stream)       engine side (after reload + re-pack, in each vLLM worker)
 SentDigest.add(HF name, tensor)          engine_digest(worker)
   hash:    exact multiset hash              hash of every parameter vLLM holds (embedding: its logical rows)
   columns: tensor[:, C(K)]                  kernel columns: the module's own GEMM on one-hot rows e_c, c in C(K)
                  +-------------------  compare  --------------------+
                     per (module, parameter), through vLLM's packing (qkv, gate_up, experts, tied head):
                     any difference -> WeightSyncError naming the modules
```

Why two summaries. On a CPU vLLM packs each linear layer's weight into an opaque GEMM handle after loading and
frees the weight itself (`dispatch_cpu_unquantized_gemm(remove_weight=True)`); the vocabulary matrices keep their
weight beside a packed copy. A stale *packed copy* is what went wrong before (the LM head after a reload), and a
hash of the parameter cannot see it. So every linear-like module (vLLM's LinearBase, the embedding and LM head) is
read through its own kernel: `quant_method.apply(module, X)` with X the one-hot rows of a few fixed input columns
C(K) returns those columns of the weight the kernel multiplies by. Each output is one weight times 1 plus exact
zeros, so it is exact in any kernel that accumulates in the weight's precision or wider (vLLM's CPU GEMMs,
measured in fp32 and bf16; not TF32, which rounds fp32 inputs): the comparison is equality, no tolerance. Every other
parameter vLLM holds (norms, biases, the embedding's lookup matrix, the experts) is compared whole by an exact
integer hash of its bits b (a signed integer of the dtype's width): sum(b) and sum(high half of b x low half of
b) over its elements, summed exactly in int64 (the second term is nonlinear: a change that keeps sum(b) still
shows). The hash does not depend on the order of the elements, so it reads the experts' packed layout (a reordering) and the fused
qkv / gate_up tensors (concatenations) as the sum of their parts' hashes. It sees values, not layout: a wrong
layout (e.g. experts left unpacked) is a large error the log-prob probe catches.

What it promises: a module whose weights vLLM did not take (a tensor dropped from the stream, a loader that
skipped it, a packed copy not rebuilt) fails the check whenever the update changed any of the module's values
in the engine's dtype (for the linear layers: any value in the checked columns), however small the change.

Engines of one rank only (rollout.tp = 1): with tp > 1 each rank holds a slice (and replicated KV heads) that the
two sides would have to map; those engines rely on the probe alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

DIGEST_COLUMNS = 8  # input columns of each linear-like module read through its kernel
HASH_CHUNK = 1 << 22  # elements hashed at a time: < 2^32 terms of |x| < 2^31, so each int64 sum is exact
_BITS = {
    torch.float32: (torch.int32, 16),  # (integer view, half its width in bits)
    torch.bfloat16: (torch.int16, 8),
    torch.float16: (torch.int16, 8),
}
_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.\d+\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PARAM = {"gate_proj": "w13_weight", "up_proj": "w13_weight", "down_proj": "w2_weight"}
TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def digest_columns(in_features: int) -> torch.Tensor:
    """The fixed input columns C(K) read through a linear-like module's kernel (the same on both sides)."""
    generator = torch.Generator().manual_seed(20261204 + in_features)
    return torch.randperm(in_features, generator=generator)[: min(DIGEST_COLUMNS, in_features)].sort().values


def multiset_hash(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[int, int]:
    """Exact hash of `tensor`'s values in `dtype` (module docstring): order-free, additive over parts."""
    int_dtype, half = _BITS[dtype]
    flat = tensor.detach().reshape(-1)
    first = second = 0
    for start in range(0, flat.numel(), HASH_CHUNK):  # cast per chunk: no whole copy in `dtype`
        bits = flat[start : start + HASH_CHUNK].to(dtype).view(int_dtype)
        # signed high half x unsigned low half fits the integer type (|x| < 2^(2 half - 1)); sums are int64
        first += int(bits.sum(dtype=torch.int64))
        second += int(((bits >> half) * (bits & ((1 << half) - 1))).sum(dtype=torch.int64))
    return first, second


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


@dataclass
class SentDigest:
    """What the trainer sent in one update, per Hugging Face tensor name: its hash and, for a matrix, its
    digest columns, both in the engine's dtype."""

    dtype: torch.dtype
    hashes: dict[str, tuple[int, int]] = field(default_factory=dict)
    columns: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N, c] float64, CPU

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Record one streamed (name, tensor) pair (after `split_experts`)."""
        self.hashes[name] = multiset_hash(tensor, self.dtype)
        if tensor.ndim == 2:
            cols = digest_columns(tensor.shape[1]).to(tensor.device)
            self.columns[name] = tensor.detach()[:, cols].to(self.dtype).double().cpu()


def engine_digest(worker: Any, dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """Run in each vLLM worker (collective_rpc): per module of the engine's model, "hashes" {parameter: hash}
    of what it holds, "kernel" [N, c] the digest columns its own GEMM multiplies by (linear-like modules), and
    "rows" the logical rows (an embedding's vocabulary without padding)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.model_runner.get_model()
    out: dict[str, dict[str, Any]] = {"": {"packed": dict(getattr(model, "packed_modules_mapping", {}))}}
    for name, module in model.named_modules():  # an alias (a MoE layer's gate) once
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        rows = module.org_vocab_size if isinstance(module, VocabParallelEmbedding) else None
        entry: dict[str, Any] = {"rows": rows, "kernel": None, "hashes": {}}
        for param_name, param in params.items():
            if param.numel() > 0:
                entry["hashes"][param_name] = multiset_hash(param.data[:rows], dtype)
        if isinstance(module, LinearBase | VocabParallelEmbedding):
            in_features = (
                module.embedding_dim
                if isinstance(module, VocabParallelEmbedding)
                else getattr(module, "input_size_per_partition", module.input_size)  # replicated: whole
            )
            cols = digest_columns(in_features)
            weight_dtype = module.weight.dtype
            device = module.weight.device
            one_hot = torch.zeros(len(cols), in_features, dtype=weight_dtype, device=device)
            one_hot[torch.arange(len(cols)), cols] = 1
            with torch.no_grad():
                kernel = module.quant_method.apply(module, one_hot)  # [c, N]
            entry["kernel"] = kernel.t()[:rows].double().cpu()  # [N, c]
        out[name] = entry
    return out


def _sources(module: str, param: str, packed: dict[str, list[str]], sent: Iterable[str]) -> list[str]:
    """The streamed names vLLM packs into `module`.`param`, in its packing order."""
    if param in ("w13_weight", "w2_weight"):  # fused experts (vLLM 0.32: <mlp>.experts.routed_experts)
        owners = (module, module.rpartition(".")[0])
        return [
            n
            for n in sent
            if (m := _EXPERT.match(n)) and m["module"] in owners and _EXPERT_PARAM[m["proj"]] == param
        ]
    if module == "lm_head" and TIED_HEAD not in sent:
        return [EMBEDDING]  # a tied head multiplies by the embedding
    prefix, _, leaf = module.rpartition(".")
    return [f"{prefix}.{part}.{param}".lstrip(".") for part in packed.get(leaf, [leaf])]


def compare(sent: SentDigest, engine: dict[str, dict[str, Any]]) -> list[str]:
    """Where the engine holds something other than what was sent: one line per module and parameter."""
    packed = engine.get("", {}).get("packed", {})
    problems: list[str] = []
    used: set[str] = set()
    names = list(sent.hashes)
    for module, entry in engine.items():
        if not module:
            continue
        for param, held in entry["hashes"].items():
            sources = _sources(module, param, packed, names)
            missing = [s for s in sources if s not in sent.hashes]
            used.update(sources)
            if missing or not sources:
                problems.append(
                    f"{module}.{param}: nothing streamed for it ({', '.join(missing) or 'no tensor'})"
                )
                continue
            expected = (0, 0)
            for source in sources:
                expected = _add(expected, sent.hashes[source])
            if held != expected:
                problems.append(f"{module}.{param}: its values differ from the {len(sources)} tensor(s) sent")
        if entry["kernel"] is not None:
            sources = _sources(module, "weight", packed, names)
            used.update(sources)
            if any(s not in sent.columns for s in sources):
                problems.append(f"{module}.weight: nothing streamed for its kernel ({', '.join(sources)})")
                continue
            expected_columns = torch.cat([sent.columns[s] for s in sources])  # [N, c]
            kernel = entry["kernel"][: expected_columns.shape[0]]
            if kernel.shape != expected_columns.shape or not torch.equal(kernel, expected_columns):
                worst = (
                    float((kernel - expected_columns).abs().max())
                    if kernel.shape == expected_columns.shape
                    else None
                )
                problems.append(
                    f"{module}.weight: its kernel multiplies by other weights than those sent (max |difference| "
                    f"{worst:.3g} over {DIGEST_COLUMNS} columns)"
                    if worst is not None
                    else f"{module}.weight: its kernel's shape {tuple(kernel.shape)} is not the sent "
                    f"{tuple(expected_columns.shape)}"
                )
    problems += [f"{n}: sent, but no module of the engine holds it" for n in names if n not in used]
    return problems
