"""The decoder's causal attention: bf16 on a CPU (SDPA forward, dockrl's block-causal backward) against float64.
Each backward test runs both paths of that backward: torch's ops and the native kernel (models/native/attention.c,
where it builds), which rounds less (all fp32, bf16 once at the end) and so meets the same bounds.

Tolerances come from bf16 rounding. Every value in the bf16 backward passes through at most a few roundings to bf16
(unit roundoff u = 2^-9): the probabilities before p.T @ dout, dp = dout @ v.T, the forward output behind
rowsum(dout * out), ds before ds @ k and ds.T @ q, and the result; the matmuls accumulate in fp32 (about 2^-24
per term). So each result is within c * u * (the same computation on absolute values) with c = 8 > the number of
roundings on any path; a wrong index or a missing term is an O(1) relative error instead.
"""

import pytest
import torch
import torch.nn.functional as F

import dockrl.models.attention as attention
from dockrl.models import native
from dockrl.models.attention import causal_attention

BOUND = 8 * 2.0**-9  # c * u, see the module docstring


@pytest.fixture(
    params=[
        "torch",
        pytest.param(
            "native",
            marks=pytest.mark.skipif(not native.available(), reason="the native kernels do not build"),
        ),
    ]
)
def path(request, monkeypatch):
    """The backward's path: torch's ops, or the native kernel."""
    monkeypatch.setattr(attention, "_native_backward", lambda: request.param == "native")
    return request.param


def _reference(q, k, v, grad_out):
    """Float64 attention on the bf16 values, its gradients, and magnitudes: the same products on |values|."""
    groups = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    kr, vr = k64.repeat_interleave(groups, 1), v64.repeat_interleave(groups, 1)
    seq, scale = q.shape[2], q.shape[-1] ** -0.5
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    probs = torch.softmax((q64 @ kr.transpose(-1, -2) * scale).masked_fill(future, float("-inf")), -1)
    out = probs @ vr  # [B, N, T, D]
    out.backward(grad_out.double())
    with torch.no_grad():
        g, p = grad_out.double().abs(), probs
        out_mag = p @ vr.abs()
        dp_mag = g @ vr.abs().transpose(-1, -2)  # |dout| |v|.T
        delta_mag = (g * out_mag).sum(-1, keepdim=True)
        ds_mag = p * (dp_mag + delta_mag) * scale  # [B, N, T, T]

        def fold(x):  # query heads -> their kv head
            return x.view(x.shape[0], -1, groups, *x.shape[2:]).sum(2)

        mags = {
            "out": out_mag,
            "q": ds_mag @ kr.abs(),
            "k": fold(ds_mag.transpose(-1, -2) @ q64.abs()),
            "v": fold(p.transpose(-1, -2) @ g),
        }
    return out.detach(), {"q": q64.grad, "k": k64.grad, "v": v64.grad}, mags


def _worst(actual, expected, magnitude):
    """The largest error relative to its element's magnitude."""
    return ((actual.double() - expected).abs() / (magnitude + 1e-30)).max().item()


def _within(name, actual, expected, magnitude):
    worst = _worst(actual, expected, magnitude)
    assert worst <= BOUND, f"{name}: error reaches {worst:.3g} of its magnitude (bound {BOUND:.3g})"
    assert magnitude.max() > 0.1, f"{name}: a test of nothing"


def _inputs(batch, heads, kv_heads, seq, dim):
    """bf16 q, k, v (leaves with gradients) and grad_out, seeded by `seq`."""
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(batch, heads, seq, dim, generator=gen).mul(2).bfloat16().requires_grad_()
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen).mul(2).bfloat16().requires_grad_()
    v = torch.randn(batch, kv_heads, seq, dim, generator=gen).bfloat16().requires_grad_()
    return q, k, v, torch.randn(batch, heads, seq, dim, generator=gen).bfloat16()


@pytest.mark.parametrize(
    "batch,heads,kv_heads,seq,dim",
    [
        (3, 4, 2, 37, 16),
        (2, 8, 4, 64, 32),
        (4, 2, 2, 5, 8),
        (1, 4, 1, 1, 8),
        (5, 6, 3, 19, 8),
        (1, 4, 2, 40, 64),  # the native kernel's register paths: heads of 32, 64 and 128
        (1, 2, 1, 21, 128),
    ],
)
@pytest.mark.parametrize("block_elements", [1 << 22, 64])
def test_bf16_cpu_attention_and_gradients_match_float64(
    batch, heads, kv_heads, seq, dim, block_elements, path, monkeypatch
):
    """Grouped queries (1 to 4 per kv head), lengths that split into uneven query blocks (and the native
    kernel's blocks of 8 queries and 16 keys), one token, and row chunks of one (block_elements=64) or all
    rows."""
    monkeypatch.setattr(attention, "_BLOCK_ELEMENTS", block_elements)
    q, k, v, grad_out = _inputs(batch, heads, kv_heads, seq, dim)
    out = causal_attention(q, k, v)
    out.backward(grad_out)
    expected_out, expected_grads, mags = _reference(q, k, v, grad_out)
    assert out.dtype == torch.bfloat16 and q.grad.dtype == torch.bfloat16
    _within("out", out, expected_out, mags["out"])
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _within(f"grad {name}", tensor.grad, expected_grads[name], mags[name])


def _unscaled_probs(q_blk, k_c, bias):
    """A broken backward's probabilities: the scores without their 1/sqrt(D)."""
    keys = k_c[:, : bias.shape[1]].transpose(1, 2)
    return torch.softmax(torch.baddbmm(bias, q_blk, keys), dim=-1)


def _bias_one_key_late(start, end, num_groups):
    """A broken backward's mask: each query also sees the next key (a wrong index)."""
    query_pos = torch.arange(start, end).repeat(num_groups)
    future = torch.arange(end)[None, :] > query_pos[:, None] + 1
    return torch.zeros(future.shape).masked_fill_(future, float("-inf"))


_NATIVE_BACKWARD = native.attention_backward


def _native_keys_for_values(q, k, v, out, grad_out):
    """A broken native backward: the keys passed as the values (a wrong operand)."""
    return _NATIVE_BACKWARD(q, k, k, out, grad_out)


def _native_without_delta(q, k, v, out, grad_out):
    """A broken native backward: rowsum(dout * out) dropped from ds (a missing term)."""
    return _NATIVE_BACKWARD(q, k, v, torch.zeros_like(out), grad_out)


@pytest.mark.parametrize(
    "broken",
    [
        (attention, "_block_probs", _unscaled_probs),
        (attention, "_causal_bias", _bias_one_key_late),
        (native, "attention_backward", _native_keys_for_values),
        (native, "attention_backward", _native_without_delta),
    ],
)
def test_the_bounds_fail_a_broken_backward(broken, monkeypatch):
    """The check above, run against a backward with a missing scale or an off-by-one mask (torch's ops), or with
    a wrong operand or a missing term (the native kernel), must fail: the bounds are not so loose that a wrong
    gradient passes."""
    module, name, replacement = broken
    if module is native and not native.available():
        pytest.skip("the native kernels do not build here")
    monkeypatch.setattr(attention, "_native_backward", lambda: module is native)
    monkeypatch.setattr(module, name, replacement)
    q, k, v, grad_out = _inputs(3, 4, 2, 37, 16)
    causal_attention(q, k, v).backward(grad_out)
    _, expected_grads, mags = _reference(q, k, v, grad_out)
    for name, tensor in (("q", q), ("k", k)):
        assert _worst(tensor.grad, expected_grads[name], mags[name]) > BOUND, name


@pytest.mark.parametrize("amx", [True, False])
def test_long_sequences_take_torchs_backward_on_amx(amx, path, monkeypatch):
    """From AMX_FLASH_BACKWARD_TOKENS tokens on a CPU with AMX tiles (AMX_FLASH_OVER_NATIVE_TOKENS where the
    native backward runs) the backward is torch's flash kernel, and its output and gradients meet the same
    bounds against float64; below it, or without AMX, ours."""
    monkeypatch.setattr(attention, "_has_amx", lambda: amx)
    native_path = path == "native"
    long = attention.AMX_FLASH_OVER_NATIVE_TOKENS if native_path else attention.AMX_FLASH_BACKWARD_TOKENS
    for seq, flash in ((long - 1, False), (long, amx)):
        q, k, v, grad_out = _inputs(1, 2, 1, seq, 8)
        out = causal_attention(q, k, v)
        assert (type(out.grad_fn).__name__ == "_CpuCausalAttentionBackward") != flash, (seq, out.grad_fn)
        if seq == long:
            out.backward(grad_out)
            expected_out, expected_grads, mags = _reference(q, k, v, grad_out)
            _within("out", out, expected_out, mags["out"])
            for name, tensor in (("q", q), ("k", k), ("v", v)):
                _within(f"grad {name}", tensor.grad, expected_grads[name], mags[name])


def test_query_blocks_cover_every_token_once():
    for seq in (1, 15, 16, 17, 64, 143, 1000):
        blocks = attention._query_blocks(seq)
        assert blocks[0][0] == 0 and blocks[-1][1] == seq
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert len(blocks) <= attention._QUERY_BLOCKS and all(end - start >= 1 for start, end in blocks)


def test_fp32_and_no_grad_paths_are_torchs_sdpa():
    """fp32 (any device) and every pass without a gradient take torch's kernel as it is: the forward values of
    the bf16 training path are those of scoring (reference, old log-probs) bit for bit."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(causal_attention(q, k, v), expected)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    with torch.no_grad():
        scored = causal_attention(qb, kb, vb)
    trained = causal_attention(qb.requires_grad_(), kb, vb)
    assert torch.equal(scored, trained.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_stacks_equal_lengths_with_each_rows_own_numbers(dtype):
    """packed_causal_attention runs sequences of one length, too far from the others to share a padded bucket,
    as one batch: each row's output and gradients are bit for bit those of its own causal_attention call (rows
    of a batch are independent), and a token sees its own sequence only (lengths repeat and differ, in mixed
    order)."""
    torch.manual_seed(0)
    lengths = [4, 9, 4, 1, 9, 9, 2, 4]
    assert attention.length_buckets(lengths) == [[3], [6], [0, 2, 7], [1, 4, 5]]  # nothing padded
    bounds = tuple(int(b) for b in torch.tensor([0, *lengths]).cumsum(0))
    total, heads, kv_heads, dim = bounds[-1], 4, 2, 16
    q = torch.randn(1, heads, total, dim).to(dtype).requires_grad_()
    k = torch.randn(1, kv_heads, total, dim).to(dtype).requires_grad_()
    v = torch.randn(1, kv_heads, total, dim).to(dtype).requires_grad_()
    grad = torch.randn(1, heads, total, dim).to(dtype)
    out = attention.packed_causal_attention(q, k, v, bounds)
    out.backward(grad)
    got = [out.detach(), *(x.grad for x in (q, k, v))]
    for x in (q, k, v):
        x.grad = None
    rows = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    parts = [causal_attention(q[:, :, r], k[:, :, r], v[:, :, r]) for r in rows]
    torch.cat(parts, dim=2).backward(grad)
    want = [torch.cat(parts, dim=2).detach(), *(x.grad for x in (q, k, v))]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_length_buckets_pad_like_lengths_within_the_waste_bound():
    """Shortest first, a row joins while rows x longest^2 <= 1.5 x sum L^2: 17 and 20 (2 x 400 <= 1.5 x 689),
    then 21 (3 x 441 = 1,323 <= 1.5 x 1,130 = 1,695), 25 (4 x 625 = 2,500 <= 1.5 x 1,755 = 2,632); 40 starts
    its own (5 x 1,600 > 1.5 x 3,980); 41 joins it (2 x 1,681 <= 1.5 x 3,281), 80 alone."""
    lengths = [25, 40, 17, 80, 21, 41, 20]
    assert attention.length_buckets(lengths) == [[2, 6, 4, 0], [1, 5], [3]]
    assert attention.length_buckets([7, 7, 7]) == [[0, 1, 2]]


def _sees_the_future(q, k, v):
    """A broken kernel for the check below: attention over every slot of the batch, later ones (pads) too."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])


@pytest.mark.parametrize("broken", [False, True])
def test_packed_attention_pads_like_lengths_into_one_call(broken, monkeypatch):
    """Eight rows of 17-25 tokens go in one padded call, a 60-token row alone: every row's output and gradients
    (bf16, the CPU backward) are within the bf16 bounds of its own float64 attention, so no real token sees a
    pad or another row. A kernel that lets tokens see later slots must fail the same check."""
    lengths = [20, 17, 60, 25, 22, 18, 24, 21, 19]
    bounds = tuple(int(b) for b in torch.tensor([0, *lengths]).cumsum(0))
    calls = []

    def counted(q, k, v):
        calls.append(q.shape[0])
        return (_sees_the_future if broken else causal_attention)(q, k, v)

    monkeypatch.setattr(attention, "causal_attention", counted)
    q, k, v, grad_out = _inputs(1, 4, 2, bounds[-1], 16)
    out = attention.packed_causal_attention(q, k, v, bounds)
    out.backward(grad_out)
    assert sorted(calls) == [1, 8]  # the 60-token row alone, the other eight padded to 25 in one call
    worst = 0.0
    for start, end in zip(bounds[:-1], bounds[1:]):
        row = slice(start, end)
        expected_out, expected_grads, mags = _reference(
            q[:, :, row], k[:, :, row], v[:, :, row], grad_out[:, :, row]
        )
        worst = max(worst, _worst(out[:, :, row].detach(), expected_out, mags["out"]))
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            worst = max(worst, _worst(tensor.grad[:, :, row], expected_grads[name], mags[name]))
    assert (worst > BOUND) == broken, f"worst error {worst:.3g} of its magnitude (bound {BOUND:.3g})"
