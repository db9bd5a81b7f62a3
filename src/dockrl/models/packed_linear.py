"""Decode-time linear layers of a CPU rollout: each weight packed once per weight version, the projections that
read the same input fused.

A decode step multiplies a few rows by every weight matrix of the model. On a CPU, oneDNN lays the weight out
in its blocked format at every call, which for a handful of rows costs about as much as the product itself,
and each of a layer's seven projections is a call of its own. `PackedWeights` packs every weight once
(`torch.ops.mkldnn._reorder_linear_weight`: what inductor's frozen CPU graphs and vLLM's CPU backend do) and
fuses q, k, v into one matmul and gate, up into another, so a layer makes 4 matmul calls instead of 7 and
none re-lays out a weight. The tied (or untied) LM head is packed too. Measured (the engine with and without,
8.3M model, vocabulary 8,000, 128 tokens, bf16, one thread): 1.25x decode tokens/s at 8 rows, 1.03-1.10x at
64, where the step is compute-bound.

Outputs are bit-identical to `nn.Linear`'s: every output column is the same dot product in the same order,
only the weight's layout and the number of calls change (tests/unit/test_packed_linear.py; the rollout
engine's tokens and log-probs with and without packing are compared there too).

On a CPU with AMX tiles and the native kernels on (`PackedWeights(tiled=True)`: the engine's
rollout.native_kernels), the packs are laid out for the tiles instead and run through models/native/linear.c
(`native.TiledLinear`): oneDNN's bf16 call costs ~35 us at a few rows whatever its size, the tiles' own work
for a 256 x 512 projection of 8 rows ~10 us. Their sums are oneDNN's AMX kernel's (32 inputs at a time, in
order), so the outputs are the same where oneDNN does not split the inputs over threads, and within fp32
accumulation otherwise (tests/unit/test_native_linear.py). With every layer's projections on tiles, a decode
step's layers run in one native call (`native.TiledStack`, built here with the packs).

Where it applies: bf16 weights on a CPU whose oneDNN computes bf16 (`supported`). fp32 is left as it is:
fusing alone measured 0.97x there (MKL's fp32 GEMM reads the weight in place; oneDNN's packed fp32 kernel
differs from MKL's in the last bits), and an accelerator's GEMMs take the weight as it is.

Only the rollout engine uses it, around its model calls (`applied()`): the packed copies hold no gradient and
cost one more copy of the weights while it runs (oneDNN's layout or the tiles', never both). They are built at the first call and rebuilt after
`invalidate()`, which the engine's `weights_changed()` calls on every weight update (the colocated switch
rewrites the bucket buffers the parameters view in place, which no version counter of the parameters shows);
`applied()` also rebuilds when a source weight's storage moved. A layer is packed only when its projections
are plain `nn.Linear` with plain weights and no hooks: a tensor-parallel layer (RowParallelLinear), a LoRA
adapter, an MoE layer (the experts keep their own path) or a DTensor weight runs as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from dockrl.models import native


class PackedLinear:
    """y = x @ cat(weights).T + cat(biases), split back into the sources' outputs; bf16: the fused weight in
    oneDNN's blocked layout (`rows`: the batch it is laid out for; any batch gives the same result), or with
    `tiled` in the AMX tiles' layout of the native projection (native.TiledLinear)."""

    def __init__(
        self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], rows: int, tiled: bool = False
    ) -> None:
        weight = torch.cat([w.detach() for w in weights])
        self.bias: torch.Tensor | None = None  # sources without a bias: zeros in their place
        if any(b is not None for b in biases):
            self.bias = torch.cat(
                [w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in zip(weights, biases)]
            )
        self.widths = [w.shape[0] for w in weights]
        self.tiled = native.TiledLinear(weight, self.bias) if tiled else None  # then the only copy
        self.onednn = self.tiled is None and weight.dtype == torch.bfloat16
        self.weight: torch.Tensor | None = None
        if self.tiled is None:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows) if self.onednn else weight

    @classmethod
    def of(cls, linears: list[nn.Linear], rows: int, tiled: bool = False) -> PackedLinear:
        """The linears fused in order."""
        return cls([linear.weight for linear in linears], [linear.bias for linear in linears], rows, tiled)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., sum of the sources' out_features]."""
        if self.tiled is not None:
            return self.tiled(x)
        assert self.weight is not None
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The sources' outputs of x, in their order."""
        return self(x).split(self.widths, dim=-1)


def supported(model: nn.Module) -> bool:
    """Whether packing applies to this model's weights (see the module docstring's table)."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _tiled_layer(
    layer: Any, qkv: PackedLinear, o: PackedLinear, gate_up: PackedLinear, down: PackedLinear
) -> native.TiledLayer:
    """A decoder layer (decoder.DecoderLayer, which imports this module) whose four packed projections are on
    tiles, as native.TiledStack takes it."""
    attn = layer.self_attn
    head_norms = None
    if attn.q_norm is not None and attn.k_norm is not None:
        head_norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
    norm, post = layer.input_layernorm, layer.post_attention_layernorm
    assert qkv.tiled and o.tiled and gate_up.tiled and down.tiled
    return native.TiledLayer(
        (norm.weight, norm.eps),
        (post.weight, post.eps),
        head_norms,
        qkv.tiled,
        qkv.widths,
        o.tiled,
        gate_up.tiled,
        down.tiled,
    )


def _plain(*linears: nn.Module) -> bool:
    return all(
        type(linear) is nn.Linear
        and type(linear.weight) is nn.Parameter
        and not linear._forward_hooks
        and not linear._forward_pre_hooks
        for linear in linears
    )


class PackedWeights:
    """The packed projections of a dockrl Transformer's decoder layers and LM head (module docstring)."""

    def __init__(self, model: nn.Module, rows: int, tiled: bool = False) -> None:
        self.model, self.rows = model, max(1, rows)
        # the native projections on AMX tiles where asked for and usable (native.TiledLinear)
        self.tiled = tiled and native.linear_available()
        self._packs: list[tuple[nn.Module, str, object]] = []  # (module, attribute, its packed projections)
        self._sources: list[tuple[nn.Module, str]] = []  # (module, parameter name) of every packed tensor
        self._built: tuple[int, ...] | None = None  # their storage addresses when the packs were built

    def invalidate(self) -> None:
        """The weights changed in place: the packs are rebuilt at the next `applied()`."""
        self._packs, self._sources, self._built = [], [], None

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block the model's projections run packed (built first, or rebuilt when a weight's storage
        moved); outside it, as they are (the packs are never left on the model: a training forward of the same
        model must not see them)."""
        if self._built != self._addresses():
            self._build()
        # object.__setattr__: the attribute is a plain one (set in the modules' __init__), and nn.Module's own
        # __setattr__ costs microseconds per call on every decode step
        for module, name, packed in self._packs:
            object.__setattr__(module, name, packed)
        try:
            yield
        finally:
            for module, name, _ in self._packs:
                object.__setattr__(module, name, None)

    def _addresses(self) -> tuple[int, ...]:
        """The storage address of every weight and bias the packs were built from, as the modules hold them now
        (read from the modules' parameter dicts: nn.Module's __getattr__ would cost more than the step's
        projections at a few rows)."""
        return tuple(module._parameters[name].data_ptr() for module, name in self._sources)  # type: ignore[union-attr]

    @torch.no_grad()
    def _build(self) -> None:
        model, rows, tiled = self.model, self.rows, self.tiled
        packs: list[tuple[nn.Module, str, object]] = []
        sources: list[nn.Module] = []
        stack: list[native.TiledLayer] | None = [] if tiled else None  # every layer's, or None
        for layer in model.decoder_layers():  # type: ignore[operator]
            attn, mlp = layer.self_attn, layer.mlp
            qkv = o = gate_up = down = None
            if _plain(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                qkv = PackedLinear.of([attn.q_proj, attn.k_proj, attn.v_proj], rows, tiled)
                o = PackedLinear.of([attn.o_proj], rows, tiled)
                packs.append((attn, "packed", (qkv, o)))
                sources += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            if hasattr(mlp, "gate_proj") and _plain(mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                gate_up = PackedLinear.of([mlp.gate_proj, mlp.up_proj], rows, tiled)
                down = PackedLinear.of([mlp.down_proj], rows, tiled)
                packs.append((mlp, "packed", (gate_up, down)))
                sources += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            if stack is not None and qkv and o and gate_up and down:
                stack.append(_tiled_layer(layer, qkv, o, gate_up, down))
            else:
                stack = None
        self._sources = [(linear, "weight") for linear in sources]
        self._sources += [(linear, "bias") for linear in sources if linear.bias is not None]
        if stack:  # a decode step's layers in one native call (DecoderModel._decode_natively)
            packs.append((cast(nn.Module, model.model), "tiled_stack", native.TiledStack(stack)))
            layers: list[Any] = model.decoder_layers()  # type: ignore[operator]
            norms = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in layers]
            norms += [(layer.self_attn.q_norm, layer.self_attn.k_norm) for layer in layers]
            self._sources += [(norm, "weight") for pair in norms for norm in pair if norm is not None]
        head = model.output_weight()  # type: ignore[operator]
        if type(head) is nn.Parameter and model.gather_logits is None:
            packs.append((model, "packed_head", PackedLinear([head], [None], rows, tiled)))
            owner = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
            self._sources.append((owner, "weight"))
        self._packs, self._built = packs, self._addresses()
