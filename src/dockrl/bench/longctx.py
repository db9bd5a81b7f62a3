"""`dockrl bench longctx`: context parallelism (actor.cp) on long responses - peak memory per rank and step time.

A tiny random model (`--hidden-size`, `--num-layers`) takes policy updates on `--rows` rows of a 64-token prompt and
a response of each length in `--lengths`, under each cp in `--cp`: cp gloo processes on this machine, one (dp, cp) =
(1, cp) mesh, FSDP2 over the cp ranks, the same code path as `dockrl train` with actor.cp (engines/train/
policy_update). Per (length, cp): `step_s`, the median seconds of `--repeats` updates after a warm-up update (the
slowest rank's; the cp processes share this machine's cores, so on a small CPU they run side by side, not in
parallel), and `peak_mb`, the most any rank's resident memory rose above its level before an update (the
high-water mark, reset just before: activations, the ring's buffers, gradients' transients; parameters, their
gradients and AdamW state exist before). `vs_cp1` is peak_mb over the cp = 1 row's of the same length (and
packing). The ranks run with glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_): every buffer past it
is its own mapping, returned to the system when freed, so the resident set follows the live tensors instead of
keeping an earlier pass's freed blocks (with the default, growing threshold a later, longer pass reuses them and
its rise is under-counted). `predicted_mb` is `dockrl plan`'s estimate of the same rise (parallel/memory_plan.py
`update_peak`, fp32).

`--packing off,on` adds actor.packing (padding-free micro-batches) beside cp: with packing the cp = 1 update runs
its rows end to end (segment-masked attention); under cp > 1 micro-batches are padded whatever packing says (each
padded row is split), so those cases are not run twice.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

PROMPT_TOKENS = 64
MMAP_THRESHOLD = 1 << 16  # bytes: glibc's mmap threshold in the ranks (module docstring)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, lengths and layouts."""
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--lengths", default="4096,8192", help="response lengths, comma-separated")
    parser.add_argument("--cp", default="1,2,4", help="context-parallel sizes, comma-separated")
    parser.add_argument("--rows", type=int, default=1, help="rows per update (one micro-batch)")
    parser.add_argument("--repeats", type=int, default=2, help="timed updates per case (after one warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / cp)")
    parser.add_argument("--packing", default="off", help="actor.packing values, comma-separated: off,on")


def run(args: argparse.Namespace) -> list[dict]:
    """One row per (length, cp), each layout in its own spawned processes."""
    import os
    import tempfile
    from pathlib import Path

    from dockrl.parallel.dist import free_port
    from dockrl.parallel.memory_plan import update_peak
    from dockrl.parallel.spawn import spawn_ranks

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # the spawned ranks' (module docstring)
    packings = [{"off": False, "on": True}[x] for x in args.packing.split(",")]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _write_model(Path(tmp) / "model", args)
        model_args = _model_args(args)
        for length in [int(x) for x in args.lengths.split(",")]:
            for cp in [int(x) for x in args.cp.split(",")]:
                for packing in packings if cp == 1 else [False]:
                    out = Path(tmp) / f"{length}-{cp}-{packing}.json"
                    threads = args.threads or max(1, (os.cpu_count() or 1) // cp)
                    spec = {"length": length, "rows": args.rows, "repeats": args.repeats, "threads": threads}
                    spec["packing"] = packing
                    spawn_ranks(_worker, cp, free_port(), str(model_dir), spec, str(out))
                    ranks = json.loads(out.read_text())
                    tokens = PROMPT_TOKENS + length
                    predicted = update_peak(model_args, rows=args.rows, seq_len=tokens, cp=cp, dtype_bytes=4)
                    rows.append(
                        {
                            "tokens": tokens,
                            "cp": cp,
                            "packing": packing,
                            "step_s": max(r["step_s"] for r in ranks),
                            "peak_mb": max(r["peak_mb"] for r in ranks),
                            "predicted_mb": predicted["total"] / 2**20,
                            "loss": ranks[0]["loss"],
                        }
                    )
    for row in rows:
        base = next(
            r
            for r in rows
            if r["tokens"] == row["tokens"] and r["cp"] == 1 and r["packing"] == row["packing"]
        )
        row["vs_cp1"] = row["peak_mb"] / base["peak_mb"]
    return rows


def _write_model(path: Any, args: argparse.Namespace) -> Any:
    """The model of `_model_args`, random, saved at `path`."""
    from dockrl.models.decoder import Transformer
    from dockrl.models.hf import save_model

    model_args = _model_args(args)
    model = Transformer(model_args)
    model.init_weights(seed=0)
    save_model(model, model_args, path)
    return path


def _model_args(args: argparse.Namespace) -> Any:
    """A llama-shaped model (head dim 64, grouped queries 2:1) that holds the longest response."""
    from dockrl.models.config import ModelArgs

    heads = max(2, args.hidden_size // 64)
    longest = max(int(x) for x in args.lengths.split(",")) + PROMPT_TOKENS
    return ModelArgs(
        family="llama",
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 8 // 3 // 64 * 64,
        num_layers=args.num_layers,
        num_heads=heads,
        num_kv_heads=heads // 2,
        head_dim=64,
        max_position_embeddings=longest,
        eos_token_id=1,
        pad_token_id=0,
    )


def _worker(rank: int, world: int, port: int, model_dir: str, spec: dict, out: str, leave) -> None:
    """One cp rank: build the engine on a (1, cp) mesh, take 1 + repeats updates, write its figures."""
    import torch
    import torch.distributed as dist

    from dockrl.algos.losses import PPO_CLIP_LOSS
    from dockrl.bench.steady_state import proc_status, rss_reset
    from dockrl.config import ActorConfig
    from dockrl.engines.train.policy_update import policy_update
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.parallel.dist import init_distributed, training_mesh

    torch.set_num_threads(spec["threads"])
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=1800)
    mesh = training_mesh("cpu", 1, 1, world)
    optim = ActorConfig(lr=1e-5, micro_batch_size=spec["rows"], max_tokens_per_micro_batch=0)
    engine = TrainEngine(
        model_dir, device="cpu", precision="fp32", mesh=mesh, optim=optim, packing=spec["packing"]
    )
    generator = torch.Generator().manual_seed(0)
    vocab, length = engine.args.vocab_size, spec["length"]
    batch: dict[str, list] = {
        "prompt_ids": [
            torch.randint(2, vocab, (PROMPT_TOKENS,), generator=generator) for _ in range(spec["rows"])
        ],
        "response_ids": [
            torch.randint(2, vocab, (length,), generator=generator) for _ in range(spec["rows"])
        ],
        "advantages": [torch.randn(1, generator=generator).expand(length) for _ in range(spec["rows"])],
    }
    plan = PPO_CLIP_LOSS  # token-mean clipped surrogate, no KL, no entropy term

    def update() -> dict[str, float] | None:
        return policy_update(
            engine,
            batch,
            list(range(spec["rows"])),
            ["advantages"],
            plan,
            temperature=1.0,
            micro_batch_size=spec["rows"],
            pad_token_id=0,
            world_size=1,
        )

    update()  # warm-up: gradients and AdamW state allocated
    times, peak = [], 0
    metrics: dict[str, float] | None = None
    for _ in range(spec["repeats"]):
        dist.barrier()
        before = rss_reset()
        start = time.perf_counter()
        metrics = update()
        times.append(time.perf_counter() - start)
        peak = max(peak, proc_status("VmHWM") - before)
    figures = {
        "step_s": statistics.median(times),
        "peak_mb": peak / 2**20,
        "loss": (metrics or {}).get("loss"),
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    leave(rank)
