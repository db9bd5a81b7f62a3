"""Native CPU kernels of the rollout engine's decode step, built on first use with the host's C compiler.

decode.c holds the work of a decoder layer between its matmuls for one new token per row (the residual adds
and RMSNorms, RoPE, the KV write and attention over each row's own slots, SwiGLU): what it computes, how it
rounds and why. linear.c holds the bf16 projections on AMX tiles (`TiledLinear`, used by the rollout's
packed projections: models/packed_linear.py) and a decode step's layers in one call with them
(`DecodeStep.decode_layers`), where the compiler and the CPU have AMX (`linear_available()`; elsewhere the
projections stay oneDNN's). head.c, attention.c, norm.c and rope.c serve the training engine and every other
full forward: the fused LM head's softmax work (head.py), causal attention's backward (`attention_backward`),
RMSNorm (norm.py) and RoPE (rope.py).
`DecoderModel._decode_natively` runs a decode step's layers with them and torch's
projections, and a returning turn's new tokens the same way (each token a row of its sequence). They are
built once per source, compiler and CPU (the CPU's flags name the file: `-march=native` code runs only where
it was built) into the cache directory, then loaded with ctypes. Their OpenMP calls
resolve to the runtime torch has already loaded, so `torch.set_num_threads` sets their threads as it does
torch's.

Nothing here is required: without a C compiler, or with DOCKRL_NATIVE=off, `available()` is False and the
decoder keeps its torch path, which computes the same values up to the order of fp32 sums. Which one runs is
in `status()` (and in `dockrl bench rollout`'s output).

Environment: DOCKRL_NATIVE=off (never build or load), DOCKRL_NATIVE_LINEAR=off (decode.c's kernels, not
linear.c's tiles: for a before/after), CC (the compiler; default cc), DOCKRL_NATIVE_DIR (where
builds are kept; default $XDG_CACHE_HOME/dockrl/native or ~/.cache/dockrl/native).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("decode.c", "linear.c", "head.c", "attention.c", "norm.c", "rope.c")
)
HEADERS = (Path(__file__).with_name("bf16.h"),)  # included by the sources: part of the build's key
# -ffast-math: the sums vectorise (reassociation) and expf uses glibc's vector variants; contraction off: no
# FMA where torch rounds a product before adding (decode.c's header).
FLAGS = ("-O3", "-march=native", "-ffast-math", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "dockrl_add_rms_norm": ([_P, _I, _P, _I, _P, _P, _I, _I, _F], None),
    "dockrl_swiglu": ([_P, _I, _P, _I, _P, _I, _I], None),
    "dockrl_rope_attention": (
        [_P, _I, _P, _I, _P, _I]  # q, k, v rows and their strides
        + [_P, _P, _F, _P, _P]  # q_norm, k_norm, eps, cos, sin
        + [_P, _P, _I, _I, _I, _I]  # cache keys, values; row, head, block, slot strides
        + [_P, _I, _I, _I, _I]  # block table, its row stride, block size, blocks in the pool, capacity
        + [_P, _I]  # each query row's sequence (NULL: row b is sequence b), the cache's sequences
        + [_P, _P, _I, _P, _I]  # offsets, lengths, num_keys, bias, its row stride
        + [_P, _I, _I, _I, _I, _F],  # out, B, N, K, D, scale
        ctypes.c_int,
    ),
    # head.c (models/native/head.py): the fused LM head's softmax work; z, rows, vocab, ldz, temperature first
    "dockrl_head_max": ([_P, _I, _I, _I, _F, _P], None),  # peak
    "dockrl_head_sums": ([_P, _I, _I, _I, _F, _P, _P, _P], None),  # peak, sum_exp, weighted
    "dockrl_head_grad": (
        [_P, _I, _I, _I, _F, _P, _P, _P, _P]  # lse, mean_z, g_entropy, g_sum
        + [_P, _P, _P, _I, _P, _I],  # ids, g_ids, z_ids, m, dz, its row stride
        None,
    ),
    "dockrl_head_accumulate": ([_P, _P, _I], None),  # dst (fp32), src, n
    # attention.c (`attention_backward`): q, k, v, out, dout, dq, dk, dv, each with its strides, then B, N, K,
    # T, D, scale
    "dockrl_attention_backward": ([_P, _P] * 8 + [_I, _I, _I, _I, _I, _F], ctypes.c_int),
    # norm.c (models/native/norm.py): the training engine's RMSNorm, rows with their strides, then T, H:
    # x, w, out, r, eps (forward); x, w, r, g, g_x, g_w (backward)
    "dockrl_rms_norm_forward": ([_P, _I, _P, _P, _I, _P, _I, _I, _F], None),
    "dockrl_rms_norm_backward": ([_P, _I, _P, _P, _P, _I, _P, _I, _P, _I, _I], ctypes.c_int),
    # rope.c (models/native/rope.py): x or g with three strides, cos, signed sin with two, out, then B, T, H, D
    "dockrl_rope_forward": ([_P, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _I, _I], None),
    "dockrl_rope_backward": ([_P, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _I, _I], None),
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_LINEAR_SIGNATURES = {  # linear.c: the bf16 projections on AMX tiles, and a decode step's layers with them
    "dockrl_linear_ready": ([], ctypes.c_int),
    "dockrl_linear_pack_bf16": ([_P, _I, _I, _P], None),
    "dockrl_linear_bf16": ([_P, _I, _P, _P, _P, _I, _I, _I, _I], ctypes.c_int),
    "dockrl_decode_layers_bf16": ([_P, _I, _P], ctypes.c_int),
}


class _DecodeLayer(ctypes.Structure):
    """linear.c's DecodeLayer: what one layer owns in `DecodeStep.decode_layers`."""

    _fields_ = [
        *((name, _P) for name in ("ln1", "ln2", "q_norm", "k_norm")),
        *((name, _F) for name in ("eps1", "eps2", "qk_eps")),
        *((name, _P) for name in ("qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down")),
        *((name, _P) for name in ("down_bias", "cache_k", "cache_v")),
        *((name, _I) for name in ("row", "head", "block", "slot")),
    ]


class _DecodeRows(ctypes.Structure):
    """linear.c's DecodeRows: what a step's layers share."""

    _fields_ = [
        *((name, _P) for name in ("x", "h", "qkv", "attn", "pending", "gate_up", "act", "cos", "sin")),
        *((name, _P) for name in ("table", "cache_rows", "offsets", "lengths", "bias")),
        *((name, _I) for name in ("table_stride", "block_size", "num_blocks", "capacity", "num_rows")),
        *((name, _I) for name in ("num_keys", "bias_stride", "B", "H", "N", "K", "D", "I")),
        ("scale", _F),
    ]


# decode.c's bounds on the query heads per key/value head and on the head size
MAX_GROUP = 64
MAX_HEAD_DIM = 512

_lock = threading.Lock()
_kernels: dict[tuple[str, torch.dtype], Callable[..., Any]] | None = None
_linear: dict[str, Callable[..., Any]] | None = None  # linear.c's entry points where the tiles are usable
_linear_status = "not loaded yet"  # linear_status()
_status = "not loaded yet"


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def _build_dir() -> Path:
    if os.environ.get("DOCKRL_NATIVE_DIR"):
        return Path(os.environ["DOCKRL_NATIVE_DIR"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "dockrl" / "native"


def _compiler_version(compiler: str) -> str:
    done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
    return done.stdout.splitlines()[0] if done.stdout else ""


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler and CPU: built into the cache unless already there. Two
    processes building at once each write a temporary file and rename it into place (atomic)."""
    key = hashlib.sha256(
        b"\0".join(
            [
                *(source.read_bytes() for source in (*SOURCES, *HEADERS)),
                " ".join(FLAGS).encode(),
                _compiler_version(compiler).encode(),
                _cpu_flags().encode(),
            ]
        )
    ).hexdigest()[:16]
    target = _build_dir() / f"decode-{platform.machine()}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", partial, *LIBS],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _load() -> dict[tuple[str, torch.dtype], Callable[..., Any]] | None:
    global _kernels, _linear, _linear_status, _status
    if _kernels is not None or _status != "not loaded yet":
        return _kernels
    with _lock:
        if _kernels is not None or _status != "not loaded yet":
            return _kernels
        if os.environ.get("DOCKRL_NATIVE", "").lower() in ("0", "off", "false", "no"):
            _status = "off (DOCKRL_NATIVE)"
            return None
        compiler = os.environ.get("CC", "cc")
        if shutil.which(compiler) is None:
            _status = f"off: no C compiler ({compiler!r} is not on PATH; set CC)"
            return None
        try:
            library = ctypes.CDLL(str(_build(compiler)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _status = f"off: the build failed: {error}"
            return None
        kernels = {}
        for name, (argtypes, restype) in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                function = getattr(library, f"{name}_{suffix}")
                function.argtypes, function.restype = argtypes, restype
                kernels[name, dtype] = function
        linear = {}
        for name, (argtypes, restype) in _LINEAR_SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, restype
            linear[name] = function
        # ready() asks the kernel for this process's use of the tiles (built without AMX: always 0)
        if os.environ.get("DOCKRL_NATIVE_LINEAR", "").lower() in ("0", "off", "false", "no"):
            _linear_status = "off (DOCKRL_NATIVE_LINEAR)"
        elif not linear["dockrl_linear_ready"]():
            _linear_status = (
                "off: no AMX tiles (the CPU or the compiler has none, or the kernel did not grant them)"
            )
        else:
            _linear, _linear_status = linear, "on"
        _kernels, _status = kernels, "on"
        return kernels


def status() -> str:
    """'on', or why the native kernels are off ('not loaded yet' before the first `available()`)."""
    return _status


def available() -> bool:
    """Whether the kernels are built and loaded (building them on the first call)."""
    return _load() is not None


def linear_available() -> bool:
    """Whether the bf16 projections on AMX tiles (linear.c) run here: the kernels load, the compiler and the CPU
    have AMX, the kernel lets this process use the tiles, and DOCKRL_NATIVE_LINEAR is not off."""
    return _load() is not None and _linear is not None


def linear_status() -> str:
    """'on', or why the AMX projections are off."""
    return _status if _load() is None else _linear_status


def attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention's gradients (dq, dk, dv) in attention.c: q, out, grad_out [B, N, T, D] and k, v
    [B, K, T, D] (K divides N; fp32 or bf16, one dtype, the last dim contiguous), the scale D^-0.5.
    `available()` must be True."""
    assert _kernels is not None, "attention_backward needs available()"
    _check_attention((q, k, v, out, grad_out), q)
    grads = tuple(torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
    dq, dk, dv = _attention_call("dockrl_attention_backward", (q, k, v, out, grad_out), grads)
    return dq, dk, dv


def _check_attention(tensors: tuple[torch.Tensor, ...], q: torch.Tensor) -> None:
    """attention.c's operands: one dtype (fp32 or bf16), the last dim contiguous, K dividing N, q's shape for
    every [B, N, T, D] operand (the first three are q, k, v)."""
    if (
        len({t.dtype for t in tensors}) != 1
        or q.dtype not in _SUFFIX
        or any(t.stride(3) != 1 for t in tensors)
    ):
        raise ValueError("native attention needs one dtype (fp32 or bf16) and a contiguous last dim")
    k = tensors[1]
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] or any(t.shape != q.shape for t in tensors[3:]):
        raise ValueError(f"native attention: shapes {[tuple(t.shape) for t in tensors]} do not fit")


def _attention_call(
    name: str, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """Call attention.c's `name` with each tensor's pointer and (b, head, token) strides, then B, N, K, T, D and
    the scale D^-0.5; returns `outputs`."""
    assert _kernels is not None
    q, k = inputs[0], inputs[1]
    tensors = (*inputs, *outputs)
    strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in tensors]  # alive during the call
    args: list[Any] = []
    for t, stride in zip(tensors, strides):
        args += [t.data_ptr(), ctypes.cast(stride, ctypes.c_void_p)]
    batch, heads, seq, dim = q.shape
    if _kernels[name, q.dtype](*args, batch, heads, k.shape[1], seq, dim, dim**-0.5):
        raise MemoryError(f"{name}: a thread's scratch could not be allocated")
    return outputs


class TiledLinear:
    """y = x @ weight.T + bias on AMX tiles (linear.c): the bf16 weight [N, K] packed into the tiles' layout at
    construction (a copy: the caller's weight can change afterwards without changing this one). Any number of
    rows; `linear_available()` must be True."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        assert _linear is not None, "TiledLinear needs linear_available()"
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(
                f"TiledLinear needs a bf16 [N, K] CPU weight; got {weight.dtype} {tuple(weight.shape)}"
            )
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != weight.shape[:1]):
            raise ValueError(
                f"TiledLinear needs a bf16 bias [{weight.shape[0]}]; got {bias.dtype} {tuple(bias.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        tiles = -(-self.out_features // 16) * -(-self.in_features // 32)
        self.packed = torch.empty(tiles * 512, dtype=torch.bfloat16)
        _linear["dockrl_linear_pack_bf16"](
            weight.contiguous().data_ptr(), self.out_features, self.in_features, self.packed.data_ptr()
        )
        self.bias = None if bias is None else bias.contiguous().clone()
        self._call = _linear["dockrl_linear_bf16"]
        self._pointers = (self.packed.data_ptr(), None if self.bias is None else self.bias.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] bf16 (its last dim contiguous) -> [..., N] bf16."""
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"TiledLinear: x {x.dtype} {tuple(x.shape)} is not bf16 [..., {self.in_features}]"
            )
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.stride(1) != 1 or rows.stride(0) < self.in_features:
            rows = rows.contiguous()
        count = rows.shape[0]
        out = torch.empty(count, self.out_features, dtype=torch.bfloat16)
        if count > 0:
            packed, bias = self._pointers
            code = self._call(
                rows.data_ptr(),
                rows.stride(0),
                packed,
                bias,
                out.data_ptr(),
                self.out_features,
                count,
                self.out_features,
                self.in_features,
            )
            if code != 0:
                raise MemoryError("TiledLinear: no memory for the zero-padded copy of x")
        if x.dim() == 2:
            return out
        return out.reshape(*x.shape[:-1], self.out_features)


class TiledLayer(NamedTuple):
    """What `TiledStack` needs of one dense decoder layer whose packed projections are on tiles: its norms'
    weights and epsilons, q_norm / k_norm (weights and their eps; None: none), the fused q | k | v projection
    and its columns' widths, o, the fused gate | up and down."""

    input_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None
    qkv: TiledLinear
    qkv_widths: list[int]
    o: TiledLinear
    gate_up: TiledLinear
    down: TiledLinear


class TiledStack:
    """A model's dense decoder layers as linear.c's decode_layers reads them (`DecodeStep.decode_layers`): the
    per-layer arguments laid out once, when the packs are built (models/packed_linear.py), rather than at every
    step. It points at the layers' norm weights (in place: a weight update that rewrites them is seen; one that
    moves them rebuilds the packs) and holds the tiled projections; each layer's cache is filled in when the
    caches change. `linear_available()` must be True."""

    def __init__(self, layers: list[TiledLayer]) -> None:
        first = layers[0]
        self.qkv_widths = first.qkv_widths
        self.width = first.gate_up.out_features // 2  # the MLP's
        if len(self.qkv_widths) != 3 or self.qkv_widths[1] != self.qkv_widths[2]:
            raise ValueError(f"TiledStack needs q | k | v widths; got {self.qkv_widths}")
        self.layers = layers  # alive while pointed at
        self.specs = (_DecodeLayer * len(layers))()
        for spec, layer in zip(self.specs, layers):
            if layer.qkv_widths != self.qkv_widths or layer.gate_up.out_features != 2 * self.width:
                raise ValueError("TiledStack needs layers of one shape")
            spec.ln1, spec.eps1 = layer.input_norm[0].data_ptr(), layer.input_norm[1]
            spec.ln2, spec.eps2 = layer.post_norm[0].data_ptr(), layer.post_norm[1]
            if layer.head_norms is not None:
                spec.q_norm, spec.k_norm = layer.head_norms[0].data_ptr(), layer.head_norms[1].data_ptr()
                spec.qk_eps = layer.head_norms[2]
            for name in ("qkv", "o", "gate_up", "down"):
                weight, bias = getattr(layer, name)._pointers
                setattr(spec, name, weight)
                setattr(spec, f"{name}_bias", bias)
        self._caches: tuple[int, ...] = ()
        self.layout: tuple[int | None, ...] = ()

    def point_at(
        self, caches: list[tuple[torch.Tensor, torch.Tensor]], block_table: torch.Tensor | None
    ) -> None:
        """Each layer's (keys, values) cache into its arguments, where they are not there already."""
        key: tuple[int, ...] = ()  # paged: the table's pointer moves every step, so always filled in
        if block_table is None:
            key = tuple(part.data_ptr() for cache in caches for part in cache)
            if key == self._caches:
                return
        for spec, cache in zip(self.specs, caches, strict=True):
            self.layout = _cache_layout(cache, torch.bfloat16, block_table)
            spec.cache_k, spec.cache_v = cache[0].data_ptr(), cache[1].data_ptr()
            spec.row, spec.head, spec.block, spec.slot = self.layout[:4]
        self._caches = key


def _cache_layout(
    cache: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, block_table: torch.Tensor | None
) -> tuple[int | None, ...]:
    """rope_attention's cache arguments (row, head, block, slot strides; block table, its row stride, block
    size, blocks in the pool, capacity) of one layer's (keys, values): [B, K, S, D] slots, or with block_table
    [B, M] (int64) the paged pool's [K, num_blocks, block_size, D] (models/paged_cache.py)."""
    cache_k, cache_v = cache
    if cache_k.dtype != dtype or cache_k.stride() != cache_v.stride() or cache_k.stride(3) != 1:
        raise ValueError(
            "rope_attention needs a cache in the activations' dtype, keys and values alike, head dim contiguous"
        )
    if block_table is None:  # [B, K, S, D]
        return (cache_k.stride(0), cache_k.stride(1), 0, cache_k.stride(2), None, 0, 1, 1, cache_k.shape[2])
    if block_table.dtype != torch.int64 or block_table.stride(1) != 1:
        raise ValueError("rope_attention needs an int64 block table with contiguous rows")
    return (
        0,
        cache_k.stride(0),
        cache_k.stride(1),
        cache_k.stride(2),
        block_table.data_ptr(),
        block_table.stride(0),
        cache_k.shape[2],
        cache_k.shape[1],
        block_table.shape[1] * cache_k.shape[2],
    )


def _attention_failed(code: int, capacity: int | None, num_keys: int) -> None:
    """Raises the error rope_attention's return code names (0: none)."""
    if code == 3:
        raise ValueError(
            f"rope_attention: a row's offset is past the cache's {capacity} slots, its length outside [1, "
            f"{num_keys}], its sequence not in the cache, or one of its blocks not in the pool"
        )
    if code != 0:
        raise RuntimeError(
            f"rope_attention: the kernel returned {code} (1: group or head size past its bounds, 2: no memory)"
        )


def _row_stride(t: torch.Tensor) -> int:
    """The row stride of a [B, W] activation whose last dim is contiguous (a view of a fused projection's output
    is one)."""
    if t.dim() != 2 or (t.stride(1) != 1 and t.shape[1] != 1):
        raise ValueError(
            f"native kernels need [B, W] activations with a contiguous last dim; got {t.stride()}"
        )
    return t.stride(0)


class DecodeStep:
    """The kernels of one decode step (decode.c), bound to what its layers share: the residual stream x [B, H]
    (updated in place), RoPE's cos and signed sin [B, D], the rows' cache offsets and attended lengths [B]
    (int64), the additive bias [B, >= max(lengths)] (fp32; None: every key a row's length reaches is attended,
    and `num_keys` bounds the lengths instead of the bias's width) and, where the rows are not the cache's
    sequences in order (a returning turn's new tokens, each a row at its own offset, beside the decode rows of
    other sequences), each row's sequence in the cache `cache_rows` [B] (int64; None: row b is sequence b).
    Each layer then passes only its own tensors, so a call costs the C work and one ctypes call. `available()`
    must be True; every tensor is on the CPU, of x's dtype (fp32 or bf16; the KV cache too) but the fp32
    bias."""

    def __init__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        offsets: torch.Tensor,
        lengths: torch.Tensor,
        bias: torch.Tensor | None,
        head_dim: int,
        cache_rows: torch.Tensor | None = None,
        num_keys: int | None = None,
    ) -> None:
        assert _kernels is not None, "DecodeStep needs available()"
        if not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError("DecodeStep needs a contiguous x, cos and sin")
        if bias is not None and (bias.stride(1) != 1 or bias.dtype != torch.float32):
            raise ValueError("DecodeStep needs an fp32 bias with a contiguous last dim")
        if bias is None and num_keys is None:
            raise ValueError("DecodeStep needs a bias or num_keys")
        if offsets.dtype != torch.int64 or lengths.dtype != torch.int64:
            raise ValueError("DecodeStep needs int64 offsets and lengths")
        if cache_rows is not None and (cache_rows.dtype != torch.int64 or cache_rows.shape != offsets.shape):
            raise ValueError("DecodeStep needs int64 cache_rows, one per row")
        dtype = x.dtype
        self._norm = _kernels["dockrl_add_rms_norm", dtype]
        self._swiglu = _kernels["dockrl_swiglu", dtype]
        self._attention = _kernels["dockrl_rope_attention", dtype]
        self.x, self.h = x, torch.empty_like(x)
        rows = None if cache_rows is None else cache_rows.contiguous()
        # alive while pointed at
        self._keep = (cos, sin, offsets.contiguous(), lengths.contiguous(), bias, rows)
        self._cache_rows = None if rows is None else rows.data_ptr()
        self.batch, self.hidden = x.shape
        self.head_dim = head_dim
        if bias is not None:
            num_keys = bias.shape[1]
        assert num_keys is not None
        self.num_keys = num_keys
        self._rope = (cos.data_ptr(), sin.data_ptr())
        self._rows = (self._keep[2].data_ptr(), self._keep[3].data_ptr())
        self._bias = (None, 0) if bias is None else (bias.data_ptr(), bias.stride(0))
        self._out: torch.Tensor | None = None  # attention's output, reused by every layer ([B, N D])
        self._act: torch.Tensor | None = None  # SwiGLU's output, reused by every layer ([B, I])

    def add_rms_norm(self, add: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += add (None: nothing), then h = RMSNorm(x) * weight (as rms_norm.RMSNorm rounds); returns h [B, H]
        (the same buffer every call: the caller consumes it before the next)."""
        x = self.x
        if add is not None and add.shape != x.shape:
            raise ValueError(f"add_rms_norm: add {tuple(add.shape)} is not x's {tuple(x.shape)}")
        self._norm(
            x.data_ptr(),
            self.hidden,
            None if add is None else add.data_ptr(),
            0 if add is None else _row_stride(add),
            weight.data_ptr(),
            self.h.data_ptr(),
            self.batch,
            self.hidden,
            eps,
        )
        return self.h

    def rope_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        norms: tuple[torch.Tensor, torch.Tensor, float] | None,
        cache: tuple[torch.Tensor, torch.Tensor],
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's attention: q [B, N D], k, v [B, K D] (views of one fused output allowed), per-head norms
        (q_norm and k_norm weights [D] and their eps; None: none), RoPE, k and v written into the layer's cache
        (in the activations' dtype) at the offsets, attention over each row's own slots -> [B, N D] (the same
        buffer every layer). The cache: (keys, values) [B, K, S, D] (slots), or with block_table [B, M] (int64)
        the paged pool's [K, num_blocks, block_size, D] (models/paged_cache.py). Raises ValueError on an offset or
        length out of the cache's range, or a block a row reads that the pool does not have."""
        rows = (q.data_ptr(), _row_stride(q), k.data_ptr(), _row_stride(k), v.data_ptr(), _row_stride(v))
        heads = (q.shape[1] // self.head_dim, k.shape[1] // self.head_dim)
        return self._attend(rows, heads, q.dtype, norms, cache, block_table)

    def rope_attention_fused(
        self,
        qkv: torch.Tensor,
        widths: list[int],
        norms: tuple[torch.Tensor, torch.Tensor, float] | None,
        cache: tuple[torch.Tensor, torch.Tensor],
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rope_attention` of a fused projection's output qkv [B, N D + 2 K D] (q | k | v, `widths` their
        columns), read in place: no views to make."""
        stride, size = _row_stride(qkv), qkv.element_size()
        if len(widths) != 3 or sum(widths) != qkv.shape[1] or widths[1] != widths[2]:
            raise ValueError(
                f"rope_attention_fused: widths {widths} are not q | k | v of {qkv.shape[1]} columns"
            )
        q_ptr = qkv.data_ptr()
        k_ptr = q_ptr + widths[0] * size
        rows = (q_ptr, stride, k_ptr, stride, k_ptr + widths[1] * size, stride)
        heads = (widths[0] // self.head_dim, widths[1] // self.head_dim)
        return self._attend(rows, heads, qkv.dtype, norms, cache, block_table)

    def _attend(
        self,
        rows: tuple[int, ...],
        heads: tuple[int, int],
        dtype: torch.dtype,
        norms: tuple[torch.Tensor, torch.Tensor, float] | None,
        cache: tuple[torch.Tensor, torch.Tensor],
        block_table: torch.Tensor | None,
    ) -> torch.Tensor:
        """The kernel call of `rope_attention`: q, k, v as (pointer, row stride) x 3, (N, K) heads."""
        cache_k, cache_v = cache
        layout = _cache_layout(cache, dtype, block_table)
        if self._out is None:
            self._out = torch.empty(self.batch, heads[0] * self.head_dim, dtype=dtype)
        out = self._out
        num_keys = self.num_keys if block_table is not None else min(self.num_keys, cache_k.shape[2])
        code = self._attention(
            *rows,
            None if norms is None else norms[0].data_ptr(),
            None if norms is None else norms[1].data_ptr(),
            0.0 if norms is None else norms[2],
            *self._rope,
            cache_k.data_ptr(),
            cache_v.data_ptr(),
            *layout,
            self._cache_rows,
            cache_k.shape[0] if block_table is None else block_table.shape[0],
            *self._rows,
            num_keys,
            *self._bias,
            out.data_ptr(),
            self.batch,
            heads[0],
            heads[1],
            self.head_dim,
            self.head_dim**-0.5,
        )
        _attention_failed(code, layout[-1], num_keys)
        return out

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate, up [B, I] (views of one fused output allowed) -> [B, I] (the same buffer
        every layer), as F.silu and * round."""
        if gate.shape != up.shape:
            raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        return self._swiglu_call(
            gate.data_ptr(), _row_stride(gate), up.data_ptr(), _row_stride(up), gate.shape, gate.dtype
        )

    def swiglu_fused(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`swiglu` of a fused projection's output gate_up [B, 2 I] (gate | up), read in place."""
        width = gate_up.shape[1] // 2
        stride = _row_stride(gate_up)
        up_ptr = gate_up.data_ptr() + width * gate_up.element_size()
        return self._swiglu_call(
            gate_up.data_ptr(), stride, up_ptr, stride, (gate_up.shape[0], width), gate_up.dtype
        )

    def _swiglu_call(
        self,
        gate_ptr: int,
        gate_stride: int,
        up_ptr: int,
        up_stride: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        if self._act is None:
            self._act = torch.empty(shape, dtype=dtype)
        act = self._act
        self._swiglu(gate_ptr, gate_stride, up_ptr, up_stride, act.data_ptr(), *act.shape)
        return act

    def decode_layers(
        self,
        stack: TiledStack,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_table: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every layer of a decode step in one native call (linear.c's decode_layers: per layer the norms, the
        tiled projections, `rope_attention_fused` and `swiglu_fused` as `DecoderModel._decode_natively` calls
        them one by one, so the same values), x updated in place; caches: each layer's (keys, values), as
        `rope_attention` takes them. Returns the last layer's output [B, H] (the same buffer every call), which
        the final norm adds. bf16 only; `linear_available()` must be True."""
        assert _linear is not None, "decode_layers needs linear_available()"
        batch, hidden, dtype = self.batch, self.hidden, self.x.dtype
        if dtype != torch.bfloat16:
            raise ValueError(f"decode_layers needs bf16 rows; got {dtype}")
        stack.point_at(caches, block_table)
        layout, widths, width = stack.layout, stack.qkv_widths, stack.width
        buffers = {
            "qkv": torch.empty(batch, sum(widths), dtype=dtype),
            "attn": torch.empty(batch, widths[0], dtype=dtype),
            "pending": torch.empty(batch, hidden, dtype=dtype),
            "gate_up": torch.empty(batch, 2 * width, dtype=dtype),
            "act": torch.empty(batch, width, dtype=dtype),
        }
        cache_k = caches[0][0]
        num_keys = self.num_keys if block_table is not None else min(self.num_keys, cache_k.shape[2])
        rows = _DecodeRows(
            x=self.x.data_ptr(),
            h=self.h.data_ptr(),
            **{name: buffer.data_ptr() for name, buffer in buffers.items()},
            cos=self._rope[0],
            sin=self._rope[1],
            table=layout[4],
            cache_rows=self._cache_rows,
            offsets=self._rows[0],
            lengths=self._rows[1],
            bias=self._bias[0],
            table_stride=layout[5],
            block_size=layout[6],
            num_blocks=layout[7],
            capacity=layout[8],
            num_rows=cache_k.shape[0] if block_table is None else block_table.shape[0],
            num_keys=num_keys,
            bias_stride=self._bias[1],
            B=batch,
            H=hidden,
            N=widths[0] // self.head_dim,
            K=widths[1] // self.head_dim,
            D=self.head_dim,
            I=width,
            scale=self.head_dim**-0.5,
        )
        code = _linear["dockrl_decode_layers_bf16"](
            ctypes.addressof(stack.specs), len(stack.specs), ctypes.addressof(rows)
        )
        _attention_failed(code, layout[8], num_keys)
        return buffers["pending"]
