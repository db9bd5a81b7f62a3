"""The roofline a benchmark's passes are measured against: the host's matmul peak and memory bandwidth, measured
once per bench run, and the matmul work and memory traffic of each pass, counted from the model's shape.

Work (FLOP) of one forward pass over a sequence of L tokens (`forward_flops`):

    2 x matmul_params x L                      every projection, the MLP (an MoE layer's k routed experts and its
                                               router) and the LM head, once per token; an untied embedding is a
                                               lookup (no FLOPs), a tied one is counted once, as the head
  + layers x 4 x L^2 x (heads x head_dim)      attention's two score matmuls (Q K^T and P V, 2 L^2 d each) over
                                               the full square, what a dense kernel computes (a causal kernel
                                               that skips the masked half does half of this)

A pass's work is `PASS_FORWARDS[pass]` forward-equivalents of that: 1 for a forward (rollout, reference, old
log-probs), 3 for forward and backward (update: the backward pass is two matmuls per forward matmul). Recomputed
activations (checkpointing) are not counted: they are overhead, not the pass's work.

Traffic of one decode step (`decode_step_bytes`; a whole rollout: `decode_bytes`): every matmul weight read once
per rank (the embedding's rows of the batch only, left out) plus each sequence's K and V cache up to its
position, in their dtypes. A decode step cannot run faster than that traffic over the measured bandwidth, so its
bytes / seconds / bandwidth (`share`) is its share of the bandwidth bound.

Attainable time of a whole rollout (`rollout_seconds`; a measured rollout's `decode_roofline_share` is it over
the measured seconds). A decode step of M rows reads the weights once but multiplies them by M rows: its work is
2 x matmul_params x M plus attention's 4 x layers x heads x head_dim x (context + 1) per row (the positions its
new token attends to). Above the machine balance (peak FLOP/s over bandwidth, ~11 rows in bf16 at 392 GFLOP/s
and 35 GB/s) a step is compute-bound and the bandwidth share understates how near it is to what the machine can
do; so each step takes max(its bytes / bandwidth, its FLOPs / the peak of its dtype), over the steps of
`decode_bytes`'s continuous-batching model (max(lengths) steps, one per new token, the first included; a sequence
that ended does nothing), plus the prefill: a forward over the prompts at the matmul peak. Both terms are lower
bounds of their own, so the sum is what no schedule of these steps can beat (up to the first token, which the
prefill's logits give and the model also counts as a decode step: one step per sequence too many).

Peak (`measure_peak`): the best of `repeats` timed n x n matmuls per dtype (fp32; bf16 only where the CPU
computes it natively, `cpu_has_native_bf16`), and a stream of large copies and adds (bytes read + written per
second), at the thread count the run uses. Shares are a pass's FLOPs over its seconds x the peak: 1.0 is the
machine's best on large square matmuls, which small-batch passes cannot reach.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

# forward-equivalents of matmul work per pass (see the module docstring)
PASS_FORWARDS: dict[str, int] = {"rollout": 1, "reference": 1, "old_logprobs": 1, "update": 3}


def matmul_params(args: Any) -> int:
    """Weights a token's forward pass multiplies by (a models.config.ModelArgs): attention's q, k, v, o
    projections, the MLP (an MoE layer: its k routed experts and the router), and the LM head once."""
    hidden, q_width = args.hidden_size, args.num_heads * args.head_dim
    kv_width = args.num_kv_heads * args.head_dim
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
    dense = 3 * hidden * args.intermediate_size
    moe = args.num_experts_per_tok * 3 * hidden * args.moe_intermediate_size + hidden * args.num_experts
    mlps = sum(moe if args.num_experts and args.is_moe_layer(i) else dense for i in range(args.num_layers))
    return args.num_layers * attention + mlps + args.vocab_size * hidden


def forward_flops(args: Any, lengths: Sequence[float]) -> float:
    """Matmul FLOPs of one forward pass over sequences of these lengths (tokens each, prompt and response)."""
    width = args.num_heads * args.head_dim
    linear = 2 * matmul_params(args) * sum(lengths)
    attention = args.num_layers * 4 * width * sum(n * n for n in lengths)
    return float(linear + attention)


def pass_flops(args: Any, pass_name: str, lengths: Sequence[float]) -> float:
    """Matmul FLOPs of a pass (`PASS_FORWARDS`: rollout, reference, old_logprobs, update) over the sequences."""
    return PASS_FORWARDS[pass_name] * forward_flops(args, lengths)


def decode_step_bytes(
    args: Any, contexts: Sequence[float], *, weight_bytes: int, kv_bytes: int, ranks: int = 1
) -> float:
    """Bytes one decode step reads: the matmul weights (`weight_bytes` each) once per rank, and each sequence's K
    and V cache (`kv_bytes` each: engines/rollout/kv_layouts.cache_dtype, the weights' dtype where the native
    decode kernels run, fp32 on a CPU without them) over its
    `contexts` (tokens before the new one) in every layer."""
    kv_per_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim
    return float(weight_bytes * ranks * matmul_params(args) + kv_bytes * kv_per_token * sum(contexts))


def decode_bytes(
    args: Any, prompt_len: int, lengths: Sequence[int], *, weight_bytes: int, kv_bytes: int
) -> float:
    """Bytes a whole rollout's decode steps read on one rank: max(lengths) steps, each reading the weights, and
    every sequence's cache over the tokens before each of its new tokens (prompt_len + t for t < its length),
    a sequence that has ended reading nothing (continuous batching)."""
    kv_per_token = 2 * args.num_layers * args.num_kv_heads * args.head_dim
    contexts = sum(n * prompt_len + n * (n - 1) / 2 for n in lengths)
    return float(weight_bytes * max(lengths) * matmul_params(args) + kv_bytes * kv_per_token * contexts)


def rollout_seconds(
    args: Any,
    prompt_len: int,
    lengths: Sequence[int],
    *,
    weight_bytes: int,
    kv_bytes: int,
    flops_per_s: float,
    bytes_per_s: float,
    ranks: int = 1,
) -> float:
    """The attainable seconds of a whole rollout (see the module docstring): the prefill, a forward over the
    `len(lengths)` prompts of `prompt_len` tokens at `flops_per_s`, plus max(lengths) decode steps, each
    max(bytes / `bytes_per_s`, FLOPs / `flops_per_s`) over the sequences still running (`lengths` new tokens
    each); `ranks` read the weights once each per step (their rows split over them), as in decode_step_bytes."""
    row_flops = 2 * matmul_params(args)
    attention_per_position = 4 * args.num_layers * args.num_heads * args.head_dim
    seconds = forward_flops(args, [prompt_len] * len(lengths)) / flops_per_s
    for step in range(max(lengths)):
        rows = sum(1 for n in lengths if n > step)
        context = prompt_len + step  # tokens before each running row's new one
        step_bytes = decode_step_bytes(
            args, [context] * rows, weight_bytes=weight_bytes, kv_bytes=kv_bytes, ranks=ranks
        )
        step_flops = rows * (row_flops + attention_per_position * (context + 1))
        seconds += max(step_bytes / bytes_per_s, step_flops / flops_per_s)
    return float(seconds)


def share(work: float, seconds: float, rate: float) -> float | None:
    """work / seconds over the rate (FLOP/s or bytes/s): the share of the roofline a pass reached."""
    if seconds <= 0 or rate <= 0:
        return None
    return work / seconds / rate


def measure_peak(threads: int, *, size: int = 2048, repeats: int = 5, stream_mb: int = 256) -> dict[str, Any]:
    """The host's matmul peak per dtype (GFLOP/s) and memory bandwidth (GB/s) at `threads` torch threads, each
    the best of `repeats` runs: {"threads", "fp32_gflops", "bf16_gflops" (only where native), "bandwidth_gbs"}.
    Restores torch's thread count."""
    import torch

    from dockrl.recipes.preflight import cpu_has_native_bf16

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out: dict[str, Any] = {"threads": threads, "matmul_n": size}
        dtypes = {"fp32": torch.float32} | ({"bf16": torch.bfloat16} if cpu_has_native_bf16() else {})
        for name, dtype in dtypes.items():
            square = _Square(size, dtype)
            out[f"{name}_gflops"] = square.flops / _best(square, repeats) / 1e9
        n = stream_mb * 2**20 // 4
        x, y, z = torch.ones(n), torch.ones(n), torch.empty(n)
        copy_s = _best(lambda: z.copy_(x), repeats)  # reads x, writes z
        add_s = _best(lambda: torch.add(x, y, out=z), repeats)  # reads x and y, writes z
        out["bandwidth_gbs"] = max(2 * 4 * n / copy_s, 3 * 4 * n / add_s) / 1e9
        return out
    finally:
        torch.set_num_threads(before)


def _best(fn: Any, repeats: int) -> float:
    fn()  # warm up (allocations, kernel selection)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def shape_bound(
    args: Any,
    lengths: Sequence[float],
    precision: str,
    *,
    threads: int = 1,
    budget: int = 4096,
    repeats: int = 3,
    size: int = 2048,
) -> dict[str, float] | None:
    """The share of the matmul peak that one rank's update and reference passes could reach at their own shapes:
    every matmul of the pass (a dense model's seven projections per layer and the LM head in the fused head's
    chunks; the update's two backward matmuls beside each forward one: d input and d weight) timed alone with
    torch at `threads` threads in `precision`, the rank's sequences (`lengths`) in micro-batches of at most
    `budget` tokens, each against a `size` x `size` matmul timed beside it (`_peak_costs`); attention's FLOPs
    at the peak (a bound its kernels cannot beat). The pass's FLOPs (`pass_flops`) over what its matmuls cost
    in FLOPs at the peak: {"update", "reference", "peak_gflops" (the best square matmul seen)}. A pass cannot
    reach more than this share of the peak whatever runs around its matmuls. Shapes larger than the square
    may pass 1.0. None for an MoE model (its experts' shapes follow the routing)."""
    import torch

    from dockrl.parallel.memory_plan import HEAD_CHUNK_ELEMENTS, HEAD_MIN_CHUNK_TOKENS

    if args.num_experts:
        return None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        square = _Square(size, dtype)
        tokens = int(sum(lengths))
        micro_batches = max(1, math.ceil(tokens / budget))
        rows = math.ceil(tokens / micro_batches)
        hidden, q_width = args.hidden_size, args.num_heads * args.head_dim
        kv_width = args.num_kv_heads * args.head_dim
        layer = [(hidden, q_width), (hidden, kv_width), (hidden, kv_width), (q_width, hidden)]
        layer += [(hidden, args.intermediate_size)] * 2 + [(args.intermediate_size, hidden)]
        chunk = min(rows, max(HEAD_MIN_CHUNK_TOKENS, HEAD_CHUNK_ELEMENTS // args.vocab_size))
        forward = backward = 0.0  # FLOPs at the peak, per micro-batch
        for (n_in, n_out), count in Counter(layer).items():
            f, b = _peak_costs(rows, n_in, n_out, dtype, repeats, square)
            forward += args.num_layers * count * f
            backward += args.num_layers * count * b
        f, b = _peak_costs(chunk, hidden, args.vocab_size, dtype, repeats, square)
        chunks = math.ceil(rows / chunk)
        forward, backward = micro_batches * (forward + chunks * f), micro_batches * (backward + chunks * b)
        attention = args.num_layers * 4 * q_width * sum(n * n for n in lengths)
        out: dict[str, float] = {"peak_gflops": square.best_rate / 1e9}
        for name, cost in (
            ("update", forward + backward + 3 * attention),
            ("reference", forward + attention),
        ):
            out[name] = pass_flops(args, name, lengths) / cost
        return out
    finally:
        torch.set_num_threads(before)


class _Square:
    """An n x n matmul of `dtype`, the peak's measure (`measure_peak`; `shape_bound` times it beside each shape),
    and the best rate it has shown there."""

    def __init__(self, size: int, dtype: Any):
        import torch

        generator = torch.Generator().manual_seed(0)
        self.a, self.b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
        self.out = torch.empty(size, size, dtype=dtype)
        self.flops = 2 * size**3
        self.best_rate = 0.0

    def __call__(self) -> None:
        import torch

        torch.mm(self.a, self.b, out=self.out)


def _peak_costs(
    rows: int, n_in: int, n_out: int, dtype: Any, repeats: int, square: _Square
) -> tuple[float, float]:
    """What one linear layer's forward (x [rows, in] by the weight [out, in], as nn.Linear) and its backward's two
    matmuls (d x = d y W, d W = d y^T x) cost in FLOPs at the peak: each op's best seconds x the square's best
    rate, both timed in the same `repeats` rounds (a host that slows down or speeds up moves both alike)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n_in, generator=generator).to(dtype)
    weight = torch.randn(n_out, n_in, generator=generator).to(dtype)
    grad = torch.randn(rows, n_out, generator=generator).to(dtype)
    ops: list[Callable[[], object]] = [
        lambda: torch.nn.functional.linear(x, weight),
        lambda: torch.mm(grad, weight),
        lambda: torch.mm(grad.t(), x),
    ]
    timers: list[Callable[[], object]] = [square, *ops]
    for timed in timers:
        timed()  # warm up
    best = [math.inf] * len(timers)
    for _ in range(repeats):
        for i, timed in enumerate(timers):
            start = time.perf_counter()
            timed()
            best[i] = min(best[i], time.perf_counter() - start)
    rate = square.flops / best[0]
    square.best_rate = max(square.best_rate, rate)
    return best[1] * rate, (best[2] + best[3]) * rate


def peak_flops(peak: dict[str, Any], precision: str) -> float:
    """The matmul peak (FLOP/s) of a run's precision ("fp32" or "bf16"); fp32's where bf16 was not measured."""
    return 1e9 * peak.get(f"{precision}_gflops", peak["fp32_gflops"])
