"""models/native: the decode step's kernels (decode.c) against the torch ops they replace, each within the
rounding their different order of fp32 sums allows, and the decoder's native decode path against its torch
path. Every check is also run against a reference with one thing broken (a dropped weight, eps, mask or RoPE,
the wrong scale) to show that its bound catches that.

The bounds, with u = 2^-24 (fp32's unit roundoff):
- an elementwise op torch computes in fp32 and the kernel computes the same way: equal, or (where the kernel's
  expf is glibc's vector one and torch's is its own) within 4 u relative before the final rounding;
- RMSNorm's sum of H squares in another order: the mean's relative error is at most (H + 1) u, the rsqrt's half
  of that plus 2 u, the output's that plus 2 u;
- attention: each score (D products) within D u sum|q k| scale, the softmax's weights within twice the score
  error plus (L + 4) u relative, the weighted sum of L values within (L + 2) u max|v| plus the weights' error
  times max|v|;
- a result stored as bf16: one bf16 ulp of it more (a value near a rounding boundary may round the other way).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dockrl.models import KVCache, ModelArgs, Transformer, native
from dockrl.models import decoder as decoder_module
from dockrl.models import kv_cache as kv_cache_module
from dockrl.models.decoder import apply_rope
from dockrl.models.kv_cache import grouped_attention, row_offset_bias
from dockrl.models.rms_norm import rms_norm

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")

U = 2.0**-24
EPS = 1e-6


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at |t|."""
    finfo = torch.finfo(t.dtype)
    exponent = torch.floor(torch.log2(t.abs().double().clamp_min(finfo.tiny)))
    return torch.exp2(exponent) * finfo.eps


def _within(got: torch.Tensor, want: torch.Tensor, fp32_bound: torch.Tensor | float) -> bool:
    """|got - want| <= the fp32 bound, plus one ulp of want's dtype where it is stored rounded (bf16)."""
    bound = torch.as_tensor(fp32_bound, dtype=torch.float64)
    if want.dtype != torch.float32:
        bound = bound + _ulp(want)
    return bool(((got.double() - want.double()).abs() <= bound).all())


def _step(x: torch.Tensor, head_dim: int = 16, batch: int | None = None) -> native.DecodeStep:
    """A DecodeStep whose attention inputs are unused (for the norm and SwiGLU checks)."""
    batch = x.shape[0] if batch is None else batch
    rope = torch.zeros(batch, head_dim, dtype=x.dtype)
    rows = torch.zeros(batch, dtype=torch.long)
    return native.DecodeStep(x, rope, rope.clone(), rows, rows + 1, torch.zeros(batch, 1), head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_torchs_residual_add_and_rmsnorm(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = 256
    x = (3 * torch.randn(6, hidden, generator=g)).to(dtype)
    add = torch.randn(6, 2 * hidden, generator=g).to(dtype)[:, :hidden]  # a view of a wider output
    weight = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    residual = x + add
    want = rms_norm(residual, weight, EPS)
    step = _step(x.clone())
    got = step.add_rms_norm(add, weight, EPS)
    assert torch.equal(step.x, residual)  # the add is one fp32 add rounded once, as torch's
    bound = (1.5 * (hidden + 1) + 6) * U * want.double().abs()
    assert _within(got, want, bound)
    assert not _within(got, rms_norm(residual, torch.ones_like(weight), EPS), bound)  # weight dropped
    assert not _within(got, rms_norm(residual, weight, 1.0), bound)  # eps of another size
    assert not _within(got, weight * residual, bound)  # no normalisation
    step.add_rms_norm(None, weight, EPS)  # nothing added: x stays
    assert torch.equal(step.x, residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_silu_times_up(dtype):
    g = torch.Generator().manual_seed(1)
    fused = (2 * torch.randn(5, 2 * 96, generator=g)).to(dtype)
    gate, up = fused.split(96, dim=-1)  # views of one fused projection, as the packed MLP gives
    want = F.silu(gate) * up
    got = _step(torch.zeros(5, 8, dtype=dtype), head_dim=8).swiglu(gate, up)
    # silu's fp32 value within 4 u (expf) and its rounding to dtype: one ulp of silu times |up| more in bf16
    silu = F.silu(gate.float())
    bound = 6 * U * (silu * up.float()).abs().double()
    if dtype != torch.float32:
        bound = bound + _ulp(F.silu(gate)) * up.double().abs()
    assert _within(got, want, bound)
    assert not _within(got, gate * up, bound)
    assert not _within(got, torch.sigmoid(gate) * up, bound)


def _attention_case(dtype: torch.dtype, qk_norm: bool, head_dim: int = 16, group: int = 2):
    """Ragged rows of a GQA layer (4 key/value heads of head_dim, `group` query heads each) with a filled cache
    in dtype: rows of 1 to 41 keys, so the kernel's 16-key blocks and its 4-key and single-key loops all run,
    with head_dim 48 both its 32-wide value sums in registers and the 16 left over, and in bf16 with head_dim
    32 or 64 the group's heads summed together (four at a time: group 5 runs a four and a one)."""
    g = torch.Generator().manual_seed(2)
    batch, kv_heads, slots = 4, 4, 48
    heads = group * kv_heads
    offsets = torch.tensor([3, 17, 0, 40])
    q = torch.randn(batch, heads * head_dim, generator=g).to(dtype)
    kv = torch.randn(batch, 2 * kv_heads * head_dim, generator=g).to(dtype)
    k, v = kv.split(kv_heads * head_dim, dim=-1)
    angles = 6 * torch.rand(batch, head_dim // 2, generator=g)
    both = torch.cat((angles, angles), dim=-1)
    sin = both.sin().to(dtype)
    cos, signed_sin = both.cos().to(dtype), torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), -1)
    cache = tuple(torch.randn(batch, kv_heads, slots, head_dim, generator=g).to(dtype) for _ in range(2))
    norms = None
    if qk_norm:
        norms = tuple((1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2)) + (EPS,)
    return q, k, v, cos, signed_sin.contiguous(), cache, offsets, norms, head_dim


def _torch_attention(q, k, v, cos, sin, cache, offsets, norms, head_dim, *, mask_rows=True, rope_k=True):
    """What Attention.forward and _cached_attention do for one decode token per row (the reference)."""
    batch = q.shape[0]
    q4 = q.view(batch, 1, -1, head_dim)
    k4 = k.reshape(batch, 1, -1, head_dim)
    if norms is not None:
        q4, k4 = rms_norm(q4, norms[0], norms[2]), rms_norm(k4, norms[1], norms[2])
    rope = (cos[:, None, None], sin[:, None, None])
    q_rot = apply_rope(q4.transpose(1, 2), *rope)
    k_rot = apply_rope(k4.transpose(1, 2), *rope) if rope_k else k4.transpose(1, 2)
    keys, values = (part.float() for part in cache)  # attention in fp32 (kv_cache.attention_dtype on a CPU)
    rows = torch.arange(batch)
    keys[rows, :, offsets] = k_rot.float()[:, :, 0]
    values[rows, :, offsets] = v.reshape(batch, -1, head_dim).float()
    num_keys = int(offsets.max()) + 1
    key_mask = torch.ones(batch, num_keys, dtype=torch.bool)
    bias = row_offset_bias(
        key_mask, offsets if mask_rows else torch.full_like(offsets, num_keys - 1), 1, torch.float32
    )
    out = grouped_attention(q_rot.float(), keys[:, :, :num_keys], values[:, :, :num_keys], bias)
    return out.to(q.dtype).reshape(batch, -1), (keys, values), bias, q_rot.float(), num_keys


def _attention_bound(q_rot, keys, values, num_keys, head_dim) -> torch.Tensor:
    """The module docstring's attention bound per row (the same for every element of the row)."""
    heads = q_rot.shape[1]
    group = heads // keys.shape[1]
    k = keys[:, :, :num_keys].repeat_interleave(group, dim=1).double()  # [B, N, L, D]
    products = (q_rot.double().abs() @ k.abs().transpose(-1, -2)).amax(dim=(1, 2, 3)) * head_dim**-0.5  # [B]
    score_error = head_dim * U * products
    weight_error = 2 * score_error + (num_keys + 4) * U
    vmax = values[:, :, :num_keys].abs().amax(dim=(1, 2, 3)).double()
    return ((num_keys + 2) * U + weight_error) * vmax  # [B]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(("head_dim", "group"), [(16, 2), (32, 2), (32, 5), (48, 2), (64, 3)])
def test_rope_attention_is_attentions_decode_step(dtype, qk_norm, head_dim, group):
    q, k, v, cos, sin, cache, offsets, norms, head_dim = _attention_case(dtype, qk_norm, head_dim, group)
    want, (keys, values), bias, q_rot, num_keys = _torch_attention(
        q, k, v, cos, sin, cache, offsets, norms, head_dim
    )
    lengths = offsets + 1
    x = torch.zeros(q.shape[0], 8, dtype=dtype)
    step = native.DecodeStep(x, cos, sin, offsets, lengths, bias.reshape(q.shape[0], -1), head_dim)
    mine = tuple(part.clone() for part in cache)
    got = step.rope_attention(q, k, v, norms, mine)
    assert torch.equal(mine[1].float(), values)  # v written as it is
    if norms is None:  # RoPE'd k written exactly: the same ops, rounded at the same points
        assert torch.equal(mine[0].float(), keys)
    else:  # k's per-head norm sums D squares in another order (the norm bound), then RoPE (two products, a sum)
        largest = keys.abs().amax()
        bound = 2 * (1.5 * (head_dim + 1) + 8) * U * largest
        if dtype != torch.float32:
            bound = bound + 2 * _ulp(largest.to(dtype))
        assert ((mine[0].float() - keys).abs() <= bound).all()
    bound = _attention_bound(q_rot, keys, values, num_keys, head_dim)[:, None]
    assert _within(got, want, bound)
    # the checks see a missing per-row mask (every row over the longest), k left unrotated, the wrong scale
    unmasked = _torch_attention(q, k, v, cos, sin, cache, offsets, norms, head_dim, mask_rows=False)[0]
    assert not _within(got, unmasked, bound)
    unrotated_keys = _torch_attention(q, k, v, cos, sin, cache, offsets, norms, head_dim, rope_k=False)[1][0]
    assert not torch.equal(mine[0].float(), unrotated_keys)
    scaled = grouped_attention(2 * q_rot, keys[:, :, :num_keys], values[:, :, :num_keys], bias)
    assert not _within(got, scaled.to(dtype).reshape(q.shape[0], -1), bound)


@pytest.mark.parametrize("group", [2, 5])
def test_rope_attention_reads_a_paged_pool_as_its_slots(group):
    """The same rows through the paged layout (blocks of 6 in a shuffled pool: runs that break mid-row, odd
    and even), in bf16 with head_dim 32 (the grouped value sums): within the attention bound of torch's, as the
    slots layout is; a pool whose blocks are read in the wrong order is caught."""
    q, k, v, cos, sin, cache, offsets, norms, head_dim = _attention_case(torch.bfloat16, False, 32, group)
    want, (keys, values), bias, q_rot, num_keys = _torch_attention(
        q, k, v, cos, sin, cache, offsets, norms, 32
    )
    batch, kv_heads, slots = cache[0].shape[:3]
    blocks, size = slots // 6, 6
    order = torch.randperm(batch * blocks, generator=torch.Generator().manual_seed(7))
    table = order.reshape(batch, blocks)  # row b's block j is the pool's block table[b, j]
    pool = tuple(
        torch.zeros(kv_heads, batch * blocks, size, head_dim, dtype=torch.bfloat16) for _ in range(2)
    )
    for part, source in zip(pool, cache):
        part[:, table.reshape(-1)] = (
            source.reshape(batch, kv_heads, blocks, size, head_dim)
            .transpose(0, 1)
            .reshape(kv_heads, batch * blocks, size, head_dim)
        )
    x = torch.zeros(batch, 8, dtype=torch.bfloat16)

    def attend(block_table: torch.Tensor) -> torch.Tensor:
        step = native.DecodeStep(x, cos, sin, offsets, offsets + 1, bias.reshape(batch, -1), head_dim)
        return step.rope_attention(q, k, v, None, tuple(part.clone() for part in pool), block_table).clone()

    bound = _attention_bound(q_rot, keys, values, num_keys, head_dim)[:, None]
    assert _within(attend(table), want, bound)
    assert not _within(attend(table.roll(1, dims=1)), want, bound)


def test_rope_attention_refuses_offsets_lengths_and_blocks_outside_the_cache():
    """The kernel checks every row before it writes or reads: an offset past the cache, a length past the keys
    asked for (the bias), a block the pool does not have are named errors, not reads past the memory."""
    q, k, v, cos, sin, cache, offsets, norms, head_dim = _attention_case(torch.float32, False)
    batch, slots = q.shape[0], cache[0].shape[2]
    x = torch.zeros(batch, 8)

    def attend(rows, lengths, keys, table=None, pool=cache):
        step = native.DecodeStep(x, cos, sin, rows, lengths, torch.zeros(batch, keys), head_dim)
        return step.rope_attention(q, k, v, None, pool, table)

    attend(offsets, offsets + 1, slots)  # in range
    past = offsets.clone()
    past[1] = slots
    with pytest.raises(ValueError, match="offset is past the cache's 48 slots"):
        attend(past, offsets + 1, slots)
    with pytest.raises(ValueError, match=r"length outside \[1, 8\]"):
        attend(offsets, offsets + 1, 8)
    # paged: [K, num_blocks, block_size, D] with 6 blocks of 8; row 3's offset 40 is in its table's block 5
    pool = tuple(
        part.permute(1, 0, 2, 3).reshape(4, batch * 6, 8, head_dim)[:, :6].contiguous() for part in cache
    )
    table = torch.arange(6).repeat(batch, 1)
    attend(offsets, offsets + 1, slots, table, pool)
    table[3, 5] = 6  # not in the pool
    with pytest.raises(ValueError, match="blocks not in the pool"):
        attend(offsets, offsets + 1, slots, table, pool)


def _model(family: str, dtype: torch.dtype) -> Transformer:
    args = ModelArgs(
        family=family,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=24 if family == "qwen3" else 16,
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        max_position_embeddings=128,
    )
    model = Transformer(args)
    model.init_weights(seed=0, std=0.2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=g))
            elif name.endswith("bias"):
                param.copy_(0.3 * torch.randn(param.shape, generator=g))
    return model.to(dtype).eval()


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("seq", [1, 4])
@pytest.mark.parametrize("holes", [False, True])
def test_native_decode_step_is_the_layers_torch_path(family, seq, holes, monkeypatch):
    """A decode step of ragged rows (continuous batching) through DecoderModel, and with seq 4 a returning
    turn's new tokens on each row's kept cache (each token a query row of its own): the native path against
    the layers' torch path from the same cache. fp32, so the only differences are the kernels' sums: the cache
    writes and the hidden states within 64 (H + L) u of their size (each of the 2 layers' norms and attention,
    compounded through the residual stream). With every key in the mask the native path builds no bias (a
    row's length bounds its keys); with keys left out (holes) it does, and leaving them in is caught."""
    model = _model(family, torch.float32)
    batch, slots = 3, 40
    cache = KVCache(model.args, batch, slots, torch.float32, "cpu")
    lengths = [5, 12, 1]
    prompts = torch.randint(0, 97, (batch, max(lengths)), generator=torch.Generator().manual_seed(3))
    for row, length in enumerate(lengths):  # prefill each row alone, at offset 0 of its own cache row
        model.hidden_states_per_row(
            prompts[row : row + 1, :length],
            cache.rows(1, row),
            torch.zeros(1, dtype=torch.long),
            None,
            torch.ones(1, length, dtype=torch.bool),
        )
    offsets = torch.tensor(lengths)
    token = torch.randint(0, 97, (batch, seq), generator=torch.Generator().manual_seed(4))
    every_key = torch.ones(batch, max(lengths) + seq, dtype=torch.bool)
    key_mask = every_key.clone()
    if holes:
        key_mask[0, 2] = key_mask[1, 7] = key_mask[1, 0] = False

    def decode(native_on: bool, mask: torch.Tensor = key_mask) -> tuple[torch.Tensor, KVCache]:
        copy = KVCache(model.args, batch, slots, torch.float32, "cpu")
        for mine, theirs in zip(copy.k + copy.v, cache.k + cache.v):
            mine.copy_(theirs)
        hidden = model.hidden_states_per_row(token, copy, offsets, None, mask, native=native_on)
        return hidden, copy

    calls = []
    biases = []
    real, real_bias = native.DecodeStep.rope_attention, decoder_module.row_offset_bias
    monkeypatch.setattr(
        native.DecodeStep, "rope_attention", lambda self, *a: calls.append(1) or real(self, *a)
    )
    monkeypatch.setattr(decoder_module, "row_offset_bias", lambda *a: biases.append(1) or real_bias(*a))
    got, got_cache = decode(True)
    monkeypatch.undo()
    assert len(calls) == model.args.num_layers  # the native path ran
    assert len(biases) == int(holes)  # a bias only where the mask leaves keys out
    want, want_cache = decode(False)
    relative = 64 * (model.args.hidden_size + slots) * U
    assert got.shape == want.shape == (batch, seq, model.args.hidden_size)
    for mine, theirs in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):  # the new slots written
        assert ((mine - theirs).abs() <= relative * theirs.abs().amax()).all()
    bound = relative * want.abs().amax(dim=-1, keepdim=True)
    assert _within(got, want, bound)
    assert want.abs().max() > 0.5  # not a comparison of near-zero states
    # the bound sees one layer's attention gone wrong: the scale doubled in the kernel's reference
    monkeypatch.setattr(
        kv_cache_module, "grouped_attention", lambda q, k, v, b: grouped_attention(2 * q, k, v, b)
    )
    broken, _ = decode(False)
    assert not _within(got, broken, bound)
    monkeypatch.undo()
    if holes:  # the keys left out attended after all
        assert not _within(got, decode(False, every_key)[0], bound)
    if seq > 1:  # and the new tokens not seeing each other's keys (each only the kept cache and itself)
        monkeypatch.undo()
        monkeypatch.setattr(decoder_module, "row_offset_bias", _without_the_new_keys)
        blind, _ = decode(False)
        assert not _within(got, blind, bound)


def _without_the_new_keys(key_mask, cache_offset, seq, dtype):
    """row_offset_bias with query t of a row masked from the row's new keys before it (offset .. offset + t)."""
    bias = row_offset_bias(key_mask, cache_offset, seq, dtype).clone()  # [B, 1, T, S]
    for row, offset in enumerate(cache_offset.tolist()):
        for t in range(1, seq):
            bias[row, 0, t, offset : offset + t] = float("-inf")
    return bias


@torch.no_grad()
def test_native_rows_read_and_write_their_own_sequences_in_place():
    """cache_rows (CacheWrite.rows): two returning rows whose sequences are rows 3 and 1 of a 4-row cache run in
    place, as the same rows copied out (KVCache.take), run on the torch path and written back: the same hidden
    states within test_native_decode_step_is_the_layers_torch_path's bound, the same new keys and values, and
    rows 0 and 2 untouched. Without the kernels, rows are refused by name."""
    model = _model("qwen2", torch.float32)
    slots, kept, seq = 40, [6, 9], 3
    cache = KVCache(model.args, 4, slots, torch.float32, "cpu")
    g = torch.Generator().manual_seed(5)
    for part in cache.k + cache.v:
        part.copy_(torch.randn(part.shape, generator=g))
    before = [part.clone() for part in cache.k + cache.v]
    rows = torch.tensor([3, 1])
    offsets = torch.tensor(kept)
    ids = torch.randint(0, 97, (2, seq), generator=g)
    key_mask = torch.ones(2, max(kept) + seq, dtype=torch.bool)
    got = model.hidden_states_per_row(ids, cache, offsets, None, key_mask, native=True, cache_rows=rows)
    copy = KVCache(model.args, 4, slots, torch.float32, "cpu")
    for mine, theirs in zip(copy.k + copy.v, before):
        mine.copy_(theirs)
    part = copy.take(rows, slots)
    want = model.hidden_states_per_row(ids, part, offsets, None, key_mask, native=False)
    copy.put(rows, part)
    relative = 64 * (model.args.hidden_size + slots) * U
    assert _within(got, want, relative * want.abs().amax(dim=-1, keepdim=True))
    for mine, theirs, old in zip(cache.k + cache.v, copy.k + copy.v, before):
        assert ((mine - theirs).abs() <= relative * theirs.abs().amax()).all()
        assert torch.equal(mine[[0, 2]], old[[0, 2]])  # the other sequences untouched
        assert not torch.equal(mine[[3, 1]], old[[3, 1]])  # the new slots written
    with pytest.raises(RuntimeError, match="CacheWrite.rows needs the native kernels"):
        model.hidden_states_per_row(ids, cache, offsets, None, key_mask, native=False, cache_rows=rows)


def test_the_native_path_is_skipped_where_it_does_not_apply(monkeypatch):
    """A dense bf16 model on a CPU with a bf16 cache decodes natively, and the rollout engine keeps its cache in
    bf16 for it (half of fp32's bytes); a cache or activations of another dtype, an MoE model, the kernels
    unavailable or rollout.native_kernels=false send it to the torch path and the engine to an fp32 cache."""
    from dockrl.engines.rollout import RolloutEngine

    model = _model("qwen2", torch.bfloat16)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    fp32 = kv_cache_module.CacheWrite(
        KVCache(model.args, 2, 8, torch.float32, "cpu"), row_offsets=torch.zeros(2)
    )
    bf16 = kv_cache_module.CacheWrite(
        KVCache(model.args, 2, 8, torch.bfloat16, "cpu"), row_offsets=torch.zeros(2)
    )
    assert decoder_module._natively_decodable(model.model, x, bf16)
    assert not decoder_module._natively_decodable(model.model, x, fp32)
    assert not decoder_module._natively_decodable(model.model, x.float(), fp32)  # weights of another dtype
    assert RolloutEngine(model, num_slots=2, max_seq_len=8).cache_dtype == torch.bfloat16
    off = RolloutEngine(model, num_slots=2, max_seq_len=8, native_kernels=False)
    assert off.cache_dtype == torch.float32 and not off.native_kernels
    moe = Transformer(
        ModelArgs(
            family="qwen3_moe",
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=16,
            qk_norm=True,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            max_position_embeddings=64,
        )
    ).to(torch.bfloat16)
    assert not decoder_module.natively_decodable(moe)
    assert RolloutEngine(moe, num_slots=2, max_seq_len=8).cache_dtype == torch.float32
    monkeypatch.setattr(native, "available", lambda: False)
    assert not decoder_module._natively_decodable(model.model, x, bf16)


def test_without_a_compiler_or_when_turned_off_the_kernels_say_why(monkeypatch):
    monkeypatch.setattr(native, "_kernels", None)
    monkeypatch.setattr(native, "_status", "not loaded yet")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert not native.available()
    assert "no C compiler" in native.status() and "no-such-compiler-here" in native.status()
    monkeypatch.setattr(native, "_status", "not loaded yet")
    monkeypatch.setenv("DOCKRL_NATIVE", "off")
    assert not native.available() and native.status() == "off (DOCKRL_NATIVE)"


def test_a_failed_build_names_the_compilers_error(monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native, "_kernels", None)
    monkeypatch.setattr(native, "_status", "not loaded yet")
    monkeypatch.setattr(native, "SOURCES", (broken,))
    monkeypatch.setenv("DOCKRL_NATIVE_DIR", str(tmp_path / "builds"))
    assert not native.available()
    assert native.status().startswith("off: the build failed") and "broken.c" in native.status()
    assert not list((tmp_path / "builds").glob("*.so"))  # nothing half-built left to load


@torch.no_grad()
@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_the_rollout_engine_decodes_natively_in_both_cache_layouts(layout, monkeypatch):
    """rollout.native_kernels through the engine: ragged rows that finish at different steps (continuous
    batching, idle slots among the running ones) draw the same tokens as with torch's ops, their log-probs
    within 64 (H + L) u of the logits' size (the hidden states' bound carried through the LM head), in the
    slots and the paged layout alike; the kernels ran on every decode step."""
    from dockrl.engines.rollout import Request, RolloutEngine, SamplingParams

    model = _model("qwen2", torch.float32)
    prompts = [[5, 9, 2], [7] * 11, [3, 1, 4, 1, 5, 9, 2, 6], [8]]
    lengths = [12, 4, 9, 15]

    def run(native_on: bool) -> dict[int, tuple[list[int], torch.Tensor]]:
        engine = RolloutEngine(model, num_slots=3, max_seq_len=40, kv_cache=layout, native_kernels=native_on)
        for index, (prompt, length) in enumerate(zip(prompts, lengths)):
            engine.add(
                Request(prompt, [index], SamplingParams(max_new_tokens=length, temperature=1.0), tag=index)
            )
        return {c.tag: (c.generation.token_ids.tolist(), c.generation.logprobs) for c in engine.run()}

    steps = []
    real = native.DecodeStep.__init__
    monkeypatch.setattr(native.DecodeStep, "__init__", lambda self, *a: steps.append(1) or real(self, *a))
    got = run(True)
    monkeypatch.undo()
    want = run(False)
    assert len(steps) >= max(lengths) - 1  # every decode step (the first token comes from the prefill)
    largest = max(
        model(torch.tensor(prompts[tag] + tokens)[None]).abs().max().item()
        for tag, (tokens, _) in want.items()
    )
    bound = 64 * (model.args.hidden_size + 40) * U * 2 * largest  # a logit's error, twice (logsumexp)
    for tag, (tokens, logprobs) in want.items():
        assert got[tag][0] == tokens
        assert (got[tag][1] - logprobs).abs().max().item() <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_outputs_read_in_place_equal_their_views(dtype):
    """rope_attention_fused and swiglu_fused read q | k | v and gate | up where the packed projections wrote
    them: the same bits as the views' calls, and a width list that does not add up is refused."""
    q, k, v, cos, sin, cache, offsets, norms, head_dim = _attention_case(dtype, False)
    batch = q.shape[0]
    qkv = torch.cat((q, k, v), dim=-1)
    bias = torch.zeros(batch, cache[0].shape[2])
    step = native.DecodeStep(
        torch.zeros(batch, 8, dtype=dtype), cos, sin, offsets, offsets + 1, bias, head_dim
    )
    by_views = step.rope_attention(q, k, v, None, tuple(c.clone() for c in cache)).clone()
    fused = step.rope_attention_fused(
        qkv, [q.shape[1], k.shape[1], v.shape[1]], None, tuple(c.clone() for c in cache)
    )
    assert torch.equal(by_views, fused)
    with pytest.raises(ValueError, match="not q | k | v"):
        step.rope_attention_fused(qkv, [q.shape[1], k.shape[1], 1], None, cache)
    gate_up = torch.randn(batch, 2 * 24, generator=torch.Generator().manual_seed(5)).to(dtype)
    views = step.swiglu(*gate_up.split(24, dim=-1)).clone()
    assert torch.equal(step.swiglu_fused(gate_up), views)
