"""`dockrl bench scaling`: how a GRPO step's cost grows with model size and response length, dockrl and TRL.

The grid: model sizes (--sizes, from SIZES: about 1M, 6M, 25M and 50M parameters, all with an LM head of
--vocab-size rows, 8,000 by default, so the head is a real share of the work) x response lengths (--lengths:
128, 512, 2048 new tokens). Each point is `dockrl bench e2e`'s workload at that shape (the arithmetic task,
--prompts x --samples sequences per step, KL 0.001, each system at its CPU default precision, dockrl with
actor.dp=--dp) run for --steps steps, the first untimed. A random model ends a response with its own small
end-of-sequence probability (about 1 / vocab per token), so lengths are close to the maximum.

Per point and system: step seconds, response tokens/s, where the time went (bench e2e's stage figures, and its
`peak_share` per pass against the roofline measured again at the start of each point, `peak_fp32` and
`peak_bf16` in its rows (the `roofline` row holds the first measurement, before the grid), its `shape_bound`,
and its rollout's `decode_bw_share` and `decode_roofline_share`), and
`work`, the matmul work of the step in TFLOP from bench/roofline.py: five forward-equivalents (a forward of the
rollout, one of the reference, forward and backward of the update) of 2 x matmul params per token plus
attention's 4 x layers x heads x head_dim x length^2 per sequence. `s_per_tflop` is step
seconds over work: constant when the time grows as the work does; it rises where a system's time grows faster
(per-token overhead of decoding small batches, memory traffic), and falls where larger matmuls run nearer the
CPU's peak. `speedup`: dockrl's tokens/s over TRL's at the same point. TRL runs at its fastest configuration
(--trl-config, as in bench e2e).

--out DIR writes DIR/scaling.json and DIR/scaling.png (step time against response length per size and system,
and s_per_tflop) with the report code (dockrl.observe.report.scaling_plot).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from dockrl.bench import e2e

# name -> decoder shape (hidden, layers, heads, kv heads, MLP width); parameters with an 8,000-row tied head:
# 1m 1.2M, 6m 8.3M (bench e2e's shape), 25m 28M, 50m 52M.
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "1m": (96, 4, 3, 1, 288),
    "6m": (256, 8, 8, 4, 768),
    "25m": (512, 8, 16, 4, 1536),
    "50m": (640, 10, 20, 4, 1920),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The grid, the workload per point and the systems."""
    parser.add_argument("--sizes", default="1m,6m,25m,50m", help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--lengths", default="128,512,2048", help="comma list of max new tokens")
    parser.add_argument("--vocab-size", type=int, default=8000, help="LM-head rows of every model")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--steps", type=int, default=2, help="steps per point and system (the first untimed)")
    parser.add_argument("--dp", type=int, default=2, help="dockrl's actor.dp")
    parser.add_argument("--systems", default="dockrl,trl", help="comma list of dockrl, trl")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="bound on each run")
    parser.add_argument("--out", default=None, help="write scaling.json and scaling.png here")
    e2e.add_trl_config_argument(parser)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (size, length) point for each system; one row per point and system."""
    from dockrl.data.synthetic import write_task
    from dockrl.models.hf import read_config
    from dockrl.models.tiny import make_tiny

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        raise SystemExit(f"--sizes={args.sizes}: unknown {unknown}; use a comma list of {', '.join(SIZES)}")
    lengths = [int(n) for n in args.lengths.split(",") if n.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if sorted(set(systems) - {"dockrl", "trl"}):
        raise SystemExit(f"--systems={args.systems}: use a comma list of dockrl, trl")
    available = e2e.available_memory_bytes()  # once, before any point runs (e2e.available_memory_bytes)
    peak = e2e.measure_peak()
    rows: list[dict[str, Any]] = [{"size": "roofline", "system": "host", **peak}]
    with tempfile.TemporaryDirectory(prefix="dockrl-bench-scaling-") as tmp:
        root = Path(tmp)
        data = write_task("arithmetic", root / "data", num_train=256, num_test=32, seed=0)
        for size in sizes:
            hidden, layers, heads, kv_heads, mlp = SIZES[size]
            model = make_tiny(
                root / f"model-{size}",
                family="qwen2",
                hidden_size=hidden,
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=kv_heads,
                intermediate_size=mlp,
                padded_vocab_size=args.vocab_size,
                max_position_embeddings=e2e._MAX_PROMPT_LEN
                + max(lengths),  # the longest prompt kept + response
                seed=0,
            )
            params = e2e._active_params(model)
            for length in lengths:
                # the roofline again at every point: a grid runs for up to an hour on a host whose cores'
                # speed moves 2-3x within minutes, so each point's shares are against the peak of its moment
                point_peak = e2e.measure_peak()
                point = argparse.Namespace(
                    steps=args.steps,
                    prompts=args.prompts,
                    samples=args.samples,
                    max_new_tokens=length,
                    kl_coef=0.001,
                    dp=args.dp,
                    timeout_s=args.timeout_s,
                    overrides=[],
                    trl_config=args.trl_config,
                    trl_threads=args.trl_threads,
                )
                for system in systems:
                    work_dir = root / f"{size}-{length}-{system}"
                    work_dir.mkdir()
                    if system == "dockrl":
                        got: dict[str, Any] | str = e2e._dockrl(
                            point, work_dir, model, data["train"], point_peak
                        )
                    else:
                        got = e2e._trl(point, work_dir, model, data["train"], available, point_peak)
                    if isinstance(got, str):  # TRL not installed
                        rows.append({"size": size, "length": length, "system": system, "skipped": got})
                        continue
                    mean_length = got.get("response_length_mean") or length
                    sequences = args.prompts * args.samples
                    rows.append(
                        {
                            "size": size,
                            "params_m": params / 1e6,
                            "length": length,
                            "system": system,
                            "step_s": got["step_s"],
                            "response_tokens_per_s": got["response_tokens_per_s"],
                            "response_length_mean": mean_length,
                            "work_tflop": work_tflop(read_config(model), sequences, mean_length),
                            # the point's own roofline (GFLOP/s), which its shares are against
                            **{
                                f"peak_{dtype}": point_peak[f"{dtype}_gflops"]
                                for dtype in ("fp32", "bf16")
                                if f"{dtype}_gflops" in point_peak
                            },
                            # where the time went: dockrl's stages, TRL's generate / train (bench e2e's)
                            **{k: v for k, v in got.items() if k.endswith("_s") and k != "step_s" and v},
                            **{
                                k: got[k]
                                for k in (
                                    "peak_share",
                                    "shape_bound",
                                    "decode_bw_share",
                                    "decode_roofline_share",
                                    "trl_config",
                                    "peak_rss_gib",
                                    "start_rss_gib",
                                    "padded_length",
                                )
                                if k in got
                            },
                        }
                    )
    for row in rows:
        if "step_s" in row:
            row["s_per_tflop"] = row["step_s"] / row["work_tflop"]
    _speedups(rows)
    if args.out:
        from dockrl.observe.report import scaling_plot

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "scaling.json").write_text(json.dumps(rows, indent=1))
        scaling_plot(rows, out / "scaling.png")
    return rows


def work_tflop(model_args: Any, sequences: int, response_length: float) -> float:
    """A step's matmul work in TFLOP (see the module docstring): five forward-equivalents over the step's
    sequences (rollout, reference, update forward + backward) of bench/roofline.py's forward. Prompts (~15
    tokens here) are left out of the lengths."""
    from dockrl.bench.roofline import PASS_FORWARDS, forward_flops

    forwards = PASS_FORWARDS["rollout"] + PASS_FORWARDS["reference"] + PASS_FORWARDS["update"]
    return forwards * forward_flops(model_args, [response_length] * sequences) / 1e12


def _speedups(rows: list[dict[str, Any]]) -> None:
    """dockrl's tokens/s over TRL's, on dockrl's row of each point that has both."""
    trl = {(r["size"], r["length"]): r for r in rows if r["system"] == "trl" and "step_s" in r}
    for row in rows:  # the roofline's row (and a skipped point's) has no time
        other = trl.get((row["size"], row.get("length")))
        if row["system"] == "dockrl" and "step_s" in row and other is not None:
            row["speedup"] = row["response_tokens_per_s"] / other["response_tokens_per_s"]
