"""models/rms_norm.py: Hugging Face's forward bit for bit, a backward written out within fp32 rounding of the exact
gradient, and only x and the rsqrt kept for it; the native kernels (models/native/norm.py) within the same bounds
of the exact values, broken ones caught."""

from __future__ import annotations

import pytest
import torch

from dockrl.models.native.norm import NormKernels, norm_kernels
from dockrl.models.rms_norm import AUTO, RMSNorm, use_norm_kernels

EPS = 1e-6
NATIVE = norm_kernels()
PATHS = [
    "torch",
    pytest.param(
        "native", marks=pytest.mark.skipif(NATIVE is None, reason="the native kernels do not build here")
    ),
]


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen2RMSNorm.forward, autograd through every op."""
    input_dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * xf.to(input_dtype)


def _inputs(dtype: torch.dtype, shape=(3, 37, 128), path: str = "torch"):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_()
    norm = RMSNorm(shape[-1], EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(shape[-1], generator=g))
    grad = torch.randn(shape, generator=g).to(dtype)
    use_norm_kernels(norm, NATIVE if path == "native" else None)
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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [(3, 37, 128), (2, 300, 128)]
)  # the second past the kernels' OpenMP threshold
def test_backward_is_within_fp32_rounding_of_the_exact_gradient(dtype, path, shape):
    """Against the exact gradient of the same inputs (float64): g_x's error is g_y's rounding to x's dtype (u r |g
    w|, as autograd's), fp32 sums of H terms and a few fp32 ops on both of its terms (4 (H + 2) eps_fp32), and the
    final rounding (one ulp of the result); g_weight's is an fp32 sum over the T tokens of |g x r| with r's own
    error ((T + H + 4) eps_fp32) and its rounding. Dropping the mean term (x r^3 mean(g_y x)) or the weight's
    factor misses these by orders of magnitude (shown on the native kernels: broken ones below)."""
    x, norm, grad = _inputs(dtype, shape, path=path)
    ratios = _gradient_error_ratios(x, norm, grad)
    assert ratios["x"] <= 1 and ratios["weight"] <= 1, ratios
    if path == "native":
        for kind in (_NativeWithoutTheMeanTerm, _NativeWithoutTheWeight):
            use_norm_kernels(norm, kind(NATIVE._kernels))
            assert _gradient_error_ratios(x, norm, grad)["x"] > 1, kind.__name__


def _gradient_error_ratios(x: torch.Tensor, norm: RMSNorm, grad: torch.Tensor) -> dict[str, float]:
    """The largest |error| / bound of each gradient against float64 (the test's docstring)."""
    dtype = x.dtype
    grad_x, grad_weight = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    x64, w64, g64 = x.detach().double(), norm.weight.detach().double(), grad.double()
    r = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    dim, tokens = x.shape[-1], x.numel() // x.shape[-1]
    exact_x = r * g64 * w64 - x64 * r.pow(3) * (g64 * w64 * x64).mean(-1, keepdim=True)
    exact_weight = (g64 * x64 * r).reshape(-1, dim).sum(0)
    eps32, unit = torch.finfo(torch.float32).eps, torch.finfo(dtype).eps / 2
    first = r * (g64 * w64).abs()
    second = x64.abs() * r.pow(3) * (g64 * w64 * x64).abs().mean(-1, keepdim=True)
    bound_x = unit * first + 4 * (dim + 2) * eps32 * (first + second) + _ulp(exact_x.to(dtype)).double()
    terms = (g64 * x64 * r).abs().reshape(-1, dim).sum(0)
    bound_weight = (tokens + dim + 4) * eps32 * terms + _ulp(exact_weight.to(dtype)).double()
    return {
        "x": ((grad_x.double() - exact_x).abs() / bound_x).max().item(),
        "weight": ((grad_weight.double() - exact_weight).abs() / bound_weight).max().item(),
    }


class _NativeWithoutTheMeanTerm(NormKernels):
    """g_x = g_y r: the kernels given x = 0 for g_x (the weight's gradient from the right call)."""

    def backward(self, x, weight, rstd, grad, need_x, need_weight):
        grad_x, _ = super().backward(torch.zeros_like(x), weight, rstd, grad, need_x, False)
        return grad_x, super().backward(x, weight, rstd, grad, False, need_weight)[1]


class _NativeWithoutTheWeight(NormKernels):
    """g_x as if the weight were ones."""

    def backward(self, x, weight, rstd, grad, need_x, need_weight):
        grad_x, _ = super().backward(x, torch.ones_like(weight), rstd, grad, need_x, False)
        return grad_x, super().backward(x, weight, rstd, grad, False, need_weight)[1]


@pytest.mark.skipif(NATIVE is None, reason="the native kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_forward_is_within_fp32_rounding_of_the_exact_values(dtype):
    """out = E(w E(x r)): against float64 w x r, r's sum of H squares in another order moves it by (H + 4) eps_fp32
    relative, which may flip E(x r) by one ulp of it, and the last rounding is one ulp of out; Hugging Face's
    own forward meets the same bound. The same values with or without a gradient to compute (the update's
    forward and the reference's are one computation), and the weight left out is caught."""
    x, norm, _ = _inputs(dtype, shape=(4, 70, 256), path="native")  # past the kernels' OpenMP threshold
    x64, w64 = x.detach().double(), norm.weight.detach().double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    eps32 = torch.finfo(torch.float32).eps
    bound = (
        w64.abs() * (y.abs() * (x.shape[-1] + 4) * eps32 + _ulp(y.to(dtype)).double())
        + _ulp((w64 * y).to(dtype)).double()
    )

    def ratio(out: torch.Tensor) -> float:
        return ((out.double() - w64 * y).abs() / bound).max().item()

    out = norm(x)
    assert ratio(out) <= 1 and ratio(hf_rms_norm(x, norm.weight)) <= 1
    with torch.no_grad():
        assert torch.equal(norm(x), out)
        use_norm_kernels(norm, AUTO)  # a norm's default: the native kernels where they load
        assert torch.equal(norm(x), out)
    assert ratio(NATIVE.forward(x.detach(), torch.ones_like(norm.weight), EPS)[0]) > 1


@pytest.mark.parametrize("path", PATHS)
def test_only_the_gradients_asked_for_are_computed(path):
    x, norm, grad = _inputs(torch.bfloat16, path=path)
    both = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    norm.weight.requires_grad_(False)
    (grad_x,) = torch.autograd.grad(norm(x), (x,), grad)
    assert torch.equal(grad_x, both[0])
    norm.weight.requires_grad_(True)
    (grad_weight,) = torch.autograd.grad(norm(x.detach()), (norm.weight,), grad)
    assert torch.equal(grad_weight, both[1]) and grad_weight.dtype == torch.bfloat16


@pytest.mark.parametrize("path", PATHS)
def test_the_backward_keeps_x_and_the_rsqrt_only(path):
    """bf16 x [T, H]: x (2 T H bytes) and the fp32 rsqrt (4 T), not autograd's fp32 copy of x and the bf16 y
    (4 T H + 2 T H); the weight is the module's own."""
    x, norm, _ = _inputs(torch.bfloat16, shape=(64, 128), path=path)
    kept: dict[int, int] = {}

    def pack(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        norm(x)
    kept.pop(norm.weight.untyped_storage().data_ptr())
    assert sum(kept.values()) == 64 * 128 * 2 + 64 * 4


@pytest.mark.skipif(NATIVE is None, reason="the native kernels do not build here")
def test_native_gradients_do_not_depend_on_the_thread_count():
    """The weight's gradient sums fixed ranges of rows, then the ranges in order (norm.c): the same bits on one
    thread and on two (a resumed run may use another count)."""
    x, norm, grad = _inputs(torch.bfloat16, shape=(2, 300, 128), path="native")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.autograd.grad(norm(x), (x, norm.weight), grad)
        torch.set_num_threads(2)
        two = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
