"""`dockrl bench activations`: what actor.activation_checkpointing saves in memory and costs in time.

One forward and backward pass of a random llama-shaped model on one micro-batch (`--rows` x `--seq-len`
tokens), with each decoder layer's activations kept (plain) or recomputed in the backward pass (recompute),
each in a fresh process so one's allocations never serve the other. Reported per mode: the median seconds of
`--repeats` passes after a warm-up, and the extra host RSS of one pass (the high-water mark, reset just
before, minus the RSS before: activations, gradients and the transient logits). `recompute_cost` is the
time ratio recompute / plain, `memory_saved` the plain peak over the recompute peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model and micro-batch shape."""
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=4, help="sequences in the micro-batch")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per mode (after one warm-up)")


def run(args: argparse.Namespace) -> list[dict]:
    """One row per mode, each measured in a child process."""
    rows = []
    for recompute in (False, True):
        spec = {**vars(args), "recompute": recompute}
        spec.pop("fn", None)
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from dockrl.bench.activations import measure; measure({json.dumps(spec)!r})",
            ],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if done.returncode != 0:
            raise RuntimeError(f"bench activations child failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    plain, recompute = rows
    recompute["recompute_cost"] = recompute["pass_s"] / plain["pass_s"]
    recompute["memory_saved"] = plain["peak_extra_mb"] / max(recompute["peak_extra_mb"], 1e-9)
    return rows


def measure(spec_json: str) -> None:
    """In a child process: build the model, time and measure the passes, print one JSON line."""
    import statistics
    import time

    import torch

    from dockrl.bench.steady_state import proc_status, rss_reset
    from dockrl.models import ModelArgs, Transformer

    spec = json.loads(spec_json)
    hidden = spec["hidden_size"]
    args = ModelArgs(
        family="llama",
        vocab_size=spec["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_layers=spec["num_layers"],
        num_heads=max(1, hidden // 64),
        num_kv_heads=max(1, hidden // 64),
        head_dim=64,
        max_position_embeddings=spec["seq_len"],
    )
    model = Transformer(args)
    model.init_weights(seed=0, std=0.02)
    model.train()
    model.model.checkpoint_layers = spec["recompute"]
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, args.vocab_size, (spec["rows"], spec["seq_len"]), generator=generator)

    def one_pass() -> None:
        model.zero_grad(set_to_none=False)
        logits = model(input_ids)
        logits.float().logsumexp(-1).mean().backward()

    one_pass()  # warm-up: gradients allocated, kernels chosen
    before = rss_reset()
    one_pass()
    peak_extra = proc_status("VmHWM") - before
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    mode = "recompute" if spec["recompute"] else "plain"
    params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "mode": mode,
                "params_m": params / 1e6,
                "tokens": spec["rows"] * spec["seq_len"],
                "pass_s": statistics.median(times),
                "peak_extra_mb": peak_extra / 2**20,
            }
        )
    )
