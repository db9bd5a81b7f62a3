"""models/native/rope.py: decoder.apply_rope on the native kernels gives torch's ops' bits, forward and backward,
in both dtypes, for the projection's strided views and for angles shared by every row; a broken kernel is caught."""

from __future__ import annotations

import pytest
import torch

from dockrl.models import decoder
from dockrl.models.native.rope import RopeKernels, rope_kernels

KERNELS = rope_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the native kernels do not build here")


def torch_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """decoder.apply_rope's torch ops."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def _case(dtype, batch, seq, heads, dim, angle_rows):
    g = torch.Generator().manual_seed(batch * 1000 + seq)
    # q as Attention.forward makes it: the projection's output [B, T, H D] viewed [B, H, T, D]
    proj = (2 * torch.randn(batch, seq, heads * dim + 8, generator=g)).to(dtype).requires_grad_()
    cos = torch.randn(angle_rows, 1, seq, dim, generator=g).to(dtype)
    sin = torch.randn(angle_rows, 1, seq, dim, generator=g).to(dtype)
    grad = torch.randn(batch, heads, seq, dim, generator=g).to(dtype)
    return proj, cos, sin, grad


def _view(proj, heads, dim):
    batch, seq = proj.shape[:2]
    return proj[..., : heads * dim].reshape(batch, seq, heads, dim).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch, seq, heads, dim, angle_rows",
    [
        (1, 143, 8, 32, 1),
        (3, 37, 4, 64, 3),
        (2, 5, 2, 16, 1),
        (2, 300, 8, 32, 2),
    ],  # the last past OpenMP's bar
)
def test_native_rope_is_torchs_bit_for_bit(dtype, batch, seq, heads, dim, angle_rows, monkeypatch):
    proj, cos, sin, grad = _case(dtype, batch, seq, heads, dim, angle_rows)
    calls: list[str] = []
    monkeypatch.setattr(decoder, "rope_kernels", lambda: _Counting(KERNELS._kernels, calls))
    expected = torch_rope(_view(proj, heads, dim), cos, sin)
    (expected_grad,) = torch.autograd.grad(expected, proj, grad)
    out = decoder.apply_rope(_view(proj, heads, dim), cos, sin)
    (out_grad,) = torch.autograd.grad(out, proj, grad)
    assert calls == ["forward", "backward"]  # the native kernels ran
    assert (
        out.stride() == expected.stride()
    )  # in torch's memory order (attention and o_proj see what they saw)
    assert torch.equal(out, expected) and torch.equal(out_grad, expected_grad)
    with torch.no_grad():  # without a gradient to compute: the forward alone, the same bits
        assert torch.equal(decoder.apply_rope(_view(proj, heads, dim), cos, sin), expected)
    # the check sees a wrong rotation: the angles swapped, or the backward's roll left out
    assert not torch.equal(KERNELS.forward(_view(proj, heads, dim), sin, cos), expected)
    wrong = KERNELS.backward(grad, cos, torch.roll(sin, dim // 2, dims=-1))
    assert not torch.equal(wrong, _view(expected_grad, heads, dim))


def test_angles_with_a_gradient_keep_torchs_ops():
    proj, cos, sin, grad = _case(torch.float32, 1, 9, 2, 16, 1)
    cos.requires_grad_()
    out = decoder.apply_rope(_view(proj, 2, 16), cos, sin)
    grads = torch.autograd.grad(out, (proj, cos), grad)
    expected = torch.autograd.grad(torch_rope(_view(proj, 2, 16), cos, sin), (proj, cos), grad)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


class _Counting(RopeKernels):
    """The kernels, each call named in `calls`."""

    def __init__(self, kernels, calls: list[str]) -> None:
        super().__init__(kernels)
        self.calls = calls

    def forward(self, x, cos, sin):
        self.calls.append("forward")
        return super().forward(x, cos, sin)

    def backward(self, grad, cos, sin):
        self.calls.append("backward")
        return super().backward(grad, cos, sin)
