"""Decoder-only transformer for the Llama / Qwen2 / Qwen3 families, numerically matching transformers.

Parameter names equal Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, ...), so state dicts map
1:1 and TP plans / FSDP2 target the same module paths. Every decoder layer is one nn.Module at
`model.layers[i]` built from plain nn.Linear / nn.Embedding submodules.

Shape letters: B batch, T new tokens in this call, S key slots attended (T, or cache_offset + T with a
cache), H hidden size, V vocabulary, N query heads, K key/value heads, D head dim.

Attention mask: causal by slot index (a query in slot s sees key slots <= s) and `key_mask` (False = padding).
A query always sees its own slot, so left-padding queries, which see no valid key, stay finite.

Three explicit paths, one per entry point of `Transformer`:
- `forward` / `hidden_states` without a cache: plain causal attention over the T tokens (training, scoring),
  or with `segments` (cumulative lengths) block-diagonal causal attention over rows packed end to end in one
  [1, T] row (padding-free micro-batches: attention.packed_causal_attention; positions restart per row);
- with `kv_cache` and an int `cache_offset`: every row writes its T new keys at slots [offset, offset + T)
  and attends slots [0, offset + T) (prefill, lockstep decode);
- `hidden_states_per_row` (the rollout engine's continuous batching): row b writes at its own positions
  [row_offsets[b], row_offsets[b] + T) and attends key positions [0, S) with S = key_mask.shape[1], causally
  from its own offset, so rows of one batch sit at different lengths: of a slot-indexed `KVCache` (row b is
  cache row b, read in place), or of a `PagedKVCache` whose blocks each row reaches through its block table
  (models/paged_cache.py; the blocks attended are gathered each call). Its mask is additive (`row_offset_bias`:
  0 where a query attends, -inf elsewhere; built once per forward and added to every layer's scores in one
  cheap pass, where a boolean `masked_fill_` broadcast over the query heads took ten times as long).
Inside, a `CacheWrite` carries which path a call takes down to the attention layers (models/kv_cache.py holds it,
the caches and the masks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.autograd.function import once_differentiable

from dockrl.models import native
from dockrl.models.attention import causal_attention, packed_causal_attention, sdpa
from dockrl.models.config import ModelArgs
from dockrl.models.kv_cache import (
    CacheWrite,
    KVCache,
    attention_dtype,
    attention_mask,
    cached_attention,
    row_offset_bias,
)
from dockrl.models.moe import MoEBlock
from dockrl.models.native.rope import RopeKernels, rope_kernels
from dockrl.models.packed_linear import PackedLinear
from dockrl.models.paged_cache import PagedKVCache
from dockrl.models.rms_norm import RMSNorm

if TYPE_CHECKING:
    from dockrl.models.vision import Images


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """RoPE inverse frequencies [D/2] in fp32 on CPU, as transformers computes them (default or llama3)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if args.rope_type == "default":
        return inv_freq
    scaling = args.rope_scaling
    assert scaling is not None  # rope_type "llama3" comes from rope_scaling
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos, signed_sin [B, 1, T, D] (see `DecoderModel._rope`).

    transformers' x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1): roll(x) = cat(x2, x1) times
    sin with its first half negated gives the same products bit for bit (negation is exact) in fewer ops. On a
    CPU where the native kernels load, the same ops in one pass each way (models/native/rope.py), with the same
    bits and the same memory order."""
    kernels = rope_kernels() if x.device.type == "cpu" else None  # loaded (built) for CPU tensors only
    if kernels is not None and kernels.fits(x, cos, signed_sin):
        if not torch.is_grad_enabled() or not x.requires_grad:
            return kernels.forward(x, cos, signed_sin)
        if not (cos.requires_grad or signed_sin.requires_grad):
            return _NativeRope.apply(x, cos, signed_sin, kernels)
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class _NativeRope(torch.autograd.Function):
    """`apply_rope` in rope.c, forward and backward (the angles hold no gradient); keeps the angles only, as
    torch's products do."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: RopeKernels
    ) -> torch.Tensor:
        ctx.kernels = kernels
        ctx.save_for_backward(cos, sin)
        return kernels.forward(x, cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        cos, sin = ctx.saved_tensors
        return ctx.kernels.backward(grad, cos, sin), None, None, None


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE, optional qk-norm and an optional static KV cache."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        hidden, q_width, kv_width = (
            args.hidden_size,
            args.num_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_width, bias=args.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_width, bias=args.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_width, bias=args.attention_bias)
        self.o_proj = nn.Linear(q_width, hidden, bias=args.o_proj_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        # Context parallelism (dockrl.parallel.context.attach): attention of this rank's tokens of a sequence
        # split over ranks, q [B, N, T, D], k, v [B, K, T, D] -> [B, N, T, D]; None: the whole sequence is here.
        self.context_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = (
            None
        )
        # The rollout engine's packed projections (q|k|v fused, o) while it decodes on a CPU
        # (models/packed_linear.py); None: the modules above.
        self.packed: tuple[PackedLinear, PackedLinear] | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        write: CacheWrite | None = None,
        segments: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]. mask bool [B, 1, T, S] or None for plain causal without cache; `cache`
        this layer's (keys, values) of `write.cache`; `segments` the cumulative lengths of packed rows (B = 1)."""
        batch, seq = x.shape[:2]
        if self.packed is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.packed[0].split(x)
        # -1 heads: under tensor parallelism the projections hold only this rank's heads.
        q = q.reshape(batch, seq, -1, self.head_dim)  # [B, T, N, D]
        k = k.reshape(batch, seq, -1, self.head_dim)  # [B, T, K, D]
        v = v.reshape(batch, seq, -1, self.head_dim).transpose(1, 2)  # [B, K, T, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), *rope)  # [B, N, T, D]
        k = apply_rope(k.transpose(1, 2), *rope)  # [B, K, T, D]
        if write is not None:
            out = cached_attention(q, k, v, mask, cache, write).to(x.dtype)  # [B, N, T, D]
        elif segments is not None:  # packed rows: each attends its own earlier tokens only
            out = packed_causal_attention(q, k, v, segments)
        elif mask is None and self.context_attention is not None:  # a sequence split over cp ranks
            out = self.context_attention(q, k, v)
        elif mask is None:  # plain causal attention over the T tokens (training, scoring)
            out = causal_attention(q, k, v)
        else:  # padded rows without a cache
            out = sdpa(q, k, v, mask)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return self.o_proj(out) if self.packed is None else self.packed[1](out)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        # The rollout engine's packed projections (gate|up fused, down) while it decodes on a CPU; None: the
        # modules above.
        self.packed: tuple[PackedLinear, PackedLinear] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]."""
        if self.packed is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.packed[0].split(x)
        return self.packed[1](F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, args: ModelArgs, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        # Qwen3-MoE: experts on the layers ModelArgs.is_moe_layer names, a dense MLP on the others.
        self.mlp: nn.Module = MoEBlock(args, index) if args.is_moe_layer(index) else MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        write: CacheWrite | None = None,
        segments: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]."""
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache, write, segments)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (Hugging Face's `model.` prefix).

    Its forward runs through `self.model(...)` so FSDP2 hooks on this module (if it is sharded on its own)
    fire before the embedding is used.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # Plain attribute, not a buffer: survives meta-device init, to_empty() and load_state_dict().
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}
        # Training with activation checkpointing (actor.activation_checkpointing): each layer's activations
        # are recomputed in the backward pass instead of kept.
        self.checkpoint_layers = False
        # The rollout engine's layers as one native call while it decodes on a CPU with AMX tiles
        # (models/packed_linear.py, native.TiledStack); None: layer by layer.
        self.tiled_stack: native.TiledStack | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        key_mask: torch.Tensor | None,
        write: CacheWrite | None = None,
        segments: tuple[int, ...] | None = None,
        image_embeds: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, T, H]; arguments as in `Transformer.hidden_states`; image_embeds
        [U, H] replace the embeddings of the tokens of image_mask [B, T] (None: the <|image_pad|> tokens), in
        order."""
        batch, seq = input_ids.shape
        if segments is not None:
            _check_segments(segments, batch, seq, key_mask, write)
        x = self.embed_tokens(input_ids)  # [B, T, H]
        if image_embeds is not None:
            is_image = input_ids == self.args.image_token_id if image_mask is None else image_mask
            x = _merge_image_embeds(x, is_image, image_embeds)
        rope = self._rope(position_ids, x.dtype)
        mask: torch.Tensor | None
        if write is not None and write.row_offsets is not None:
            assert key_mask is not None, "per-row cache offsets come with a key mask"
            rows = x.reshape(batch * seq, -1)
            if write.native and _natively_decodable(self, rows, write):
                # the kernels attend each row's keys up to its own offset: a mask of every key needs no bias
                bias = None if bool(key_mask.all()) else self._row_bias(key_mask, write, seq)
                decoded = self._decode_natively(rows, rope, bias, write, seq, key_mask.shape[1])
                return decoded.view(batch, seq, -1)
            mask = self._row_bias(key_mask, write, seq)
        else:
            offset = 0 if write is None else write.offset
            mask = attention_mask(key_mask, batch, seq, offset, write is not None, input_ids.device)
        if write is not None and write.rows is not None:
            raise RuntimeError("CacheWrite.rows needs the native kernels, which do not apply to this pass")
        recompute = self.checkpoint_layers and write is None and torch.is_grad_enabled()
        for index, layer in enumerate(self.layers):
            if recompute:  # keeps only the layer's input; its forward runs again in the backward pass
                x = torch.utils.checkpoint.checkpoint(
                    layer, x, rope, mask, None, None, segments, use_reentrant=False
                )
                continue
            cache = None if write is None else write.cache.layer(index)
            x = layer(x, rope, mask, cache, write, segments)
        return self.norm(x)

    def _row_bias(self, key_mask: torch.Tensor, write: CacheWrite, seq: int) -> torch.Tensor:
        """row_offset_bias for the rows of `write` (per-row offsets), in the cache's attention dtype."""
        assert write.row_offsets is not None
        dtype = attention_dtype(write.cache.k[0].dtype, key_mask.device)
        return row_offset_bias(key_mask, write.row_offsets, seq, dtype)

    def _decode_natively(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        bias: torch.Tensor | None,
        write: CacheWrite,
        seq: int,
        num_keys: int,
    ) -> torch.Tensor:
        """A decode step's layers (one token per row, each at its own offset of a slots or paged cache) with the
        native kernels between torch's projections (models/native: the residual adds and norms, RoPE, the KV
        write and attention over each row's own slots, SwiGLU): x [B, H] -> final-normed [B, H]. With seq T > 1
        (a returning turn's new tokens on its kept cache) x is [B T, H], token t of row b a query row of its own
        at offset row_offsets[b] + t: every token's keys are written before any attends, so the rows attend as
        a prefill would. A row attends its keys [0, offset] of the num_keys the step has; bias (row_offset_bias:
        a key mask with keys left out) masks some of them, None: none. The caller has checked that the kernels
        apply (`_natively_decodable`)."""
        assert write.row_offsets is not None
        entries = x.shape[0]  # B T
        head_dim = self.args.head_dim
        cos, sin = (part.reshape(entries, head_dim).contiguous() for part in rope)
        # row_offset_bias: fp32 on a CPU (attention_dtype), contiguous
        bias_rows = None if bias is None else bias.reshape(entries, -1)
        offsets, cache_rows = write.row_offsets, write.rows
        if seq > 1:
            offsets = (offsets[:, None] + torch.arange(seq)).reshape(-1)
            rows = torch.arange(entries // seq) if cache_rows is None else cache_rows
            cache_rows = rows.repeat_interleave(seq)
        lengths = (offsets + 1).clamp_(max=num_keys)  # a parked row's garbage query stays in range
        step = native.DecodeStep(
            x.contiguous(), cos, sin, offsets, lengths, bias_rows, head_dim, cache_rows, num_keys
        )
        if self.tiled_stack is not None:  # every layer in one native call
            caches = [write.cache.layer(index) for index in range(len(self.layers))]
            last = step.decode_layers(self.tiled_stack, caches, write.block_table)
            return step.add_rms_norm(last, self.norm.weight, self.norm.eps)
        pending: torch.Tensor | None = None  # the last sublayer's output, added to x by the next norm
        for index, layer in enumerate(cast("Iterable[DecoderLayer]", self.layers)):
            norm = layer.input_layernorm
            h = step.add_rms_norm(pending, norm.weight, norm.eps)
            attn = layer.self_attn
            norms = None
            if attn.q_norm is not None and attn.k_norm is not None:
                norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
            cache = write.cache.layer(index)
            if attn.packed is None:
                q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
                out = step.rope_attention(q, k, v, norms, cache, write.block_table)  # [B, N D]
                pending = attn.o_proj(out)
            else:  # the fused q | k | v output read in place
                qkv = attn.packed[0]
                out = step.rope_attention_fused(qkv(h), qkv.widths, norms, cache, write.block_table)
                pending = attn.packed[1](out)
            norm = layer.post_attention_layernorm
            h = step.add_rms_norm(pending, norm.weight, norm.eps)
            mlp = cast(MLP, layer.mlp)  # dense: _natively_decodable
            if mlp.packed is None:
                pending = mlp.down_proj(step.swiglu(mlp.gate_proj(h), mlp.up_proj(h)))
            else:  # the fused gate | up output read in place
                pending = mlp.packed[1](step.swiglu_fused(mlp.packed[0](h)))
        return step.add_rms_norm(pending, self.norm.weight, self.norm.eps)

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [B, 1, T, D] (sin with its first D/2 entries negated, for `apply_rope`), computed in
        fp32 then cast to dtype, as transformers does."""
        device = position_ids.device
        inv_freq = self._inv_freq_by_device.get(device)
        if inv_freq is None:
            # Computed on CPU, then moved, so every device uses bit-identical frequencies.
            inv_freq = rope_inv_freq(self.args).to(device)
            self._inv_freq_by_device[device] = inv_freq
        freqs = position_ids[..., None].float() * inv_freq  # [B, T, D/2], or [3, B, T, D/2] for mrope
        if freqs.dim() == 4:
            freqs = _mrope_angles(freqs, self.args.mrope_section)
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        sin = emb.sin().to(dtype)
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return emb.cos().to(dtype).unsqueeze(1), signed_sin.unsqueeze(1)


class Transformer(nn.Module):
    """Decoder-only causal LM; `forward` returns logits, `hidden_states` the final-normed hidden states.

    The LM head is `lm_head` (nn.Linear, no bias) or, with tied embeddings, the embedding weight itself;
    use `output_weight()` to get whichever applies (vocab-parallel log-prob code needs the raw weight).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.vision is not None:
            from dockrl.models.vision import VisionTower  # vision.py builds on this module's layers

            self.visual = VisionTower(args.vision)
        # An inference model under tensor parallelism all-gathers its vocab slice of the logits (set by
        # dockrl.parallel.tensor_parallel.parallelize(gather_logits=True)); None: logits as computed.
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The rollout engine's packed LM head while it decodes on a CPU (models/packed_linear.py).
        self.packed_head: PackedLinear | None = None

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers, in order (typed: `model.layers` is an nn.ModuleList)."""
        return [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    def output_weight(self) -> torch.Tensor:
        """The [V, H] LM head weight (the embedding weight when tied)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_offset: int = 0,
        head: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
        segments: tuple[int, ...] | None = None,
        images: Images | None = None,
    ) -> Any:
        """Logits [B, T, V] in the parameter dtype; arguments as in `hidden_states`. With `head`, returns
        head(hidden [B, T, H], LM-head weight [V, H]) instead: a loss that fuses the LM head (training's
        chunked log-probs, dockrl.algos.head_logprobs) runs inside forward, where FSDP2 has unsharded the
        weight."""
        hidden = self.hidden_states(
            input_ids, position_ids, key_mask, kv_cache, cache_offset, segments, images
        )
        if head is not None:
            return head(hidden, self.output_weight())
        return self.lm_logits(hidden)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [..., V] of final hidden states [..., H].

        A tensor-parallel model holds a vocab slice of the head: training keeps the slice's logits
        [..., V/tp]; an inference model's `gather_logits` all-gathers the slices so samplers see the full
        vocabulary.
        """
        if self.packed_head is None:
            logits = F.linear(hidden, self.output_weight())
        else:
            logits = self.packed_head(hidden)
        return logits if self.gather_logits is None else self.gather_logits(logits)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_offset: int = 0,
        segments: tuple[int, ...] | None = None,
        images: Images | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, T, H], without a cache or with every row at `cache_offset`.

        input_ids [B, T] int64. position_ids [B, T], default arange(cache_offset, cache_offset + T) per row.
        key_mask bool [B, S] (True = real token; S = T without cache, cache_offset + T with one; None = all
        real). With kv_cache, the new keys/values go to slots [cache_offset, cache_offset + T).
        segments (no cache, no key_mask, B = 1): cumulative lengths (0, L_0, L_0 + L_1, ..., T) of rows packed
        end to end; each row attends its own tokens only, and position_ids default to restart at each row.
        A vision model (qwen2_5_vl) takes position_ids [3, B, T] too (temporal, height, width streams:
        vision.mrope_positions; [B, T] is all three equal, right for text), and `images`, whose embeddings
        replace the <|image_pad|> tokens of input_ids in order.
        """
        batch, seq = input_ids.shape
        if not isinstance(cache_offset, int):
            raise TypeError("cache_offset is an int here; per-row offsets go to hidden_states_per_row")
        if kv_cache is None and cache_offset != 0:
            raise ValueError(f"cache_offset={cache_offset} needs a kv_cache; pass kv_cache or cache_offset=0")
        if kv_cache is not None and cache_offset + seq > kv_cache.max_len:
            raise ValueError(
                f"cache_offset + T = {cache_offset + seq} exceeds kv_cache.max_len={kv_cache.max_len}; "
                "allocate a longer KVCache"
            )
        if position_ids is None and segments is not None:
            position_ids = segment_positions(segments, input_ids.device)[None]
        if position_ids is None:
            position_ids = torch.arange(cache_offset, cache_offset + seq, device=input_ids.device)
            position_ids = position_ids.expand(batch, seq)
        write = None if kv_cache is None else CacheWrite(kv_cache, offset=cache_offset)
        mask = None if images is None else images.token_mask
        hidden = self.model(
            input_ids, position_ids, key_mask, write, segments, self.image_embeds(images), mask
        )
        if images is None and self._trains_vision():
            # A trainable tower takes part in every backward, images or not: under FSDP2 every rank then
            # reduces the same gradients (zeros here), whichever rows it got.
            hidden = hidden + 0.0 * self.visual(self.visual.blank_images()).sum()
        return hidden

    def _trains_vision(self) -> bool:
        return (
            self.args.vision is not None
            and torch.is_grad_enabled()
            and any(p.requires_grad for p in self.visual.parameters())
        )

    def image_embeds(self, images: Images | None) -> torch.Tensor | None:
        """The vision tower's embeddings [U, H] of `images` (None without images); without autograd when the
        tower is frozen (actor.vision.freeze, LoRA)."""
        if images is None:
            return None
        if self.args.vision is None:
            raise ValueError(
                f"images given to a model of family={self.args.family!r}, which has no vision tower"
            )
        with torch.set_grad_enabled(self._trains_vision()):
            return self.visual(images)

    def hidden_states_per_row(
        self,
        input_ids: torch.Tensor,
        kv_cache: KVCache | PagedKVCache,
        row_offsets: torch.Tensor,
        block_table: torch.Tensor | None,
        key_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        images: Images | None = None,
        native: bool = False,
        cache_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, T, H] of rows at their own cache offsets (continuous batching).

        row_offsets int64 [B]: row b writes its new keys/values at positions [row_offsets[b], row_offsets[b] +
        T) - of cache row b of a KVCache (block_table None), or in the blocks its row of block_table [B, M] names
        in a PagedKVCache - and attends key positions [0, S), S = key_mask.shape[1], causally from its offset.
        position_ids default row_offsets[b] + arange(T). The caller keeps every offset + T <= max_len (or M x
        block_size, with the blocks allocated) and S <= max_len (not checked here: it would cost a device sync
        per decode step). native: the layers run with the native kernels where they apply
        (`DecoderModel._decode_natively`; T > 1: each new token a query row of its own); with them, cache_rows
        [B] (int64) puts row b in sequence cache_rows[b] of a KVCache instead of b (CacheWrite.rows).
        """
        if position_ids is None:
            position_ids = row_offsets[:, None] + torch.arange(input_ids.shape[1], device=input_ids.device)
        write = CacheWrite(
            kv_cache, row_offsets=row_offsets, block_table=block_table, native=native, rows=cache_rows
        )
        mask = None if images is None else images.token_mask
        return self.model(input_ids, position_ids, key_mask, write, None, self.image_embeds(images), mask)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float = 0.02) -> None:
        """Random init: linear and embedding weights ~ N(0, std), norms = 1, biases = 0.

        With a seed the draws come from a private CPU generator (same values on every device); call this
        before sharding the model.
        """
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                param.fill_(1.0)
            elif generator is None:
                param.normal_(0.0, std)
            else:
                values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
                param.copy_(values)


def native_layers(args: ModelArgs) -> bool:
    """Whether the native kernels take this model's layers: they are built, and the model is dense (no MoE
    layer: every MLP SwiGLU) with a group and head size within their bounds."""
    return (
        not args.is_moe
        and args.num_heads // args.num_kv_heads <= native.MAX_GROUP
        and args.head_dim <= native.MAX_HEAD_DIM
        and native.available()
    )


def natively_decodable(model: Transformer | DecoderModel) -> bool:
    """Whether a decode step of this model can run with the native kernels (`DecoderModel._decode_natively`):
    `native_layers`, on a CPU in fp32 or bf16 with plain weights (not DTensors) and no split sequence."""
    decoder = model.model if isinstance(model, Transformer) else model
    first = cast(DecoderLayer, decoder.layers[0])
    weight = first.self_attn.q_proj.weight
    return (
        native_layers(decoder.args)
        and weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and type(weight.data) is torch.Tensor
        and first.input_layernorm.weight.dtype == weight.dtype
        and first.self_attn.context_attention is None
    )


def _natively_decodable(model: DecoderModel, x: torch.Tensor, write: CacheWrite) -> bool:
    """`natively_decodable`, with x and the cache in the weights' dtype (the kernels' E: decode.c)."""
    dtype = x.dtype
    return (
        write.cache.k[0].dtype == dtype
        and cast(DecoderLayer, model.layers[0]).self_attn.q_proj.weight.dtype == dtype
        and natively_decodable(model)
    )


def _mrope_angles(freqs: torch.Tensor, section: tuple[int, ...] | None) -> torch.Tensor:
    """Multimodal RoPE: angles [3, B, T, D/2] of the temporal, height and width position streams -> [B, T, D/2],
    chunk i of `section` taken from stream i % 3 (transformers picks the same chunks after cos / sin, which
    act elementwise, so the bits agree)."""
    if section is None or freqs.shape[0] != 3:
        raise ValueError(
            f"position_ids with a stream dim {tuple(freqs.shape[:-1])} need a model with mrope_section "
            "(qwen2_5_vl) and 3 streams [3, B, T]"
        )
    return torch.cat([chunk[i % 3] for i, chunk in enumerate(freqs.split(list(section), dim=-1))], dim=-1)


def _merge_image_embeds(x: torch.Tensor, is_image: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
    """x [B, T, H] with the rows of image_embeds [U, H] at the tokens of is_image [B, T], in order."""
    num_tokens = int(is_image.sum())
    if num_tokens != image_embeds.shape[0]:
        raise ValueError(
            f"{num_tokens} image-pad tokens in input_ids but {image_embeds.shape[0]} image embeddings; each image "
            "takes grid t*h*w / merge_size^2 tokens (vision_processing.image_token_count)"
        )
    return x.masked_scatter(is_image[..., None], image_embeds.to(x.dtype))


def segment_positions(segments: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [T]: each packed row's positions 0 .. L_i - 1 (T = segments[-1]), as that row alone would have."""
    lengths = torch.tensor([end - start for start, end in zip(segments[:-1], segments[1:])])
    starts = torch.tensor(segments[:-1]).repeat_interleave(lengths)  # [T] the start of each token's row
    return (torch.arange(segments[-1]) - starts).to(device)


def _check_segments(
    segments: tuple[int, ...], batch: int, seq: int, key_mask: torch.Tensor | None, write: CacheWrite | None
) -> None:
    """Packed rows come as one [1, T] row without a cache or key mask; cumulative lengths from 0 to T."""
    if batch != 1 or write is not None or key_mask is not None:
        raise ValueError("segments (packed rows) need input_ids [1, T], no kv_cache and no key_mask")
    if segments[0] != 0 or segments[-1] != seq or any(a >= b for a, b in zip(segments[:-1], segments[1:])):
        raise ValueError(f"segments must rise from 0 to T={seq} (cumulative row lengths); got {segments}")
