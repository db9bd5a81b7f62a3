"""models/rms_norm.py: Hugging Face's forward bit for bit, a backward written out within one unit in the last
place of autograd's, and only x and the rsqrt kept for it."""

from __future__ import annotations

import pytest
import torch

from dockrl.models.rms_norm import RMSNorm

EPS = 1e-6


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen2RMSNorm.forward, autograd through every op."""
    input_dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * xf.to(input_dtype)


def _inputs(dtype: torch.dtype, shape=(3, 37, 128)):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_()
    norm = RMSNorm(shape[-1], EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(shape[-1], generator=g))
    grad = torch.randn(shape, generator=g).to(dtype)
    return x, norm, grad


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at |t| (floats of t's dtype around each element)."""
    finfo = torch.finfo(t.dtype)
    exponent = torch.floor(torch.log2(t.abs().double().clamp_min(finfo.tiny)))
    return torch.exp2(exponent) * finfo.eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_hugging_faces_bit_for_bit(dtype):
    x, norm, _ = _inputs(dtype)
    assert torch.equal(norm(x), hf_rms_norm(x, norm.weight))
    with torch.no_grad():  # no gradient to compute: the forward alone, not the autograd Function
        assert torch.equal(norm(x), hf_rms_norm(x, norm.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_autograds_up_to_reassociation(dtype):
    """Both compute the same fp32 expressions in another order: at most D eps_fp32 of the terms' magnitude apart
    before the final rounding to x's dtype, which that can move by at most one unit in the last place. Dropping
    the mean term (x r^3 mean(g_y x)) or the weight's factor fails this by orders of magnitude."""
    x, norm, grad = _inputs(dtype)
    ours = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    theirs = torch.autograd.grad(hf_rms_norm(x, norm.weight), (x, norm.weight), grad)
    xf, dim = x.detach().float(), x.shape[-1]
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    grad_y = (grad * norm.weight.detach()).float()
    terms = (rstd * grad_y).abs() + (xf * rstd.pow(3) * (grad_y * xf).abs().mean(-1, keepdim=True)).abs()
    bound = dim * torch.finfo(torch.float32).eps * terms
    if dtype != torch.float32:
        bound = bound + _ulp(theirs[0]).float()
    assert ((ours[0].float() - theirs[0].float()).abs() <= bound).all()
    # the weight's gradient: a sum over the 111 tokens of the same bf16 products, in another order
    weight_terms = (grad.float() * (xf * rstd).to(dtype).float()).abs().reshape(-1, dim).sum(0)
    weight_bound = x.numel() // dim * torch.finfo(torch.float32).eps * weight_terms
    if dtype != torch.float32:
        weight_bound = weight_bound + _ulp(theirs[1]).float()
    assert ((ours[1].float() - theirs[1].float()).abs() <= weight_bound).all()


def test_only_the_gradients_asked_for_are_computed():
    x, norm, grad = _inputs(torch.bfloat16)
    norm.weight.requires_grad_(False)
    (grad_x,) = torch.autograd.grad(norm(x), (x,), grad)
    (expected,) = torch.autograd.grad(hf_rms_norm(x, norm.weight), (x,), grad)
    assert (grad_x.float() - expected.float()).abs().max() <= _ulp(expected).max()
    norm.weight.requires_grad_(True)
    (grad_weight,) = torch.autograd.grad(norm(x.detach()), (norm.weight,), grad)
    assert grad_weight.shape == norm.weight.shape and grad_weight.dtype == torch.bfloat16


def test_the_backward_keeps_x_and_the_rsqrt_only():
    """bf16 x [T, H]: x (2 T H bytes) and the fp32 rsqrt (4 T), not autograd's fp32 copy of x and the bf16 y
    (4 T H + 2 T H); the weight is the module's own."""
    x, norm, _ = _inputs(torch.bfloat16, shape=(64, 128))
    kept: dict[int, int] = {}

    def pack(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        norm(x)
    kept.pop(norm.weight.untyped_storage().data_ptr())
    assert sum(kept.values()) == 64 * 128 * 2 + 64 * 4
