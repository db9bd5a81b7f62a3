"""`dockrl bench kernels`: what precision, attention kernels, fused ops and torch.compile give per training stage.

One decoder (the e2e bench's 6.4M shape by default: hidden 256, 8 layers, 8/4 heads, MLP 768) and one micro-batch
of --rows x --tokens (28 x 143: one of the e2e workload's token-budget micro-batches). Rows, each the best of
--repeats runs on --threads threads (the bench runs on one, like each dp rank):

  stage     forward (reference / old log-probs: no grad) and update (forward + backward) of the whole decoder,
            fp32 against bf16 weights (what run.precision picks), and with --compile each decoder layer under
            torch.compile(dynamic=True) (inductor), whose compile time is reported beside it; computed as the
            training engine computes on this host (the native norms, LM head and attention backward where the
            kernels load)
  attention one layer's causal attention, forward + backward in bf16: torch's SDPA against dockrl's
            (SDPA forward, block-causal backward: dockrl.models.attention), its backward in torch's ops and
            as the native kernel (models/native/attention.c; left out, with the reason, where not built)
  head      the fused LM head's log-probs and entropies, forward + backward in bf16, at --rows x --tokens
            tokens and --vocab-size: torch's ops against the native softmax kernels (models/native/head.c)
  packed    one layer's attention over a packed micro-batch (padding-free training), forward + backward in bf16
            and fp32: one call per distinct row length against like lengths padded into buckets
            (packed_causal_attention, PAD_WASTE), for --small's micro-batch (128 rows of 17-27 tokens: prompt +
            up to 10) and for --rows rows of --tokens / 2 to --tokens
  rmsnorm   transformers' composite RMSNorm against torch's F.rms_norm and dockrl's (models/rms_norm.py: the
            same forward, its backward written out; and its native kernels, models/native/norm.c), forward +
            backward
  rope      rotate_half with cat against roll and a signed sin (dockrl.models.decoder.apply_rope), in torch's
            ops and in its native kernels (models/native/rope.c)
  swiglu    silu(gate) * up, eager (torch has no fused CPU op for it; --compile adds inductor's fusion)
  decode    one layer's decode-step attention of the rollout engine over --decode-rows rows of --decode-keys
            cached keys each (bf16 activations): torch's path (RoPE, the write into an fp32 cache, then
            grouped_attention) against the native kernel's (models/native: RoPE, the write and attention in one
            call over a bf16 cache); the native row is left out, with the reason, where the kernels are not built
  projections  a layer's four packed bf16 projections at --decode-rows rows and at --rows x --tokens:
            oneDNN's packed weights (torch's linear where oneDNN computes no bf16) against the AMX tiles'
            (models/native/linear.c); the tiles' row is left out, with the reason, where the host has none

`speedup` is the first variant's time over each other's. Only the stage rows measure what a run spends; the
others isolate one op at the micro-batch's shape.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model shape, micro-batch shape, repeats, threads, --compile."""
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=28, help="rows in the micro-batch")
    parser.add_argument("--tokens", type=int, default=143, help="tokens per row")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant; the best counts")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--compile", action="store_true", help="also torch.compile each decoder layer (minutes to compile)"
    )
    parser.add_argument("--decode-rows", type=int, default=128, help="rows of the decode attention rows")
    parser.add_argument("--decode-keys", type=int, default=200, help="cached keys per row there")
    parser.add_argument("--vocab-size", type=int, default=8000, help="the LM head rows' vocabulary")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time every variant; one row per (what, variant)."""
    import torch

    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    rows += _stage_rows(args)
    rows += _op_rows(args)
    return rows


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (allocations, lazy init)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _row(what: str, variant: str, seconds: float, base: float, **extra: Any) -> dict[str, Any]:
    return {"what": what, "variant": variant, "ms": seconds * 1e3, "speedup": base / seconds, **extra}


def _model(args: argparse.Namespace, dtype):
    from dockrl.models.config import ModelArgs
    from dockrl.models.decoder import Transformer

    hidden = args.hidden_size
    model_args = ModelArgs(
        family="qwen2",
        vocab_size=492,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_layers=args.num_layers,
        num_heads=hidden // 32,
        num_kv_heads=max(1, hidden // 64),
        head_dim=32,
        max_position_embeddings=max(512, args.tokens),
        tie_word_embeddings=True,
        attention_bias=True,
        qk_norm=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Transformer(model_args)
    model.init_weights(seed=0)
    return model.to(dtype)


def _stage_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from dockrl.algos.head_logprobs import head_token_stats
    from dockrl.models.native.head import head_kernels

    ids = torch.randint(3, 492, (args.rows, args.tokens), generator=torch.Generator().manual_seed(0))
    kernels = head_kernels()  # as the training engine on a CPU (None where the native kernels do not load)

    def head(hidden, weight):
        flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        return head_token_stats(flat, weight, ids[:, 1:].reshape(-1), kernels=kernels)

    def forward(model) -> None:
        with torch.no_grad():
            model(ids, head=head)

    def update(model) -> None:
        logp, entropy = model(ids, head=head)
        (logp.sum() + 0.01 * entropy.sum()).backward()

    out: list[dict[str, Any]] = []
    models = {"fp32": _model(args, torch.float32), "bf16": _model(args, torch.bfloat16)}
    compile_s = None
    if args.compile:
        compiled = _model(args, torch.bfloat16)
        for index, layer in enumerate(compiled.model.layers):
            compiled.model.layers[index] = torch.compile(layer, dynamic=True)
        start = time.perf_counter()
        update(compiled)
        forward(compiled)
        compile_s = time.perf_counter() - start
        models["bf16 compiled layers"] = compiled
    for stage, fn in (("forward", forward), ("update", update)):
        base = None
        for variant, model in models.items():
            seconds = _best(functools.partial(fn, model), args.repeats)
            base = base or seconds
            extra = {"compile_s": compile_s} if "compiled" in variant else {}
            out.append(_row(f"stage {stage}", variant, seconds, base, **extra))
    return out


def _op_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from dockrl.models import native
    from dockrl.models.attention import causal_attention
    from dockrl.models.decoder import apply_rope
    from dockrl.models.native.norm import norm_kernels
    from dockrl.models.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(1)
    bf16, hidden = torch.bfloat16, args.hidden_size
    heads, kv_heads, dim, rows, tokens = hidden // 32, max(1, hidden // 64), 32, args.rows, args.tokens
    out: list[dict[str, Any]] = []

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(bf16).requires_grad_()

    q, k, v = (
        leaf(rows, heads, tokens, dim),
        leaf(rows, kv_heads, tokens, dim),
        leaf(rows, kv_heads, tokens, dim),
    )
    grad = torch.randn(rows, heads, tokens, dim, generator=gen).to(bf16)

    def sdpa() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    def ours(native_backward: bool) -> None:
        with _native_attention(native_backward):
            causal_attention(q, k, v).backward(grad)

    base = _best(sdpa, args.repeats)
    out.append(_row("attention fwd+bwd (bf16)", "torch SDPA", base, base))
    out.append(
        _row("attention fwd+bwd (bf16)", "dockrl backward", _best(lambda: ours(False), args.repeats), base)
    )
    if native.available():
        native_s = _best(lambda: ours(True), args.repeats)
        out.append(_row("attention fwd+bwd (bf16)", "dockrl backward, native", native_s, base))
    else:
        out.append({"what": "attention fwd+bwd (bf16)", "variant": f"native: {native.status()}"})
    out += _head_rows(args, gen)
    out += _packed_rows(args, heads, kv_heads, dim, gen)

    x, weight = leaf(rows, tokens, hidden), leaf(hidden)
    grad_x = torch.randn(rows, tokens, hidden, generator=gen).to(bf16)

    def composite() -> None:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + 1e-6)
        (weight * normed.to(bf16)).backward(grad_x)

    def fused() -> None:
        F.rms_norm(x, (hidden,), weight, 1e-6).backward(grad_x)

    def written_out(kernels: Any = None) -> None:
        rms_norm(x, weight, 1e-6, kernels).backward(grad_x)

    what = "rmsnorm fwd+bwd (bf16)"
    base = _best(composite, args.repeats)
    out.append(_row(what, "composite (transformers)", base, base))
    out.append(_row(what, "F.rms_norm", _best(fused, args.repeats), base))
    out.append(_row(what, "dockrl (backward written out)", _best(written_out, args.repeats), base))
    kernels = norm_kernels()
    if kernels is None:
        out.append({"what": what, "variant": f"native: {native.status()}"})
    else:
        out.append(_row(what, "dockrl, native", _best(lambda: written_out(kernels), args.repeats), base))

    cos = torch.randn(rows, 1, tokens, dim, generator=gen).to(bf16)
    sin = torch.randn(rows, 1, tokens, dim, generator=gen).to(bf16)
    signed = torch.cat((-sin[..., : dim // 2], sin[..., dim // 2 :]), dim=-1)

    def rope_cat() -> None:
        rotated = torch.cat((-q[..., dim // 2 :], q[..., : dim // 2]), dim=-1)
        (q * cos + rotated * sin).backward(grad)

    def rope_roll() -> None:  # apply_rope's torch ops
        (q * cos + torch.roll(q, dim // 2, dims=-1) * signed).backward(grad)

    def rope_native() -> None:  # apply_rope where the native kernels load
        apply_rope(q, cos, signed).backward(grad)

    what = "rope fwd+bwd (bf16)"
    base = _best(rope_cat, args.repeats)
    out.append(_row(what, "cat (transformers)", base, base))
    out.append(_row(what, "roll, signed sin", _best(rope_roll, args.repeats), base))
    if native.available():
        out.append(_row(what, "roll, signed sin, native", _best(rope_native, args.repeats), base))
    else:
        out.append({"what": what, "variant": f"native: {native.status()}"})

    gate, up = leaf(rows, tokens, 3 * hidden), leaf(rows, tokens, 3 * hidden)
    grad_h = torch.randn(rows, tokens, 3 * hidden, generator=gen).to(bf16)

    def swiglu(fn=lambda g, u: F.silu(g) * u) -> None:
        fn(gate, up).backward(grad_h)

    base = _best(swiglu, args.repeats)
    out.append(_row("swiglu fwd+bwd (bf16)", "eager", base, base))
    if args.compile:
        fused_swiglu = torch.compile(lambda g, u: F.silu(g) * u, dynamic=True)
        out.append(
            _row("swiglu fwd+bwd (bf16)", "compiled", _best(lambda: swiglu(fused_swiglu), args.repeats), base)
        )
    out += _decode_rows(args, heads, kv_heads, dim, gen)
    out += _projection_rows(args, heads, kv_heads, dim, gen)
    return out


@contextlib.contextmanager
def _native_attention(on: bool) -> Iterator[None]:
    """The training attention's backward natively (`on`, where built) or in torch's ops, for a while."""
    from dockrl.models import attention, native

    before = attention._native_backward
    attention._native_backward = lambda: on and native.available()
    try:
        yield
    finally:
        attention._native_backward = before


def _head_rows(args: argparse.Namespace, gen: Any) -> list[dict[str, Any]]:
    """The fused LM head's forward + backward over --rows x --tokens tokens at --vocab-size (bf16): torch's
    ops against the native softmax kernels."""
    import torch

    from dockrl.algos.head_logprobs import head_token_stats
    from dockrl.models import native
    from dockrl.models.native.head import head_kernels

    tokens = args.rows * args.tokens
    hidden = torch.randn(tokens, args.hidden_size, generator=gen).bfloat16().requires_grad_()
    weight = (
        (torch.randn(args.vocab_size, args.hidden_size, generator=gen) * 0.05).bfloat16().requires_grad_()
    )
    targets = torch.randint(0, args.vocab_size, (tokens,), generator=gen)
    what = f"LM head fwd+bwd (bf16, vocab {args.vocab_size})"

    def run(kernels: Any) -> None:
        logp, entropy = head_token_stats(hidden, weight, targets, kernels=kernels)
        (logp.sum() + 0.01 * entropy.sum()).backward()

    base = _best(lambda: run(None), args.repeats)
    out = [_row(what, "torch ops", base, base)]
    kernels = head_kernels()
    if kernels is None:
        out.append({"what": what, "variant": f"native: {native.status()}"})
    else:
        out.append(_row(what, "native kernels", _best(lambda: run(kernels), args.repeats), base))
    return out


def _project(projections: Sequence[Callable[[Any], Any]], inputs: list[Any]) -> None:
    for projection, x in zip(projections, inputs):
        projection(x)


def _projection_rows(
    args: argparse.Namespace, heads: int, kv_heads: int, dim: int, gen
) -> list[dict[str, Any]]:
    """A decoder layer's four packed bf16 projections (q | k | v, o, gate | up, down) at --decode-rows rows and
    at --rows x --tokens (a prefill's): oneDNN's packed weights (models/packed_linear.py) against the AMX
    tiles' (models/native/linear.c); the tiles' row is left out, with the reason, where they are not usable."""
    import torch
    import torch.nn.functional as F

    from dockrl.models import native
    from dockrl.models.packed_linear import PackedLinear

    bf16, hidden = torch.bfloat16, args.hidden_size
    mlp = 3 * hidden
    packed = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    shapes = [  # (in, out) of q | k | v, o, gate | up, down
        (hidden, (heads + 2 * kv_heads) * dim),
        (heads * dim, hidden),
        (hidden, 2 * mlp),
        (mlp, hidden),
    ]
    weights = [torch.randn(n, k, generator=gen).to(bf16) for k, n in shapes]
    out: list[dict[str, Any]] = []
    for rows in (args.decode_rows, args.rows * args.tokens):
        what = f"a layer's 4 projections ({rows} rows, bf16)"
        inputs = [torch.randn(rows, k, generator=gen).to(bf16) for k, _ in shapes]
        if packed:
            onednn: list[Callable[[Any], Any]] = [PackedLinear([w], [None], rows) for w in weights]
        else:  # oneDNN computes no bf16 here (the rollout then runs the modules as they are)
            onednn = [functools.partial(F.linear, weight=w) for w in weights]
        base = _best(functools.partial(_project, onednn, inputs), args.repeats)
        out.append(_row(what, "oneDNN packed" if packed else "torch linear", base, base))
        if not native.linear_available():
            out.append({"what": what, "variant": f"AMX tiles: {native.linear_status()}"})
            continue
        tiled = [native.TiledLinear(w, None) for w in weights]
        out.append(
            _row(
                what,
                "AMX tiles (native)",
                _best(functools.partial(_project, tiled, inputs), args.repeats),
                base,
            )
        )
    return out


def _decode_rows(args: argparse.Namespace, heads: int, kv_heads: int, dim: int, gen) -> list[dict[str, Any]]:
    """One layer's decode-step attention, torch's path against the native kernel's (module docstring)."""
    import torch

    from dockrl.models import native
    from dockrl.models.decoder import apply_rope
    from dockrl.models.kv_cache import grouped_attention

    bf16, rows, keys = torch.bfloat16, args.decode_rows, args.decode_keys
    slots = keys + 1
    what = f"decode attention ({rows} rows x {keys} keys, bf16)"
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(bf16)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    angles = torch.rand(rows, dim // 2, generator=gen)
    both = torch.cat((angles, angles), dim=-1)
    cos, sin = both.cos().to(bf16), both.sin().to(bf16)
    signed = torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), dim=-1).contiguous()
    cache = torch.randn(2, rows, kv_heads, slots, dim, generator=gen)
    fp32_k, fp32_v = cache[0].clone(), cache[1].clone()
    offsets = torch.full((rows,), keys - 1, dtype=torch.long)
    bias = torch.zeros(rows, 1, 1, keys)
    index = torch.arange(rows)

    def torch_path() -> None:
        rope = (cos[:, None, None], signed[:, None, None])
        q_rot = apply_rope(q.view(rows, 1, heads, dim).transpose(1, 2), *rope)
        k_rot = apply_rope(k.view(rows, 1, kv_heads, dim).transpose(1, 2), *rope)
        fp32_k[index, :, offsets] = k_rot.float()[:, :, 0]
        fp32_v[index, :, offsets] = v.view(rows, kv_heads, dim).float()
        grouped_attention(q_rot.float(), fp32_k[:, :, :keys], fp32_v[:, :, :keys], bias).to(bf16)

    base = _best(torch_path, args.repeats)
    out = [_row(what, "torch (fp32 cache)", base, base)]
    if not native.available():
        return out + [{"what": what, "variant": f"native kernel: {native.status()}"}]
    bf16_cache = (cache[0].to(bf16), cache[1].to(bf16))
    x = torch.zeros(rows, heads * dim, dtype=bf16)
    step = native.DecodeStep(x, cos, signed, offsets, offsets + 1, bias.reshape(rows, keys), dim)
    widths = [heads * dim, kv_heads * dim, kv_heads * dim]

    def native_path() -> None:
        step.rope_attention_fused(qkv, widths, None, bf16_cache)

    return out + [_row(what, "native kernel (bf16 cache)", _best(native_path, args.repeats), base)]


def _packed_rows(args: argparse.Namespace, heads: int, kv_heads: int, dim: int, gen) -> list[dict[str, Any]]:
    """`packed` rows: packed_causal_attention with pad_waste 1 (rows of one length per call) against the
    default buckets, per row-length mix and dtype."""
    import torch

    from dockrl.models.attention import PAD_WASTE, packed_causal_attention

    mixes = {
        "128 rows of 17-27 tokens": torch.randint(17, 28, (128,), generator=gen).tolist(),
        f"{args.rows} rows of {args.tokens // 2}-{args.tokens} tokens": torch.randint(
            args.tokens // 2, args.tokens + 1, (args.rows,), generator=gen
        ).tolist(),
    }
    out: list[dict[str, Any]] = []
    for mix, lengths in mixes.items():
        bounds = tuple(int(b) for b in torch.tensor([0, *lengths]).cumsum(0))
        for dtype in (torch.bfloat16, torch.float32):

            def leaf(width: int, dtype=dtype, total=bounds[-1]):
                return torch.randn(1, width, total, dim, generator=gen).to(dtype).requires_grad_()

            q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
            grad = torch.randn(q.shape, generator=gen).to(dtype)

            def run(waste: float, q=q, k=k, v=v, grad=grad, bounds=bounds) -> None:
                packed_causal_attention(q, k, v, bounds, pad_waste=waste).backward(grad)

            what = f"packed attention fwd+bwd ({'bf16' if dtype == torch.bfloat16 else 'fp32'}), {mix}"
            base = _best(functools.partial(run, 1.0), args.repeats)
            out.append(_row(what, "one call per length", base, base))
            variant = f"like lengths padded (waste <= {PAD_WASTE})"
            out.append(_row(what, variant, _best(functools.partial(run, PAD_WASTE), args.repeats), base))
    return out
