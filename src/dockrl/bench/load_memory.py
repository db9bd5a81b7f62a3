"""`dockrl bench load`: host memory and time of loading (and saving) the policy on dp ranks.

Spawns `--dp` gloo processes. Each builds the actor's TrainEngine (FSDP2 over dp) from a Hugging Face
checkpoint and measures the host RSS the load added: the high-water mark (VmHWM, reset through
/proc/self/clear_refs just before) minus the RSS before. dockrl's loader builds the model on the meta device
and reads only this rank's rows of each tensor from the safetensors files; `--naive` also measures the
whole-model load (every rank reads the whole checkpoint, then shards: `from_pretrained` on each rank). Without `--model` a random
llama-shaped checkpoint of ~60M parameters (`--dtype`, fp32 by default) is written to a temporary directory first.

With `--save`, each rank then takes one optimizer step (so AdamW state exists) and writes a resumable
checkpoint the way a run does: its DCP shards (model, AdamW, LR schedule) and the Hugging Face export gathered
on rank 0; reported are save_s, the extra RSS peak of saving and the bytes on disk.

The last stdout line (with --json) is one JSON object: model_bytes (fp32 parameters), peak_extra_rss_bytes
(max over ranks), its ratio to model_bytes, load_s (max over ranks), dp, and the naive and save figures when
asked.
"""

from __future__ import annotations

import argparse

from dockrl.bench.steady_state import proc_status, rss_reset, take_one_step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Layout, model and what to compare."""
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model directory or checkpoint root; default: a random one",
    )
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="of the random checkpoint")
    parser.add_argument("--naive", action="store_true", help="also measure the whole-model load")
    parser.add_argument("--save", action="store_true", help="also measure saving a resumable checkpoint")


def _naive_load(model_dir: str, mesh):
    """The whole-model load: every rank reads every tensor, then FSDP2 keeps its rows."""
    import torch

    from dockrl.engines.train.train_engine import fully_shard_layers
    from dockrl.models.hf import load_model

    model = load_model(model_dir, dtype=torch.float32)
    fully_shard_layers(model, mesh, "fp32")
    return model


def _warm_up(model_dir: str, mesh) -> None:
    """Import and initialise everything a load touches once (module code is resident memory too, and it
    is not the load's cost), by loading a one-layer model of the same kind."""
    import dataclasses
    import tempfile

    from dockrl.config import ActorConfig
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.models.decoder import Transformer
    from dockrl.models.hf import read_config, save_model

    args = dataclasses.replace(
        read_config(model_dir), num_layers=1, vocab_size=64, hidden_size=64, head_dim=8
    )
    args = dataclasses.replace(args, intermediate_size=64)
    with tempfile.TemporaryDirectory() as tmp:
        model = Transformer(args)
        model.init_weights(0)
        save_model(model, args, tmp)
        TrainEngine(tmp, device="cpu", precision="fp32", mesh=mesh, optim=ActorConfig())
        _naive_load(tmp, mesh)


def _save(model_dir: str, mesh, world: int, out: str) -> dict:
    """One optimizer step, then a checkpoint as a run writes it; time, RSS peak and bytes on disk."""
    import gc
    import time
    from pathlib import Path

    import torch

    from dockrl.checkpoint.sharded import export_hf, save_engine
    from dockrl.config import ActorConfig
    from dockrl.engines.train.train_engine import TrainEngine

    engine = TrainEngine(model_dir, device="cpu", precision="fp32", mesh=mesh, optim=ActorConfig())
    take_one_step(engine, world, seed=engine.dp_rank)
    root = Path(out).parent / "checkpoint"
    gc.collect()
    torch.distributed.barrier()
    base = rss_reset()
    start = time.perf_counter()
    save_engine(engine, root / "actor")
    sharded_s = time.perf_counter() - start
    sharded_peak = proc_status("VmHWM") - base
    gc.collect()
    torch.distributed.barrier()
    base = rss_reset()
    export_hf(engine, root / "hf", tokenizer_dir=None)
    result = {
        "save_s": time.perf_counter() - start,
        "save_sharded_s": sharded_s,
        "save_sharded_peak_extra": sharded_peak,
        "export_peak_extra": proc_status("VmHWM") - base,
    }
    if torch.distributed.get_rank() == 0:
        size = lambda path: sum(f.stat().st_size for f in path.rglob("*") if f.is_file())  # noqa: E731
        result["sharded_bytes"], result["hf_bytes"] = size(root / "actor"), size(root / "hf")
    return result


def _worker(
    rank: int, world: int, port: int, args: argparse.Namespace, model_dir: str, out: str, leave
) -> None:
    import gc
    import time

    import torch

    from dockrl.config import ActorConfig
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.parallel.dist import data_parallel_mesh, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=600)
    mesh = data_parallel_mesh("cpu", world)
    _warm_up(model_dir, mesh)
    result = {}
    gc.collect()
    base = rss_reset()
    start = time.perf_counter()
    engine = TrainEngine(model_dir, device="cpu", precision="fp32", mesh=mesh, optim=ActorConfig())
    result["load_s"] = time.perf_counter() - start
    result["peak_extra"] = proc_status("VmHWM") - base
    result["held"] = sum(p.to_local().numel() * 4 for p in engine.model.parameters())  # type: ignore[attr-defined]
    del engine
    gc.collect()
    if args.naive:
        torch.distributed.barrier()
        base = rss_reset()
        start = time.perf_counter()
        model = _naive_load(model_dir, mesh)
        result["naive_load_s"] = time.perf_counter() - start
        result["naive_peak_extra"] = proc_status("VmHWM") - base
        del model
    if args.save:
        result.update(_save(model_dir, mesh, world, out))
    results = [None] * world
    torch.distributed.all_gather_object(results, result)
    if rank == 0:
        torch.save(results, out)
    leave(rank)


def run(args: argparse.Namespace) -> dict:
    """Spawn the ranks, measure, and summarise (max over ranks)."""
    import os
    import tempfile

    import torch

    from dockrl.checkpoint.directory import resolve_model_path
    from dockrl.models.config import ModelArgs
    from dockrl.models.decoder import Transformer
    from dockrl.models.hf import read_config, save_model
    from dockrl.parallel.dist import free_port
    from dockrl.parallel.spawn import spawn_ranks

    # A freed tensor must leave RSS for the peak to mean anything: pin glibc's mmap threshold at 64 KiB.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = None if args.model is None else resolve_model_path(args.model)
        if model_dir is None:
            model_args = ModelArgs(
                family="llama",
                vocab_size=args.vocab_size,
                hidden_size=args.hidden_size,
                intermediate_size=3 * args.hidden_size,
                num_layers=args.num_layers,
                num_heads=8,
                num_kv_heads=8,
                head_dim=args.hidden_size // 8,
            )
            model = Transformer(model_args)
            model.init_weights(0)
            save_model(model, model_args, tmp, dtype=torch.bfloat16 if args.dtype == "bf16" else None)
            del model
            model_dir = tmp
        num_params = read_config(model_dir).num_params()
        out = os.path.join(tmp, "results.pt")
        spawn_ranks(_worker, args.dp, free_port(), args, model_dir, out)
        results = torch.load(out, weights_only=False)
    model_bytes = num_params * 4
    peak = max(r["peak_extra"] for r in results)
    summary = {
        "dp": args.dp,
        "num_params": num_params,
        "model_bytes": model_bytes,
        "peak_extra_rss_bytes": peak,
        "peak_over_model": peak / model_bytes,
        "shard_bytes": max(r["held"] for r in results),
        "load_s": max(r["load_s"] for r in results),
    }
    if args.save:
        summary.update(
            save_s=max(r["save_s"] for r in results),
            save_sharded_s=max(r["save_sharded_s"] for r in results),
            save_sharded_peak_extra_rss_bytes=max(r["save_sharded_peak_extra"] for r in results),
            export_peak_extra_rss_bytes=max(r["export_peak_extra"] for r in results),
            checkpoint_sharded_bytes=results[0]["sharded_bytes"],
            checkpoint_hf_bytes=results[0]["hf_bytes"],
        )
    if args.naive:
        naive = max(r["naive_peak_extra"] for r in results)
        summary.update(
            naive_peak_extra_rss_bytes=naive,
            naive_peak_over_model=naive / model_bytes,
            naive_load_s=max(r["naive_load_s"] for r in results),
        )
    return summary
